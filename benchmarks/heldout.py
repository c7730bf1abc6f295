"""Held-out evaluation against held-out size: time and peak memory of ``clozax evaluate --full``
(every held-out row, streamed chunk by chunk) on the held-out split of generated corpora of
growing size, beside a baseline checkout's ``clozax evaluate`` of a run whose frozen set holds
every held-out row (the whole set in memory: the default before the keyed sample, and
``train.eval_rows=none`` today).

    python benchmarks/heldout.py --sizes 10 100 1000 --baseline /tmp/old/src

Each size: one plain-text file by paragraph (``benchmarks/prepare.py``'s generator), prepared
once; a tiny-preset run trained 2 steps by each version on it; then each version's evaluate in
its own process (wall seconds, peak RSS from ``wait4``). The two evaluations are run side by
side on the same machine, one after the other; ratios are new / baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from prepare import generate_text, run_prepare  # noqa: E402

TRAIN = ["--preset", "tiny", "--steps", "2", "--set", "train.batch_size=8",
         "--set", "train.eval_every=2", "--set", "train.save_every=2"]


def peak_rss_of(cmd: list[str], src: Path | None = None) -> dict:
    """``cmd`` in its own process: wall seconds and its own peak RSS (MiB)."""
    env = {**os.environ, "COLUMNS": "200"}
    if src is not None:
        env["PYTHONPATH"] = str(src)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "clozax.app.cli", *cmd], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{err[-2000:]}")
    return {"seconds": seconds, "rss_mib": usage.ru_maxrss / 1024}


def one_size(tmp: Path, megabytes: float, baseline: Path | None) -> None:
    corpus, data = tmp / "one.txt", tmp / f"ds-{megabytes:g}"
    if not (data / "manifest.json").is_file():
        generate_text(corpus, megabytes)
        prepared = run_prepare(str(corpus), data, ["--text-unit", "paragraph",
                                                   "--tokenizer-sample", "20000"])
        corpus.unlink()
        print(f"{megabytes:g} MB: prepared in {prepared['seconds']:.1f} s", flush=True)
    heldout = json.loads((data / "manifest.json").read_text())["splits"]["heldout"]
    new_run, old_run = tmp / f"run-new-{megabytes:g}", tmp / f"run-old-{megabytes:g}"
    for run in (new_run, old_run):
        shutil.rmtree(run, ignore_errors=True)
    train_new = peak_rss_of(["train", "--data", str(data), "--out", str(new_run), *TRAIN])
    new = peak_rss_of(["evaluate", str(new_run), "--full"])
    full = json.loads((new_run / "eval_full.json").read_text())
    line = (f"{megabytes:>7g} MB corpus: held-out {heldout['documents']:,} documents, "
            f"{full['schedule']['rows']:,} rows, {full['trained']['count']:,} positions | "
            f"new evaluate --full {new['seconds']:.1f} s, peak RSS {new['rss_mib']:.0f} MiB "
            f"(train {train_new['rss_mib']:.0f} MiB)")
    if baseline is not None:
        # (a baseline before the sample: its default frozen set is every held-out row)
        train_old = peak_rss_of(["train", "--data", str(data), "--out", str(old_run), *TRAIN],
                                baseline)
        old = peak_rss_of(["evaluate", str(old_run)], baseline)
        whole = json.loads((old_run / "eval.json").read_text())
        line += (f" | baseline evaluate (whole set in memory) {old['seconds']:.1f} s, peak RSS "
                 f"{old['rss_mib']:.0f} MiB (train {train_old['rss_mib']:.0f} MiB), "
                 f"{whole['trained']['count']:,} positions | new/baseline: time "
                 f"{new['seconds'] / old['seconds']:.2f}x, RSS "
                 f"{new['rss_mib'] / old['rss_mib']:.2f}x")
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[10.0, 100.0])
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a baseline checkout's src/ (git archive REV src | tar -x -C DIR)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep corpora and runs here (re-used when present)")
    args = parser.parse_args()
    tmp = args.keep or Path(tempfile.mkdtemp(prefix="clozax-heldout-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        for size in args.sizes:
            one_size(tmp, size, args.baseline)
    finally:
        if args.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
