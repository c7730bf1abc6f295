"""Summarize a `clozax train` run from its metrics.jsonl: steady tokens/s, and the share of the
command's wall time spent compiling (to the first step), evaluating and checkpointing.

    .venv/bin/python benchmarks/run_summary.py RUN --wall SECONDS [--first-step SECONDS]

``--wall`` is the whole command's wall time (measured by the caller); ``--first-step`` the
"compiled and ran the first step in X s" the run printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def summarize(run: Path, wall: float, first_step: float | None) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    eval_s = sum(r.get("eval_seconds", 0.0) for r in records)
    save_s = sum(r.get("checkpoint_seconds", 0.0) for r in records)
    steady = statistics.median(rates[1:]) if len(rates) > 1 else (rates[0] if rates else None)
    return {
        "run": str(run), "steps": records[-1]["step"] if records else 0, "wall_s": wall,
        "tokens_per_s_steady": steady, "tokens_per_s_logged": rates,
        "first_step_s": first_step, "eval_s": eval_s, "checkpoint_s": save_s,
        "eval_share": eval_s / wall, "checkpoint_share": save_s / wall,
        "first_step_share": None if first_step is None else first_step / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--wall", type=float, required=True)
    parser.add_argument("--first-step", type=float)
    args = parser.parse_args()
    s = summarize(args.run, args.wall, args.first_step)
    steady = s["tokens_per_s_steady"]
    print(f"{s['run']}: {s['steps']} steps in {s['wall_s']:.1f} s wall; steady "
          f"{steady:,.0f} tokens/s; first step {s['first_step_s']} s; evaluation "
          f"{s['eval_s']:.1f} s ({100 * s['eval_share']:.1f} %), checkpoints "
          f"{s['checkpoint_s']:.1f} s ({100 * s['checkpoint_share']:.1f} %) of wall")
    print(json.dumps(s))


if __name__ == "__main__":
    main()
