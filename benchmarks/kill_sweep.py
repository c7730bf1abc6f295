"""Kill sweep: SIGKILL `clozax train` at many instants, resume each time with the same command,
and check the finished run against an uninterrupted one, bit for bit.

The suite's harness (tests/test_crash_consistency.py) kills a run at four sampled instants;
this sweep kills it N times, at instants drawn with a seed from the four kinds (during a save,
just after a commit and before its digest, just after a digest, between steps) over the whole
run, and prints N kills, N resumed, and whether the end is bitwise equal.

    python benchmarks/kill_sweep.py --kills 40 --seed 0

It uses the tests' fault hooks (tests/faults.py: slowed saves and digests so each instant can be
hit; none changes a number) and its own prepared built-in corpus.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import numpy as np  # noqa: E402

import faults  # noqa: E402  (the tests' fault hooks)

KINDS = ("during a save", "after a commit, before its digest", "after a digest",
         "between steps")


def instant(kind: str, at: int, run: Path):
    ck, digests = run / "checkpoints", run / "checkpoint_digests"
    return {
        "during a save": lambda: any(int(p.name.split(".")[0]) >= at
                                     for p in ck.glob("*orbax-checkpoint-tmp*")),
        "after a commit, before its digest": lambda: any(
            s >= at and not (digests / f"{s}.json").exists() for s in faults.steps_dirs(run)),
        "after a digest": lambda: any(int(p.stem) >= at for p in digests.glob("*.json")),
        "between steps": lambda: any(s >= at for s in faults.logged_steps(run)),
    }[kind]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=40)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the working directory")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="clozax-kill-sweep-"))
    data = work / "data"
    code, err = faults.run(["prepare", "--out", str(data), "--vocab-size", "1024",
                            "--seq-len", "64", "--quiet"])
    assert code == 0, err
    cadence = ["--steps", str(args.steps), "--set", "train.save_every=3",
               "--set", "train.eval_every=30"]
    train = ["train", "--data", str(data), *faults.TRAIN, *cadence]
    asynchronous = {"CLOZAX_HOST_MALLOC": "default"}
    slow = {**asynchronous, "CLOZAX_TEST_STEP_SECONDS": "0.03",
            "CLOZAX_TEST_SAVE_SECONDS": "0.25", "CLOZAX_TEST_DIGEST_SECONDS": "0.25"}
    t0 = time.perf_counter()
    reference = work / "reference"
    code, err = faults.run([*train, "--out", str(reference)], asynchronous)
    assert code == 0, err
    rng = random.Random(args.seed)
    out = work / "killed"
    kills, missed, kinds = 0, 0, {k: 0 for k in KINDS}
    targets = sorted(rng.randrange(3, args.steps - 2) for _ in range(args.kills))
    for at in targets:
        kind = rng.choice(KINDS)
        proc = faults.start([*train, "--out", str(out)], slow)
        if faults.kill_when(proc, instant(kind, at, out)):
            kills += 1
            kinds[kind] += 1
        else:
            missed += 1  # the instant passed before the poll saw it, or the run ended
        proc.communicate()
    code, err = faults.run([*train, "--out", str(out)], asynchronous)
    equal = (code == 0 and faults.logged_steps(out) == faults.logged_steps(reference)
             and faults.losses(out) == faults.losses(reference)
             and np.array_equal(faults.flat_params(out), faults.flat_params(reference)))
    print(f"{kills} kills ({', '.join(f'{k}: {n}' for k, n in kinds.items())}), "
          f"{missed} instants missed; {kills} resumed; finished run bitwise equal to the "
          f"uninterrupted one: {equal}; {time.perf_counter() - t0:.0f} s")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    raise SystemExit(0 if equal else 1)


if __name__ == "__main__":
    main()
