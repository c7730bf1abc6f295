"""Crash consistency: any kill, any signal, any second process — nothing lost, nothing silently
wrong (README, "Reliability").

The real CLI runs in subprocesses (``tests/faults.py``). One run is watched while it trains —
readers in a loop beside a trainer that saves every other step — and is the reference; a
second run of the same command is stopped again and again, by SIGTERM, SIGKILL at instants
sampled with a fixed seed over its whole life (during a save, just after a commit and before
its digest, just after a digest, between steps) and a double Ctrl-C, each time
continued by the same command, and must end bit for bit equal to the reference (checkpoint
cadence, signals and kills change no number).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from orbax.checkpoint._src.path import step as orbax_step

import faults
from clozax.app.cli import main
from clozax.core import locks
from clozax.train import checkpoint as ckpt
from clozax.train.run_dir import load_run
from commands import one_line_error

STEPS = 24
CADENCE = ["--steps", str(STEPS), "--set", "train.save_every=3", "--set", "train.eval_every=12"]
# Saves overlap the steps that follow them, as on every host with an accelerator.
ASYNC = {"CLOZAX_HOST_MALLOC": "default"}
SLOW = {**ASYNC, "CLOZAX_TEST_STEP_SECONDS": "0.03", "CLOZAX_TEST_SAVE_SECONDS": "0.3",
        "CLOZAX_TEST_DIGEST_SECONDS": "0.3"}


def _train(data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(data), "--out", str(out), *faults.TRAIN, *CADENCE, *extra]


READERS = r"""
import sys, time
from pathlib import Path
from clozax.judge.evaluate import evaluate_run
from clozax.judge.fill import fill

run, done, progress = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
outcomes = []
while not done.exists():
    try:
        if len(outcomes) % 4 == 3:
            evaluate_run(run, failures=2)
        else:
            fill(run, "return the [MASK] of it", top_k=2)
        outcomes.append("ok")
    except ValueError as e:
        outcomes.append(str(e))
    with open(progress, "a") as f:  # the trainer's gate counts these
        f.write("read\n")
print("\n".join(outcomes))
"""


@pytest.fixture(scope="module")
def watched(stdlib_data, tmp_path_factory) -> dict:
    """The reference run, trained with a checkpoint every other step while ``fill`` and
    ``evaluate`` read it in a loop (their file writes recorded)."""
    root = tmp_path_factory.mktemp("crash")
    out, done, writes = root / "watched", root / "trainer-done", root / "writes"
    progress = root / "reads"
    # 0.2 s a step, and step 12 waits until the readers have read 3 times: on a loaded machine
    # their process (imports, restores, compiles) once needed longer than the whole training
    # (two reads, at 0.1 s and at 0.2 s a step), so time alone cannot promise the overlap.
    trainer = faults.start(_train(stdlib_data, out, "--set", "train.save_every=2"),
                           {**ASYNC, "CLOZAX_TEST_STEP_SECONDS": "0.2",
                            "CLOZAX_TEST_GATE": f"{progress}:3:12"})
    assert faults.wait_for(trainer, lambda: bool(faults.steps_dirs(out)), 120)
    readers = subprocess.Popen(
        [sys.executable, "-c", faults.HOOKS + READERS, str(out), str(done), str(progress)],
        cwd=faults.ROOT,
        env={**os.environ, "CLOZAX_TEST_AUDIT_WRITES": str(writes)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    live = _status(out)  # beside the trainer and the readers, as a user checking on a job
    _, err = trainer.communicate(timeout=300)
    done.touch()
    said, reader_err = readers.communicate(timeout=120)
    return {"run": out, "trainer": (trainer.returncode, err), "readers": (
        readers.returncode, said.split(), reader_err), "writes": Path(f"{writes}-single"),
        "status": (trainer.pid, live, _status(out))}


def _status(run: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "clozax.app.cli", "status", str(run), "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _assert_same_run(run: Path, reference: Path) -> None:
    """Bitwise the reference's parameters, and its metrics: every step once, same losses."""
    assert faults.logged_steps(run) == faults.logged_steps(reference)
    assert faults.losses(run) == faults.losses(reference)
    assert np.array_equal(faults.flat_params(run), faults.flat_params(reference))
    assert list((run / "checkpoints").glob("*orbax-checkpoint-tmp*")) == []


