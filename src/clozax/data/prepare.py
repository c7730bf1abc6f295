"""``clozax prepare``: documents → document-level split → frozen tokenizer → packed shards.

Order of work, in a hidden sibling directory ``.{out}.partial-r{key}`` renamed into place only
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

``--workers N`` uses N cores: N processes each with a one-thread tokenizer (``data/executors.py``),
and N tokenizer-training threads; ``--executor dask`` reads and packs on a Dask cluster. The
output never depends on the executor or N.

One writer per ``--out``: the whole prepare holds its lock (``core/locks.py``; a second one is
refused naming the first), and ``--out`` and the lock are checked again before the rename (a
prepare whose lock was taken over publishes nothing).

Resuming: a prepare killed or failed at any point and run again continues after the last
finished piece, phase or shard, with the same final bytes; each phase is keyed by what it
depends on, so another ``--seq-len`` or tokenizer keeps the reading, and a changed corpus file
is read again alone (``data/partial.py``). A bad row is a recorded skip, never the end of the
run; an error keeps what was finished (the partial is deleted only when nothing was).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TypeVar

import numpy as np
from rich.console import Console
from rich.progress import Progress

import clozax.data.partial as partial
from clozax.core import files, locks
from clozax.core.files import file_sha256, publish_dir
from clozax.data.corpus import Accounting, CorpusRejected, check_corpus
from clozax.data.dataset import FORMAT_VERSION, unigram_file
from clozax.data.executors import Dask, Local, Task, WorkerFailed
from clozax.data.manifest import FrozenTokenizer, Shards, build_manifest
from clozax.data.pack import result_path
from clozax.data.packing import PACKER_VERSION
from clozax.data.pieces import piece_costs, plan
from clozax.data.prepare_config import PrepareConfig, executors
from clozax.data.prepare_summary import print_summary, progress_bars
from clozax.data.readers import Layout
from clozax.data.split import SPLITS, TRAIN
from clozax.data.spool import Dedup, Sample, piece_read, spool_path
from clozax.data.tokenizer import find_specials, load_tokenizer, parse_special_tokens

# Test hook: when set, sleep this many seconds after everything is written, before the rename.
_PAUSE_ENV = "CLOZAX_TEST_PAUSE_BEFORE_RENAME"
T = TypeVar("T")


def prepare(out: str | Path, *, quiet: bool = False, console: Console | None = None,
            **options) -> dict:
    """Prepare a dataset at ``out`` (options: the fields of ``PrepareConfig``); returns the
    manifest. Prints progress to stderr and a summary table unless ``quiet``."""
    valid = [f.name for f in fields(PrepareConfig) if f.name != "out"]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"unknown prepare option(s) {', '.join(unknown)}; valid: "
                         f"{', '.join(valid)}")
    if getattr(multiprocessing.current_process(), "_inheriting", False):  # as multiprocessing
        # checks it: a spawned worker is importing the parent's script
        raise RuntimeError("prepare() was called while a prepare worker imported your script; "
                           "put the call under `if __name__ == \"__main__\":`")
    config = PrepareConfig(out=Path(out), **options)
    console = console or Console()
    say = (lambda message: None) if quiet else (
        lambda message: Console(stderr=True, highlight=False).print(message))
    with locks.hold(config.out, f"dataset {config.out}", say=say):  # one writer per --out
        return _prepare(config, quiet, console, say)


def _prepare(config: PrepareConfig, quiet: bool, console: Console, say) -> dict:
    out = config.out
    _check_out(config)
    if config.tokenizer is not None:  # fail on a bad --tokenizer before reading
        find_specials(load_tokenizer(config.tokenizer), parse_special_tokens(
            config.special_tokens) if config.special_tokens else None)
    started = time.perf_counter()
    layout = Layout(config.text_unit, config.group_by)
    pieces = plan(config.corpus, layout, config.shard_bytes)  # checks the path now
    seconds = {"plan": time.perf_counter() - started}  # per phase, for the summary only
    settings = partial.read_settings(config, FORMAT_VERSION)
    tmp = partial.partial_path(out, settings)
    partial.refuse_or_discard(out, tmp, settings, config.discard_partial, say)
    partial.begin(tmp, settings)
    try:
        progress = progress_bars(quiet)
        local, executor = executors(config, len(pieces["pieces"]), say)
        with progress, executor:
            manifest = _build(_Job(config, tmp, progress, seconds, say, local, executor), pieces)
        if isinstance(executor, Dask) and executor.hosts:  # that the cluster did the work
            say("read and packed on " + ", ".join(f"{host} ({n} tasks)" for host, n in
                                                  sorted(executor.hosts.items())))
    except WorkerFailed:
        raise  # its message says that the finished part is kept
    except ValueError as e:  # bad input: keep what was finished (nothing, if it came first)
        if isinstance(e, CorpusRejected) or not partial.has_work(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        raise ValueError(f"{str(e).splitlines()[0]}; the finished part is kept in {tmp} for "
                         "the next run") from None
    if os.environ.get(_PAUSE_ENV):
        time.sleep(float(os.environ[_PAUSE_ENV]))
    locks.check_held(out)  # a holder whose lock was taken over publishes nothing
    if out.exists() and not config.overwrite:  # written by someone else meanwhile
        raise ValueError(f"output directory {out} appeared while this prepare ran; the "
                         f"prepared dataset is kept in {tmp}: run the same command with "
                         "--overwrite to replace it, or move it away and run it again")
    partial.finish(tmp)
    publish_dir(tmp, out)
    if not quiet:
        print_summary(manifest, console, time.perf_counter() - started, seconds)
    return manifest


def _check_out(config: PrepareConfig) -> None:
    out = config.out
    if out.exists() and not config.overwrite:
        raise ValueError(f"output directory {out} already exists; pass --overwrite to replace "
                         "it or choose another --out")
    if out.exists() and not (out / "manifest.json").is_file() and \
            not (out.is_dir() and not any(out.iterdir())):
        raise ValueError(f"refusing to --overwrite {out}: it is not a clozax dataset (no "
                         "manifest.json); remove it yourself or choose another --out")


@dataclass(frozen=True)
class _Job:
    """What the stages of one prepare share: its settings, partial directory, progress bars,
    per-phase seconds (for the summary), message sink and executors."""

    config: PrepareConfig
    tmp: Path
    progress: Progress
    seconds: dict[str, float]
    say: Callable[[str], None]
    local: Local
    executor: Local | Dask


@dataclass(frozen=True)
class _Keys:
    """Each phase keyed by what it depends on (data/partial.py), so a rerun with other
    tokenizer or packing settings keeps the reading, and one with the same keeps it all."""

    corpus: str
    tokenizer: str
    pack: str


def _build(job: _Job, the_plan: dict) -> dict:
    keys = _phase_keys(job.config, the_plan)
    if (job.tmp / "manifest.json").is_file() and partial.phase_done(job.tmp, "manifest",
                                                                    keys.pack):
        return files.read_json(job.tmp / "manifest.json")  # finished; killed before its rename
    phase1 = _timed(job, "reading", lambda: _spooled(job, the_plan, keys.corpus))
    tokenizer = _timed(job, "tokenizer", lambda: _frozen_tokenizer(job, phase1, keys.tokenizer))
    _timed(job, "packing", lambda: _pack(job, phase1, tokenizer, keys.pack))
    shards = _gathered(job, phase1, tokenizer)
    manifest = build_manifest(job.config, tokenizer, shards, job.tmp)
    files.write_json(job.tmp / "manifest.json", manifest)
    partial.mark_phase(job.tmp, "manifest", keys.pack)
    return manifest


def _timed(job: _Job, phase: str, stage: Callable[[], T]) -> T:
    started = time.perf_counter()
    result = stage()
    job.seconds[phase] = time.perf_counter() - started
    return result


def _phase_keys(config: PrepareConfig, the_plan: dict) -> _Keys:
    corpus = partial.corpus_identity(the_plan)
    tokenizer = partial.key_of([corpus, config.tokenizer_model, config.vocab_size,
                                config.lowercase, config.tokenizer and
                                file_sha256(config.tokenizer)])
    pack = partial.key_of([tokenizer, config.seq_len, PACKER_VERSION,
                           *([config.special_tokens] if config.special_tokens else [])])
    return _Keys(corpus, tokenizer, pack)


def _spooled(job: _Job, the_plan: dict, corpus: str) -> dict:
    """Phase 1: read, clean, split and spool the pieces; dedup in corpus order (kept when a
    resumed run finished it for this corpus)."""
    phase1 = files.read_json(job.tmp / "spool" / "done.json")
    if phase1 is None or phase1.get("corpus") != corpus:
        phase1 = _read_pieces(job, the_plan, corpus)
    return phase1


def _frozen_tokenizer(job: _Job, phase1: dict, key: str) -> FrozenTokenizer:
    """Phase 2: the tokenizer, trained on train documents only (or ``--tokenizer`` copied
    byte for byte), written under a temporary name so that its presence means finished."""
    config, tmp = job.config, job.tmp
    path = tmp / "tokenizer.json"
    if path.is_file() and not partial.phase_done(tmp, "tokenizer", key):
        job.say("the tokenizer settings or the corpus changed since the unfinished prepare: "
                "training the tokenizer again (the reading is kept)")
        path.unlink()
    if not path.is_file():
        partial_tokenizer = tmp / "tokenizer.json.partial"
        if config.tokenizer is not None:
            shutil.copyfile(config.tokenizer, partial_tokenizer)  # unchanged, byte for byte
        else:
            threshold = phase1["sample_threshold"]
            n_train = phase1["docs"][TRAIN] if threshold is None else config.tokenizer_sample
            training = job.progress.add_task("training tokenizer", total=1,
                                             detail=f"{n_train:,}")
            options = {"model": config.tokenizer_model, "vocab_size": config.vocab_size,
                       "lowercase": config.lowercase, "length": n_train}
            job.local.run([Task("train", {  # here: one task with every local core's thread
                "tmp": str(tmp), "pieces": phase1["shards"][TRAIN], "threshold": threshold,
                "seed": config.seed, "options": options})])
            job.progress.advance(training)
        partial.mark_phase(tmp, "tokenizer", key)
        partial_tokenizer.rename(path)
    tok = load_tokenizer(path)
    names = parse_special_tokens(config.special_tokens) if config.special_tokens else None
    return FrozenTokenizer(path, tok, find_specials(tok, names),
                      tok.get_vocab_size(with_added_tokens=True))


def _pack(job: _Job, phase1: dict, tokenizer: FrozenTokenizer, key: str) -> None:
    """Phase 3: encode, chunk, pack and write one data shard per piece with kept documents of
    a split, over the workers; a shard's result file marks it finished."""
    tmp, pieces = job.tmp, phase1["shards"]  # per split, the pieces with kept documents
    tasks = [Task("pack", {"tmp": str(tmp), "split": split, "k": k, "piece": piece,
                           "seq_len": job.config.seq_len, "specials": tokenizer.specials},
                  spool_path(tmp, piece, split).stat().st_size)
             for split in SPLITS for k, piece in enumerate(pieces[split])]
    packing = job.progress.add_task("packing shards", total=len(tasks), detail="")
    if (tmp / "results").is_dir() and not partial.phase_done(tmp, "packing", key):
        shutil.rmtree(tmp / "results")  # packed for another seq_len or tokenizer
    (tmp / "results").mkdir(exist_ok=True)
    partial.mark_phase(tmp, "packing", key)
    todo = [t for t in tasks if not result_path(tmp, t.args["split"], t.args["k"]).is_file()]
    job.progress.advance(packing, len(tasks) - len(todo))
    job.executor.run(todo, done=lambda i: job.progress.advance(packing))


