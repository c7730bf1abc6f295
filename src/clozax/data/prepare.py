"""``clozax prepare``: documents → document-level split → frozen tokenizer → packed shards.

Order of work, in a hidden sibling directory ``.{out}.partial-{key}`` renamed into place only
when complete (no half dataset is ever visible as complete):

1. cut the corpus into pieces (``data/pieces.py``: whole files, or ranges of a large file);
   read, clean and split each piece into spools over ``--workers`` processes, deduplicating the
   pieces here in corpus order as they finish (``data/spool.py``; ``spool/done.json`` marks
   the phase finished);
2. train the tokenizer on the kept train documents only, or a keyed sample of them (or copy
   ``--tokenizer`` unchanged); ``tokenizer.json`` appears by rename when finished;
3. encode, chunk and best-fit pack each piece's kept documents of a split into one data shard,
   over the workers (``data/pack.py``; a shard's result file marks it finished);
4. write ``manifest.json`` with the shard index, delete the spools, rename into place.

``--workers N`` uses N cores: N processes each with a one-thread tokenizer (``data/pool.py``),
and N tokenizer-training threads. The output never depends on N.

Resuming: ``key`` hashes everything that decides the output (the config without speed-only
settings, the corpus files' names, sizes and modification times, the clozax version), so a
prepare killed at any point and run again with the same settings finds its directory and
continues after the last finished piece, phase or shard, with the same final bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import clozax
from clozax.core import files
from clozax.core.files import claim_dir, file_sha256, publish_dir, remove_stale_partials
from clozax.core.vocab import SPECIAL_NAMES
from clozax.data.corpus import MAX_RUN_CHARS, Accounting
from clozax.data.dataset import (
    FORMAT_VERSION,
    data_files,
    file_records,
    fingerprint,
    unigram_file,
)
from clozax.data.pack import result_path
from clozax.data.packing import MAX_SEQ_LEN, MIN_SEQ_LEN, PACKER_VERSION
from clozax.data.pieces import plan
from clozax.data.pool import Pool, WorkerFailed
from clozax.data.readers import Layout
from clozax.data.sources import MAX_DOCUMENT_CHARS, MAX_LINE_BYTES, find_files
from clozax.data.split import HELDOUT, SPLITS, TRAIN
from clozax.data.spool import Dedup, Sample, piece_read
from clozax.data.tokenizer import TOKENIZER_MODELS, find_specials, load_tokenizer

# Input bytes per piece, so per data shard (at least: see pieces.MAX_PIECES).
SHARD_BYTES = 1 << 22
SPEED_ONLY = ("workers", "overwrite")  # not in the resume key: they change no byte
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
    text_unit: str = "file"
    group_by: str = "document"
    heldout_fraction: float = 0.05
    seed: int = 0
    tokenizer_model: str = "bpe"
    tokenizer: Path | None = None
    vocab_size: int = 8192
    tokenizer_sample: int | None = None
    lowercase: bool = True
    seq_len: int = 128
    strict: bool = False
    overwrite: bool = False
    shard_bytes: int = SHARD_BYTES
    workers: int | None = None  # None: every core

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
        if self.tokenizer_sample is not None and self.tokenizer_sample < 1:
            raise ValueError(f"--tokenizer-sample {self.tokenizer_sample} must be at least 1 "
                             "(documents to train the tokenizer on); omit it to use them all")


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
    started = time.perf_counter()
    layout = Layout(config.text_unit, config.group_by)
    pieces = plan(config.corpus, layout, config.shard_bytes)  # checks the path now
    seconds = {"plan": time.perf_counter() - started}  # per phase, for the summary only
    tmp = out.parent / f".{out.name}.partial-r{_resume_key(config)}"
    remove_stale_partials(out, keep=tmp)  # a killed run with other settings is not resumed
    claim_dir(tmp, "another prepare with the same settings")
    try:
        progress = _progress(quiet)
        with progress:
            manifest = _build(config, pieces, tmp, progress, seconds)
    except WorkerFailed:
        raise  # keep the finished shards for the next run
    except ValueError:  # bad input: nothing worth resuming
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / "lock").unlink()
    if os.environ.get(_PAUSE_ENV):
        time.sleep(float(os.environ[_PAUSE_ENV]))
    publish_dir(tmp, out)
    if not quiet:
        print_summary(manifest, console or Console(), time.perf_counter() - started, seconds)
    return manifest


def _resume_key(config: PrepareConfig) -> str:
    """A hash of everything that decides the output bytes (see the module docstring)."""
    settings = {k: str(v) for k, v in asdict(config).items() if k not in SPEED_ONLY}
    corpus = [platform.python_version()] if config.corpus == "stdlib" else [
        (str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in find_files(config.corpus)[0]]
    if config.tokenizer is not None:
        corpus.append(file_sha256(config.tokenizer))
    text = json.dumps([settings, corpus, clozax.__version__, FORMAT_VERSION], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _progress(quiet: bool) -> Progress:
    return Progress(
        TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("docs {task.fields[detail]}"), TimeElapsedColumn(),
        console=Console(stderr=True), disable=quiet, transient=False,
    )


def _build(config: PrepareConfig, the_plan: dict, tmp: Path, progress: Progress,
           seconds: dict[str, float]) -> dict:
    workers = Pool(config.workers or os.cpu_count() or 1, inline=len(the_plan["pieces"]) == 1)
    clock = time.perf_counter()
    # 1. read, clean, split and spool the pieces; dedup in corpus order (skipped when a resumed
    #    run finished it)
    phase1 = files.read_json(tmp / "spool" / "done.json")
    if phase1 is None:
        phase1 = _read_pieces(config, the_plan, tmp, progress, workers)
    accounting = Accounting(**phase1["accounting"])
    docs, groups, shards = phase1["docs"], phase1["groups"], phase1["shards"]
    seconds["reading"], clock = time.perf_counter() - clock, time.perf_counter()

    # 2. tokenizer, frozen (written under a temporary name, so its presence means finished)
    tokenizer_path = tmp / "tokenizer.json"
    if not tokenizer_path.is_file():
        partial = tmp / "tokenizer.json.partial"
        if config.tokenizer is not None:
            shutil.copyfile(config.tokenizer, partial)  # unchanged, byte for byte
        else:
            threshold = phase1["sample_threshold"]
            n_train = docs[TRAIN] if threshold is None else config.tokenizer_sample
            training = progress.add_task("training tokenizer", total=1, detail=f"{n_train:,}")
            options = {"model": config.tokenizer_model, "vocab_size": config.vocab_size,
                       "lowercase": config.lowercase, "length": n_train}
            workers.run([{"kind": "train", "args": {
                "tmp": str(tmp), "pieces": shards[TRAIN], "threshold": threshold,
                "seed": config.seed, "options": options}}])
            progress.advance(training)
        partial.rename(tokenizer_path)
    seconds["tokenizer"], clock = time.perf_counter() - clock, time.perf_counter()
    tok = load_tokenizer(tokenizer_path)
    specials = find_specials(tok)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)

    # 3. encode, chunk, pack, write: one data shard per piece with kept documents of a split
    tasks = [{"kind": "pack", "args": {"tmp": str(tmp), "split": split, "k": k, "piece": piece,
                                       "seq_len": config.seq_len}}
             for split in SPLITS for k, piece in enumerate(shards[split])]
    packing = progress.add_task("packing shards", total=len(tasks), detail="")
    (tmp / "results").mkdir(exist_ok=True)
    todo = [t for t in tasks if not result_path(tmp, t["args"]["split"], t["args"]["k"]).is_file()]
    progress.advance(packing, len(tasks) - len(todo))
    workers.run(todo, done=lambda i: progress.advance(packing))
    seconds["packing"] = time.perf_counter() - clock
    split_stats, ids_sha256, index = {}, {}, {}
    keys = ("documents", "rows", "tokens", "chunks", "chunked_documents")
    for split in SPLITS:
        ids_hash, counts = hashlib.sha256(), np.zeros(vocab_size, np.int64)
        total, index[split], skipped = dict.fromkeys(keys, 0), [], 0
        for k in range(len(shards[split])):  # in shard order, one result held at a time
            result = files.read_json(result_path(tmp, split, k))
            for source, reason in result["skips"]:
                accounting.unkeep(source, reason)
            ids_hash.update(b"".join(bytes.fromhex(i) for i in result["ids"]))
            counts += np.asarray(result["counts"], np.int64)
            index[split].append({key: result[key] for key in ("name", "rows", "documents",
                                                              "tokens")})
            total = {key: total[key] + result[key] for key in keys}
            skipped += len(result["skips"])
        np.save(tmp / unigram_file(split), counts)
        ids_sha256[split] = ids_hash.hexdigest()
        split_stats[split] = {
            "groups": groups[split], "documents": total["documents"], "rows": total["rows"],
            "tokens": total["tokens"], "pad_tokens": total["rows"] * config.seq_len -
            total["tokens"], "chunks": total["chunks"],
            "chunked_documents": total["chunked_documents"], "skipped_documents": skipped}
    accounting.check()
    for split in SPLITS:
        if split_stats[split]["documents"] == 0:
            raise ValueError(f"the {split} split has no document with a non-special token after "
                             f"tokenization; add text to {config.corpus}")
    shutil.rmtree(tmp / "spool")
    shutil.rmtree(tmp / "results")

    # 4. manifest
    real = sum(s["tokens"] for s in split_stats.values())
    total = sum(s["rows"] for s in split_stats.values()) * config.seq_len
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
        "splits": split_stats,
        "shards": index,
        "tokenizer": {
            "file": tokenizer_path.name, "sha256": file_sha256(tokenizer_path),
            "vocab_size": vocab_size,
            "trained_on": "given" if config.tokenizer else TRAIN,
            "sample": None if config.tokenizer else config.tokenizer_sample,
            "model": "given" if config.tokenizer else config.tokenizer_model,
            "lowercase": None if config.tokenizer else config.lowercase,
            "specials": specials,
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
        "document_ids_sha256": ids_sha256,
        "split": {"seed": config.seed, "heldout_fraction": config.heldout_fraction,
                  "group_field": config.group_field},
        "text_field": config.text_field,
        "seq_len": config.seq_len,
        "packer": PACKER_VERSION,
        "shard_bytes": config.shard_bytes,
        "tokenizer_sha256": manifest["tokenizer"]["sha256"],
        "files": file_records(tmp, data_files(index)),
    }
    manifest["fingerprint"] = fingerprint(manifest["identity"])
    files.write_json(tmp / "manifest.json", manifest)
    return manifest


def _read_pieces(config: PrepareConfig, the_plan: dict, tmp: Path, progress: Progress,
                 workers: Pool) -> dict:
    """Phase 1 (see the module docstring and ``data/spool.py``): read pieces over the workers,
    merging each here as soon as every piece before it is merged."""
    (tmp / "spool").mkdir(exist_ok=True)
    files.write_json(tmp / "spool" / "plan.json", the_plan)
    files.write_json(tmp / "spool" / "settings.json", {
        "fields": [config.text_field, config.group_field, config.label_field],
        "layout": [config.text_unit, config.group_by], "strict": config.strict,
        "seed": config.seed, "heldout_fraction": config.heldout_fraction})
    n = len(the_plan["pieces"])
    sample = Sample(None if config.tokenizer else config.tokenizer_sample, config.seed)
    dedup = Dedup(tmp, sample)
    reading = progress.add_task("reading", total=n, detail="")
    read = [piece_read(tmp, i) for i in range(n)]  # a resumed run keeps the pieces it read
    merged = 0

    def merge_ready() -> None:
        nonlocal merged
        while merged < n and read[merged]:
            dedup.merge(merged)
            merged += 1
            progress.update(reading, completed=merged, detail=f"{dedup.accounting.read:,}")

    def finished(i: int) -> None:
        read[todo[i]] = True
        merge_ready()

    merge_ready()
    todo = [i for i in range(n) if not read[i]]
    workers.run([{"kind": "read", "args": {"tmp": str(tmp), "piece": i}} for i in todo],
                done=finished)
    groups = dedup.close()
    accounting = dedup.accounting
    accounting.check()
    _check_corpus(config, accounting, groups)
    phase1 = {"accounting": asdict(accounting), "docs": dedup.docs, "groups": groups,
              "shards": dedup.shards, "sample_threshold": sample.threshold()}
    files.write_json(tmp / "spool" / "done.json", phase1)
    return phase1


def _check_corpus(config: PrepareConfig, accounting: Accounting,
                  groups: dict[str, int]) -> None:
    if accounting.kept == 0:
        if accounting.skipped:
            first = "; ".join(f"{s['source']}: {s['reason']}" for s in accounting.skips[:3])
            raise ValueError(f"every one of the {accounting.read} documents in {config.corpus} "
                             f"was skipped (first: {first}); fix the input or --text-field")
        raise ValueError(f"corpus {config.corpus} has no non-empty documents; add text")
    n_groups = groups[TRAIN] + groups[HELDOUT]
    for split, other in ((HELDOUT, TRAIN), (TRAIN, HELDOUT)):
        if not groups[split]:
            raise ValueError(
                f"the {split} split would be empty: all {n_groups} group(s) hashed into "
                f"{other} at --heldout-fraction {config.heldout_fraction} --seed {config.seed};"
                " add documents from more groups (or --group-field), or change the fraction "
                "or seed")


def print_summary(manifest: dict, console: Console, seconds: float | None = None,
                  phases: dict[str, float] | None = None) -> None:
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
                  f"{manifest['packing_efficiency']:.4f}, shards " +
                  ", ".join(f"{k} {len(v)}" for k, v in manifest["shards"].items()))
    sample = f", a sample of {t['sample']:,} documents" if t.get("sample") else ""
    console.print(f"tokenizer {t['model']} (trained on {t['trained_on']}{sample}), vocab "
                  f"{t['vocab_size']:,}, sha256 {t['sha256']}")
    if seconds is not None:
        each = ", ".join(f"{k} {v:.1f} s" for k, v in (phases or {}).items())
        console.print(f"prepared in {seconds:.1f} s" + (f" ({each})" if each else ""))