@pytest.mark.slow
def test_readers_beside_a_trainer_that_saves_every_other_step_never_disturb_it(watched):
    code, err = watched["trainer"]
    assert code == 0, err[-3000:]
    code, outcomes, reader_err = watched["readers"]
    assert code == 0 and len(outcomes) >= 3 and set(outcomes) == {"ok"}, \
        (outcomes, reader_err[-2000:])
    assert "is training" in reader_err and "using its newest committed checkpoint" in reader_err
    # The readers wrote only evaluate's own result files (atomically: a temporary, a rename):
    # the newest step's at the top, each step's in history/ (made by the first evaluate).
    out = watched["run"]
    log = watched["writes"]
    written = {Path(line.split(" ", 1)[1])
               for line in (log.read_text().splitlines() if log.exists() else [])}
    inside = {p for p in written if p.is_relative_to(out)}
    names = {(p.parent.relative_to(out).as_posix(), p.name.split(".tmp-")[0].lstrip("."))
             for p in inside}
    assert {n for where, n in names if where == "."} <= {"eval.json", "failures.jsonl",
                                                         "history"}
    per_step = r"eval-\d+\.json|failures-\d+\.jsonl"
    assert all(where == "." or where == "history" and re.fullmatch(per_step, n)
               for where, n in names), names
    # (That the watched run's numbers are an undisturbed run's: the next test ends equal.)


def test_a_reader_opening_a_run_as_its_trainer_removes_an_old_step_takes_the_newest(
        tiny_run_copy, monkeypatch):
    # The instant the test above once met on a loaded machine: orbax lists the steps, then
    # reads each one's metadata; a step the trainer's ``keep`` removes in between made
    # orbax raise FileNotFoundError out of the reader. Here the removal is placed exactly there.
    steps = sorted(int(p.name) for p in (tiny_run_copy / "checkpoints").iterdir()
                   if p.name.isdigit())
    listed = orbax_step.Metadata.commit_timestamp
    removed = []

    def commit_timestamp(metadata):
        if metadata.step == steps[0] and not removed:
            shutil.rmtree(metadata.path)  # as the trainer's keep does
            removed.append(metadata.step)
        return listed.fget(metadata)

    monkeypatch.setattr(orbax_step.Metadata, "commit_timestamp", property(commit_timestamp))
    assert load_run(tiny_run_copy).step == steps[-1]
    assert removed == [steps[0]] and len(steps) >= 2


@pytest.mark.slow
def test_status_of_a_live_run_names_its_step_and_lock_holder_and_then_its_end(watched):
    pid, live, after = watched["status"]
    assert live["state"] == "training" and live["lock"]["pid"] == pid
    assert 0 < live["step"] < live["steps"] == STEPS and live["checkpoints"]
    assert live["eta_s"] is not None and live["recent_losses"]
    assert after["state"] == "finished" and after["lock"] is None and after["step"] == STEPS
    # digested, not "verified": status reads no checkpoint's bytes (a damaged step has a
    # digest too)
    assert after["checkpoints"][-1] == {"step": STEPS, "digested": True}
    assert after["heldout_sample"]["step"] == STEPS and after["disk"]["run_bytes"] > 0


# --------------------------------------------------------------------------- instants


def _instant(kind: str, at: int, run: Path):
    """A condition on ``run``'s files that holds at the instant ``kind`` of a step >= ``at``
    of the launch about to start (files a previous launch left are older than it)."""
    ck, digests = run / "checkpoints", run / ckpt.DIGEST_DIR
    since = time.time()

    def new(path: Path) -> bool:
        try:
            return path.stat().st_mtime >= since
        except FileNotFoundError:
            return False

    def during_save() -> bool:
        return any(int(p.name.split(".")[0]) >= at and new(p)
                   for p in ck.glob("*orbax-checkpoint-tmp*"))

    def committed_not_digested() -> bool:
        return any(s >= at and new(ck / str(s)) and not (digests / f"{s}.json").exists()
                   for s in faults.steps_dirs(run))

    def digested() -> bool:
        return any(int(p.stem) >= at and new(p) for p in digests.glob("*.json"))

    def between_steps() -> bool:  # the launch has restored (and rewritten the metrics) first
        return new(run / "metrics.jsonl") and max(faults.logged_steps(run) or [0]) >= at

    return {"during a save": during_save, "after a commit, before its digest":
            committed_not_digested, "after a digest": digested,
            "between steps": between_steps}[kind]


KINDS = ["during a save", "after a commit, before its digest", "after a digest",
         "between steps"]


def _abstract(run: Path):
    from clozax.train.run_dir import abstract_state, read_config

    return abstract_state(read_config(run)[0])


def _no_damage(message: str) -> None:
    raise AssertionError(f"a kill left a damaged checkpoint: {message}")


def _stopped_by(proc, sig, code: int) -> int:
    """The step a signalled run saved; its one line, its exit code, quickly."""
    sent = time.monotonic()
    _, err = proc.communicate(timeout=60)
    lines = [line for line in err.strip().splitlines() if line.startswith("stopped:")]
    assert proc.returncode == code and len(lines) == 1, err[-2000:]
    assert "Traceback" not in err and time.monotonic() - sent < 20
    return int(lines[0].split(" at step ")[1].split(":")[0])


