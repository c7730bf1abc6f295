"""BM25 from ``bm25s``: the lexical ranking behind ``clozax retrieval``'s baseline (the same
documents for the same queries) and ``clozax embed``'s hard negatives (``data/negatives.py``).

A query's ranking holds only the documents that match it (score > 0), as a search engine's
BM25 (BEIR's Elasticsearch baseline) returns them: ``bm25s`` fills a top k past the matches with
score-0 documents in index order, which are dropped. A document whose id is the query's is
dropped too (BEIR's ``ignore_identical_ids``), and k + 1 are asked for so that k remain."""

from __future__ import annotations

from collections.abc import Mapping


def bm25_run(documents: Mapping[str, str], queries: Mapping[str, str], k: int,
             keep_identical_ids: bool = False) -> dict[str, dict[str, float]]:
    """BM25 (Lucene's variant, k1 = 1.5, b = 0.75: ``bm25s``'s defaults, the BEIR baselines'
    family) over ``documents``: each query's top ``k`` of the documents that match it (fewer
    when fewer match; none is an empty ranking), without the one whose id is the query's unless
    ``keep_identical_ids``. ``bm25s`` is used rather than a home-made index: sparse scores
    computed once at indexing, maintained and benchmarked against Elasticsearch/Pyserini on
    BEIR by its authors."""
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
    found, scores = index.retrieve(tokens, k=min(k + 1, len(doc_ids)), show_progress=False,
                                   backend_selection="numpy", n_threads=1)  # [Q, k + 1]
    run = {}
    for n, q in enumerate(query_ids):
        hits = ((doc_ids[int(i)], float(s)) for i, s in zip(found[n], scores[n], strict=True))
        kept = [(d, s) for d, s in hits if s > 0 and (keep_identical_ids or d != q)]
        run[q] = dict(kept[:k])
    return run
