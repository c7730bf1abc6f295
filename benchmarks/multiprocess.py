"""Two processes against one: `clozax train` as a 2-process job (2 simulated CPU devices each,
gloo collectives on localhost) beside 1 process with 4 devices, same data, same steps, run one
after the other on this machine; prints each side's steady tokens/s and the ratio.

    .venv/bin/python benchmarks/multiprocess.py [--data DIR] [--steps 60] [--preset small]

What it can show is the overhead of the multi-controller runtime and of cross-process
collectives on one host; it cannot show network bandwidth between hosts (a real cluster).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run(data: Path, out: Path, processes: int, steps: int, preset: str, batch: int) -> dict:
    argv = [sys.executable, "-m", "clozax.app.cli", "train", "--data", str(data), "--out", str(out),
            "--preset", preset, "--steps", str(steps), "--set", f"train.batch_size={batch}",
            "--set", "train.eval_every=100000", "--set", "train.save_every=100000",
            "--set", "train.log_every=5"]
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={4 // processes}"}
    port, procs = _port(), []
    start = time.perf_counter()
    for i in range(processes):
        penv = dict(env)
        if processes > 1:
            penv |= {"CLOZAX_COORDINATOR": f"localhost:{port}",
                     "CLOZAX_NUM_PROCESSES": str(processes), "CLOZAX_PROCESS_ID": str(i)}
        procs.append(subprocess.Popen(argv, env=penv, cwd=ROOT, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"error: the {processes}-process run failed")
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]  # after compiling
    waits = [r["data_wait_s"] for r in records if "data_wait_s" in r]
    return {"processes": processes, "tokens_per_s": statistics.median(rates), "wall_s": wall,
            "data_wait_s": waits[-1] if waits else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "stdlib")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    if not (args.data / "manifest.json").is_file():
        raise SystemExit(f"error: {args.data} is not a prepared dataset; run "
                         f"`clozax prepare --out {args.data}` first")
    root = Path(tempfile.mkdtemp(prefix="clozax-multiprocess-"))
    try:
        one = run(args.data, root / "one", 1, args.steps, args.preset, args.batch)
        two = run(args.data, root / "two", 2, args.steps, args.preset, args.batch)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for r in (one, two):
        print(f"{r['processes']} process(es) x {4 // r['processes']} devices: "
              f"{r['tokens_per_s']:,.0f} tokens/s steady, {r['wall_s']:.0f} s wall, "
              f"waited {r['data_wait_s']} s for data in all")
    print(f"2 processes / 1 process: {two['tokens_per_s'] / one['tokens_per_s']:.2f}x "
          "tokens/s (same host, same run)")


if __name__ == "__main__":
    main()
