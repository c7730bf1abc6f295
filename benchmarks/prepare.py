"""Benchmark ``clozax prepare``: documents/s, tokens/s and peak RSS per corpus size.

Each run is a separate ``clozax prepare`` subprocess; its peak RSS comes from ``os.wait4``.
Generated corpora are JSONL files of stdlib docstrings recombined at random (with a serial
number so none is a duplicate), written to a temporary directory and deleted afterwards.

    .venv/bin/python benchmarks/prepare.py                 # stdlib + 200 MB
    .venv/bin/python benchmarks/prepare.py --sizes 50 100  # RSS against corpus size
    .venv/bin/python benchmarks/prepare.py --no-stdlib --sizes 50 200 \
        --tokenizer data/stdlib/tokenizer.json              # without tokenizer training
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def generate_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """Write a JSONL corpus of about ``megabytes`` MB; returns the document count."""
    from clozax.data.readers import RawDocument, read_stdlib

    pool = [r.text for r in read_stdlib() if isinstance(r, RawDocument)]
    rng = random.Random(seed)
    target = int(megabytes * 1e6)
    written = n = 0
    with path.open("w", encoding="utf-8") as f:
        while written < target:
            text = "\n\n".join(rng.choice(pool) for _ in range(rng.randint(1, 3)))
            line = json.dumps({"text": f"{text}\n(variant {n})", "group": f"g{n // 40}",
                               "label": f"l{n % 17}"}) + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
            n += 1
    return n


def run_prepare(corpus: str, out: Path, extra: list[str]) -> dict:
    """One prepare subprocess: wall seconds, peak RSS (MiB) and the manifest."""
    cmd = [sys.executable, "-m", "clozax.cli", "prepare", "--corpus", corpus, "--out", str(out),
           "--quiet", *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"prepare failed with exit code {proc.returncode}: {' '.join(cmd)}")
    manifest = json.loads((out / "manifest.json").read_text())
    return {"seconds": seconds, "rss_mib": usage.ru_maxrss / 1024, "manifest": manifest}


def report(name: str, size_mb: float | None, result: dict) -> None:
    m = result["manifest"]
    docs = m["documents"]["read"]
    tokens = sum(s["tokens"] for s in m["splits"].values())
    s = result["seconds"]
    size = "   built-in" if size_mb is None else f"{size_mb:>8.1f} MB"
    print(f"{name:<10} {size} {docs:>10,} docs {tokens:>13,} tokens {s:>7.1f} s "
          f"{docs / s:>9,.0f} docs/s {tokens / s:>11,.0f} tokens/s "
          f"peak RSS {result['rss_mib']:>7.0f} MiB  packing {m['packing_efficiency']:.4f}",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="*", default=[200.0],
                        help="generated corpus sizes in MB (default: 200)")
    parser.add_argument("--no-stdlib", action="store_true", help="skip the built-in corpus")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="use this tokenizer.json for the generated corpora instead of "
                        "training one (isolates the pipeline's memory from the trainer's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="clozax-bench-") as tmp:
        tmp = Path(tmp)
        if not args.no_stdlib:
            result = run_prepare("stdlib", tmp / "stdlib", [])
            report("stdlib", None, result)
        for size in args.sizes:
            corpus = tmp / f"corpus-{size:g}.jsonl"
            t = time.perf_counter()
            n = generate_corpus(corpus, size)
            print(f"generated {corpus.name}: {n:,} documents in {time.perf_counter() - t:.0f} s",
                  flush=True)
            extra = ["--group-field", "group", "--label-field", "label"]
            if args.tokenizer is not None:
                extra += ["--tokenizer", str(args.tokenizer.resolve())]
            result = run_prepare(str(corpus), tmp / f"ds-{size:g}", extra)
            report("generated", corpus.stat().st_size / 1e6, result)
            corpus.unlink()


if __name__ == "__main__":
    main()
