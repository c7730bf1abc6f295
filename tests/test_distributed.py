"""Several processes, one run (JAX's multi-controller runtime, gloo collectives on CPU).

One test (the launches dominate its time), several launches of the real CLI on localhost:
2 processes x 2 simulated devices against 1 process x 4 devices; the job preempted (SIGTERM
to one process: both save the same step), then one process killed at a sampled instant, then
resumed, bitwise; a process that raises ends the job; a ``--minutes`` budget kept by both;
checkpoints moved between the two topologies, with and without fsdp. Jobs that do not depend
on each other run side by side (not the --minutes one, whose budget is what it checks).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import faults
from clozax.train.run_dir import load_run
from conftest import simulated_devices

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8
TRAIN = ["--preset", "tiny", "--steps", str(STEPS), "--set", "train.batch_size=8",
         "--set", "train.eval_every=4", "--set", "train.save_every=2", "--set", "train.log_every=1",
         "--set", "train.eval_rows=16", "--set", "optim.warmup_steps=2"]
HEARTBEAT_SECONDS = 5
EXIT_BOUND_SECONDS = 60  # a survivor must exit within this after its peer is killed
MINUTES = 0.3  # the --minutes job's budget

# Each process records every file write it makes (the run's files must come from process 0),
# with the fault hooks of tests/faults.py.
RECORDING = faults.HOOKS + """
import os, sys
from clozax.core import files
from clozax.train import observe
from clozax.app.cli import main

log = os.environ["CLOZAX_TEST_WRITES"] + "-" + os.environ.get("CLOZAX_PROCESS_ID", "single")
real_bytes, real_metrics = files.write_bytes, observe.TrainLog.metrics

def write_bytes(path, data):
    with open(log, "a") as f:
        f.write(f"{path}\\n")
    return real_bytes(path, data)

def metrics(self, record):
    if self.enabled:
        with open(log, "a") as f:
            f.write("metrics.jsonl\\n")
    return real_metrics(self, record)

files.write_bytes, observe.TrainLog.metrics = write_bytes, metrics
main(sys.argv[1:])
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(data, out, processes: int, *extra, writes: Path | None = None,
            env: dict | None = None, train: list[str] = TRAIN):
    """Start the job; returns the list of Popen (one per process)."""
    devices = 4 // processes
    env = {**simulated_devices(devices), "CLOZAX_HEARTBEAT_SECONDS": str(HEARTBEAT_SECONDS),
           "CLOZAX_TEST_WRITES": str(writes or out.parent / f"{out.name}-writes"),
           **(env or {})}
    argv = ["train", "--data", str(data), "--out", str(out), *train, *extra]
    port = _free_port()
    procs = []
    for i in range(processes):
        penv = dict(env)
        if processes > 1:
            penv |= {"CLOZAX_COORDINATOR": f"localhost:{port}",
                     "CLOZAX_NUM_PROCESSES": str(processes), "CLOZAX_PROCESS_ID": str(i)}
        procs.append(subprocess.Popen([sys.executable, "-c", RECORDING, *argv], cwd=ROOT,
                                      env=penv, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def _finish(procs) -> None:
    for p in procs:
        output, _ = p.communicate(timeout=300)
        assert p.returncode == 0, output[-3000:]


def _run(data, out, processes: int, *extra, writes: Path | None = None) -> None:
    _finish(_launch(data, out, processes, *extra, writes=writes))


def _flat(run: Path) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel()
                           for x in jax.tree.leaves(load_run(run).params)])


def _losses(run: Path) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "lr" in r}


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


def _truncate(run: Path, keep: int) -> None:
    """Keep the run's checkpoints up to step ``keep`` only (as if it had stopped there)."""
    for d in (run / "checkpoints").iterdir():
        if d.name.isdigit() and int(d.name) > keep:
            shutil.rmtree(d)
            (run / "checkpoint_digests" / f"{d.name}.json").unlink(missing_ok=True)


