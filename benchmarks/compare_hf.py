"""Side by side, in one process: clozax's train step against Hugging Face ``BertForMaskedLM``.

Both sides train the same shapes on the same rows (vocab 8192, hidden 256, 4 layers, 4 heads,
intermediate 1024, seq 128, batch 32, 15 % masking, AdamW with the same hyper-parameters,
global-norm clipping 1.0, no dropout on either side: clozax has none, so HF gets
``hidden_dropout_prob = attention_probs_dropout_prob = 0``). After warm-up (compilation
excluded), timed blocks of ``--steps-per-block`` steps alternate between the two sides, so load
from other processes on a shared machine hits both; the ratio reported is the median over the
block pairs of clozax tokens/s / HF tokens/s.

    .venv/bin/python benchmarks/compare_hf.py                   # fp32 and bf16, ~3 min on 2 cores
    .venv/bin/python benchmarks/compare_hf.py --dtype fp32 --blocks 6 --steps-per-block 5
    .venv/bin/python benchmarks/compare_hf.py --synthetic --json
    .venv/bin/python benchmarks/compare_hf.py --shape base --dtype bf16   # BERT-base, for GPUs
    .venv/bin/python benchmarks/compare_hf.py --shape modern-small --synthetic --dtype fp32
    .venv/bin/python benchmarks/compare_hf.py --shape modern-base --synthetic --dtype bf16

The ``modern-*`` shapes put clozax's modern presets (RoPE, GeGLU, no biases, global attention
every third layer and a 128-token window on the others, 30 % masking, rows of 1024) against
``ModernBertForMaskedLM`` (SDPA, the same sliding window as a mask) with a 30 % collator.

clozax side: ``clozax.train.make_train_step`` + ``make_optimizer`` (the real step: on-device
corruption, sparse head at the static selected slots, clipping, AdamW), ``jax.jit`` with
``donate_argnums=0``; the batch is read from the memory-mapped split and ``device_put`` inside
the timed loop. bf16: ``model.compute_dtype=bfloat16`` (fp32 parameters and statistics).

HF side (its best honest configuration): ``BertForMaskedLM`` with its default attention
implementation (SDPA), ``DataCollatorForLanguageModeling`` (mlm_probability 0.15) on
pre-tokenized ids that carry ``special_tokens_mask`` as ``run_mlm.py`` prepares them,
``torch.optim.AdamW`` (fused where torch supports it, weight decay off for biases and LayerNorm
as the HF Trainer does), ``clip_grad_norm_(1.0)``, ``torch.set_num_threads(os.cpu_count())``.
bf16: forward and loss under ``torch.autocast(device, dtype=torch.bfloat16)``, as the Trainer's
``bf16=True`` does.

This file is the command line (its options, the header it prints, ``--allocators``' one process
per setting); the rest lies beside it: ``shapes.py`` (shapes, hyper-parameters, the shared
rows), ``clozax_side.py`` (``ClozaxSide``), ``hf_side.py`` (``HFSide`` and the HF model,
tokenizer and AdamW groups that ``quality.py`` uses too) and ``timing.py`` (``compare``: warm-up,
alternating timed blocks, medians and ratios, the breakdown and FLOP rates; ``print_result``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

# The pieces live beside this file (the script's directory is on sys.path); ``profile_step.py``
# reads ``SHAPES``, ``DTYPES``, ``load_rows`` and ``ClozaxSide`` from here.
from clozax_side import ClozaxSide  # noqa: F401
from hf_side import hf_dims
from shapes import DTYPES, SHAPES, load_rows  # noqa: F401
from timing import compare, print_result

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT / "data" / "stdlib"


# Host allocator settings. Each is fixed at process start (glibc reads them then), so one process
# runs one setting for both sides; ``--allocators`` with several runs one process per setting and
# compares each side at its own best, so neither side is handicapped by the other's setting.
ALLOCATORS = {
    # clozax.hostmem, as `clozax train` applies it: one arena, no mmap, no trim. Measured:
    # clozax fp32 +13 %, HF fp32 +16 %, HF bf16 -26 % (its threads contend for the one arena).
    "clozax": {},
    "default": {"CLOZAX_HOST_MALLOC": "default"},  # glibc as it comes
    # No mmap and no trim, glibc's usual per-thread arenas: HF bf16's fastest setting measured.
    "no-mmap": {"CLOZAX_HOST_MALLOC": "default", "MALLOC_MMAP_MAX_": "0",
                "MALLOC_TRIM_THRESHOLD_": str(2**62)},
}


def run_allocators(argv: list[str], names: list[str]) -> int:
    """One subprocess per allocator setting; then each side at its best, per dtype."""
    runs = {}
    for name in names:
        what = ALLOCATORS[name] or "clozax.hostmem, as clozax train"
        print(f"-- allocator {name!r} ({what}) ...", file=sys.stderr, flush=True)
        env = {**os.environ, **ALLOCATORS[name]}
        for key in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX"):
            if key not in ALLOCATORS[name]:
                env.pop(key, None)
        out = subprocess.run([sys.executable, __file__, *argv, "--allocators", name, "--json"],
                             env=env, capture_output=True, text=True)
        if out.returncode:
            sys.stderr.write(out.stdout + out.stderr)
            return out.returncode
        runs[name] = json.loads(out.stdout)
    summary = []
    for i, r0 in enumerate(next(iter(runs.values()))["results"]):
        by = {name: run["results"][i] for name, run in runs.items()}
        best_cz = max(by, key=lambda n: by[n]["clozax_tokens_per_s"])
        best_hf = max(by, key=lambda n: by[n]["hf_tokens_per_s"])
        summary.append({
            "dtype": r0["dtype"],
            "per_allocator": {n: {"clozax_tokens_per_s": r["clozax_tokens_per_s"],
                                  "hf_tokens_per_s": r["hf_tokens_per_s"],
                                  "same_process_ratio": r["ratio"]} for n, r in by.items()},
            "clozax_best": {"allocator": best_cz,
                            "tokens_per_s": by[best_cz]["clozax_tokens_per_s"]},
            "hf_best": {"allocator": best_hf, "tokens_per_s": by[best_hf]["hf_tokens_per_s"]},
            "ratio_best_vs_best": (by[best_cz]["clozax_tokens_per_s"]
                                   / by[best_hf]["hf_tokens_per_s"]),
        })
    if "--json" in argv:
        print(json.dumps({"runs": runs, "summary": summary}, indent=2))
        return 0
    for name, run in runs.items():
        print(f"\n######## allocator {name}")
        for r in run["results"]:
            print_result(r)
    print("\n== each side at its best allocator ==")
    for s in summary:
        cells = "; ".join(f"{n}: clozax {v['clozax_tokens_per_s']:,.0f} / HF "
                          f"{v['hf_tokens_per_s']:,.0f}" for n, v in s["per_allocator"].items())
        print(f"  {s['dtype']}: {cells}")
        print(f"  {s['dtype']}: clozax {s['clozax_best']['tokens_per_s']:,.0f} tokens/s "
              f"({s['clozax_best']['allocator']}) vs HF {s['hf_best']['tokens_per_s']:,.0f} "
              f"({s['hf_best']['allocator']}): ratio {s['ratio_best_vs_best']:.2f}x")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["fp32", "bf16", "both"], default="both")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--steps-per-block", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--synthetic", action="store_true", help="uniform random ids, no data")
    parser.add_argument("--documents", type=int, metavar="N",
                        help="with --synthetic: rows packed with documents of about N tokens "
                        "(clozax attends within each; HF over the whole row)")
    parser.add_argument("--batch", type=int, help="global batch in sequences (default: shape's)")
    parser.add_argument("--seq", type=int, help="tokens per row (default: shape's; other lengths "
                        "need --synthetic or a dataset prepared at that length)")
    parser.add_argument("--hf-compile", choices=["off", "on", "best"], default="off",
                        help="HF side under torch.compile: off, on, or best (time both after "
                        "warm-up, compare against the faster)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help='clozax config override, e.g. --set model.attention=\'"cudnn"\'')
    parser.add_argument("--peak-tflops", type=float,
                        help="the device's dense peak for the dtype (e.g. 989 for H100/H200 "
                        "bf16): also print MFU against it")
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    parser.add_argument("--allocators", default="clozax",
                        help="comma-separated host allocator settings, one process each: "
                        f"{', '.join(ALLOCATORS)}, or 'all'; with several, each side is "
                        "compared at its best (default: clozax, this process)")
    args = parser.parse_args(argv)
    names = list(ALLOCATORS) if args.allocators == "all" else args.allocators.split(",")
    if unknown := [n for n in names if n not in ALLOCATORS]:
        parser.error(f"unknown allocator {unknown}; choose from {', '.join(ALLOCATORS)} or all")
    if len(names) > 1:  # each child gets "--allocators NAME" last, which argparse keeps
        return run_allocators(list(sys.argv[1:] if argv is None else argv), names)
    if args.batch is not None:
        if args.batch < 1:
            parser.error("--batch must be >= 1")
        SHAPES[args.shape] = {**SHAPES[args.shape], "batch": args.batch}
    if args.seq is not None:
        from clozax.core.model_config import PRESETS

        top = PRESETS[SHAPES[args.shape]["preset"]]["max_positions"]
        if not 8 <= args.seq <= top:
            parser.error(f"--seq must lie in [8, {top}] (the preset's max_positions)")
        SHAPES[args.shape] = {**SHAPES[args.shape], "seq": args.seq}
    if min(args.steps_per_block, args.blocks, args.warmup) < 1:
        parser.error("--steps-per-block, --blocks and --warmup must be >= 1")
    if args.documents is not None and (args.documents < 4 or not args.synthetic):
        parser.error("--documents needs --synthetic and at least 4 tokens a document")

    from clozax.train import hostmem

    kept = hostmem.keep_freed_memory()  # before JAX is imported (a no-op unless "clozax")

    import jax
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = SHAPES[args.shape]
    synthetic = args.synthetic or not (args.data / "manifest.json").is_file()
    rows = load_rows(None if synthetic else args.data, synthetic, shape["vocab"], shape["seq"],
                     documents=args.documents)
    env = {
        "shape": {**shape, **hf_dims(shape["preset"])},
        "data": rows.source,
        "jax": jax.__version__, "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "host_malloc": names[0] + (" (clozax.hostmem applied)" if kept else ""),
        "torch_threads": torch.get_num_threads(), "torch_device": device,
        "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "python": sys.version.split()[0],
        "steps_per_block": args.steps_per_block, "blocks": args.blocks, "warmup": args.warmup,
    }
    if not args.json:
        print(f"shape {env['shape']}; data: {rows.source}")
        print(f"jax {env['jax']} ({env['jax_backend']}, XLA_FLAGS={env['xla_flags']!r}, host "
              f"allocator {env['host_malloc']}, both sides); "
              f"torch {torch.__version__} on {device}, {env['torch_threads']} threads")
        print(f"{args.blocks} alternating blocks x {args.steps_per_block} steps after "
              f"{args.warmup} warm-up steps per side", flush=True)
    dtypes = ["fp32", "bf16"] if args.dtype == "both" else [args.dtype]
    results = []
    for d in dtypes:
        r = compare(d, args, rows, device)
        results.append(r)
        if not args.json:
            if d == dtypes[0]:
                print(f"HF: {r['hf_model']}, attention {r['hf_attention']}, {r['hf_optimizer']},"
                      f" DataCollatorForLanguageModeling, transformers "
                      f"{__import__('transformers').__version__}")
            print_result(r)
            sys.stdout.flush()
    if args.json:
        print(json.dumps({"env": env, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
