"""Where prepare's tasks run: this process, worker processes here, or a Dask cluster.

A task is ``Task(kind, args, cost)``: ``kind`` names a function in ``TASKS`` (reading a piece,
training the tokenizer, packing a shard) or is ``"module:function"``, ``args`` are its keyword
arguments, ``cost`` what it reads in bytes. ``executor.run(tasks, done)`` runs them all, the
costliest first, and calls ``done(i)`` here as task ``i`` finishes, in whatever order they
finish. Tasks read and write only the prepare's partial directory, atomically and last, so the
output is the same bytes whichever executor and however many workers ran them, and what finished
is kept when one fails.

- ``Local(workers)``: ``concurrent.futures.ProcessPoolExecutor`` (spawn context), each worker
  with a one-thread tokenizer; one worker, or one task alone, runs here.
- ``Dask(address, workers)``: the tasks on a Dask cluster (``pip install 'clozax[cluster]'``):
  the scheduler at ``address`` — hosts that mount ``--out`` at the same path — or, without one,
  a local cluster of ``workers`` processes. Dask, not Ray: measured on this machine, see the
  README's "prepare on several machines".

A task raising ``ValueError`` (bad input, e.g. a skip under ``--strict``) is re-raised here with
its message; a worker that dies is ``WorkerFailed``. Either way the tasks not yet started are
cancelled and the running ones finish (their outputs are whole files or nothing).
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import multiprocessing
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from clozax.core import files

TASKS = {
    "read": "clozax.data.spool:read_task",
    "train": "clozax.data.tokenizer:train_task",
    "pack": "clozax.data.pack:pack_task",
}
EXECUTORS = ("local", "dask")
# Test hooks: sleep this many seconds after each task; a worker starting the task dealt
# ``rank``-th (0-based, costliest first) of a run, when "kind:rank" is FAIL_TASK, exits at once
# with status 3 (as if killed).
PAUSE_AFTER_TASK_ENV = "CLOZAX_TEST_PAUSE_AFTER_TASK"
FAIL_TASK_ENV = "CLOZAX_TEST_FAIL_TASK"
ONE_THREAD = {"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}


class WorkerFailed(ValueError):
    """A worker process failed; the tasks finished so far are kept for a resumed run."""


@dataclass(frozen=True)
class Task:
    kind: str
    args: dict = field(default_factory=dict)
    cost: int = 0  # bytes it reads: the costliest start first, so none is left for last


def run_task(kind: str, args: dict, rank: int) -> None:
    """Run one task (in a worker, or here), dealt ``rank``-th; the test hooks act here."""
    if os.environ.get(FAIL_TASK_ENV) == f"{kind}:{rank}":
        os._exit(3)
    module, name = TASKS.get(kind, kind).split(":")  # or "module:function" (the tests')
    getattr(importlib.import_module(module), name)(**args)
    if os.environ.get(PAUSE_AFTER_TASK_ENV):
        time.sleep(float(os.environ[PAUSE_AFTER_TASK_ENV]))


def _by_cost(tasks: list[Task]) -> list[int]:
    return sorted(range(len(tasks)), key=lambda i: (-tasks[i].cost, i))


def _failed(what: str) -> WorkerFailed:
    return WorkerFailed(f"a prepare worker {what}; finished work is kept: run the same command "
                        "to resume")


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


class Local:
    """``workers`` cores: ``min(workers, tasks)`` processes, each with ``workers // processes``
    tokenizer threads (so one task, e.g. training the tokenizer, gets every thread). One
    process with one thread, or with every core's thread, is this one; ``inline`` keeps every
    task here (for work too small to pay for starting processes)."""

    def __init__(self, workers: int, inline: bool = False):
        self.workers, self.inline = workers, inline

    def __enter__(self) -> Local:
        return self

    def __exit__(self, *_) -> None:
        pass

    def run(self, tasks: list[Task], done: Callable[[int], None] = lambda i: None) -> None:
        if not tasks:
            return
        processes = 1 if self.inline else min(self.workers, len(tasks))
        threads = self.workers // processes
        parallel = {"TOKENIZERS_PARALLELISM": "true" if threads > 1 else "false"}
        if self.inline or processes == 1 and (threads == 1 or threads >= (os.cpu_count() or 1)):
            with environment(parallel):  # a thread count can't be set in a running process
                for rank, i in enumerate(_by_cost(tasks)):
                    run_task(tasks[i].kind, tasks[i].args, rank)
                    done(i)
            return
        env = {**parallel, "RAYON_NUM_THREADS": str(threads)}
        # Submitted from this thread, which so spawns the workers: their parent-death signal
        # follows this thread, which outlives the pool.
        pool = cf.ProcessPoolExecutor(processes, multiprocessing.get_context("spawn"),
                                      initializer=_worker_start, initargs=(env, os.getpid()))
        try:
            futures = {pool.submit(run_task, tasks[i].kind, tasks[i].args, rank): i
                       for rank, i in enumerate(_by_cost(tasks))}
            for future in cf.as_completed(futures):
                try:
                    future.result()
                except cf.process.BrokenProcessPool:
                    raise _failed("process died (killed, out of memory, or a script calling "
                                  "prepare() without `if __name__ == \"__main__\":`?)") from None
                done(futures[future])
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _worker_start(env: dict[str, str], parent: int) -> None:
    os.environ.update(env)
    _die_with_parent(parent)


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


def dask_available() -> bool:
    try:
        importlib.import_module("distributed")
    except ImportError:
        return False
    return True


def token_path(tmp: Path) -> Path:
    """Beside the partial directory (never in it: its files become the dataset's): the
    prepare whose tasks may run."""
    return tmp.parent / f".{tmp.name}.dask-run"


def run_on_cluster(kind: str, args: dict, rank: int, token: str | None = None) -> str | None:
    """A task on a cluster worker, which must see the prepare's partial directory. A task of
    a prepare that is gone — killed, its tasks still queued on the scheduler — finds another
    run's token beside the directory (``token_path``) and does nothing (returns None), so it
    never races the rerun that replaced it."""
    tmp = Path(args["tmp"])
    if not tmp.is_dir():
        raise ValueError(f"the worker on {socket.gethostname()} cannot see {tmp}: put "
                         "--out on a filesystem every host mounts at the same path")
    if token is not None and _read_token(tmp) != token:
        return None  # orphaned
    for key, value in ONE_THREAD.items():  # a worker's tasks run one per thread
        os.environ.setdefault(key, value)
    run_task(kind, args, rank)
    return socket.gethostname()


def _read_token(tmp: Path) -> str | None:
    try:
        return token_path(tmp).read_text()
    except OSError:
        return None


class Dask:
    """Tasks on the Dask scheduler at ``address``, or on a local cluster of ``workers``
    single-threaded processes when ``address`` is None, from ``with`` until its end.
    ``hosts`` counts the tasks each host ran."""

    def __init__(self, address: str | None, workers: int):
        self.address, self.workers = address, workers
        self.hosts: dict[str, int] = {}

    def __enter__(self) -> Dask:
        from distributed import Client, LocalCluster

        self.cluster = None
        if self.address is None:
            self.cluster = LocalCluster(n_workers=self.workers, threads_per_worker=1,
                                        processes=True, dashboard_address=None, env=ONE_THREAD,
                                        silence_logs=40)
        try:
            self.client = Client(self.cluster or self.address, timeout="30s")
        except (OSError, TimeoutError) as e:
            raise ValueError(f"no Dask scheduler answers at {self.address} ({e}); start one "
                             "(`dask scheduler`) or check --scheduler") from None
        return self

    def __exit__(self, *_) -> None:
        self.client.close()
        if self.cluster is not None:
            self.cluster.close()

    def run(self, tasks: list[Task], done: Callable[[int], None] = lambda i: None) -> None:
        if not tasks:
            return
        from distributed import KilledWorker, as_completed

        token = uuid.uuid4().hex  # this run's: a killed earlier run's queued tasks stand down
        tokens = [token_path(Path(tmp)) for tmp in {t.args["tmp"] for t in tasks}]
        for path in tokens:
            files.write_text(path, token)
        futures = {}
        for rank, i in enumerate(_by_cost(tasks)):
            future = self.client.submit(run_on_cluster, tasks[i].kind, tasks[i].args, rank,
                                        token, pure=False, priority=-rank, retries=0)
            futures[future] = i
        try:
            for future in as_completed(futures):
                try:
                    host = future.result()
                except KilledWorker:
                    raise _failed("on the cluster died (killed, or out of memory?)") from None
                if host is None:
                    raise _failed("stood down: another prepare of this --out took over")
                self.hosts[host] = self.hosts.get(host, 0) + 1
                done(futures[future])
        finally:
            self.client.cancel(list(futures))
            for path in tokens:
                path.unlink(missing_ok=True)