def _gathered(job: _Job, phase1: dict, tokenizer: FrozenTokenizer) -> Shards:
    """The shards' results added up per split, in shard order, one result held at a time;
    the unigram counts written; the spools and results deleted."""
    tmp, seq_len = job.tmp, job.config.seq_len
    accounting = Accounting(**phase1["accounting"])
    stats, ids_sha256, index = {}, {}, {}
    keys = ("documents", "rows", "tokens", "chunks", "chunked_documents")
    for split in SPLITS:
        ids_hash, counts = hashlib.sha256(), np.zeros(tokenizer.vocab_size, np.int64)
        total, index[split], skipped = dict.fromkeys(keys, 0), [], 0
        for k in range(len(phase1["shards"][split])):
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
        stats[split] = {
            "groups": phase1["groups"][split], "documents": total["documents"],
            "rows": total["rows"], "tokens": total["tokens"],
            "pad_tokens": total["rows"] * seq_len - total["tokens"], "chunks": total["chunks"],
            "chunked_documents": total["chunked_documents"], "skipped_documents": skipped}
    accounting.check()
    for split in SPLITS:
        if stats[split]["documents"] == 0:
            raise ValueError(f"the {split} split has no document with a non-special token after "
                             f"tokenization; add text to {job.config.corpus}")
    shutil.rmtree(tmp / "spool")
    shutil.rmtree(tmp / "results")
    return Shards(accounting, stats, index, ids_sha256)


