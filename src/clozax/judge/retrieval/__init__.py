"""Retrieval, ``clozax retrieval``: scored as BEIR scores it. The set (a BEIR directory,
``beir.py``, or one built from the held-out split, ``heldout_set.py``), exact dense search
(``search.py``), BM25 (``bm25.py``), the metrics as ``trec_eval`` defines them
(``metrics.py``), and the rows compared side by side (``compare.py``)."""