@pytest.mark.slow
def test_two_processes_train_as_one_and_survive_faults_and_topology_changes(stdlib_data,
                                                                             tmp_path):
    one, two = tmp_path / "1x4", tmp_path / "2x2-fsdp"
    # Independent jobs run side by side (the suite's time), each job's processes as one.
    _finish([*_launch(stdlib_data, one, 1), *_launch(stdlib_data, two, 2, "--set",
                                                      "train.fsdp=true")])

    # 2 processes x 2 devices (parameters sharded over all 4) = 1 process x 4 devices: the
    # same loss each step, parameters and held-out loss.
    reference = _losses(one)
    assert sorted(reference) == list(range(1, STEPS + 1))
    losses = _losses(two)
    assert max(abs(losses[s] - reference[s]) / reference[s] for s in reference) < 1e-5
    assert _rel(_flat(one), _flat(two)) < 1e-5
    held_out = [json.loads((r / "metrics.jsonl").read_text().splitlines()[-1])["eval"]["loss"]
                for r in (one, two)]
    assert abs(held_out[0] - held_out[1]) / held_out[0] < 1e-5

    # Only process 0 wrote the run's files, metrics included.
    assert (tmp_path / "2x2-fsdp-writes-0").read_text().count("metrics.jsonl") == STEPS
    assert not (tmp_path / "2x2-fsdp-writes-1").exists()

    # Preempted: SIGTERM to process 1 alone reaches both through JAX's preemption service;
    # both save the same step, exit 143. Then process 1 SIGKILLed at a sampled instant: the
    # other exits non-zero within the bound. The same launch resumes and ends bitwise equal
    # to the uninterrupted 2-process run.
    killed = tmp_path / "killed"
    slow = {"CLOZAX_TEST_STEP_SECONDS": "0.3", "CLOZAX_HOST_MALLOC": "default"}
    procs = _launch(stdlib_data, killed, 2, "--set", "train.fsdp=true", env=slow)
    assert faults.wait_for(procs[0], lambda: bool(faults.logged_steps(killed)), 240)
    procs[1].send_signal(signal.SIGTERM)
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [143, 143], outputs[0][-3000:]
    stopped = [line for line in outputs[0].splitlines() if line.startswith("stopped:")]
    step = int(stopped[0].split(" at step ")[1].split(":")[0])
    assert faults.steps_dirs(killed)[-1] == step < STEPS
    rng = random.Random(25)  # the instant: during the save of a sampled step, or after it
    at = rng.choice([s for s in range(step + 1, STEPS) if s % 2 == 0])
    during = rng.random() < 0.5
    ck = killed / "checkpoints"
    instant = (lambda: any(int(p.name.split(".")[0]) == at
                           for p in ck.glob("*orbax-checkpoint-tmp*"))) if during else \
        (lambda: (killed / "checkpoint_digests" / f"{at}.json").exists())
    procs = _launch(stdlib_data, killed, 2, "--set", "train.fsdp=true",
                    env={**slow, "CLOZAX_TEST_SAVE_SECONDS": "0.5"})
    assert faults.wait_for(procs[0], instant, 240)
    assert all(p.poll() is None for p in procs), "the job finished before it could be killed"
    procs[1].send_signal(signal.SIGKILL)
    killed_at = time.time()
    procs[0].communicate(timeout=EXIT_BOUND_SECONDS + 30)
    survivor_exit = time.time() - killed_at
    assert procs[0].returncode != 0 and survivor_exit < EXIT_BOUND_SECONDS
    procs[1].communicate()
    _run(stdlib_data, killed, 2, "--set", "train.fsdp=true")
    assert np.array_equal(_flat(killed), _flat(two))
    assert sorted(_losses(killed)) == list(range(1, STEPS + 1))  # each step logged once

    # A process that raises (an injected error on process 1) ends the whole job in seconds.
    failing = tmp_path / "failing"
    procs = _launch(stdlib_data, failing, 2, env={"CLOZAX_TEST_FAIL_AT": "1:3"})
    said = procs[1].communicate(timeout=240)[0]
    failed_at = time.time()
    procs[0].communicate(timeout=EXIT_BOUND_SECONDS + 30)
    failed_in = time.time() - failed_at
    assert procs[1].returncode == 2 and "error: injected failure at step 3" in said, said
    assert procs[0].returncode != 0 and failed_in < EXIT_BOUND_SECONDS

    # --minutes: process 0 measures, both train the same steps, within the budget.
    budget = tmp_path / "budget"
    started = time.time()
    procs = _launch(stdlib_data, budget, 2, "--minutes", str(MINUTES),
                    train=[a for a in TRAIN if a not in ("--steps", str(STEPS))])
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    took = time.time() - started
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:]
    planned = load_run(budget).config.train.steps
    # The budget counts from process start; it cannot be kept when compiling the first step
    # alone takes longer (a loaded machine), and then the job stops after that one step.
    first = float(outputs[0].split("compiled and ran the first step in ")[1].split(" s")[0])
    assert load_run(budget).step == planned, planned
    # The budget as process 0 kept it (from its start to its last save written), not this
    # test's wall clock, which adds two launches and the teardown of jax.distributed.
    used, allowed = map(int, re.search(r"budget: (\d+) s of (\d+) s used", outputs[0]).groups())
    assert used <= allowed * 1.1 or (planned == 1 and used < first + 20), (used, first)
    assert took < MINUTES * 60 + first + 120, took  # and no process hung after its budget

    # A 2-process checkpoint resumes on 1 process, and a 1-process one on 2 processes (without
    # fsdp: the 2-process steps of this one cover the replicated layout).
    moves = {tmp_path / f"{source.name}-on-{n}": (source, n) for source, n in ((two, 1), (one, 2))}
    for moved, (source, _) in moves.items():
        shutil.copytree(source, moved)
        _truncate(moved, 4)
        (moved / "metrics.jsonl").write_text("")
    _finish([p for moved, (_, n) in moves.items() for p in _launch(stdlib_data, moved, n)])
    for moved, (source, _) in moves.items():
        assert load_run(moved).step == STEPS
        assert _rel(_flat(source), _flat(moved)) < 1e-5
        a, b = (json.loads((r / "metrics.jsonl").read_text().splitlines()[-1])["eval"]
                for r in (source, moved))
        assert abs(a["loss"] - b["loss"]) / a["loss"] < 1e-5 and a["count"] == b["count"]
    print(f"process 1 killed {'during the save' if during else 'after the digest'} of step "
          f"{at}: survivor exited {survivor_exit:.1f} s later; the peer of a "
          f"failing process {failed_in:.1f} s after it (heartbeat {HEARTBEAT_SECONDS} s); "
          f"2-process --minutes {MINUTES} took {took:.1f} s for {planned} steps")