def _read_pieces(job: _Job, the_plan: dict, corpus: str) -> dict:
    """Phase 1 (see the module docstring and ``data/spool.py``): read pieces over the workers,
    merging each here as soon as every piece before it is merged."""
    config, tmp, progress, seconds = job.config, job.tmp, job.progress, job.seconds
    (tmp / "spool").mkdir(exist_ok=True)
    partial.keep_read_pieces(tmp / "spool", the_plan, job.say)  # a changed file is read again
    files.write_json(tmp / "spool" / "plan.json", the_plan)
    files.write_json(tmp / "spool" / "settings.json", {
        "fields": [config.text_field, config.group_field, config.label_field],
        "layout": [config.text_unit, config.group_by], "strict": config.strict,
        "seed": config.seed, "heldout_fraction": config.heldout_fraction})
    n = len(the_plan["pieces"])
    sample = Sample(None if config.tokenizer else config.tokenizer_sample, config.seed)
    dedup = Dedup(tmp, sample, group_runs=config.group_field is None)
    reading = progress.add_task("reading", total=n, detail="")
    read = [piece_read(tmp, i) for i in range(n)]  # a resumed run keeps the pieces it read
    merged = 0

    def merge_ready() -> None:  # the serial part of reading, timed for the summary
        nonlocal merged
        start = time.perf_counter()
        while merged < n and read[merged]:
            dedup.merge(merged)
            merged += 1
            progress.update(reading, completed=merged, detail=f"{dedup.accounting.read:,}")
        seconds["merge (serial)"] = seconds.get("merge (serial)", 0.0) + \
            time.perf_counter() - start

    def finished(i: int) -> None:
        read[todo[i]] = True
        merge_ready()

    merge_ready()
    todo, costs = [i for i in range(n) if not read[i]], piece_costs(the_plan)
    job.executor.run([Task("read", {"tmp": str(tmp), "piece": i}, costs[i]) for i in todo],
                     done=finished)
    groups = dedup.close()
    accounting = dedup.accounting
    accounting.check()
    check_corpus(accounting, groups, config.corpus, config.heldout_fraction, config.seed)
    # "shards": the key a resumed prepare of an older version finds in done.json, kept
    phase1 = {"accounting": asdict(accounting), "docs": dedup.docs, "groups": groups,
              "shards": dedup.pieces, "sample_threshold": sample.threshold(),
              "corpus": corpus}
    files.write_json(tmp / "spool" / "done.json", phase1)
    return phase1
