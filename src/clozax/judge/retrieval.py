"""Retrieval as BEIR scores it: exact search in bounded memory, and metrics as ``trec_eval``
defines them.

Search: cosine or dot-product scores of every query against every document, a block of
documents at a time, keeping a running top-k per query, so a collection of N documents never
needs the N × queries score matrix (peak: queries × (block + k) scores).

Metrics (``trec_eval`` 9.x, which ``pytrec_eval`` wraps and BEIR calls; checked against it in
tests):
- a run is ranked by score, descending, ties broken by document id, *descending* (trec_eval's
  order; documents are compared as strings);
- ``ndcg_cut_k``: DCG over the first k of the run with gain = the qrels grade and discount
  ``log2(rank + 1)``; the ideal DCG from the query's qrels grades (> 0) sorted descending, cut
  at k; 0 when the ideal is 0;
- ``recip_rank`` at k (BEIR's MRR@k: the run cut at k first): 1 / rank of the first document
  with grade ≥ 1, 0 if none;
- ``recall_k``: relevant documents (grade ≥ 1) among the first k, over all relevant ones;
- the mean is over the queries that have at least one relevant document in the qrels and a run
  (as ``pytrec_eval``'s per-query results are averaged in BEIR).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import numpy as np

Qrels = Mapping[str, Mapping[str, int]]  # query id -> document id -> grade
Run = Mapping[str, Mapping[str, float]]  # query id -> document id -> score
METRICS = ("ndcg@10", "mrr@10", "recall@100")


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
           indices: np.ndarray) -> dict[str, dict[str, float]]:
    """``top_k``'s result as a trec-style run."""
    return {q: {doc_ids[int(i)]: float(s) for s, i in zip(row_s, row_i, strict=True)}
            for q, row_s, row_i in zip(query_ids, scores, indices, strict=True)}


def ranked(scores: Mapping[str, float]) -> list[str]:
    """Document ids in trec_eval's order: score descending, then id descending."""
    return [d for d, _ in sorted(scores.items(), key=lambda x: (x[1], x[0]), reverse=True)]


def per_query(qrels: Qrels, run: Run, k_ndcg: int = 10, k_mrr: int = 10,
              k_recall: int = 100) -> dict[str, dict[str, float]]:
    """``{query: {"ndcg@10", "mrr@10", "recall@100"}}`` for each query that has a relevant
    document and a run."""
    out = {}
    for query, grades in qrels.items():
        relevant = {d for d, g in grades.items() if g >= 1}
        if not relevant or query not in run:
            continue
        order = ranked(run[query])
        out[query] = {f"ndcg@{k_ndcg}": _ndcg(order[:k_ndcg], grades, k_ndcg),
                      f"mrr@{k_mrr}": _reciprocal_rank(order[:k_mrr], relevant),
                      f"recall@{k_recall}": len(relevant & set(order[:k_recall])) / len(relevant)}
    return out


def mean(results: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """The mean of each metric over the queries scored."""
    if not results:
        raise ValueError("no query has a relevant document in the qrels and a ranking; check "
                         "that the qrels name the queries and documents given")
    names = next(iter(results.values())).keys()
    return {m: float(np.mean([r[m] for r in results.values()])) for m in names}


def _ndcg(order: list[str], grades: Mapping[str, int], k: int) -> float:
    dcg = sum(grades.get(d, 0) / math.log2(rank + 2) for rank, d in enumerate(order))
    ideal = sorted((g for g in grades.values() if g > 0), reverse=True)[:k]
    idcg = sum(g / math.log2(rank + 2) for rank, g in enumerate(ideal))
    return dcg / idcg if idcg > 0 else 0.0


def _reciprocal_rank(order: list[str], relevant: set[str]) -> float:
    return next((1.0 / (rank + 1) for rank, d in enumerate(order) if d in relevant), 0.0)


def bm25_run(documents: Mapping[str, str], queries: Mapping[str, str], k: int,
             ) -> dict[str, dict[str, float]]:
    """BM25 (Lucene's variant, k1 = 1.5, b = 0.75: ``bm25s``'s defaults, the BEIR baselines'
    family) over ``documents``, the top ``k`` of each query. ``bm25s`` is used rather than a
    home-made index: sparse scores computed once at indexing, maintained and benchmarked
    against Elasticsearch/Pyserini on BEIR by its authors."""
    try:
        import bm25s
    except ImportError:
        raise ValueError("BM25 needs bm25s: pip install 'clozax[retrieval]'") from None
    import logging

    logging.getLogger("bm25s").setLevel(logging.WARNING)  # its index logs at DEBUG
    doc_ids, query_ids = list(documents), list(queries)
    index = bm25s.BM25(method="lucene", k1=1.5, b=0.75)
    index.index(bm25s.tokenize([documents[d] for d in doc_ids], stopwords="en",
                               show_progress=False), show_progress=False)
    tokens = bm25s.tokenize([queries[q] for q in query_ids], stopwords="en",
                            show_progress=False)
    found, scores = index.retrieve(tokens, k=min(k, len(doc_ids)), show_progress=False,
                                   backend_selection="numpy", n_threads=1)
    return {q: {doc_ids[int(i)]: float(s) for i, s in zip(found[n], scores[n], strict=True)}
            for n, q in enumerate(query_ids)}
