"""The contrastive stage, ``clozax embed``: an encoder trained on (query, positive) pairs into
an embedder. The step (``step.py``: InfoNCE over in-batch negatives as a (sum, count), with
gradient caching), the stage as a clozax run (``stage.py``) and a ``--minutes`` stage's length
(``lengths.py``). It sits in the train layer beside the MLM loop and reuses its run
directory, checkpoints and locks."""
