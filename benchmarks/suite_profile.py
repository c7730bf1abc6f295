"""Where the test suite's time goes, grouped by file and by kind of cost.

    .venv/bin/python benchmarks/suite_profile.py                      # the whole suite
    .venv/bin/python benchmarks/suite_profile.py -- -m fast           # any pytest arguments
    .venv/bin/python benchmarks/suite_profile.py --read profile.json  # print a saved profile

Runs pytest with ``tests/suite_profile.py``'s recorder on (``CLOZAX_SUITE_PROFILE``), then
prints two tables. By file: tests, wall seconds and share, in-process compile seconds, seconds
in child processes and how many were started. By kind, each test's wall time split into: its
child processes (by program: a ``clozax`` command, a ``python -c`` script of several devices or
processes, the docs build, Chromium; overlapping children count once, and children that run
beside in-process work are counted as child time), in-process XLA compilation, in-process
tracing and lowering, and the rest (training and evaluation steps, data, Python). The slowest
tests follow. The saved profile (``--json``, default ``suite-profile.json`` in the working
directory) keeps every test's record.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="suite-profile.json", help="Where to save the profile.")
    parser.add_argument("--read", help="Print a saved profile instead of running the suite.")
    parser.add_argument("--slowest", type=int, default=15)
    parser.add_argument("pytest_args", nargs="*", help="After --: arguments for pytest.")
    args = parser.parse_args()
    path = Path(args.read or args.json).absolute()
    if not args.read:
        start = time.perf_counter()
        code = subprocess.call([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                                *args.pytest_args], cwd=ROOT,
                               env={**os.environ, "CLOZAX_SUITE_PROFILE": str(path)})
        print(f"\npytest exited {code} after {time.perf_counter() - start:.0f} s wall")
    report(json.loads(path.read_text()), args.slowest)


def kind_of(program: str) -> str:
    if program.startswith("clozax"):
        return "clozax command in a subprocess"
    if program == "python -m mkdocs":
        return "docs build (mkdocs subprocess)"
    if program == "chromium":
        return "Chromium screenshot"
    if program.startswith("python"):
        return "python script in a subprocess (devices, processes, probes)"
    return f"other program ({program})"


def split_test(test: dict) -> dict[str, float]:
    """A test's wall seconds by kind (they sum to its wall time)."""
    parts: dict[str, float] = collections.Counter()
    child_total = sum(c["wall"] for c in test["children"]) or 1.0
    for child in test["children"]:  # the union, shared in proportion to each child's time
        parts[kind_of(child["program"])] += test["child_wall"] * child["wall"] / child_total
    inside = max(test["wall"] - test["child_wall"], 0.0)
    compile_s = min(test["compile"], inside)
    trace_s = min(test["trace"], inside - compile_s)
    parts["XLA compile in the pytest process"] += compile_s
    parts["tracing and lowering in the pytest process"] += trace_s
    parts["the rest in the pytest process (steps, data, Python)"] += inside - compile_s - trace_s
    return parts


def report(profile: dict, slowest: int) -> None:
    tests = profile["tests"]
    total = sum(t["wall"] for t in tests)
    print(f"\n{len(tests)} tests, {total:.0f} s in tests ({profile['wall']:.0f} s session wall, "
          f"{profile['cpu']} cores, load at the end {profile['load'][0]:.2f})\n")
    files: dict[str, list[dict]] = collections.defaultdict(list)
    for t in tests:
        files[t["nodeid"].split("::")[0]].append(t)
    print(f"{'file':34} {'tests':>5} {'wall s':>8} {'share':>6} {'compile s':>9} "
          f"{'child s':>8} {'children':>8}")
    for name, group in sorted(files.items(), key=lambda kv: -sum(t["wall"] for t in kv[1])):
        wall = sum(t["wall"] for t in group)
        print(f"{name:34} {len(group):5d} {wall:8.1f} {wall / total:6.1%} "
              f"{sum(t['compile'] for t in group):9.1f} "
              f"{sum(t['child_wall'] for t in group):8.1f} "
              f"{sum(len(t['children']) for t in group):8d}")
    kinds: dict[str, float] = collections.Counter()
    starts: dict[str, int] = collections.Counter()
    for t in tests:
        kinds.update(split_test(t))
        starts.update(kind_of(c["program"]) for c in t["children"])
    print(f"\n{'kind':60} {'wall s':>8} {'share':>6} {'starts':>6}")
    for kind, seconds in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"{kind:60} {seconds:8.1f} {seconds / total:6.1%} {starts.get(kind, ''):>6}")
    imports = [(t["nodeid"], t["imported"]) for t in tests if t["imported"]]
    if imports:
        print("\nheavy packages first imported by (their import time is in that test's rest):")
        for nodeid, names in imports:
            print(f"  {', '.join(names)}: {nodeid}")
    print(f"\nthe {slowest} slowest tests:")
    for t in sorted(tests, key=lambda t: -t["wall"])[:slowest]:
        programs = collections.Counter(c["program"] for c in t["children"])
        said = ", ".join(f"{n}× {p}" for p, n in programs.most_common())
        print(f"  {t['wall']:7.1f} s  compile {t['compile']:5.1f}  {t['nodeid']}"
              + (f"  [{said}]" if said else ""))


if __name__ == "__main__":
    main()
