"""The BM25 baseline of ``clozax retrieval``: a lexical ranking of the same documents for the
same queries, from ``bm25s``."""

from __future__ import annotations

from collections.abc import Mapping


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
