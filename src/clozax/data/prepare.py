"""``clozax prepare``: documents → document-level split → frozen tokenizer → packed rows.

Order of work (everything lands in a hidden sibling directory, renamed into place only when
complete, so a crash leaves no partial output):

1. read, clean, dedup and split the corpus, streaming kept documents to per-split spool files;
2. train the tokenizer on the train spool only (or copy ``--tokenizer`` unchanged);
3. encode each split in batches, chunk, best-fit pack, write rows and document records;
4. write ``manifest.json``, delete the spools, rename into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from tokenizers import Tokenizer

import clozax
from clozax.core import files
from clozax.core.files import file_sha256, remove_stale_partials, staged_dir
from clozax.core.vocab import SPECIAL_NAMES
from clozax.data.corpus import Accounting, clean
from clozax.data.dataset import (
    FORMAT_VERSION,
    SplitWriter,
    file_records,
    fingerprint,
    token_dtype,
)
from clozax.data.packing import (
    MAX_SEQ_LEN,
    MIN_SEQ_LEN,
    PACKER_VERSION,
    BestFitPacker,
    chunk_document,
)
from clozax.data.readers import FieldNames, Record, read_corpus
from clozax.data.split import HELDOUT, SPLITS, TRAIN, assign_split, group_key
from clozax.data.tokenizer import (
    TOKENIZER_MODELS,
    find_specials,
    load_tokenizer,
    train_tokenizer,
)

ENCODE_BATCH = 1024  # documents per encode_batch call; speed only
# Test hook: when set, sleep this many seconds after everything is written, before the rename.
_PAUSE_ENV = "CLOZAX_TEST_PAUSE_BEFORE_RENAME"


@dataclass(frozen=True)
class PrepareConfig:
    """Everything that decides a prepared dataset's contents."""

    out: Path
    corpus: str = "stdlib"
    text_field: str = "text"
    group_field: str | None = None
    label_field: str | None = None
    heldout_fraction: float = 0.05
    seed: int = 0
    tokenizer_model: str = "bpe"
    tokenizer: Path | None = None
    vocab_size: int = 8192
    lowercase: bool = True
    seq_len: int = 128
    strict: bool = False
    overwrite: bool = False

    def __post_init__(self):
        if not MIN_SEQ_LEN <= self.seq_len <= MAX_SEQ_LEN:
            raise ValueError(f"--seq-len {self.seq_len} is outside [{MIN_SEQ_LEN}, "
                             f"{MAX_SEQ_LEN}] (the longest model preset's positions); pick a value "
                             "in that range")
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


def prepare(out: str | Path, *, quiet: bool = False, console: Console | None = None,
            **options) -> dict:
    """Prepare a dataset at ``out`` (options: the fields of ``PrepareConfig``); returns the
    manifest. Prints progress to stderr and a summary table unless ``quiet``."""
    valid = [f.name for f in fields(PrepareConfig) if f.name != "out"]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"unknown prepare option(s) {', '.join(unknown)}; valid: "
                         f"{', '.join(valid)}")
    config = PrepareConfig(out=Path(out), **options)
    out = config.out
    if out.exists() and not config.overwrite:
        raise ValueError(f"output directory {out} already exists; pass --overwrite to replace "
                         "it or choose another --out")
    if out.exists() and not (out / "manifest.json").is_file() and \
            not (out.is_dir() and not any(out.iterdir())):
        raise ValueError(f"refusing to --overwrite {out}: it is not a clozax dataset (no "
                         "manifest.json); remove it yourself or choose another --out")
    if config.tokenizer is not None:
        load_tokenizer(config.tokenizer)  # fail on a bad --tokenizer before reading
    names = FieldNames(config.text_field, config.group_field, config.label_field)
    records = read_corpus(config.corpus, names, config.strict)  # checks the path now
    remove_stale_partials(out)
    started = time.perf_counter()
    with staged_dir(out) as tmp:
        progress = _progress(quiet)
        with progress:
            manifest = _build(config, records, tmp, progress)
        if os.environ.get(_PAUSE_ENV):
            time.sleep(float(os.environ[_PAUSE_ENV]))
    if not quiet:
        print_summary(manifest, console or Console(), time.perf_counter() - started)
    return manifest


def _progress(quiet: bool) -> Progress:
    return Progress(
        TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("docs {task.fields[detail]}"), TimeElapsedColumn(),
        console=Console(stderr=True), disable=quiet, transient=False,
    )


