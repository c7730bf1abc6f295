"""Where the suite's time goes: a pytest plugin that records, for every test, its wall time and
what filled it, written as JSON for ``benchmarks/suite_profile.py`` to group by file and kind.

Turned on by ``CLOZAX_SUITE_PROFILE=FILE`` (``tests/conftest.py`` registers it); off, it costs
nothing. Per test (setup, call and teardown together):

- ``wall``: seconds;
- ``compile``: seconds XLA spent compiling in the pytest process (JAX's own
  ``backend_compile_duration`` events; a persistent-cache hit is not a compile) and ``trace``:
  seconds spent tracing and lowering to MLIR;
- ``children``: every process the test started — its program (``python``, ``chromium``, ...),
  the ``clozax`` command or ``-c`` script it ran, and its wall seconds from start until its exit
  was collected; ``child_wall`` is the union of those intervals (children that overlap count once);
- ``imported``: heavy packages first imported during the test (torch, transformers, mkdocs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ENV = "CLOZAX_SUITE_PROFILE"
HEAVY = ("torch", "transformers", "mkdocs", "sklearn", "tensorboardX", "wandb", "distributed")


def _program(args) -> str:
    """A short name for what a child runs: ``clozax train``, ``python -c``, ``chromium``."""
    argv = [os.fspath(a) for a in ([args] if isinstance(args, (str, bytes, os.PathLike))
                                   else list(args))]
    if not argv:
        return "?"
    head = Path(argv[0]).name
    if head.startswith("python") or argv[0] == sys.executable:
        if argv[1:3] == ["-m", "clozax.app.cli"]:
            return f"clozax {argv[3]}" if len(argv) > 3 else "clozax"
        if argv[1:2] == ["-m"]:
            return f"python -m {argv[2]}"
        if argv[1:2] == ["-c"]:
            script = argv[2]
            if "from clozax.app.cli import main" in script:  # tests/faults.py's wrapper
                command = next((a for a in argv[3:] if not a.startswith("-")), "")
                return f"clozax {command} (wrapped)"
            return "python -c"
        return "python"
    return head


class Recorder:
    """Collects the per-test records; ``pytest_sessionfinish`` writes them."""

    def __init__(self, path: str):
        self.path = Path(path)
        self.tests: list[dict] = []
        self.children: list[dict] = []
        self.compile = {"compile": 0.0, "trace": 0.0}
        self._start = time.perf_counter()
        self._watch_compiles()
        self._watch_children()

    def _watch_compiles(self) -> None:
        from jax import monitoring
        from jax._src import dispatch

        kinds = {dispatch.BACKEND_COMPILE_EVENT: "compile",
                 dispatch.JAXPR_TRACE_EVENT: "trace",
                 dispatch.JAXPR_TO_MLIR_MODULE_EVENT: "trace"}

        def listener(event: str, duration: float, **_):
            if event in kinds:
                self.compile[kinds[event]] += duration

        monitoring.register_event_duration_secs_listener(listener)

    def _watch_children(self) -> None:
        recorder, popen_init = self, subprocess.Popen.__init__
        handle_exit = subprocess.Popen._handle_exitstatus

        def init(popen, args, *a, **kw):
            popen._profile = {"program": _program(args), "start": time.perf_counter(),
                              "end": None}
            recorder.children.append(popen._profile)
            popen_init(popen, args, *a, **kw)

        def exited(popen, *a, **kw):
            record = getattr(popen, "_profile", None)
            if record is not None and record["end"] is None:
                record["end"] = time.perf_counter()
            return handle_exit(popen, *a, **kw)

        subprocess.Popen.__init__ = init
        subprocess.Popen._handle_exitstatus = exited

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        modules, compiled, born = set(sys.modules), dict(self.compile), len(self.children)
        start = time.perf_counter()
        yield
        end = time.perf_counter()
        children = self.children[born:]
        for child in children:
            if child["end"] is None:  # still running (a module fixture's helper): until now
                child["end"] = end
        self.tests.append({
            "nodeid": item.nodeid,
            "wall": end - start,
            "compile": self.compile["compile"] - compiled["compile"],
            "trace": self.compile["trace"] - compiled["trace"],
            "children": [{"program": c["program"], "wall": c["end"] - c["start"]}
                         for c in children],
            "child_wall": _union([(c["start"], c["end"]) for c in children]),
            "imported": sorted(m for m in HEAVY if m in sys.modules and m not in modules),
        })

    def pytest_sessionfinish(self, session):
        self.path.write_text(json.dumps({
            "wall": time.perf_counter() - self._start, "cpu": os.cpu_count(),
            "load": os.getloadavg(), "tests": self.tests}, indent=1))


def _union(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total
