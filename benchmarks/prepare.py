"""Benchmark ``clozax prepare``: documents/s, tokens/s and peak RSS per corpus size, input
shapes against normal text, and ``--workers 2`` against ``--workers 1``.

Each run is a separate ``clozax prepare`` subprocess; its peak RSS comes from ``os.wait4`` (the
largest of the process and its worker children). Generated corpora are written to a temporary
directory and deleted afterwards: JSONL files of stdlib docstrings recombined at random (with
a serial number so none is a duplicate), and for ``--shapes`` the same text as very long
documents, very long lines, very long unbroken runs (20 files of each), and many tiny files.

    .venv/bin/python benchmarks/prepare.py                 # stdlib + 200 MB
    .venv/bin/python benchmarks/prepare.py --sizes 50 100  # RSS against corpus size
    .venv/bin/python benchmarks/prepare.py --no-stdlib --sizes 50 200 \
        --tokenizer data/stdlib/tokenizer.json              # without tokenizer training
    .venv/bin/python benchmarks/prepare.py --no-stdlib --sizes --shapes 20   # seconds/MB ratios
    .venv/bin/python benchmarks/prepare.py --no-stdlib --sizes --workers-ratio 50
    .venv/bin/python benchmarks/prepare.py --no-stdlib --sizes --text 1000 \
        --tokenizer-sample 20000            # one 1 GB .txt file, by paragraph
    .venv/bin/python benchmarks/prepare.py --no-stdlib --sizes --workers-ratio 50 --rounds 2 \
        --baseline ../old/src          # and an older commit's prepare, side by side
    .venv/bin/python benchmarks/prepare.py --no-stdlib --sizes --executors 40 --rounds 2 \
        --baseline ../old/src          # executors on few- and many-piece corpora
    .venv/bin/python benchmarks/prepare.py --no-stdlib --sizes --non-ascii 1000 \
        --tokenizer-sample 20000       # one 1 GB Cyrillic/Greek/CJK .txt file, by paragraph
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPE_FILES = 20  # long-document, line and run corpora: this many files, so both splits exist


def generate_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """Write a JSONL corpus of about ``megabytes`` MB; returns the document count."""
    from clozax.data.readers import RawDocument
    from clozax.data.stdlib import read_stdlib

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


def generate_shape(path: Path, shape: str, megabytes: float, seed: int = 0) -> Path:
    """``megabytes`` of docstring text in one adversarial shape; returns the corpus path."""
    from clozax.data.readers import RawDocument
    from clozax.data.stdlib import read_stdlib

    pool = [r.text for r in read_stdlib() if isinstance(r, RawDocument)]
    rng = random.Random(seed)
    target = int(megabytes * 1e6)
    if shape == "tiny-files":  # ~250-byte documents, one file each
        path.mkdir()
        written = n = 0
        while written < target:
            text = f"{rng.choice(pool)[:240]} {n}"
            (path / f"{n // 1000:04d}").mkdir(exist_ok=True)
            (path / f"{n // 1000:04d}" / f"{n:07d}.txt").write_text(text)
            written += len(text)
            n += 1
        return path
    path.mkdir()  # SHAPE_FILES files (split groups) of one long document, line or run each
    for k in range(SHAPE_FILES):
        with (path / f"{k:02d}.txt").open("w", encoding="utf-8") as f:
            written = 0
            while written < target / SHAPE_FILES:
                if shape == "run":  # letters and digits only: one unbroken run
                    piece = "".join(c for c in rng.choice(pool) if c.isalnum())
                else:
                    piece = rng.choice(pool)
                    piece = piece.replace("\n", " ") + " " if shape == "line" else \
                        piece + "\n\n"
                f.write(piece)
                written += len(piece)
    return path


def generate_text(path: Path, megabytes: float, seed: int = 0) -> int:
    """One plain-text file of about ``megabytes`` MB: docstrings as blank-line separated
    paragraphs, each with a serial number; returns the paragraph count."""
    from clozax.data.readers import RawDocument
    from clozax.data.stdlib import read_stdlib

    pool = [r.text.replace("\n\n", "\n") for r in read_stdlib() if isinstance(r, RawDocument)]
    rng = random.Random(seed)
    target = int(megabytes * 1e6)
    written = n = 0
    with path.open("w", encoding="utf-8") as f:
        while written < target:
            piece = f"{rng.choice(pool)} ({n})\n\n"
            f.write(piece)
            written += len(piece.encode("utf-8"))
            n += 1
    return n


SCRIPTS = {  # syllables of three scripts, for text no ASCII byte starts a paragraph of
    "cyrillic": "ба ве ги до жу зе ки ло му но пы ре со ту фе хи це чу ша щё эй юн яр".split(),
    "greek": "λα με νι ξο πυ ρα σε τι φο χυ ψα ωμ αλ ελ ιν ον".split(),
    "cjk": list("的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年"),
}


def generate_non_ascii(path: Path, megabytes: float, seed: int = 0) -> int:
    """One plain-text file of about ``megabytes`` MB of blank-line separated paragraphs in
    Cyrillic, Greek and CJK, some opening with a quote or an accented letter; returns the
    paragraph count."""
    rng = random.Random(seed)
    target, written, n = int(megabytes * 1e6), 0, 0
    openers = ["", "", "«", "“", "É", "Ж"]
    with path.open("w", encoding="utf-8") as f:
        while written < target:
            script = SCRIPTS[rng.choice(list(SCRIPTS))]
            joiner = "" if script is SCRIPTS["cjk"] else " "
            words = [joiner.join(rng.choice(script) for _ in range(rng.randint(1, 4)))
                     for _ in range(rng.randint(8, 60))]
            piece = f"{rng.choice(openers)}{' '.join(words)} {n}.\n\n"
            f.write(piece)
            written += len(piece.encode("utf-8"))
            n += 1
    return n


def run_prepare(corpus: str, out: Path, extra: list[str], src: Path | None = None,
                one_core: bool = False) -> dict:
    """One prepare subprocess: wall seconds, peak RSS (MiB) and the manifest. ``src``: run the
    clozax source tree there instead (a baseline checkout); ``one_core``: pinned to core 0."""
    cmd = [sys.executable, "-m", "clozax.app.cli", "prepare", "--corpus", corpus, "--out", str(out),
           *extra]
    if one_core:
        cmd = ["taskset", "-c", "0", *cmd]
    env = os.environ if src is None else {**os.environ, "PYTHONPATH": str(src)}
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**env, "COLUMNS": "200"}, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    summary = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"prepare failed with exit code {proc.returncode}: {' '.join(cmd)}")
    manifest = json.loads((out / "manifest.json").read_text())
    phases = re.search(r"prepared in [\d.]+ s \((.*)\)", summary)  # older versions: none
    return {"seconds": seconds, "rss_mib": usage.ru_maxrss / 1024, "manifest": manifest,
            "phases": phases.group(1) if phases else "",
            # CPU seconds of the process and its waited-for workers, per wall second
            "cores_busy": (usage.ru_utime + usage.ru_stime) / seconds}


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
    if result["phases"]:
        print(f"    {result['phases']}", flush=True)


def shapes(tmp: Path, megabytes: float, extra: list[str]) -> None:
    """Seconds per MB of each input shape, and its ratio to normal text's."""
    rates = {}
    for shape in ("normal", "long-document", "line", "run", "tiny-files"):
        if shape == "normal":
            corpus = tmp / "normal.jsonl"
            generate_corpus(corpus, megabytes)
        else:
            corpus = generate_shape(tmp / shape, shape, megabytes)
        result = run_prepare(str(corpus), tmp / f"ds-{shape}",
                             [*extra, "--heldout-fraction", "0.2"])
        size = megabytes if shape != "normal" else corpus.stat().st_size / 1e6
        rates[shape] = result["seconds"] / size
        report(shape, size, result)
        print(f"    {rates[shape]:.2f} s/MB, {rates[shape] / rates['normal']:.2f}x normal text",
              flush=True)