def _build(config: PrepareConfig, records: Iterator[Record], tmp: Path,
           progress: Progress) -> dict:
    # 1. read, clean, split, spool
    accounting = Accounting()
    spools = {split: (tmp / f"{split}.spool.jsonl").open("w", encoding="utf-8")
              for split in SPLITS}
    # Groups are counted by their 64-bit keys, not names, to keep memory small.
    groups: dict[str, set[int]] = {split: set() for split in SPLITS}
    docs = dict.fromkeys(SPLITS, 0)
    reading = progress.add_task("reading", total=None, detail="")
    for doc in clean(records, accounting):
        key = group_key(doc.group, config.seed)
        split = assign_split(key, config.heldout_fraction)
        groups[split].add(key)
        docs[split] += 1
        spools[split].write(json.dumps(asdict(doc), ensure_ascii=False) + "\n")
        progress.advance(reading)
    for f in spools.values():
        f.close()
    progress.update(reading, total=accounting.read, completed=accounting.read)
    accounting.check()
    _check_corpus(config, accounting, groups)

    # 2. tokenizer, frozen
    tokenizer_path = tmp / "tokenizer.json"
    if config.tokenizer is not None:
        tok = load_tokenizer(config.tokenizer)
        shutil.copyfile(config.tokenizer, tokenizer_path)  # unchanged, byte for byte
    else:
        training = progress.add_task("training tokenizer", total=docs[TRAIN], detail="")
        texts = _texts(tmp / f"{TRAIN}.spool.jsonl", progress, training)
        tok = train_tokenizer(texts, model=config.tokenizer_model, vocab_size=config.vocab_size,
                              lowercase=config.lowercase, length=docs[TRAIN])
        tok.save(str(tokenizer_path))
    specials = find_specials(tok)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)

    # 3. encode, chunk, pack, write
    split_stats, ids_sha256 = {}, {}
    for split in SPLITS:
        stats = _pack_split(config, tmp, split, tok, specials, token_dtype(vocab_size),
                            progress, docs[split], accounting)
        ids_sha256[split] = stats.pop("document_ids_sha256")
        split_stats[split] = {"groups": len(groups[split]), **stats}
        (tmp / f"{split}.spool.jsonl").unlink()
    accounting.check()
    for split in SPLITS:
        if split_stats[split]["documents"] == 0:
            raise ValueError(f"the {split} split has no document with a non-special token after "
                             f"tokenization; add text to {config.corpus}")

    # 4. manifest
    real = sum(s["tokens"] for s in split_stats.values())
    total = sum(s["rows"] for s in split_stats.values()) * config.seq_len
    manifest = {
        "format_version": FORMAT_VERSION,
        "clozax_version": clozax.__version__,
        "corpus": {"source": config.corpus, "text_field": config.text_field,
                   "group_field": config.group_field, "label_field": config.label_field,
                   **({"python": platform.python_version()} if config.corpus == "stdlib"
                      else {})},
        "documents": {"read": accounting.read, "kept": accounting.kept,
                      "duplicates": accounting.duplicates, "skipped": accounting.skipped},
        "skipped": accounting.skips,
        "skip_reasons": accounting.skip_reasons,
        "splits": split_stats,
        "tokenizer": {
            "file": tokenizer_path.name, "sha256": file_sha256(tokenizer_path),
            "vocab_size": vocab_size,
            "trained_on": "given" if config.tokenizer else TRAIN,
            "model": "given" if config.tokenizer else config.tokenizer_model,
            "lowercase": None if config.tokenizer else config.lowercase,
            "specials": specials,
        },
        "seq_len": config.seq_len,
        "packing_efficiency": real / total,
        "heldout_fraction": config.heldout_fraction,
        "seed": config.seed,
    }
    # Everything that determines the rows; its hash is the dataset's fingerprint.
    manifest["identity"] = {
        "document_ids_sha256": ids_sha256,
        "split": {"seed": config.seed, "heldout_fraction": config.heldout_fraction,
                  "group_field": config.group_field},
        "text_field": config.text_field,
        "seq_len": config.seq_len,
        "packer": PACKER_VERSION,
        "tokenizer_sha256": manifest["tokenizer"]["sha256"],
        "files": file_records(tmp),
    }
    manifest["fingerprint"] = fingerprint(manifest["identity"])
    files.write_json(tmp / "manifest.json", manifest)
    return manifest


