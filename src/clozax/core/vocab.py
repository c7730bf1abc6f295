"""The special-token table and what masking needs from a frozen tokenizer.

Every stage names the five special tokens the same way (``SPECIAL_NAMES``): the tokenizer
trainer puts them at ids 0..4 in this order, datasets and runs record their ids by these names,
and the exporters map them to each model family's own strings.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SPECIAL_NAMES = ("pad", "unk", "cls", "sep", "mask")
# The strings clozax's own tokenizers use (BERT style).
SPECIAL_TOKENS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]",
                  "mask": "[MASK]"}


@dataclass(frozen=True)
class Vocabulary:
    """What masking needs from the frozen tokenizer: its size and special ids by name."""

    size: int
    specials: dict  # name -> id

    @property
    def special_ids(self) -> tuple[int, ...]:
        return tuple(sorted(set(int(v) for v in self.specials.values())))

    def special_table(self) -> np.ndarray:
        """(vocab,) bool, True at special ids: ``~table[tokens]`` marks non-special tokens."""
        table = np.zeros(self.size, bool)
        table[list(self.special_ids)] = True
        return table
