"""Exact dense search in bounded memory: cosine or dot-product scores of every query against
every document, a block of documents at a time, keeping a running top-k per query, so a
collection of N documents never needs the N × queries score matrix (peak: queries × (block +
k) scores). The metrics of a ranking are ``judge/retrieval/metrics.py``'s.

A document whose id is the query's is not in the query's ranking (BEIR's default,
``ignore_identical_ids``, and its ``DenseRetrievalExactSearch``): search for ``k + 1`` and let
``as_run`` drop the self-hit and cut at ``k``, so ``k`` documents remain."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def top_k(queries: np.ndarray, documents: Iterator[np.ndarray], k: int,
          ) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` highest dot products of each query (row of ``queries`` [Q, D]) with the
    documents, given as consecutive blocks [B_i, D]. Returns ``(scores, indices)`` [Q, k'] with
    k' = min(k, documents), best first, ties by the lower document index."""
    queries = np.asarray(queries, np.float32)
    best_s = np.empty((len(queries), 0), np.float32)
    best_i = np.empty((len(queries), 0), np.int64)
    offset = 0
    for block in documents:
        scores = queries @ np.asarray(block, np.float32).T  # [Q, B]
        index = np.broadcast_to(np.arange(offset, offset + scores.shape[1]), scores.shape)
        best_s = np.concatenate([best_s, scores], axis=1)
        best_i = np.concatenate([best_i, index], axis=1)
        if best_s.shape[1] > k:  # keep k (a stable sort of a small [Q, k + B] array)
            order = np.lexsort((best_i, -best_s), axis=1)[:, :k]
            best_s = np.take_along_axis(best_s, order, 1)
            best_i = np.take_along_axis(best_i, order, 1)
        offset += scores.shape[1]
    order = np.lexsort((best_i, -best_s), axis=1)
    return np.take_along_axis(best_s, order, 1), np.take_along_axis(best_i, order, 1)


def blocks(array: np.ndarray, size: int) -> Iterator[np.ndarray]:
    """``array`` [N, D] as consecutive blocks of ``size`` rows."""
    for start in range(0, len(array), size):
        yield array[start:start + size]


def as_run(query_ids: list[str], doc_ids: list[str], scores: np.ndarray,
           indices: np.ndarray, k: int | None = None, keep_identical_ids: bool = False,
           ) -> dict[str, dict[str, float]]:
    """``top_k``'s result [Q, k'] as a trec-style run: each query's documents best first,
    without the one whose id is the query's (unless ``keep_identical_ids``), cut at ``k``
    (default: all)."""
    run = {}
    for q, row_s, row_i in zip(query_ids, scores, indices, strict=True):
        hits = ((doc_ids[int(i)], float(s)) for s, i in zip(row_s, row_i, strict=True))
        kept = [(d, s) for d, s in hits if keep_identical_ids or d != q]
        run[q] = dict(kept[:k])
    return run