@pytest.mark.slow
def test_any_kill_or_signal_then_the_same_command_ends_bitwise_equal(
        stdlib_data, watched, tmp_path):
    out = tmp_path / "stopped"
    rng = random.Random(23)
    kinds = rng.sample(KINDS, len(KINDS))  # each kind of SIGKILL instant once, seeded order
    targets = sorted(rng.sample(range(6, STEPS - 4, 3), len(kinds)))  # a save apart
    seen = []

    # SIGTERM (a preemption): the step it is at is saved, committed and digested; exit 143.
    proc = faults.start(_train(stdlib_data, out), SLOW)
    assert faults.kill_when(proc, _instant("between steps", 4, out), signal.SIGTERM)
    step = _stopped_by(proc, signal.SIGTERM, 143)
    assert step >= 4 and faults.steps_dirs(out)[-1] == step
    assert (out / ckpt.DIGEST_DIR / f"{step}.json").is_file()
    seen.append(("SIGTERM", step))

    # SIGKILL at sampled instants: whichever, a step stays restorable (never "damaged").
    for kind, at in zip(kinds, targets, strict=True):
        proc = faults.start(_train(stdlib_data, out), SLOW)
        hit = faults.kill_when(proc, _instant(kind, at, out))
        _, err = proc.communicate(timeout=60)
        assert hit, f"never reached {kind} of step >= {at}: {err[-2000:]}"
        seen.append((kind, at, faults.steps_dirs(out)[-1]))
        assert ckpt.Checkpointer(out, read_only=True).restore_latest(
            _abstract(out), say=_no_damage, params_only=True) is not None

    # Ctrl-C twice: the second ends the process at once, during the save the first asked for.
    # (One Ctrl-C: tests/test_crash_consistency.py::test_ctrl_c_saves_the_step_and_exits_130.)
    at = targets[-1] + 2
    # The save is held 10 s: the process must end well before it would have finished (the
    # bound leaves 3 s of margin for a loaded machine's interpreter teardown).
    proc = faults.start(_train(stdlib_data, out), {**SLOW, "CLOZAX_TEST_SAVE_SECONDS": "10"})
    during = _instant("during a save", at, out)
    assert faults.kill_when(proc, _instant("between steps", at, out), signal.SIGINT)
    assert faults.wait_for(proc, during, 30)
    proc.send_signal(signal.SIGINT)
    second = time.monotonic()
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGINT and time.monotonic() - second < 7

    code, err = faults.run(_train(stdlib_data, out), ASYNC)
    assert code == 0, err
    _assert_same_run(out, watched["run"])
    print(f"stopped at {seen}; resumed to step {STEPS}, bitwise equal to the watched run")


def test_a_signal_before_the_first_step_exits_at_once_and_saves_nothing(stdlib_data, tmp_path):
    # Set-up done, the first batch on its way (held 8 s here; in life the first compile, which
    # may take minutes): the process goes at once with the signal's code. It once waited for
    # the compile, trained a step at learning rate 0 and saved it.
    out = tmp_path / "early"
    proc = faults.start(_train(stdlib_data, out), {**ASYNC, "CLOZAX_TEST_STEP_SECONDS": "8"})
    assert faults.kill_when(proc, lambda: (out / "run.json").is_file(), signal.SIGTERM)
    sent = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    assert time.monotonic() - sent < 5  # not after the held batch (8 s) and a step
    assert "SIGTERM before the first step: nothing new to save" in err
    assert faults.steps_dirs(out) == [] and "Traceback" not in err
    # Its lock released on the way out (os._exit runs no finally): it once left its record,
    # which a requeue on another host waited a minute for as a live writer's.
    assert not locks.lock_path(out).exists() and locks.read_holder(out) is None


