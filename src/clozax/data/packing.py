"""Chunking documents into ``[CLS] … [SEP]`` chunks and best-fit packing them into rows.

Chunking: a document whose tokens do not fit one row (``seq_len - 2`` body tokens) is cut into
chunks, each wrapped in its own ``[CLS]``/``[SEP]``, so every segment of a row looks like a whole
input to the model. Cuts fall on word starts where possible, so whole-word masking never sees
half a word; only a single word longer than a row is cut inside. Nothing is truncated.

Packing: best fit within a bounded window of open rows (memory stays flat however large the
corpus): a chunk goes to the open row with the least free space that still fits it; when the
window is full, the fullest open row is written out to make room. Deterministic for a given
chunk order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

# A sanity bound on row length (the longest preset, modern-base, takes 8192): `clozax train`
# refuses a dataset whose rows exceed model.max_positions. Best fit scans O(seq_len) free-space
# buckets per chunk.
MAX_SEQ_LEN = 8192
MIN_SEQ_LEN = 8
# Open rows kept for best fit. Larger packs a little tighter and costs only memory.
PACKING_WINDOW = 1024
# Recorded in every dataset's identity: change it whenever chunking or packing places tokens
# differently, so that datasets packed the old way are never taken for new ones.
PACKER_VERSION = f"chunk-at-word-starts/best-fit-window-{PACKING_WINDOW}/1"


@dataclass(frozen=True)
class DocChunk:
    """One chunk of one document, with its ``[CLS]``/``[SEP]``. Lists, length <= seq_len."""

    doc: int  # document index within its split, in corpus order
    chunk: int
    ids: list[int]
    word_starts: list[bool]


def word_start_flags(word_ids: list[int | None]) -> list[bool]:
    """True at the first token of each word; a token without a word id is its own word."""
    ids = np.array(word_ids, dtype=np.float64)  # (tokens,) None -> nan, which equals nothing
    flags = np.ones(ids.size, dtype=bool)
    flags[1:] = ids[1:] != ids[:-1]
    return flags.tolist()


def chunk_document(doc: int, ids: list[int], word_ids: list[int | None], *, seq_len: int,
                   cls_id: int, sep_id: int) -> list[DocChunk]:
    """Cut a document's body tokens into chunks of at most ``seq_len`` with specials added."""
    starts = word_start_flags(word_ids)
    capacity = seq_len - 2
    chunks = []
    pos = 0
    while True:
        end = min(pos + capacity, len(ids))
        if end < len(ids):
            cut = end
            while cut > pos and not starts[cut]:  # back off to the start of the cut word
                cut -= 1
            end = cut if cut > pos else end
        chunks.append(DocChunk(doc=doc, chunk=len(chunks),
                               ids=[cls_id, *ids[pos:end], sep_id],
                               word_starts=[True, *starts[pos:end], True]))
        pos = end
        if pos >= len(ids):
            return chunks


@dataclass
class _Row:
    chunks: list[DocChunk] = field(default_factory=list)
    used: int = 0


@dataclass(frozen=True)
class PackedRow:
    """One finished row. ``placements`` are ``(doc, chunk, segment)`` for each chunk."""

    tokens: np.ndarray  # (seq_len,) int64
    segments: np.ndarray  # (seq_len,) uint16, 1..n per chunk, 0 = padding
    word_starts: np.ndarray  # (seq_len,) bool, False on padding
    placements: list[tuple[int, int, int]]


class BestFitPacker:
    """Streams chunks in, calls ``emit`` with each finished ``PackedRow`` (mutable state)."""

    def __init__(self, seq_len: int, pad_id: int, emit: Callable[[PackedRow], None],
                 window: int = PACKING_WINDOW):
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.emit = emit
        self.window = window
        # by_free[s]: open rows with exactly s free slots (a stack, for determinism)
        self.by_free: list[list[_Row]] = [[] for _ in range(seq_len + 1)]
        self.open_rows = 0

    def add(self, chunk: DocChunk) -> None:
        n = len(chunk.ids)
        assert 0 < n <= self.seq_len, n
        row = None
        for free in range(n, self.seq_len + 1):
            if self.by_free[free]:
                row = self.by_free[free].pop()
                break
        if row is None:
            if self.open_rows >= self.window:
                self._close_fullest()
            row = _Row()
            self.open_rows += 1
        row.chunks.append(chunk)
        row.used += n
        free = self.seq_len - row.used
        if free == 0:
            self.open_rows -= 1
            self._emit(row)
        else:
            self.by_free[free].append(row)

    def flush(self) -> None:
        """Write out every open row, fullest first."""
        while self.open_rows:
            self._close_fullest()

    def _close_fullest(self) -> None:
        for bucket in self.by_free:
            if bucket:
                self.open_rows -= 1
                self._emit(bucket.pop(0))
                return

    def _emit(self, row: _Row) -> None:
        tokens = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        segments = np.zeros(self.seq_len, dtype=np.uint16)
        starts = np.zeros(self.seq_len, dtype=bool)
        placements = []
        pos = 0
        for segment, chunk in enumerate(row.chunks, start=1):
            end = pos + len(chunk.ids)
            tokens[pos:end] = chunk.ids
            segments[pos:end] = segment
            starts[pos:end] = chunk.word_starts
            placements.append((chunk.doc, chunk.chunk, segment))
            pos = end
        self.emit(PackedRow(tokens, segments, starts, placements))