def workers_ratio(tmp: Path, megabytes: float, extra: list[str], baseline: Path | None,
                  rounds: int) -> None:
    """tokens/s with --workers 2 over --workers 1 on one generated corpus; with ``baseline``
    (another checkout's src/), that code too, on all cores and pinned to one, in alternating
    rounds, so every ratio is of runs side by side on the same machine."""
    corpus = tmp / "workers.jsonl"
    generate_corpus(corpus, megabytes)
    mb = corpus.stat().st_size / 1e6
    runs = {"workers 1": ([*extra, "--workers", "1"], None, False),
            "workers 2": ([*extra, "--workers", "2"], None, False)}
    if baseline is not None:
        runs["baseline"] = (extra, baseline, False)
        runs["baseline 1 core"] = (extra, baseline, True)
    rate: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (args, src, one_core) in runs.items():
            result = run_prepare(str(corpus), tmp / "ds-ratio", args, src, one_core)
            report(name, mb, result)
            m = result["manifest"]
            rate[name].append(sum(s["tokens"] for s in m["splits"].values()) /
                              result["seconds"])
    best = {name: max(r) for name, r in rate.items()}  # the least disturbed of the rounds
    print(f"--workers 2 / --workers 1 tokens/s: {best['workers 2'] / best['workers 1']:.2f}x",
          flush=True)
    if baseline is not None:
        for name in ("workers 1", "workers 2"):
            print(f"{name} / baseline (all cores): {best[name] / best['baseline']:.2f}x; "
                  f"/ baseline pinned to one core: {best[name] / best['baseline 1 core']:.2f}x",
                  flush=True)


