"""Fault injection for tests that run the real CLI in subprocesses: a wrapper script whose
test-only hooks (environment variables) slow steps, saves or digests so that a kill lands at
a chosen instant, inject a failure on one process, or record every file a process writes; and
helpers to start the command and kill it when an instant is reached.

None of the hooks changes a number: they delay, or raise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# Hooks that import clozax's training modules import JAX before the CLI could keep freed host
# memory (``train/hostmem.py``), so the tests that use them run with CLOZAX_HOST_MALLOC=default.
HOOKS = r"""
import os, sys, time
env = os.environ.get

if env("CLOZAX_TEST_AUDIT_WRITES"):  # record every file this process writes or removes
    import builtins, shutil
    log = env("CLOZAX_TEST_AUDIT_WRITES") + "-" + env("CLOZAX_PROCESS_ID", "single")
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    def hook(event, args):
        if event == "open":
            mode, flags = args[1], args[2] or 0
            if not (isinstance(mode, str) and any(c in mode for c in "wax+")
                    or mode is None and flags & writing):
                return
        elif event not in ("os.remove", "os.rename", "os.rmdir", "shutil.rmtree", "os.mkdir"):
            return
        try:
            path = os.fsdecode(args[0])
        except TypeError:
            return  # a descriptor
        if not path.startswith(log):
            with builtins.open(log, "a") as f:
                f.write(f"{event} {path}\n")
    sys.addaudithook(hook)

if env("CLOZAX_TEST_STEP_SECONDS"):  # every step takes at least this long
    from clozax.data import loader
    real_next, pause = loader.Prefetcher.__next__, float(env("CLOZAX_TEST_STEP_SECONDS"))
    def slow_next(self):
        time.sleep(pause)
        return real_next(self)
    loader.Prefetcher.__next__ = slow_next

if env("CLOZAX_TEST_GATE"):  # "FILE:N:STEP": step STEP waits (up to 120 s) for N lines in FILE
    from clozax.data import loader
    gate_file, gate_lines, gate_step = env("CLOZAX_TEST_GATE").rsplit(":", 2)
    gated_next = loader.Prefetcher.__next__
    def gate_next(self):
        deadline = time.time() + 120
        while self._next >= int(gate_step) and time.time() < deadline:
            try:
                if len(open(gate_file).read().splitlines()) >= int(gate_lines):
                    break
            except FileNotFoundError:
                pass
            time.sleep(0.05)
        return gated_next(self)
    loader.Prefetcher.__next__ = gate_next

if env("CLOZAX_TEST_SAVE_SECONDS"):  # every checkpoint's background write held open
    import orbax.checkpoint as ocp
    hold = float(env("CLOZAX_TEST_SAVE_SECONDS"))
    class Slow:
        def result(self, timeout=None):
            time.sleep(hold)
    real_save = ocp.handlers.StandardCheckpointHandler.async_save
    async def async_save(self, *args, **kwargs):
        return [*(await real_save(self, *args, **kwargs) or []), Slow()]
    ocp.handlers.StandardCheckpointHandler.async_save = async_save

if env("CLOZAX_TEST_DIGEST_SECONDS"):  # each digest recorded this long after its commit
    from clozax.train import checkpoint
    real_digests, late = checkpoint._file_digests, float(env("CLOZAX_TEST_DIGEST_SECONDS"))
    def late_digests(*args, **kwargs):
        time.sleep(late)
        return real_digests(*args, **kwargs)
    checkpoint._file_digests = late_digests

if env("CLOZAX_TEST_FAIL_AT"):  # "PROCESS:STEP": that process raises at that sync point
    from clozax.train import evaluation
    process, at = (int(x) for x in env("CLOZAX_TEST_FAIL_AT").split(":"))
    real_check = evaluation.check_finite
    def failing_check(pending, fetched, checkpointer):
        import jax
        if jax.process_index() == process and pending[-1][0] >= at:
            raise ValueError(f"injected failure at step {pending[-1][0]}")
        return real_check(pending, fetched, checkpointer)
    evaluation.check_finite = failing_check
"""
WRAPPER = HOOKS + "from clozax.app.cli import main\nmain(sys.argv[1:])\n"

# The tiny preset as the fault tests train it (the held-out sample small, a log line a step).
TRAIN = ["--preset", "tiny", "--set", "train.batch_size=8", "--set", "train.eval_rows=16",
         "--set", "optim.warmup_steps=2", "--set", "train.log_every=1"]


def start(argv: list[str], env: dict | None = None, **popen) -> subprocess.Popen:
    """``clozax ARGV`` through the wrapper, its output captured (text)."""
    return subprocess.Popen([sys.executable, "-c", WRAPPER, *argv], cwd=ROOT,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def run(argv: list[str], env: dict | None = None, timeout: float = 300) -> tuple[int, str]:
    """Run ``clozax ARGV`` to its end; ``(exit code, stderr)``."""
    proc = start(argv, env)
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def wait_for(proc: subprocess.Popen | None, condition: Callable[[], bool],
             timeout: float = 120, poll: float = 0.005) -> bool:
    """Poll ``condition`` until it holds (True) or ``proc`` ends or time runs out (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if proc is not None and proc.poll() is not None:
            return condition()
        time.sleep(poll)
    return False


def kill_when(proc: subprocess.Popen, condition: Callable[[], bool], sig=signal.SIGKILL,
              timeout: float = 120) -> bool:
    """Send ``sig`` to ``proc`` the moment ``condition`` holds; whether it was sent in time."""
    hit = wait_for(proc, condition, timeout)
    if hit and proc.poll() is None:
        proc.send_signal(sig)
        return True
    return False


def steps_dirs(run: Path) -> list[int]:
    ck = run / "checkpoints"
    return sorted(int(p.name) for p in ck.iterdir() if p.name.isdigit()) if ck.is_dir() else []


def logged_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass
    return steps


def losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "lr" in r}


def flat_params(run: Path) -> np.ndarray:
    from clozax.train.run_dir import load_run

    return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(load_run(run).params)])
