"""Corpus preparation (``clozax prepare``) and the prepared-dataset format."""

from clozax.data.dataset import FORMAT_VERSION, Dataset, Split, open_dataset
from clozax.data.packing import MAX_SEQ_LEN, MIN_SEQ_LEN
from clozax.data.prepare import PrepareConfig, prepare

__all__ = [
    "FORMAT_VERSION", "MAX_SEQ_LEN", "MIN_SEQ_LEN", "Dataset", "PrepareConfig", "Split",
    "open_dataset", "prepare",
]
