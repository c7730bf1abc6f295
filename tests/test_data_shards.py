"""Sharded output: the index, reading rows through it, workers that change no byte, resuming a
killed prepare, and the tokenizer's keyed sample."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest

from clozax.data import executors, open_dataset, prepare
from clozax.data.dataset import Split, verify_files
from clozax.data.executors import FAIL_TASK_ENV, Local, Task, WorkerFailed
from clozax.data.loader import host_batch
from clozax.data.shards import ARRAYS, RowArray
from clozax.data.spool import Sample

pytestmark = pytest.mark.fast  # make test-fast; tests marked slow stay out

WORDS = "one two three four five six seven eight nine ten eleven twelve".split()
# About 12 pieces, so shards per split: small enough to be quick, several per worker.
OPTIONS = dict(vocab_size=120, seq_len=32, heldout_fraction=0.2, shard_bytes=1500)


def _corpus(root: Path, n: int = 240) -> Path:
    rng = random.Random(0)
    rows = [{"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))),
             "label": f"l{i % 3}"} for i in range(n)]
    rows += rows[:10]  # duplicates, counted once each
    rows.append({"text": "[MASK] [MASK]"})  # only specials after tokenization: a late skip
    path = root / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_row_array_indexes_like_the_concatenated_shards():
    rng = np.random.default_rng(0)
    shards = [rng.integers(0, 9, (n, 4)).astype(np.uint16) for n in (3, 0, 5, 2)]
    whole = np.concatenate(shards)
    opened = []
    rows = RowArray(lambda k: opened.append(k) or shards[k], [len(s) for s in shards], 4,
                    np.uint16)
    assert rows.shape == whole.shape and len(rows) == 10
    assert np.array_equal(rows[7], whole[7]) and opened == [2]  # only the shard it lives in
    for key in (slice(None), slice(2, 9, 3), np.array([9, 0, 4, 4, -1]), [3]):
        assert np.array_equal(rows[key], whole[key])
    assert np.array_equal(np.asarray(rows), whole)
    with pytest.raises(IndexError):
        rows[np.array([10])]


@pytest.mark.slow
def test_one_two_workers_and_a_dask_cluster_write_byte_identical_shards_with_one_accounting(
        tmp_path):
    corpus = _corpus(tmp_path)
    one = prepare(tmp_path / "w1", corpus=str(corpus), workers=1, quiet=True,
                  tokenizer_sample=150, **OPTIONS)
    two = prepare(tmp_path / "w2", corpus=str(corpus), workers=2, quiet=True,
                  tokenizer_sample=150, **OPTIONS)
    # A local Dask cluster of two worker processes (as `dask worker`s on other hosts would).
    prepare(tmp_path / "dask", corpus=str(corpus), workers=2, executor="dask", quiet=True,
            tokenizer_sample=150, **OPTIONS)
    assert len(one["shards"]["train"]) >= 6 and len(one["shards"]["heldout"]) >= 2
    assert _files(tmp_path / "w1") == _files(tmp_path / "w2")  # manifest included
    assert _files(tmp_path / "dask") == _files(tmp_path / "w1")
    assert two["tokenizer"]["sample"] == 150 < two["splits"]["train"]["documents"]
    d = two["documents"]
    assert d["read"] == d["kept"] + d["duplicates"] + d["skipped"] == 251
    assert d["duplicates"] == 10 and two["skip_reasons"] == {
        "no non-special token after tokenization": 1}
    assert d["kept"] == sum(s["documents"] for s in two["splits"].values())

    # Reading through the index: every document's chunks, at their global rows, hold its tokens.
    ds = open_dataset(tmp_path / "w2")
    assert isinstance(ds.train.tokens, RowArray) and verify_files(ds) == []
    for split in ("train", "heldout"):
        arrays = getattr(ds, split)
        docs = list(ds.documents(split))
        assert sorted(r["index"] for r in docs) == list(range(len(docs)))
        seen = 0
        for doc in docs:
            for row, segment in doc["chunks"]:
                seen += int(np.count_nonzero(arrays.segments[row] == segment))
        assert seen == two["splits"][split]["tokens"]
        counts = np.bincount(np.asarray(arrays.tokens)[np.asarray(arrays.segments) > 0]
                             .astype(np.int64), minlength=ds.vocab_size)
        assert np.array_equal(counts, ds.unigram_counts(split))

    # The training loader reads a batch through the index as from one concatenated array.
    whole = Split(**{kind: np.asarray(getattr(ds.train, kind)) for kind in ARRAYS})
    rows = np.array([ds.train.rows - 1, 0, 17, 3, 17])
    got, want = host_batch(ds.train, rows), host_batch(whole, rows)
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_a_dataset_prepared_again_at_its_path_in_one_process_holds_the_new_corpus(tmp_path):
    """A notebook that prepares, edits the corpus and prepares again at the same --out (in its
    own process: one worker packs here). The second prepare once read the first's plan and
    packed with the first's tokenizer (caches keyed by path), and failed or wrote rows of the
    old vocabulary under the new tokenizer."""
    corpus, out = _corpus(tmp_path), tmp_path / "out"
    prepare(out, corpus=str(corpus), workers=1, quiet=True, **OPTIONS)
    first = host_batch(open_dataset(out).train, np.arange(8))["tokens"]
    rng = random.Random(1)
    other = [w.upper() + "x" for w in WORDS] + ["zeta", "eta", "theta"]
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(other) for _ in range(
        rng.randint(3, 40)))}) + "\n" for _ in range(300)))
    prepare(out, corpus=str(corpus), workers=1, quiet=True, overwrite=True, **OPTIONS)
    again = host_batch(open_dataset(out).train, np.arange(8))["tokens"]
    fresh = tmp_path / "fresh"  # the new corpus, prepared where nothing was cached
    prepare(fresh, corpus=str(corpus), workers=1, quiet=True, **OPTIONS)
    assert _files(out) == _files(fresh)
    assert not np.array_equal(again, first)
    assert np.array_equal(again, host_batch(open_dataset(fresh).train, np.arange(8))["tokens"])


def test_a_failed_worker_is_one_line_and_the_rerun_keeps_its_finished_shards(tmp_path):
    """A worker that dies (killed, the OOM killer): an error naming it; the shards finished
    before it are kept, and the rerun equals an uninterrupted run. (Kills of prepare itself at
    every phase: tests/test_crash_consistency.py.)"""
    corpus = _corpus(tmp_path)
    whole = tmp_path / "whole"
    prepare(whole, corpus=str(corpus), workers=1, quiet=True, **OPTIONS)
    out = tmp_path / "out"
    os.environ[FAIL_TASK_ENV] = "pack:4"  # read by the worker processes
    try:
        with pytest.raises(WorkerFailed, match=r"a prepare worker process died.*resume"):
            prepare(out, corpus=str(corpus), workers=2, quiet=True, **OPTIONS)
    finally:
        del os.environ[FAIL_TASK_ENV]
    assert list(tmp_path.glob(".out.partial-*/results/*.result.json"))  # kept for the rerun
    prepare(out, corpus=str(corpus), workers=2, quiet=True, **OPTIONS)
    assert _files(out) == _files(whole)
    assert not list(tmp_path.glob(".out.*"))


def test_the_costliest_task_starts_first_and_no_worker_idles_while_tasks_remain(tmp_path):
    """Uneven costs, the costliest given last: one worker holds it while the other takes every
    short task as it frees (dealing two per worker in task order would put it last). The tasks
    start once both workers are up (a worker spawned late on a loaded machine is not idling),
    and the long task outlasts the four short ones by 2 s, so neither margin is a race."""
    log, ready = tmp_path / "log.jsonl", tmp_path / "ready"
    ready.mkdir()
    both = {"log": str(log), "ready": str(ready), "workers": 2}
    tasks = [Task("executor_tasks:busy", {"seconds": 0.5, "name": f"short{i}", **both}, cost=1)
             for i in range(4)]
    tasks.append(Task("executor_tasks:busy", {"seconds": 4.0, "name": "long", **both}, cost=5))
    assert executors._by_cost(tasks)[0] == 4  # handed out first
    finished = []
    Local(2).run(tasks, done=finished.append)
    runs = {r["name"]: r for r in map(json.loads, log.read_text().splitlines())}
    assert sorted(finished) == list(range(5)) and finished[-1] == 4
    assert {runs[f"short{i}"]["pid"] for i in range(4)} == {runs["short0"]["pid"]} != \
        {runs["long"]["pid"]}  # every short task on the worker the long one did not hold
    assert runs["long"]["start"] <= min(runs[f"short{i}"]["start"] for i in range(4)) + 0.25


def test_tokenizer_sample_is_exactly_n_documents_chosen_by_a_keyed_hash():
    records = [{"id": f"{i:02x}{k:030x}", "text": f"t{i}-{k}"} for i in range(2) for k in range(50)]

    def chosen(n: int | None, seed: int) -> list[str]:
        sample = Sample(n, seed)
        for record in records:
            sample.offer(record["id"])
        lines = (json.dumps(r) + "\n" for r in records)  # as the spool writes them
        return list(sample.chosen(lines, sample.threshold()))

    texts = {seed: chosen(7, seed) for seed in (0, 1)}
    assert len(texts[0]) == len(texts[1]) == 7 and texts[0] != texts[1]
    every = [r["text"] for r in records]
    assert texts[0] == [t for t in every if t in texts[0]]  # corpus order kept
    assert chosen(100, 0) == chosen(None, 0) == every  # a sample of all is all


@pytest.mark.fast
def test_a_killed_prepares_queued_cluster_tasks_stand_down_before_a_rerun(tmp_path):
    # Orphaned Dask tasks of a killed prepare kept writing while its rerun ran: a task now
    # runs only while its prepare's token is the one beside the partial directory.
    from clozax.data import executors

    tmp = tmp_path / ".ds.partial-rkey"
    tmp.mkdir()
    executors.token_path(tmp).write_text("the rerun's")
    assert executors.run_on_cluster("executor_tasks:mark", {"tmp": str(tmp), "name": "old"}, 0,
                                    "the killed run's") is None
    assert not (tmp / "old").exists()
    host = executors.run_on_cluster("executor_tasks:mark", {"tmp": str(tmp), "name": "new"}, 0,
                                    "the rerun's")
    assert host is not None and (tmp / "new").read_text() == "new"
    assert executors.token_path(tmp).parent == tmp.parent  # beside, never in the dataset
