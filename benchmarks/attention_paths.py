"""Each attention path alone, forward and backward, side by side on one device: the
attention-path table of docs/performance.md.

For each row length and mask (rows with padding only; packed documents; documents and a ±64
window, ModernBERT's local layers) every path this device runs computes the same attention
(``clozax.core.attention.attend``) and its gradients: milliseconds per forward + backward
(median of ``--reps`` timed calls after a warm-up), TFLOP/s on the useful FLOPs (12 x the visible
(query, key) pairs x head_dim x heads: the forward's two matmuls and the backward's four), and
the compiled program's temporary memory (``memory_analysis``; "-" where the backend gives none).
A path that fails prints its error in one line and the others go on; one that runs out of
device memory (a dense path at 8,192 tokens, say) prints "out of memory", a figure, not a fault.

    .venv/bin/python benchmarks/attention_paths.py                      # this CPU, small shapes
    python benchmarks/attention_paths.py --seqs 512,1024,8192 --dtype bf16    # a GPU (gpu_check.sh)
    python benchmarks/attention_paths.py --json

Paths per platform: CPU ``einsum``, ``xla``, ``blocked`` (local layers), and ``flash`` only with
``--interpret`` (Pallas's interpreter: a correctness run, not a speed); NVIDIA GPU ``xla``,
``cudnn`` (bf16 rows without documents), ``flash``, ``blocked``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from shapes import visible_pairs

CASES = ("rows", "documents", "window")  # padding only; packed documents; documents + window
HALF = 64  # ModernBERT's local_attention // 2


def paths_for(platform: str, case: str, dtype: str, interpret: bool) -> list[str]:
    """The paths that run this case on this platform."""
    if platform == "cpu":
        paths = ["einsum", "xla"] + (["flash"] if interpret else [])
    else:
        paths = ["xla", "flash"]
        if platform == "gpu" and case == "rows" and dtype == "bfloat16":
            paths.insert(1, "cudnn")
    if case == "window":
        paths.append("blocked")
    return paths


def layout(case: str, batch: int, seq: int, document: int, seed: int = 0):
    """(key_real, segments) for a case: the last row padded by a fifth; documents of random
    lengths around ``document`` tokens (one per row for ``rows``)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    real = np.ones((batch, seq), bool)
    real[-1, seq - seq // 5:] = False
    segments = np.ones((batch, seq), np.int32)
    if case != "rows":
        for b in range(batch):
            lengths = rng.integers(max(1, document // 2), document * 3 // 2 + 1, size=seq)
            starts = np.cumsum(lengths)
            segments[b] = np.searchsorted(starts, np.arange(seq), side="right") + 1
    return real, np.where(real, segments, 0)


def measure(path: str, case: str, seq: int, args) -> dict:
    import jax
    import jax.numpy as jnp

    from clozax.core import attention

    batch = max(1, args.batch_tokens // seq)
    real, segments = layout(case, batch, seq, args.document)
    within = case != "rows"
    half = HALF if case == "window" else None
    vis = attention.full_rows(jnp.asarray(real), jnp.asarray(segments) if within else None)
    dtype = jnp.dtype(args.dtype)
    shape = (batch, seq, args.heads, args.head_dim)
    q, k, v = (jax.random.normal(key, shape, jnp.float32).astype(dtype)
               for key in jax.random.split(jax.random.key(0), 3))

    def loss(q, k, v):
        out = attention.attend(q, k, v, vis, path, half, dtype, interpret=args.interpret)
        return jnp.sum(out * out)

    program = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    compiled = program.lower(q, k, v).compile()
    memory = compiled.memory_analysis()
    temp = getattr(memory, "temp_size_in_bytes", None) if memory is not None else None
    jax.block_until_ready(compiled(q, k, v))  # warm-up
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v))
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    pairs = pairs_of(real, segments if within else None, half)
    flops = 12 * pairs * args.head_dim * args.heads
    return {"path": path, "case": case, "seq": seq, "batch": batch, "ms": seconds * 1e3,
            "tflops": flops / seconds / 1e12, "temp_mib": None if temp is None else temp / 2**20}


def pairs_of(real, segments, half) -> float:
    """Visible (query, key) pairs of a case: ``shapes.visible_pairs`` of its documents (each
    row one document without per-document attention), plus, without documents, what padding
    queries see (every real key, as on the dense paths)."""
    if segments is not None:
        return visible_pairs(segments, half)[0]
    pairs = visible_pairs(real.astype("int32"), half)[0]
    n_real = real.sum(axis=1)
    return pairs + float(((real.shape[1] - n_real) * n_real).sum())


def _out_of_memory(error: str) -> bool:
    return "RESOURCE_EXHAUSTED" in error or "out of memory" in error.lower()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="128,512", help="row lengths, comma-separated")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch-tokens", type=int, default=8192,
                        help="tokens per call: batch = this // seq (at least 1)")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--document", type=int, default=256,
                        help="packed documents' mean length in tokens")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--interpret", action="store_true",
                        help="on a CPU, also run the flash path in Pallas's interpreter")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    seqs = [int(s) for s in args.seqs.split(",")]
    cases = args.cases.split(",")
    if unknown := [c for c in cases if c not in CASES]:
        parser.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    if min(seqs) < 8 or args.reps < 1 or args.batch_tokens < 1:
        parser.error("--seqs must be >= 8, --reps and --batch-tokens >= 1")

    import jax

    platform = jax.default_backend()
    device = jax.devices()[0].device_kind
    results = []
    if not args.json:
        print(f"attention paths on {device} ({platform}), {args.dtype}, {args.heads} heads x "
              f"{args.head_dim}, {args.batch_tokens} tokens a call, documents ~{args.document}, "
              f"window +-{HALF}; forward + backward, median of {args.reps}")
        print(f"{'seq':>6} {'case':<10} {'path':<8} {'ms':>9} {'TFLOP/s':>8} {'temp MiB':>9}")
    for seq in seqs:
        for case in cases:
            if case == "window" and seq < 2 * HALF:
                continue
            for path in paths_for(platform, case, args.dtype, args.interpret):
                try:
                    r = measure(path, case, seq, args)
                except Exception as e:  # one failing path leaves the others' figures
                    message = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
                    r = {"path": path, "case": case, "seq": seq,
                         "error": f"{type(e).__name__}: {message}"}
                results.append(r)
                if args.json:
                    continue
                if "error" in r and _out_of_memory(r["error"]):  # a figure, not a fault
                    print(f"{seq:>6} {case:<10} {path:<8} out of memory")
                elif "error" in r:
                    print(f"{seq:>6} {case:<10} {path:<8} FAILED {r['error']}")
                else:
                    temp = "-" if r["temp_mib"] is None else f"{r['temp_mib']:.1f}"
                    print(f"{seq:>6} {case:<10} {path:<8} {r['ms']:>9.3f} {r['tflops']:>8.2f} "
                          f"{temp:>9}", flush=True)
    if args.json:
        print(json.dumps({"device": device, "platform": platform, "dtype": args.dtype,
                          "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