def test_a_signal_after_the_last_sync_point_finishes_the_save_then_exits_with_its_code(
        stdlib_data, tmp_path):
    # The last step's save is being written when SIGTERM comes: the command completes that
    # save and exits 143 (it once went on as if nothing had come: `clozax demo` then ran its
    # evaluation and fine-tuning until SIGKILL).
    out = tmp_path / "late"
    steps = ["--steps", "6", "--set", "train.save_every=6", "--set", "train.eval_every=6"]
    proc = faults.start(["train", "--data", str(stdlib_data), "--out", str(out),
                         *faults.TRAIN, *steps], {**ASYNC, "CLOZAX_TEST_DIGEST_SECONDS": "2"})
    # step 6 committed, its digest not yet recorded: the command is past its last sync point
    assert faults.kill_when(proc, lambda: 6 in faults.steps_dirs(out), signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    assert "stopped by SIGTERM: the run trained to step 6 and its checkpoint is saved" in err
    assert (out / ckpt.DIGEST_DIR / "6.json").is_file()  # committed and digested
    assert "Traceback" not in err


def test_ctrl_c_saves_the_step_and_exits_130_then_the_same_command_ends_equal(
        tiny_run, stdlib_data, tmp_path, capsys, monkeypatch):
    """One SIGINT in the middle of a run (in this process: the CLI's own handling)."""
    from clozax.data import loader
    from conftest import TINY_OVERRIDES

    argv = ["train", "--data", str(stdlib_data), "--out", str(tmp_path / "run"),
            "--preset", "tiny", *sum((["--set", o] for o in TINY_OVERRIDES), [])]
    real_next = loader.Prefetcher.__next__

    def ctrl_c_at_step_4(self):
        item = real_next(self)
        if item[0] == 3:  # batch 3 makes step 4
            os.kill(os.getpid(), signal.SIGINT)
        return item

    monkeypatch.setattr(loader.Prefetcher, "__next__", ctrl_c_at_step_4)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 130, err
    assert err.splitlines()[-1].startswith("stopped: stopped by SIGINT at step 4: the "
                                           "checkpoint of step 4 is saved")
    assert faults.steps_dirs(tmp_path / "run") == [3, 4]
    monkeypatch.setattr(loader.Prefetcher, "__next__", real_next)
    main(argv)
    assert np.array_equal(faults.flat_params(tmp_path / "run"), faults.flat_params(tiny_run))
    # Every step logged once: the uninterrupted run's lines, and the line of the stop (step 4).
    assert faults.logged_steps(tmp_path / "run") == sorted({*faults.logged_steps(tiny_run), 4})
    reference = faults.losses(tiny_run)
    assert {s: v for s, v in faults.losses(tmp_path / "run").items() if s != 4} == reference


# --------------------------------------------------------------------------- one writer

HOLDER = """
import sys, time
from pathlib import Path
from clozax.core import locks
with locks.hold(Path(sys.argv[1]), "x", command="clozax train (a test's holder)"):
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(directory: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], cwd=faults.ROOT,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_writer_of_a_run_or_a_dataset_is_refused_naming_the_holder(
        tiny_run_copy, stdlib_data, tmp_path, capsys):
    run_args = ["train", "--data", str(stdlib_data), "--out", str(tiny_run_copy),
                "--preset", "tiny", "--steps", "6"]
    data_args = ["prepare", "--out", str(tmp_path / "ds"), "--quiet"]
    for directory, argv in ((tiny_run_copy, run_args), (tmp_path / "ds", data_args)):
        holder = _holder(directory)
        try:
            err = one_line_error(capsys, *argv)
        finally:
            holder.kill()
            holder.wait()
        assert "is being written by \"clozax train (a test's holder)\"" in err
        assert f"pid {holder.pid}" in err and "wait for it to finish" in err
    assert not (tmp_path / "ds").exists()


def test_a_stale_lock_is_taken_over_and_said_so(tmp_path):
    said = []
    # A holder killed on this host: its record outlives it, the kernel's lock does not.
    holder = _holder(tmp_path / "run")
    holder.kill()
    holder.wait()
    assert locks.read_holder(tmp_path / "run").pid == holder.pid
    assert locks.current_holder(tmp_path / "run") is None
    with locks.hold(tmp_path / "run", "run x", say=said.append) as me:
        assert locks.current_holder(tmp_path / "run").pid == me.pid == os.getpid()
    assert len(said) == 1 and f"pid {holder.pid}" in said[0] and "no longer running" in said[0]
    assert not locks.lock_path(tmp_path / "run").exists()  # released: the file is gone
    # A holder on another host (a shared filesystem) whose heartbeat is stale: taken over.
    path = locks.lock_path(tmp_path / "run")
    path.write_text(json.dumps(REMOTE))
    old = time.time() - locks.STALE_SECONDS - 1
    os.utime(path, (old, old))
    said.clear()
    with locks.hold(tmp_path / "run", "run x", say=said.append):
        pass
    assert len(said) == 1 and "elsewhere" in said[0]


REMOTE = {"host": "elsewhere", "pid": 1, "process_start": "1", "boot": "b",
          "since": "2026-12-01T00:00:00", "command": "clozax train"}


def test_a_holder_leaving_by_os_exit_after_release_held_leaves_no_lock_to_take_over(tmp_path):
    leaver = ("import os, sys\nfrom pathlib import Path\nfrom clozax.core import locks\n"
              "with locks.hold(Path(sys.argv[1]), 'run x'):\n"
              "    locks.release_held()\n    os._exit(143)\n")
    proc = subprocess.run([sys.executable, "-c", leaver, str(tmp_path / "run")],
                          cwd=faults.ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 143, proc.stderr
    assert not locks.lock_path(tmp_path / "run").exists()
    said = []
    with locks.hold(tmp_path / "run", "run x", say=said.append):
        pass
    assert said == []  # nothing waited for, nothing taken over


def test_a_requeue_waits_for_a_remote_holders_heartbeat_to_go_stale_then_runs(
        tmp_path, monkeypatch):
    # A job OOM-killed on another node leaves a fresh heartbeat: the requeue once failed at
    # once (exit 2, "being written"), though this process held the kernel's lock.
    monkeypatch.setattr(locks, "STALE_SECONDS", 1.5)
    monkeypatch.setattr(locks, "POLL_SECONDS", 0.1)
    path = locks.lock_path(tmp_path / "run")
    path.write_text(json.dumps(REMOTE))  # its last beat: now
    said, started = [], time.monotonic()
    with locks.hold(tmp_path / "run", "run x", say=said.append) as me:
        assert locks.read_holder(tmp_path / "run").pid == me.pid
    assert 1.0 < time.monotonic() - started < 10
    assert "held by \"clozax train\" (pid 1 on elsewhere" in said[0]
    assert "last heartbeat 0 s ago; waiting" in said[0] and "took over" in said[1]


def test_a_remote_holder_whose_heartbeat_advances_is_refused(tmp_path, monkeypatch):
    import threading

    monkeypatch.setattr(locks, "STALE_SECONDS", 3.0)
    monkeypatch.setattr(locks, "POLL_SECONDS", 0.1)
    path = locks.lock_path(tmp_path / "run")
    path.write_text(json.dumps(REMOTE))
    stop = threading.Event()

    def beat():  # the live holder on the other host
        while not stop.wait(0.3):
            os.utime(path)

    beating = threading.Thread(target=beat)
    beating.start()
    try:
        with pytest.raises(locks.Locked, match=r'"clozax train" \(pid 1 on elsewhere'):
            with locks.hold(tmp_path / "run", "run x"):
                pass
    finally:
        stop.set()
        beating.join()
    assert json.loads(path.read_text())["host"] == "elsewhere"  # untouched


TAKEN_OVER_WRITER = """
import sys, time
from pathlib import Path
from clozax.core import locks
locks.HEARTBEAT_SECONDS = 0.2
directory, mode, log = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
with locks.hold(directory, "run x"):
    print("held", flush=True)
    while True:  # a commit every 20 ms, asked first (mode "checks"), or never asked (a compile)
        asked = time.time()
        if mode == "checks":
            try:
                locks.check_held(directory)
            except locks.LockLost as e:
                print(f"error: {e}", file=sys.stderr, flush=True)
                sys.exit(2)
        with open(log, "a") as f:
            f.write(f"{asked!r}\\n")
        time.sleep(0.02)
"""


def _take_over(directory: Path) -> float:
    """What a writer on another host does to a holder it judged dead (``locks._take_over``):
    its own record renamed over the lock file. Returns when it was done."""
    path = locks.lock_path(directory)
    mine = path.with_name(path.name + ".elsewhere.1")
    mine.write_text(json.dumps(REMOTE))
    os.replace(mine, path)
    return time.time()


@pytest.mark.parametrize("mode", ["checks", "heartbeat"])
def test_a_live_holder_whose_lock_is_taken_over_stops_writing_in_one_line(tmp_path, mode):
    # Its heartbeat judged stale by a writer on another host (a filesystem without flock): the
    # holder once went on writing beside the writer that took its lock over.
    log = tmp_path / "commits"
    proc = subprocess.Popen([sys.executable, "-c", TAKEN_OVER_WRITER, str(tmp_path / "run"),
                             mode, str(log)], cwd=faults.ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    assert faults.wait_for(proc, lambda: log.is_file() and len(log.read_text().split()) >= 5)
    taken = _take_over(tmp_path / "run")
    _, err = proc.communicate(timeout=30)
    asked = [float(t) for t in log.read_text().split()]
    lines = err.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: run x: this process's lock was taken over by "
                               '"clozax train" (pid 1 on elsewhere'), err
    if mode == "checks":  # asked before each commit: none after the take-over
        assert max(asked) < taken
    else:  # nothing asked (a compile, a write in flight): out at its next heartbeat
        assert max(asked) < taken + 10 * 0.2  # never, before: it wrote until killed
    assert json.loads(locks.lock_path(tmp_path / "run").read_text())["host"] == "elsewhere"


def test_a_checkpoint_save_after_the_lock_was_taken_over_commits_nothing(tmp_path):
    """Every writer of a run (``train``, ``embed``) saves through the one ``Checkpointer``,
    which asks the lock first: a save after a take-over is ``LockLost`` and no step is
    written (before, the holder committed steps beside the new writer's until its heartbeat
    noticed)."""
    import jax.numpy as jnp

    from clozax.core.train_state import TrainState
    from clozax.train import checkpoint as ckpt

    run = tmp_path / "run"
    state = TrainState(jnp.zeros((), jnp.int32), {"w": jnp.ones(3)}, {"m": jnp.zeros(3)})
    with locks.hold(run, "run x", on_lost=lambda _: None):
        checkpointer = ckpt.Checkpointer(run)
        checkpointer.save(1, state, {})
        checkpointer.wait()
        _take_over(run)
        with pytest.raises(locks.LockLost, match="lock was taken over by"):
            checkpointer.save(2, state, {})
        checkpointer.close()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["1"]


def test_a_prepare_whose_lock_is_taken_over_publishes_nothing(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} says " + "word " * (i % 7)})
                              + "\n" for i in range(200)))
    out = tmp_path / "ds"
    proc = faults.start(["prepare", "--corpus", str(corpus), "--out", str(out), "--quiet",
                         "--vocab-size", "64", "--seq-len", "32"],
                        {"CLOZAX_TEST_PAUSE_BEFORE_RENAME": "2"})
    assert faults.wait_for(proc, locks.lock_path(out).is_file)
    _take_over(out)
    _, err = proc.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, err
    assert f"error: dataset {out}: this process's lock was taken over by" in lines[0]
    assert not out.exists()


def test_a_staged_directory_is_judged_by_host_pid_and_start_never_by_pid_alone(tmp_path):
    from clozax.core import files

    out = tmp_path / "model"
    host, pid = files.process_identity()[0], os.getppid()
    start = files.process_start(pid)
    live = tmp_path / f".model.partial-s.{host}.{pid}.{start}"  # a live process's
    reused = tmp_path / f".model.partial-s.{host}.{pid}.{int(start or 0) + 1}"  # pid reused
    remote = tmp_path / f".model.partial-s.other-host.{pid}.{start}"  # in flight elsewhere
    for d in (live, reused, remote):
        d.mkdir()
    with files.staged_dir(out) as tmp:
        (tmp / "x").write_text("x")
    assert (out / "x").is_file()
    # host B once deleted host A's in-flight partial because A's pid did not run on B
    assert remote.is_dir() and live.is_dir() and not reused.exists()


@pytest.mark.fast
def test_an_atomic_write_syncs_the_file_before_its_rename_and_the_directory_after(
        tmp_path, monkeypatch):
    # A host crash (not only a process kill) must find the old file or the new one whole.
    from clozax.core import files

    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(a, b):
        events.append(("rename", str(b)))
        real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    files.write_json(tmp_path / "result.json", {"x": 1})
    kinds = [(kind, Path(path).name) for kind, path in events]
    synced_tmp = next(k for k, (kind, name) in enumerate(kinds) if kind == "fsync"
                      and name.startswith(".result.json.tmp"))
    renamed = kinds.index(("rename", "result.json"))
    assert synced_tmp < renamed < kinds.index(("fsync", tmp_path.name))
    events.clear()
    with files.staged_dir(tmp_path / "model") as staged:
        (staged / "weights").write_bytes(b"w")
    assert ("fsync", str(tmp_path / "model" / "weights")) not in events  # synced before rename
    assert any(path.endswith("/weights") for kind, path in events if kind == "fsync")
    assert events[-1] == ("fsync", str(tmp_path))  # the rename made durable


@pytest.mark.fast
def test_an_atomic_write_of_the_same_content_leaves_the_file_alone(tmp_path):
    """Rewritten only when its content changes: the same bytes keep the file (inode and
    modification time); other bytes, even of the same length, replace it."""
    from clozax.core import files

    path = files.write_json(tmp_path / "settings.json", {"lr": 1e-3, "seed": 0})
    before = path.stat()
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns - 10**9))  # a second earlier
    before = path.stat()
    files.write_json(path, {"lr": 1e-3, "seed": 0})
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    files.write_json(path, {"lr": 1e-3, "seed": 1})  # same length, other bytes
    assert files.read_json(path) == {"lr": 1e-3, "seed": 1}
    assert path.stat().st_mtime_ns != before.st_mtime_ns


NO_FLOCK_WRITER = """
import errno, fcntl, json, sys, time
from pathlib import Path
def no_flock(fd, operation):  # a FUSE or network mount without flock
    raise OSError(errno.ENOLCK, "No locks available")
fcntl.flock = no_flock
from clozax.core import locks
directory, start, outcome = Path(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3])
while time.time() < start:
    time.sleep(0.0005)
