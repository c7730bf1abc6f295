"""What a prepared dataset's ``manifest.json`` holds, built from the results of
``prepare``'s stages (``data/prepare.py``): the accounting of what was read, kept and skipped,
the splits, the shard index, the frozen tokenizer, and the identity whose hash is the
dataset's fingerprint."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import clozax
from clozax.core.files import file_sha256
from clozax.data.corpus import MAX_RUN_CHARS, Accounting
from clozax.data.dataset import FORMAT_VERSION, data_files, file_records, fingerprint
from clozax.data.packing import PACKER_VERSION
from clozax.data.prepare_config import PrepareConfig
from clozax.data.sources import MAX_DOCUMENT_CHARS, MAX_LINE_BYTES
from clozax.data.split import TRAIN
from clozax.data.tokenizer import special_strings


@dataclass(frozen=True)
class FrozenTokenizer:
    path: Path
    tok: object  # tokenizers.Tokenizer
    specials: dict
    vocab_size: int


@dataclass(frozen=True)
class Shards:
    """What the packed shards add up to: per split, its statistics, shard index and the
    sha256 of its document ids; the accounting with the packers' skips."""

    accounting: Accounting
    stats: dict
    index: dict
    ids_sha256: dict


def build_manifest(config: PrepareConfig, tokenizer: FrozenTokenizer, shards: Shards,
                   root: Path) -> dict:
    """The manifest: what was read, kept and skipped, the splits, the shard index, the
    tokenizer, and the identity whose hash is the dataset's fingerprint."""
    accounting, tok, specials = shards.accounting, tokenizer.tok, tokenizer.specials
    real = sum(s["tokens"] for s in shards.stats.values())
    total = sum(s["rows"] for s in shards.stats.values()) * config.seq_len
    manifest = {
        "format_version": FORMAT_VERSION,
        "clozax_version": clozax.__version__,
        "corpus": {"source": config.corpus, "text_field": config.text_field,
                   "group_field": config.group_field, "label_field": config.label_field,
                   "text_unit": config.text_unit, "group_by": config.group_by,
                   **({"python": platform.python_version()} if config.corpus == "stdlib"
                      else {})},
        "documents": {"read": accounting.read, "kept": accounting.kept,
                      "duplicates": accounting.duplicates, "skipped": accounting.skipped},
        "skipped": accounting.skips,
        "skip_reasons": accounting.skip_reasons,
        "splits": shards.stats,
        "shards": shards.index,
        "tokenizer": {
            "file": tokenizer.path.name, "sha256": file_sha256(tokenizer.path),
            "vocab_size": tokenizer.vocab_size,
            "trained_on": "given" if config.tokenizer else TRAIN,
            "sample": None if config.tokenizer else config.tokenizer_sample,
            "model": "given" if config.tokenizer else config.tokenizer_model,
            "lowercase": None if config.tokenizer else config.lowercase,
            "specials": specials,
            "special_strings": special_strings(tok, specials),
        },
        "seq_len": config.seq_len,
        "packing_efficiency": real / total,
        "heldout_fraction": config.heldout_fraction,
        "seed": config.seed,
        # What is cut before the tokenizer so that no input shape costs more than linear time
        # or unbounded memory (see readers, sources, corpus).
        "caps": {"document_chars": MAX_DOCUMENT_CHARS, "run_chars": MAX_RUN_CHARS,
                 "jsonl_line_bytes": MAX_LINE_BYTES},
    }
    # Everything that determines the rows; its hash is the dataset's fingerprint.
    manifest["identity"] = {
        "document_ids_sha256": shards.ids_sha256,
        "split": {"seed": config.seed, "heldout_fraction": config.heldout_fraction,
                  "group_field": config.group_field},
        "text_field": config.text_field,
        "seq_len": config.seq_len,
        "packer": PACKER_VERSION,
        "shard_bytes": config.shard_bytes,
        "tokenizer_sha256": manifest["tokenizer"]["sha256"],
        **({"specials": specials} if config.special_tokens else {}),  # named, not found
        "files": file_records(root, data_files(shards.index)),
    }
    manifest["fingerprint"] = fingerprint(manifest["identity"])
    return manifest
