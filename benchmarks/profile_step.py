"""Where a clozax train step spends its time on XLA:CPU: the JAX profiler's trace of a few
steps of ``compare_hf.py``'s clozax side, per compiled operation.

    .venv/bin/python benchmarks/profile_step.py --shape modern-small --dtype fp32
    .venv/bin/python benchmarks/profile_step.py --shape modern-small --seq 512 --top 40
    .venv/bin/python benchmarks/profile_step.py --shape small --dtype bf16

Prints the step's wall time, the operations' summed time on the compute threads (XLA:CPU runs
a matmul on every core inside YNNPACK, but an element-wise fusion on one: ``busy`` is the
summed time over the wall time times the cores), the time per kind of operation (``ynn_fusion``
= a matmul through YNNPACK, possibly with element-wise work fused in; ``copy``/``transpose``
fusions = layout changes; the rest element-wise loops) and per part of the model (the global
layers' attention, the local layers' attention — read from each operation's source op name,
``cond`` branch 1 and 0 — and everything else: dense layers, norms, head, loss, optimizer),
then the ``--top`` slowest operations with their result shape and source op name.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import compare_hf  # noqa: E402


def hlo_info(hlo: str) -> dict[str, tuple[str, str]]:
    """Each instruction name of the optimised module -> (result shape, source op name)."""
    info = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ", line)
        if m:
            op = re.search(r'op_name="([^"]+)"', line)
            info[m.group(1)] = (m.group(2), op.group(1) if op else "")
    return info


def part(op_name: str) -> str:
    if "branch_1" in op_name:
        return "global attention"
    if "branch_0" in op_name:
        return "local attention"
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(compare_hf.SHAPES), default="modern-small")
    ap.add_argument("--dtype", choices=sorted(compare_hf.DTYPES), default="fp32")
    ap.add_argument("--seq", type=int, help="row length (the batch keeps the shape's tokens)")
    ap.add_argument("--steps", type=int, default=3, help="traced steps (after 3 untraced)")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    import jax

    shape = dict(compare_hf.SHAPES[args.shape])
    if args.seq:
        shape["batch"] = shape["batch"] * shape["seq"] // args.seq
        shape["seq"] = args.seq
    rows = compare_hf.load_rows(None, True, shape["vocab"], shape["seq"])
    side = compare_hf.ClozaxSide(shape, args.dtype, rows)
    for i in range(3):
        side.step(i)
    side.sync()
    info = hlo_info(side.step_fn.lower(side.state, side.host_batch(0), side.mask_key)
                    .compile().as_text())
    with tempfile.TemporaryDirectory() as trace_dir:
        t0 = time.perf_counter()
        with jax.profiler.trace(trace_dir):
            for i in range(args.steps):
                side.step(10 + i)
            side.sync()
        wall = (time.perf_counter() - t0) / args.steps
        trace = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
        profile = jax.profiler.ProfileData.from_file(trace)
    per_op = collections.Counter()
    for plane in profile.planes:
        for line in plane.lines:
            if "Eigen" not in line.name:  # the compute threads
                continue
            for event in line.events:
                if "Thunk" not in event.name and "Slinky" not in event.name:
                    per_op[event.name] += event.duration_ns / 1e6 / args.steps
    total, cores = sum(per_op.values()), os.cpu_count()
    print(f"{args.shape} {args.dtype}, seq {shape['seq']}, batch {shape['batch']}: step "
          f"{1000 * wall:.0f} ms wall; operations {total:.0f} ms summed over the compute "
          f"threads = {total / (1000 * wall * cores):.0%} busy on {cores} cores")
    kinds, parts = collections.Counter(), collections.Counter()
    for name, ms in per_op.items():
        kinds[re.sub(r"[.\d]+$", "", name)] += ms
        is_dot = name.startswith(("ynn_fusion", "dot"))
        parts[part(info.get(name, ("", ""))[1]), "matmul" if is_dot else "other op"] += ms
    print("\nby kind of operation (ms per step):")
    for kind, ms in kinds.most_common(12):
        print(f"  {ms:8.1f}  {kind}")
    print("\nby part of the model (ms per step):")
    for (where, what), ms in sorted(parts.items()):
        print(f"  {ms:8.1f}  {where:17s} {what}")
    print(f"\nthe {args.top} slowest operations (ms per step, result shape, source op):")
    for name, ms in per_op.most_common(args.top):
        shape_, op = info.get(name, ("?", "?"))
        print(f"  {ms:8.1f}  {name:28s} {shape_[:34]:34s} {op[-70:]}")


if __name__ == "__main__":
    main()
