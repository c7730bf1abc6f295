"""What both sides of ``compare_hf.py`` share: the shapes, the dtypes, the optimiser's
hyper-parameters, the special ids and the pre-tokenized rows (``Rows``, ``load_rows``).

Nothing here imports JAX or torch (``compare_hf.py`` applies its host allocator setting before
JAX is imported).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

SPECIALS = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}

SHAPES = {  # model preset, vocabulary, sequence length, batch
    # the tiny shapes: gpu_check.sh's dry run on a CPU (QUICK=1), not a measurement
    "tiny": {"preset": "tiny", "vocab": 1024, "seq": 64, "batch": 8},
    "modern-tiny": {"preset": "modern-tiny", "vocab": 1024, "seq": 128, "batch": 4},
    "small": {"preset": "small", "vocab": 8192, "seq": 128, "batch": 32},
    "base": {"preset": "base", "vocab": 8192, "seq": 128, "batch": 32},
    "modern-small": {"preset": "modern-small", "vocab": 8192, "seq": 1024, "batch": 4},
    "modern-base": {"preset": "modern-base", "vocab": 8192, "seq": 1024, "batch": 32},
}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
LR, B1, B2, EPS, WD, CLIP = 1e-3, 0.9, 0.98, 1e-6, 0.01, 1.0  # clozax's OptimConfig defaults


@dataclass
class Rows:
    """Pre-tokenized rows shared by both sides: (rows, seq) token ids and segment ids."""

    tokens: np.ndarray  # (rows, seq) int32
    segments: np.ndarray  # (rows, seq) int32, 0 = padding
    word_starts: np.ndarray  # (rows, seq) bool
    specials: dict
    vocab: int
    source: str

    def batch_rows(self, index: int, batch: int) -> np.ndarray:
        rng = np.random.default_rng([0, index])
        return rng.choice(len(self.tokens), batch, replace=False)


def load_rows(data: Path | None, synthetic: bool, vocab: int, seq: int, n: int = 1024,
              documents: int | None = None) -> Rows:
    """The dataset's training rows, or ``n`` synthetic ones: uniform ids, one document a row,
    or (``documents``) packed documents of random lengths around that many tokens, each
    opening with [CLS] and closing with [SEP], as clozax packs a corpus (per-document
    attention on clozax's side; HF attends over the whole row, as it does on packed rows)."""
    if synthetic or data is None:
        rng = np.random.default_rng(0)
        tokens = rng.integers(len(SPECIALS), vocab, size=(n, seq), dtype=np.int32)
        segments = np.ones((n, seq), np.int32)
        if documents:
            lengths = rng.integers(max(2, documents // 2), documents * 3 // 2 + 1,
                                   size=(n, seq // max(2, documents // 2) + 1))
            starts = np.cumsum(lengths, axis=1)
            segments = np.stack([np.searchsorted(s, np.arange(seq), side="right") + 1
                                 for s in starts]).astype(np.int32)
        first = np.concatenate([np.ones((n, 1), bool), segments[:, 1:] != segments[:, :-1]], 1)
        last = np.concatenate([segments[:, 1:] != segments[:, :-1], np.ones((n, 1), bool)], 1)
        tokens[first], tokens[last] = SPECIALS["cls"], SPECIALS["sep"]
        what = f"packed documents of ~{documents} tokens" if documents else "one document a row"
        return Rows(tokens, segments, np.ones((n, seq), bool), dict(SPECIALS), vocab,
                    f"synthetic uniform ids, {n} rows, {what}")
    from clozax.data import open_dataset

    ds = open_dataset(data)
    if ds.seq_len != seq or ds.vocab_size != vocab:
        raise SystemExit(
            f"error: dataset {data} has seq_len {ds.seq_len} and vocab {ds.vocab_size}; this "
            f"shape needs {seq} and {vocab}: pass --synthetic"
        )
    split = ds.train
    return Rows(np.asarray(split.tokens, np.int32), np.asarray(split.segments, np.int32),
                np.asarray(split.word_starts, bool), dict(ds.specials), vocab,
                f"{data} train split, {split.rows} rows")


def visible_pairs(segments: np.ndarray, half: int | None = None) -> tuple[float, int]:
    """(visible (query, key) pairs, real tokens) of per-document attention over ``segments``
    (rows, seq) int, 0 = padding: each real query sees its own document's keys, within ``half``
    of it when given. Counted per document run, without a (seq, seq) mask. Shared by
    ``timing.visible_keys`` (compare_hf.py's useful FLOPs) and ``attention_paths.py``."""
    pairs, tokens = 0.0, 0
    for row in segments:
        for n in np.unique(row[row > 0], return_counts=True)[1]:
            w = n - 1 if half is None else min(half, n - 1)
            pairs += n + 2 * (w * n - w * (w + 1) / 2)  # |i - j| <= w inside a run of n
            tokens += int(n)
    return pairs, tokens