try:
    with locks.hold(directory, "run x"):
        outcome.write_text("held")
        time.sleep(1.5)
except locks.Locked:
    outcome.write_text("refused")
"""


@pytest.mark.parametrize("found", ["no lock file", "a dead holder's record"])
def test_writers_at_one_instant_on_a_filesystem_without_flock_one_holds(tmp_path, found):
    # It once let 2 of 2 hold: read the record, then write it, nothing atomic between.
    directory = tmp_path / "run"
    if found != "no lock file":
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout.strip()
        locks.lock_path(directory).write_text(json.dumps(
            {**REMOTE, "host": socket.gethostname(), "pid": int(dead), "process_start": "1"}))
    start = time.time() + 3.0  # every writer imported and waiting by then
    outcomes = [tmp_path / f"outcome-{k}" for k in range(4)]
    procs = [subprocess.Popen([sys.executable, "-c", NO_FLOCK_WRITER, str(directory),
                               str(start), str(o)], cwd=faults.ROOT) for o in outcomes]
    for proc in procs:
        assert proc.wait(timeout=60) == 0
    said = sorted(o.read_text() for o in outcomes)
    assert said == ["held", "refused", "refused", "refused"], said


# --------------------------------------------------------------------------- checkpoints


def test_damaged_optimizer_state_keeps_no_reader_from_intact_parameters_each_hashed_once(
        tiny_run, tiny_run_copy, monkeypatch):
    from clozax.core import files

    step = faults.steps_dirs(tiny_run_copy)[-1]
    step_dir = tiny_run_copy / "checkpoints" / str(step)
    victim = max((p for p in (step_dir / "opt_state").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one bad byte in the Adam moments
    victim.write_bytes(bytes(data))
    checkpointer = ckpt.Checkpointer(tiny_run_copy, read_only=True)
    try:
        assert checkpointer.damage(step) is not None  # training (which reads it) refuses it
        assert checkpointer.damage(step, params_only=True) is None
    finally:
        checkpointer.close()
    hashed, real = [], files.file_sha256
    monkeypatch.setattr(files, "file_sha256", lambda p: hashed.append(Path(p)) or real(p))
    assert load_run(tiny_run_copy).step == step  # evaluate, fill, probe: no fall-back
    mine = [p for p in hashed if step_dir in p.parents]
    assert mine and len(mine) == len(set(mine))  # each file once (it was twice)
    assert not [p for p in mine if "opt_state" in p.parts]  # 2.6 GB for a base model
    assert np.array_equal(faults.flat_params(tiny_run_copy), faults.flat_params(tiny_run))


def test_a_committed_step_without_its_digest_is_restored_and_then_digested(
        tiny_run_copy, stdlib_data):
    """Killed after the commit, before the digest: the step is unverified, never damaged —
    readers restore it (writing nothing); the next training run digests it."""
    for stale in (tiny_run_copy / ckpt.DIGEST_DIR).glob("*.json"):
        stale.unlink()  # every step undigested, the only-step case included
    digests = tiny_run_copy / ckpt.DIGEST_DIR
    assert load_run(tiny_run_copy).step == 6
    assert load_run(tiny_run_copy, step=3).step == 3
    assert not list(digests.glob("*.json"))  # readers never write
    from clozax.train import config as config_lib
    from clozax.train import loop as train_lib
    from conftest import TINY_OVERRIDES

    cfg = config_lib.resolve(preset="tiny", overrides=[*TINY_OVERRIDES, "train.steps=9"])
    train_lib.train(stdlib_data, tiny_run_copy, cfg, extend_to=9)
    assert (digests / "6.json").is_file() and (digests / "9.json").is_file()


# --------------------------------------------------------------------------- prepare

WORDS = "one two three four five six seven eight nine ten eleven twelve".split()
PREPARE = ["--vocab-size", "120", "--seq-len", "32", "--heldout-fraction", "0.2",
           "--shard-bytes", "1500", "--quiet"]


def _jsonl_corpus(root: Path, files: int = 3, rows: int = 80) -> Path:
    """A few JSONL files, each cut into several pieces (``--shard-bytes 1500``)."""
    rng = random.Random(0)
    corpus = root / "corpus"
    corpus.mkdir()
    for f in range(files):
        lines = [json.dumps({"text": " ".join(rng.choice(WORDS)
                                             for _ in range(rng.randint(3, 60)))})
                 for _ in range(rows)]
        (corpus / f"part{f}.jsonl").write_text("\n".join(lines) + "\n")
    return corpus


def _files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _partial(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.partial-r*"))


def _count(out: Path, pattern: str) -> int:
    return sum(len(list(p.glob(pattern))) for p in _partial(out))


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")  # a zombie no longer runs


@pytest.mark.slow
def test_prepare_killed_at_each_phase_resumes_to_the_same_bytes_and_its_workers_die_with_it(
        tmp_path):
    from clozax.data import prepare

    corpus = _jsonl_corpus(tmp_path)
    whole = tmp_path / "whole"
    prepare(whole, corpus=str(corpus), vocab_size=120, seq_len=32, heldout_fraction=0.2,
            shard_bytes=1500, workers=1, quiet=True)
    out = tmp_path / "out"
    argv = ["prepare", "--corpus", str(corpus), "--out", str(out), *PREPARE, "--workers", "2"]
    rng = random.Random(27)
    read, packed = rng.randint(2, 5), rng.randint(2, 6)  # sampled instants of two phases
    instants = [  # (what, condition), over the whole life of a prepare
        ("reading", lambda: _count(out, "spool/*.read.json") >= read),
        ("after the tokenizer", lambda: _count(out, "tokenizer.json") == 1),
        ("packing", lambda: _count(out, "results/*.result.json") >= packed),
        ("before the rename", lambda: _count(out, "manifest.json") == 1),
    ]
    slow = {"CLOZAX_TEST_PAUSE_AFTER_TASK": "0.15", "CLOZAX_TEST_PAUSE_BEFORE_RENAME": "30"}
    for what, condition in instants:
        proc = faults.start(argv, slow)
        assert faults.wait_for(proc, lambda p=proc: bool(_children(p.pid)), 60)
        workers = _children(proc.pid)
        assert faults.kill_when(proc, condition), (what, proc.communicate())
        proc.communicate()
        assert not out.exists(), what  # nothing visible as complete
        if what == "reading":  # a SIGKILLed prepare's workers do not live on
            assert workers and faults.wait_for(None, lambda w=workers: all(map(_gone, w)), 5)
    code, err = faults.run(argv)
    assert code == 0, err
    assert _files(out) == _files(whole)
    assert not list(tmp_path.glob(".out.*"))  # no partial, no lock left


def test_prepare_rerun_with_another_seq_len_or_a_touched_file_keeps_what_still_holds(
        tmp_path, monkeypatch):
    from clozax.data import pack, prepare, spool, tokenizer

    corpus = _jsonl_corpus(tmp_path)
    options = dict(corpus=str(corpus), vocab_size=120, heldout_fraction=0.2, shard_bytes=1500,
                   workers=1, quiet=True)  # one worker: every task runs in this process
    whole16 = tmp_path / "whole16"
    prepare(whole16, seq_len=16, **options)
    calls = {"read": 0, "train": 0, "pack": 0}
    real = {"read": spool.read_task, "train": tokenizer.train_task, "pack": pack.pack_task}

    def counted(kind, fail_after=None):
        def task(**args):
            calls[kind] += 1
            if fail_after is not None and calls[kind] > fail_after:
                raise ValueError(f"injected failure of {kind} task {calls[kind]}")
            return real[kind](**args)
        return task

    def run(seq_len, pack_fails_after=None):
        for kind in calls:
            calls[kind] = 0
        monkeypatch.setattr(spool, "read_task", counted("read"))
        monkeypatch.setattr(tokenizer, "train_task", counted("train"))
        monkeypatch.setattr(pack, "pack_task", counted("pack", pack_fails_after))
        return prepare(tmp_path / "out", seq_len=seq_len, **options)

    with pytest.raises(ValueError, match="injected failure of pack task 3.*finished part is "
                                         "kept"):
        run(32, pack_fails_after=2)
    n = calls["read"]
    assert n > 3 and calls["train"] == 1
    # Another --seq-len: the reading and the tokenizer are kept, only packing is done again.
    with pytest.raises(ValueError, match="injected failure of pack task 2"):
        run(16, pack_fails_after=1)
    assert calls["read"] == 0 and calls["train"] == 0
    # One corpus file touched: its pieces alone are read again (and, the corpus identity
    # having moved, the tokenizer trained again on the same text).
    [tmp] = _partial(tmp_path / "out")
    the_plan = json.loads((tmp / "spool" / "plan.json").read_text())
    touched = sum(the_plan["files"][p[0]][1] == "part1.jsonl" for p in the_plan["pieces"])
    os.utime(corpus / "part1.jsonl")
    run(16)
    assert 0 < calls["read"] == touched < n and calls["train"] == 1
    assert _files(tmp_path / "out") == _files(whole16)


def test_a_bad_row_is_a_recorded_skip_and_a_partial_of_other_settings_is_never_deleted(
        tmp_path, capsys):
    from clozax.data import prepare

    corpus = _jsonl_corpus(tmp_path, files=1)
    path = corpus / "part0.jsonl"
    lines = path.read_text().splitlines()
    lines[1] = '{"text": "a lone surrogate \\ud800 in valid JSON"}'
    lines[2] = "[" * 100_000 + "]" * 100_000  # nested too deep for the parser
    path.write_text("\n".join(lines) + "\n")
    manifest = prepare(tmp_path / "ds", corpus=str(path), vocab_size=120, seq_len=32,
                       heldout_fraction=0.2, shard_bytes=1500, quiet=True)
    reasons = {s["source"]: s["reason"] for s in manifest["skipped"]}
    assert reasons["part0.jsonl:2"].startswith("not valid Unicode (a lone surrogate")
    assert reasons["part0.jsonl:3"] == "JSON nested too deeply to parse"

    # --strict stops at the bad row; the pieces read before it are kept, not deleted.
    out = tmp_path / "strict"
    options = dict(corpus=str(path), vocab_size=120, seq_len=32, heldout_fraction=0.2,
                   shard_bytes=300, quiet=True)
    with pytest.raises(ValueError, match=r"part0.jsonl:2: not valid Unicode.*finished part "
                                         r"is kept in .*\.strict\.partial-r"):
        prepare(out, strict=True, **options)
    [kept] = _partial(out)
    # Another prepare of this --out with other settings: refused, naming the partial.
    err = one_line_error(capsys, "prepare", "--corpus", path, "--out", out, "--seed", "1",
                         *PREPARE)
    assert str(kept) in err and "seed 0 (now 1)" in err and "--discard-partial" in err
    assert kept.is_dir()
    prepare(out, seed=1, discard_partial=True, **options)
    assert not kept.exists() and _partial(out) == []