def executors(tmp: Path, megabytes: float, extra: list[str], baseline: Path | None,
              rounds: int) -> None:
    """Seconds of the local executor at --workers 1 and 2, of a local Dask cluster of 2, and
    with ``baseline`` (another checkout's src/) of its prepare at 1 and 2, on a few-piece
    corpus (two files of 70 % and 30 %, one piece each) and a many-piece one (one file cut into
    4 MiB pieces), in alternating rounds; ratios of the best of each against the baseline."""
    few = tmp / "few"
    few.mkdir()
    generate_corpus(few / "a.jsonl", 0.7 * megabytes, seed=1)
    generate_corpus(few / "b.jsonl", 0.3 * megabytes, seed=2)
    many = tmp / "many.jsonl"
    generate_corpus(many, megabytes, seed=3)
    corpora = {"few pieces": (str(few), ["--shard-bytes", str((few / "a.jsonl").stat().st_size
                                                              + 1)]),
               "many pieces": (str(many), [])}
    runs = {f"local {w}": (["--workers", str(w)], None) for w in (1, 2)}
    runs["dask 2"] = (["--executor", "dask", "--workers", "2"], None)
    if baseline is not None:
        runs.update({f"baseline {w}": (["--workers", str(w)], baseline) for w in (1, 2)})
    for corpus_name, (corpus, corpus_args) in corpora.items():
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(rounds):
            for name, (args, src) in runs.items():
                result = run_prepare(corpus, tmp / "ds-executors",
                                     [*extra, *corpus_args, *args], src)
                report(f"{name}", megabytes, result)
                pieces = sum(len(v) for v in result["manifest"]["shards"].values())
                print(f"    {corpus_name}: {pieces} shards, {result['cores_busy']:.2f} cores "
                      "busy on average", flush=True)
                seconds[name].append(result["seconds"])
        best = {name: min(v) for name, v in seconds.items()}
        line = ", ".join(f"{name} {s:.1f} s" for name, s in best.items())
        print(f"{corpus_name} (best of {rounds}): {line}", flush=True)
        print(f"    local 2 / local 1 speed: {best['local 1'] / best['local 2']:.2f}x; dask 2 "
              f"/ local 2: {best['local 2'] / best['dask 2']:.2f}x", flush=True)
        if baseline is not None:
            for w in (1, 2):
                print(f"    local {w} / baseline {w} speed: "
                      f"{best[f'baseline {w}'] / best[f'local {w}']:.2f}x", flush=True)


