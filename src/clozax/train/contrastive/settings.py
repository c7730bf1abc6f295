"""What a contrastive stage is (``StageSettings``): every setting of ``clozax embed`` and
``clozax retrieval``'s stage, validated, and which of them make its numbers (``identity``: a
resume must keep those; the speed-only ones it may change)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from clozax.core.pooling import POOLINGS
from clozax.data.negatives import SKIP
from clozax.data.pairs import KINDS
from clozax.train import config as config_lib
from clozax.train.checks import check_choice, check_int, check_real

SPEED_ONLY = ("chunks", "save_every", "save_every_minutes")  # a resume may change them
NEGATIVES = ("none", "bm25")
# Settings recorded only when set (a stage from before they existed has none of them)
OPTIONAL = {"negatives": lambda s: s.negatives != "none",
            "negatives_skip": lambda s: s.negatives != "none",
            "pack": lambda s: s.pack, "data": lambda s: s.data is not None,
            "withhold_validation": lambda s: s.withhold_validation}
NEGATIVES_FILE = "negatives.jsonl"  # a bm25 stage's mined (query, positive, negative) triples


@dataclass(frozen=True)
class StageSettings:
    """What a contrastive stage is; every field but ``chunks`` changes its numbers."""

    pairs: str = "first-sentence"  # a kind of corpus pair (data/pairs.py) or a JSONL file
    steps: int = 200
    minutes: float | None = None  # if set, the length comes from the measured pace
    batch_size: int = 64  # pairs per step: the in-batch negatives are the other 63
    chunks: int = 1  # gradient-cache chunks (speed and memory only)
    temperature: float = 0.05  # SimCSE's
    learning_rate: float = 1e-4
    symmetric: bool = False
    pooling: str = "mean"
    seq_len: int = 64  # tokens per text, [CLS] and [SEP] included
    dropout: float = 0.1  # SimCSE's only noise; BERT's default
    # on the attention probabilities (BERT's attention_probs_dropout_prob, which
    # sentence-transformers keeps: MiniLM's 0.1); 0 leaves the encoder's attention as is
    attention_dropout: float = 0.0
    seed: int = 0
    max_pairs: int | None = None  # a keyed sample of the corpus pairs
    negatives: str = "none"  # "bm25": a hard negative per corpus pair, mined by BM25
    negatives_skip: int = SKIP  # BM25's best-ranked passed over (likely positives)
    pack: bool = False  # several texts to a row, each attending to itself (fewer rows)
    data: str | None = None  # an imported encoder's corpus: a prepared dataset's directory
    # leave the train split's validation tenth (data/pairs.py in_validation) out of the pairs
    # and their negatives: a stage whose settings are chosen on retrieval over it
    withhold_validation: bool = False
    random_init: bool = False  # start from the source's architecture at init (the control)
    save_every: int = 100  # a checkpoint every this many updates (and at the end)
    save_every_minutes: float | None = None  # also when this much time has passed
    # A --minutes stage's lengths as its budget chose them, (after step, length), (0, L) first:
    # a re-training replays them (steps is then the last length).
    budget_revisions: tuple = ()

    def __post_init__(self):
        revisions = tuple(tuple(r) for r in self.budget_revisions)  # JSON gives lists
        object.__setattr__(self, "budget_revisions", revisions)
        for at, length in revisions:
            check_int("budget_revisions step", at, 0)
            check_int("budget_revisions length", length, max(at, 1))
        check_int("steps", self.steps, 1)
        check_int("batch_size", self.batch_size, 2)
        check_int("chunks", self.chunks, 1)
        check_int("save_every", self.save_every, 1)
        if self.save_every_minutes is not None:
            check_real("save_every_minutes", self.save_every_minutes, 0.0, math.inf,
                       low_open=True, high_open=True)
        check_int("seq_len", self.seq_len, 4)
        check_int("seed", self.seed, 0, config_lib.SEED_LIMIT - 1)
        check_real("temperature", self.temperature, 0.0, math.inf, low_open=True,
                   high_open=True)
        check_real("learning_rate", self.learning_rate, 0.0, math.inf, low_open=True,
                   high_open=True)
        check_real("dropout", self.dropout, 0.0, 1.0, high_open=True)
        check_real("attention_dropout", self.attention_dropout, 0.0, 1.0, high_open=True)
        check_choice("pooling", self.pooling, POOLINGS)
        check_choice("negatives", self.negatives, NEGATIVES)
        check_int("negatives_skip", self.negatives_skip, 0)
        if self.pack and (self.minutes is not None or self.chunks > 1):
            raise ValueError("--pack fixes its row count from every batch the stage will run "
                             "and runs them in one pass: give --steps (not --minutes) and "
                             "--chunks 1")
        if self.withhold_validation and self.pairs not in KINDS:
            raise ValueError(f"{self.pairs}: a pair file gives its own pairs, with no validation "
                             "documents to withhold or choose on; give one --learning-rate, or "
                             f"corpus pairs ({', '.join(KINDS)})")
        if self.minutes is not None:
            check_real("minutes", self.minutes, 0.0, math.inf, low_open=True, high_open=True)
        if self.batch_size % self.chunks:
            raise ValueError(f"--chunks {self.chunks} does not divide --batch-size "
                             f"{self.batch_size}; choose a divisor")

    def identity(self) -> dict:
        """The settings that make the numbers (a resume must keep them)."""
        # left out when unset, as a stage from before they existed recorded them
        unset = tuple(k for k, is_set in OPTIONAL.items() if not is_set(self))
        return {k: v for k, v in dataclasses.asdict(self).items()
                if k not in SPEED_ONLY + ("steps", "minutes", "budget_revisions") + unset}
