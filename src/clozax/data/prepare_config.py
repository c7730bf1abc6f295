"""What decides a prepared dataset's contents (``PrepareConfig``, validated), and where its
tasks run (``executors``): this machine, or a Dask cluster."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from clozax.core.vocab import SPECIAL_NAMES
from clozax.data.executors import EXECUTORS, Dask, Local, dask_available
from clozax.data.packing import MAX_SEQ_LEN, MIN_SEQ_LEN
from clozax.data.readers import Layout
from clozax.data.tokenizer import TOKENIZER_MODELS, parse_special_tokens

# Input bytes per piece, so per data shard (at least: see pieces.MAX_PIECES).
SHARD_BYTES = 1 << 22
SPEED_ONLY = ("workers", "executor", "scheduler", "overwrite", "discard_partial")  # no byte


@dataclass(frozen=True)
class PrepareConfig:
    """Everything that decides a prepared dataset's contents."""

    out: Path
    corpus: str = "stdlib"
    text_field: str = "text"
    group_field: str | None = None
    label_field: str | None = None
    text_unit: str = "file"
    group_by: str = "document"
    heldout_fraction: float = 0.05
    seed: int = 0
    tokenizer_model: str = "bpe"
    tokenizer: Path | None = None
    special_tokens: str | None = None  # "mask=<mask>,…": the given tokenizer's own strings
    vocab_size: int = 8192
    tokenizer_sample: int | None = None
    lowercase: bool = True
    seq_len: int = 128
    strict: bool = False
    overwrite: bool = False
    shard_bytes: int = SHARD_BYTES
    workers: int | None = None  # None: every core
    executor: str = "local"  # or "dask" (data/executors.py)
    scheduler: str | None = None  # a Dask scheduler's address; None: a local cluster
    discard_partial: bool = False  # delete an unfinished prepare of other settings

    def __post_init__(self):
        if not MIN_SEQ_LEN <= self.seq_len <= MAX_SEQ_LEN:
            raise ValueError(f"--seq-len {self.seq_len} is outside [{MIN_SEQ_LEN}, "
                             f"{MAX_SEQ_LEN}]; pick a value in that range (and train with "
                             "model.max_positions at least as large)")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"--heldout-fraction {self.heldout_fraction} must be strictly "
                             "between 0 and 1; 0.05 is the default")
        if self.vocab_size <= len(SPECIAL_NAMES) or self.vocab_size > 2**32:
            raise ValueError(f"--vocab-size {self.vocab_size} must exceed the "
                             f"{len(SPECIAL_NAMES)} special tokens (and fit uint32); "
                             "8192 is the default")
        if self.tokenizer_model not in TOKENIZER_MODELS:
            raise ValueError(f"--tokenizer-model {self.tokenizer_model!r} is unknown; use one "
                             f"of {', '.join(TOKENIZER_MODELS)}")
        if not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"--seed {self.seed} does not fit 64 bits; pick a smaller seed")
        if not self.text_field:
            raise ValueError("--text-field is empty; name the field holding the text")
        Layout(self.text_unit, self.group_by)  # validates both
        if self.shard_bytes < 1:
            raise ValueError(f"--shard-bytes {self.shard_bytes} must be positive; "
                             f"{SHARD_BYTES} is the default")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"--workers {self.workers} must be at least 1; omit it to use "
                             "every core")
        if self.executor not in EXECUTORS:
            raise ValueError(f"--executor {self.executor!r} is unknown; use one of "
                             f"{', '.join(EXECUTORS)}")
        if self.scheduler is not None and self.executor != "dask":
            raise ValueError("--scheduler names a Dask scheduler; pass --executor dask with it "
                             "(or drop --scheduler)")
        if self.executor == "dask" and not dask_available():
            raise ValueError("--executor dask needs Dask distributed: pip install "
                             "'clozax[cluster]' (or use --executor local)")
        if self.special_tokens is not None:
            if self.tokenizer is None:
                raise ValueError("--special-tokens names the strings of a given tokenizer; "
                                 "pass --tokenizer with it (a trained one uses BERT's)")
            parse_special_tokens(self.special_tokens)  # validates it
        if self.tokenizer_sample is not None and self.tokenizer_sample < 1:
            raise ValueError(f"--tokenizer-sample {self.tokenizer_sample} must be at least 1 "
                             "(documents to train the tokenizer on); omit it to use them all")


def executors(config: PrepareConfig, pieces: int, say) -> tuple[Local, Local | Dask]:
    """This machine's executor (the tokenizer trains here) and the one reading and packing:
    the same, or Dask. ``--workers`` beyond the cores or the pieces is capped, with a note."""
    cores = os.cpu_count() or 1
    asked = config.workers or cores
    if config.executor == "dask":
        return Local(min(asked, cores)), Dask(config.scheduler, min(asked, pieces))
    workers = min(asked, cores)
    if asked > cores:
        say(f"--workers {asked} is more than this machine's {cores} cores: using {cores}")
    if config.workers is not None and pieces < workers:
        say(f"the corpus is {pieces} piece{'s' * (pieces > 1)}: reading on {pieces} "
            f"worker{'s' * (pieces > 1)} (pieces are about --shard-bytes "
            f"{config.shard_bytes:,} of input)")
    return (local := Local(workers, inline=pieces == 1)), local
