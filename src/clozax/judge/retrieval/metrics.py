"""Retrieval metrics as ``trec_eval`` defines them (``trec_eval`` 9.x, which ``pytrec_eval``
wraps and BEIR calls; checked against it in tests):
- a run is ranked by score, descending, ties broken by document id, *descending* (trec_eval's
  order; documents are compared as strings);
- ``ndcg_cut_k``: DCG over the first k of the run with gain = the qrels grade and discount
  ``log2(rank + 1)``; the ideal DCG from the query's qrels grades (> 0) sorted descending, cut
  at k; 0 when the ideal is 0. A negative grade is a gain of 0, as trec_eval has it (a
  document judged −1 at rank 1 costs nothing; it only fails to earn);
- ``recip_rank`` at k (BEIR's MRR@k: the run cut at k first): 1 / rank of the first document
  with grade ≥ 1, 0 if none;
- ``recall_k``: relevant documents (grade ≥ 1) among the first k, over all relevant ones; 0
  when the query has none;
- a query is scored when it is in the qrels and in the run (its ranking may be empty), as
  ``pytrec_eval`` scores it: one whose judgements are all grade 0 (or below) scores 0 on every
  metric and counts in the mean, which is over every query scored (as BEIR averages
  ``pytrec_eval``'s per-query results).

The run scored is the one the caller gives: BEIR's default of dropping a document whose id is the
query's (``ignore_identical_ids``) is applied where the runs are made (``search.py`` ``as_run``,
``bm25.py``), so that k documents remain.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

Qrels = Mapping[str, Mapping[str, int]]  # query id -> document id -> grade
Run = Mapping[str, Mapping[str, float]]  # query id -> document id -> score
METRICS = ("ndcg@10", "mrr@10", "recall@100")


def ranked(scores: Mapping[str, float]) -> list[str]:
    """Document ids in trec_eval's order: score descending, then id descending."""
    return [d for d, _ in sorted(scores.items(), key=lambda x: (x[1], x[0]), reverse=True)]


def per_query(qrels: Qrels, run: Run, k_ndcg: int = 10, k_mrr: int = 10,
              k_recall: int = 100) -> dict[str, dict[str, float]]:
    """``{query: {"ndcg@10", "mrr@10", "recall@100"}}`` for each query of the qrels that the
    run has (all 0 for a query with no relevant document)."""
    out = {}
    for query, grades in qrels.items():
        if query not in run:
            continue
        relevant = {d for d, g in grades.items() if g >= 1}
        order = ranked(run[query])
        found = len(relevant & set(order[:k_recall]))
        out[query] = {f"ndcg@{k_ndcg}": _ndcg(order[:k_ndcg], grades, k_ndcg),
                      f"mrr@{k_mrr}": _reciprocal_rank(order[:k_mrr], relevant),
                      f"recall@{k_recall}": found / len(relevant) if relevant else 0.0}
    return out


def mean(results: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """The mean of each metric over every query scored."""
    if not results:
        raise ValueError("no query of the qrels has a ranking; check that the qrels name the "
                         "queries given")
    names = next(iter(results.values())).keys()
    return {m: float(np.mean([r[m] for r in results.values()])) for m in names}


def _ndcg(order: list[str], grades: Mapping[str, int], k: int) -> float:
    dcg = sum(max(grades.get(d, 0), 0) / math.log2(rank + 2) for rank, d in enumerate(order))
    ideal = sorted((g for g in grades.values() if g > 0), reverse=True)[:k]
    idcg = sum(g / math.log2(rank + 2) for rank, g in enumerate(ideal))
    return dcg / idcg if idcg > 0 else 0.0


def _reciprocal_rank(order: list[str], relevant: set[str]) -> float:
    return next((1.0 / (rank + 1) for rank, d in enumerate(order) if d in relevant), 0.0)
