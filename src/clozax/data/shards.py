"""A split's rows across its shards: file names, the index, and reading through it.

Each split is written as shards ``{split}/shard-{k:05d}.{tokens,segments,word_starts}.npy``
plus ``{split}/shard-{k:05d}.documents.jsonl``. A shard's rows and documents are numbered
locally; the manifest's ``shards`` index lists every shard's row and document counts, so global
row ``r`` of a split lives in the shard whose cumulative row range holds it. ``RowArray`` reads
rows through the index and maps a shard only when one of its rows is first read, so a process
that reads some rows (one host of a multi-process job) opens only the shards holding them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

ARRAYS = ("tokens", "segments", "word_starts")


def shard_name(k: int) -> str:
    return f"shard-{k:05d}"


def shard_files(split: str, name: str) -> dict[str, str]:
    """Relative paths of one shard's files, by kind (the arrays and ``documents``)."""
    files = {kind: f"{split}/{name}.{kind}.npy" for kind in ARRAYS}
    return {**files, "documents": f"{split}/{name}.documents.jsonl"}


def offsets(counts: list[int]) -> np.ndarray:
    """(shards + 1,) cumulative starts: shard k holds [offsets[k], offsets[k + 1])."""
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)


class RowArray:
    """Rows ``(rows, seq_len)`` of one array kind over a split's shards, read-only.

    Indexing with an int, a slice or an integer array returns a NumPy array, like a memmap;
    shards are memory-mapped on first use (``open_shard(k)``).
    """

    def __init__(self, open_shard, rows: list[int], seq_len: int, dtype: np.dtype):
        self._open_shard = open_shard
        self._starts = offsets(rows)
        self._maps: dict[int, np.ndarray] = {}
        self.shape = (int(self._starts[-1]), seq_len)
        self.dtype = np.dtype(dtype)
        self.ndim = 2

    def __len__(self) -> int:
        return self.shape[0]

    def _shard(self, k: int) -> np.ndarray:
        if k not in self._maps:
            self._maps[k] = self._open_shard(k)
        return self._maps[k]

    def __getitem__(self, key) -> np.ndarray:
        if isinstance(key, (int, np.integer)):
            return self[np.asarray([key])][0]
        if isinstance(key, slice):
            key = np.arange(*key.indices(self.shape[0]))
        rows = np.asarray(key, np.int64)  # (n,)
        if rows.size and (rows.min() < -self.shape[0] or rows.max() >= self.shape[0]):
            raise IndexError(f"row index out of range for {self.shape[0]} rows")
        rows = np.where(rows < 0, rows + self.shape[0], rows)
        shard = np.searchsorted(self._starts, rows, side="right") - 1  # (n,)
        out = np.empty((rows.size, self.shape[1]), self.dtype)  # (n, seq_len)
        for k in np.unique(shard):
            where = shard == k
            out[where] = self._shard(int(k))[rows[where] - self._starts[k]]
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)


def iter_documents(path: Path, split: str, index: list[dict]) -> Iterator[dict]:
    """A split's document records, shard by shard, one line at a time, with ``index`` and the
    chunks' rows made global (split-wide) through the shard index."""
    row_starts = offsets([s["rows"] for s in index])
    doc_starts = offsets([s["documents"] for s in index])
    for k, shard in enumerate(index):
        file = path / shard_files(split, shard["name"])["documents"]
        with file.open(encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                doc = json.loads(line)
                if k:
                    doc["index"] += int(doc_starts[k])
                    doc["chunks"] = [[row + int(row_starts[k]), seg] for row, seg in
                                     doc["chunks"]]
                yield doc