def one_text_file(tmp: Path, name: str, generate, megabytes: float, extra: list[str]) -> None:
    """Prepare one generated plain-text file by paragraph; its splits, pieces and busy cores."""
    corpus = tmp / "one.txt"
    n = generate(corpus, megabytes)
    print(f"generated {name}: {n:,} paragraphs", flush=True)
    result = run_prepare(str(corpus), tmp / "ds-text", ["--text-unit", "paragraph", *extra])
    report(name, corpus.stat().st_size / 1e6, result)
    for split, s in result["manifest"]["splits"].items():
        print(f"    {split}: {s['documents']:,} documents, {s['tokens']:,} tokens", flush=True)
    print(f"    {len(result['manifest']['shards']['train'])} train shards (one per piece), "
          f"{result['cores_busy']:.2f} cores busy on average", flush=True)
    corpus.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="*", default=[200.0],
                        help="generated corpus sizes in MB (default: 200)")
    parser.add_argument("--no-stdlib", action="store_true", help="skip the built-in corpus")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="use this tokenizer.json for the generated corpora instead of "
                        "training one (isolates the pipeline's memory from the trainer's)")
    parser.add_argument("--tokenizer-sample", type=int, default=None,
                        help="train the tokenizer on this many documents")
    parser.add_argument("--workers", type=int, default=None, help="prepare --workers")
    parser.add_argument("--shapes", type=float, default=None, metavar="MB",
                        help="compare input shapes of this size against normal text")
    parser.add_argument("--workers-ratio", type=float, default=None, metavar="MB",
                        help="compare --workers 2 with --workers 1 on a corpus of this size")
    parser.add_argument("--text", type=float, default=None, metavar="MB",
                        help="one plain-text file of this size, --text-unit paragraph")
    parser.add_argument("--executors", type=float, default=None, metavar="MB",
                        help="compare the executors on few- and many-piece corpora of this "
                        "size")
    parser.add_argument("--non-ascii", type=float, default=None, metavar="MB",
                        help="one Cyrillic/Greek/CJK plain-text file of this size, by paragraph")
    parser.add_argument("--baseline", type=Path, default=None, metavar="SRC",
                        help="with --workers-ratio or --executors: also run the clozax in this "
                        "src/ directory (e.g. a checkout of an older commit)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --workers-ratio: alternating rounds (the best of each kind "
                        "counts)")
    args = parser.parse_args()
    extra = []
    if args.tokenizer is not None:
        extra += ["--tokenizer", str(args.tokenizer.resolve())]
    if args.tokenizer_sample is not None:
        extra += ["--tokenizer-sample", str(args.tokenizer_sample)]
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
            workers = [] if args.workers is None else ["--workers", str(args.workers)]
            result = run_prepare(str(corpus), tmp / f"ds-{size:g}",
                                 ["--group-field", "group", "--label-field", "label", *extra,
                                  *workers])
            report("generated", corpus.stat().st_size / 1e6, result)
            corpus.unlink()
        if args.shapes is not None:
            shapes(tmp, args.shapes, extra)
        for size, name, generate in ((args.text, "one .txt", generate_text),
                                     (args.non_ascii, "non-ASCII", generate_non_ascii)):
            if size is not None:
                one_text_file(tmp, name, generate, size, extra)
        if args.workers_ratio is not None:
            workers_ratio(tmp, args.workers_ratio, extra, args.baseline, args.rounds)
        if args.executors is not None:
            executors(tmp, args.executors, extra, args.baseline, args.rounds)


if __name__ == "__main__":
    main()
