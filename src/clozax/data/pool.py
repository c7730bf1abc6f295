"""Tasks spread over worker processes that exchange JSON lines, never pickle.

``Pool(workers).run(tasks, done)`` runs every task — ``{"kind": …, "args": {…}}``, where
``kind`` names a function in ``TASKS`` — and calls ``done(i)`` in this process as task ``i``
finishes, in whatever order they finish. One worker runs the tasks here, in this process; more
start ``python -m clozax.data.pool`` subprocesses, each fed its next task over stdin as soon as
it answers one (so a slow task never holds up the others), at most two queued at a time.

A task raising ``ValueError`` (bad input, e.g. a skip under ``--strict``) is re-raised here with
its message. A worker that dies (a crash, the OOM killer) is ``WorkerFailed`` naming its last
stderr line; tasks write their outputs atomically and last, so what finished is kept for a
resumed run.

``--workers N`` uses N cores: with as many tasks, N processes whose tokenizers run one thread
each (``TOKENIZERS_PARALLELISM=false``); one task alone gets N tokenizer threads.
"""

from __future__ import annotations

import importlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

TASKS = {
    "read": "clozax.data.spool:read_task",
    "train": "clozax.data.spool:train_task",
    "pack": "clozax.data.pack:pack_task",
}
QUEUED = 2  # tasks sent to a worker ahead of its answers
# Test hooks: sleep this many seconds after each task; a worker running the task whose
# "kind:index" is FAIL_TASK exits at once with status 3 (as if killed).
PAUSE_AFTER_TASK_ENV = "CLOZAX_TEST_PAUSE_AFTER_TASK"
FAIL_TASK_ENV = "CLOZAX_TEST_FAIL_TASK"
PARENT_ENV = "CLOZAX_POOL_PARENT"  # the pid a worker must not outlive


class WorkerFailed(ValueError):
    """A worker process failed; the tasks finished so far are kept for a resumed run."""


def _function(kind: str) -> Callable[..., None]:
    module, name = TASKS[kind].split(":")
    return getattr(importlib.import_module(module), name)


@contextmanager
def environment(values: dict[str, str]):
    """``os.environ`` with ``values`` set, restored afterwards."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _run_one(task: dict, index: int) -> None:
    if os.environ.get(FAIL_TASK_ENV) == f"{task['kind']}:{index}":
        os._exit(3)
    _function(task["kind"])(**task["args"])
    if os.environ.get(PAUSE_AFTER_TASK_ENV):
        time.sleep(float(os.environ[PAUSE_AFTER_TASK_ENV]))


class Pool:
    """``workers`` cores for tasks: ``min(workers, tasks)`` processes, each with
    ``workers // processes`` tokenizer threads (so one task, e.g. training the tokenizer, gets
    every thread). One process with one thread, or with every core's thread, is this one;
    ``inline`` keeps every task here (for work too small to pay for starting processes)."""

    def __init__(self, workers: int, inline: bool = False):
        self.workers, self.inline = workers, inline

    def run(self, tasks: list[dict], done: Callable[[int], None] = lambda i: None) -> None:
        if not tasks:
            return
        processes = 1 if self.inline else min(self.workers, len(tasks))
        threads = self.workers // processes
        parallel = {"TOKENIZERS_PARALLELISM": "true" if threads > 1 else "false"}
        if self.inline or processes == 1 and (threads == 1 or threads >= (os.cpu_count() or 1)):
            with environment(parallel):  # a thread count can't be set in a running process
                for i, task in enumerate(tasks):
                    _run_one(task, i)
                    done(i)
            return
        with _Workers(processes, {**parallel, "RAYON_NUM_THREADS": str(threads)}) as workers:
            workers.run(tasks, done)


class _Workers:
    def __init__(self, n: int, env: dict[str, str]):
        self.env = {**os.environ, **env, PARENT_ENV: str(os.getpid())}
        self.procs: list[subprocess.Popen] = []
        self.errs = [tempfile.TemporaryFile() for _ in range(n)]
        self.pending = [b""] * n  # bytes of an answer line not yet complete

    def __enter__(self) -> _Workers:
        for err in self.errs:
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "clozax.data.pool"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=err, env=self.env, bufsize=0))
        return self

    def __exit__(self, kind, *_) -> None:
        for proc in self.procs:
            if kind is not None:
                proc.kill()
            elif not proc.stdin.closed:
                proc.stdin.close()
        for proc in self.procs:
            proc.wait()
            proc.stdout.close()
            if not proc.stdin.closed:
                proc.stdin.close()
        for err in self.errs:
            err.close()

    def run(self, tasks: list[dict], done: Callable[[int], None]) -> None:
        todo = iter(range(len(tasks)))
        waiting = dict.fromkeys(range(len(self.procs)), 0)  # tasks sent, not yet answered
        selector = selectors.DefaultSelector()
        for w, proc in enumerate(self.procs):
            selector.register(proc.stdout, selectors.EVENT_READ, w)
            for _ in range(QUEUED):
                waiting[w] += self._send(w, todo, tasks)
        left = len(tasks)
        while left:
            for key, _ in selector.select():
                w = key.data
                for answer in self._answers(w):
                    if "error" in answer:
                        raise ValueError(answer["error"])
                    waiting[w] -= 1
                    left -= 1
                    done(answer["done"])
                    waiting[w] += self._send(w, todo, tasks)
                if waiting[w] == 0:
                    selector.unregister(self.procs[w].stdout)
                    self.procs[w].stdin.close()
        selector.close()

    def _answers(self, w: int) -> list[dict]:
        """The complete answer lines worker ``w`` has written; ``WorkerFailed`` if it died."""
        data = os.read(self.procs[w].stdout.fileno(), 1 << 16)
        if not data:
            raise self._failure(w)
        lines = (self.pending[w] + data).split(b"\n")
        self.pending[w] = lines.pop()
        return [json.loads(line) for line in lines]

    def _send(self, w: int, todo, tasks: list[dict]) -> int:
        i = next(todo, None)
        if i is None:
            return 0
        try:
            self.procs[w].stdin.write((json.dumps({"index": i, **tasks[i]}) + "\n").encode())
        except BrokenPipeError:
            raise self._failure(w) from None
        return 1

    def _failure(self, w: int) -> WorkerFailed:
        code = self.procs[w].wait()
        self.errs[w].seek(0)
        err = self.errs[w].read().decode("utf-8", "replace").strip().splitlines()
        last = err[-1] if err else "no message"
        return WorkerFailed(f"a prepare worker failed (exit {code}: {last}); finished work is "
                            "kept: run the same command to resume")


def _die_with_parent(parent: int) -> None:
    """End this worker when its parent ends, however it ends (a SIGKILLed prepare must not
    leave workers writing into its partial directory): the kernel's parent-death signal on
    Linux, else a thread watching the parent's pid."""
    try:
        import ctypes

        pr_set_pdeathsig = 1
        if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL) == 0:
            if os.getppid() != parent:  # the parent died before the call took
                os._exit(1)
            return
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def main() -> None:
    """A worker: answer each task line on stdin with one JSON line (stdout is the channel
    alone; anything else printed goes to stderr)."""
    _die_with_parent(int(os.environ.get(PARENT_ENV, os.getppid())))
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    for line in sys.stdin:
        task = json.loads(line)
        try:
            _run_one(task, task["index"])
        except ValueError as e:
            channel.write(json.dumps({"error": str(e)}) + "\n")
            return
        channel.write(json.dumps({"done": task["index"]}) + "\n")


if __name__ == "__main__":
    main()