def _check_corpus(config: PrepareConfig, accounting: Accounting,
                  groups: dict[str, set[int]]) -> None:
    if accounting.kept == 0:
        if accounting.skipped:
            first = "; ".join(f"{s['source']}: {s['reason']}" for s in accounting.skips[:3])
            raise ValueError(f"every one of the {accounting.read} documents in {config.corpus} "
                             f"was skipped (first: {first}); fix the input or --text-field")
        raise ValueError(f"corpus {config.corpus} has no non-empty documents; add text")
    n_groups = len(groups[TRAIN]) + len(groups[HELDOUT])
    for split, other in ((HELDOUT, TRAIN), (TRAIN, HELDOUT)):
        if not groups[split]:
            raise ValueError(
                f"the {split} split would be empty: all {n_groups} group(s) hashed into "
                f"{other} at --heldout-fraction {config.heldout_fraction} --seed {config.seed};"
                " add documents from more groups (or --group-field), or change the fraction "
                "or seed")


def _spool(path: Path) -> Iterator[dict]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def _texts(path: Path, progress: Progress, task) -> Iterator[str]:
    for record in _spool(path):
        progress.advance(task)
        yield record["text"]


def _batches(path: Path) -> Iterator[list[dict]]:
    batch = []
    for record in _spool(path):
        batch.append(record)
        if len(batch) == ENCODE_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _pack_split(config: PrepareConfig, tmp: Path, split: str, tok: Tokenizer,
                specials: dict[str, int], dtype: np.dtype, progress: Progress,
                n_docs: int, accounting: Accounting) -> dict:
    """Encode, chunk and pack one split's spool. A document with no token that could ever be
    selected (empty after tokenization, or only special tokens such as a literal ``[MASK]``)
    is skipped with its reason, so no row can lack an eligible position."""
    writer = SplitWriter(tmp, split, config.seq_len, dtype)
    packer = BestFitPacker(config.seq_len, specials["pad"], writer.write_row)
    task = progress.add_task(f"packing {split}", total=n_docs, detail="0 tokens")
    special_ids = set(specials.values())
    ids_hash = hashlib.sha256()  # kept documents' ids, in corpus order
    index = chunks = long_docs = n_tokens = skipped = 0
    for batch in _batches(tmp / f"{split}.spool.jsonl"):
        encodings = tok.encode_batch([r["text"] for r in batch], add_special_tokens=False)
        for record, enc in zip(batch, encodings, strict=True):
            if all(i in special_ids for i in enc.ids):
                accounting.unkeep(record["source"], "no non-special token after tokenization"
                                  if enc.ids else "empty after tokenization")
                skipped += 1
                continue
            pieces = chunk_document(index, enc.ids, enc.word_ids, seq_len=config.seq_len,
                                    cls_id=specials["cls"], sep_id=specials["sep"])
            writer.add_document(index, {"id": record["id"], "group": record["group"],
                                        "label": record["label"], "source": record["source"],
                                        "tokens": len(enc.ids)}, len(pieces))
            for piece in pieces:
                packer.add(piece)
            ids_hash.update(bytes.fromhex(record["id"]))
            chunks += len(pieces)
            long_docs += len(pieces) > 1
            n_tokens += len(enc.ids)
            index += 1
        progress.update(task, advance=len(batch), detail=f"{n_tokens:,} tokens")
    packer.flush()
    writer.close()
    return {"documents": index, "rows": writer.rows, "tokens": writer.tokens,
            "pad_tokens": writer.rows * config.seq_len - writer.tokens,
            "chunks": chunks, "chunked_documents": long_docs, "skipped_documents": skipped,
            "document_ids_sha256": ids_hash.hexdigest()}


def print_summary(manifest: dict, console: Console, seconds: float | None = None) -> None:
    """Accounting, per-split sizes, packing efficiency and tokenizer hash as one table."""
    d = manifest["documents"]
    console.print(f"documents: read {d['read']:,} = kept {d['kept']:,} + duplicates "
                  f"{d['duplicates']:,} + skipped {d['skipped']:,}")
    for reason, count in manifest["skip_reasons"].items():
        console.print(f"  skipped {count:,}: {reason}")
    table = Table(title=None)
    for column in ("split", "documents", "groups", "rows", "tokens", "pad tokens", "chunked"):
        table.add_column(column, justify="left" if column == "split" else "right")
    for split, s in manifest["splits"].items():
        table.add_row(split, f"{s['documents']:,}", f"{s['groups']:,}", f"{s['rows']:,}",
                      f"{s['tokens']:,}", f"{s['pad_tokens']:,}", f"{s['chunked_documents']:,}")
    console.print(table)
    t = manifest["tokenizer"]
    console.print(f"seq_len {manifest['seq_len']}, packing efficiency "
                  f"{manifest['packing_efficiency']:.4f}")
    console.print(f"tokenizer {t['model']} (trained on {t['trained_on']}), vocab "
                  f"{t['vocab_size']:,}, sha256 {t['sha256']}")
    if seconds is not None:
        console.print(f"prepared in {seconds:.1f} s")
