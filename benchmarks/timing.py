"""The side-by-side timing harness of ``compare_hf.py``: ``compare`` (warm-up with compilation
excluded, timed blocks alternating between the two sides, medians and per-block ratios, the
forward/backward breakdown, FLOP rates), ``print_result`` (the per-dtype text report) and the
matmul peaks sampled next to the blocks (``MatmulPeak``, ``torch_matmul_peak``).

JAX and torch are imported inside the functions, not at import time.
"""

from __future__ import annotations

import math
import statistics
import time

from clozax_side import ClozaxSide
from hf_side import HFSide, hf_dims, torch_sync
from shapes import DTYPES, SHAPES, Rows, visible_pairs

from clozax.core.flops import executed_flops_per_step, layer_keys, useful_flops_per_step


def visible_keys(rows: Rows, layers: int, global_every: int, window: int) -> list[float]:
    """Keys a query attends to, per layer, averaged over the rows' tokens: ``layer_keys`` for
    one document a row; with packed documents, each query's document (cut to the window on
    local layers), which is all per-document attention computes and all the loss depends on."""
    segments = rows.segments[:64]
    if (segments == segments[:, :1]).all():
        return layer_keys(segments.shape[1], layers, global_every, window)
    (seen_global, tokens), (seen_local, _) = (visible_pairs(segments, half)
                                              for half in (None, window // 2))
    return [seen_global / tokens if i % global_every == 0 else seen_local / tokens
            for i in range(layers)]


class MatmulPeak:
    """FLOP/s of a large square ``jnp.dot`` in one dtype; ``sample()`` times ``reps`` of them.

    Sampled once per block pair, next to the timed steps, so the peak fraction compares rates
    measured under the same load from other processes. The product accumulates and returns
    float32 (``preferred_element_type``), the form in which XLA:CPU runs bf16 on its fast path
    (AMX via YNNPACK, ~1.4 TFLOP/s on 2 cores; a bf16-result dot takes a ~0.24 TFLOP/s path)
    and in which clozax's kernels call it; for float32 it is the plain product.
    """

    def __init__(self, dtype_name: str, n: int = 2048, reps: int = 4):
        import jax
        import jax.numpy as jnp

        dtype = jnp.dtype(DTYPES[dtype_name])
        self.jax, self.n, self.reps = jax, n, reps
        self.a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
        self.b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
        self.dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
        self.dot(self.a, self.b).block_until_ready()

    def sample(self) -> float:
        t0 = time.perf_counter()
        out = [self.dot(self.a, self.b) for _ in range(self.reps)]
        self.jax.block_until_ready(out)
        return 2 * self.n**3 * self.reps / (time.perf_counter() - t0)


def torch_matmul_peak(dtype_name: str, device: str, n: int = 2048, reps: int = 8,
                      one_product_s: float = 0.05) -> float:
    """The same measurement with ``torch.mm`` (context: what the HF side's kernels reach). The
    size starts at 256 and doubles up to ``n`` while one product takes under
    ``one_product_s``: a CPU without native bfloat16 (this AMD EPYC) emulates it, and a fixed
    2048 then took minutes — past the device check's 240 s for a whole comparison."""
    import torch

    dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
    size = min(256, n)
    while True:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        torch_sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        torch_sync(device)
        if size >= n or time.perf_counter() - t0 >= one_product_s:
            break
        size *= 2
    n = size
    best = math.inf
    for _ in range(3):
        torch_sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        torch_sync(device)
        best = min(best, (time.perf_counter() - t0) / reps)
    return 2 * n**3 / best



def time_block(side, start: int, steps: int, fn: str = "step") -> float:
    """Seconds for ``steps`` calls of ``side.<fn>`` on batches ``start..``, synced at the end."""
    run = getattr(side, fn)
    t0 = time.perf_counter()
    for i in range(start, start + steps):
        run(i)
    side.sync()
    return time.perf_counter() - t0


def compare(dtype_name: str, args, rows: Rows, device: str) -> dict:
    shape = SHAPES[args.shape]
    tokens_per_step = shape["batch"] * shape["seq"]
    t0 = time.perf_counter()
    cz = ClozaxSide(shape, dtype_name, rows, tuple(args.set))
    cz.step(0)
    first_loss_cz = cz.sync()
    compile_s = time.perf_counter() - t0
    candidates = {"off": [False], "on": [True], "best": [False, True]}[args.hf_compile]
    hf_rates = {}
    for compiled in candidates:  # HF at its best configuration: eager or torch.compile
        side = HFSide(shape, dtype_name, rows, device, args.data, compiled=compiled)
        t0 = time.perf_counter()
        for i in range(args.warmup):
            side.step(i)
            side.sync()
        first = time.perf_counter() - t0
        rate = tokens_per_step * args.steps_per_block / time_block(side, 0, args.steps_per_block)
        hf_rates["torch.compile" if compiled else "eager"] = {"tokens_per_s": rate,
                                                               "warmup_s": first}
        if len(candidates) == 1 or rate >= max(r["tokens_per_s"] for r in hf_rates.values()):
            hf = side
    first_loss_hf = hf.sync()
    for i in range(1, args.warmup):  # warm-up, untimed
        cz.step(i)
        cz.sync()
    cz.data_seconds = hf.data_seconds = 0.0
    cz_tps, hf_tps, ratios, peaks = [], [], [], []
    peak = MatmulPeak(dtype_name, n=8192 if device == "cuda" else 2048)
    index = args.warmup
    for b in range(args.blocks):
        # Alternate who goes first so neither side always follows the other.
        order = [("cz", cz), ("hf", hf)] if b % 2 == 0 else [("hf", hf), ("cz", cz)]
        got = {}
        for name, side in order:
            got[name] = tokens_per_step * args.steps_per_block / time_block(
                side, index, args.steps_per_block)
        index += args.steps_per_block
        cz_tps.append(got["cz"])
        hf_tps.append(got["hf"])
        ratios.append(got["cz"] / got["hf"])
        peaks.append(peak.sample())
    timed_steps = args.blocks * args.steps_per_block
    data = {"clozax": cz.data_seconds / timed_steps, "hf": hf.data_seconds / timed_steps}

    # Breakdown (compile excluded): forward-only vs the full step, a few steps each.
    reps = max(2, args.steps_per_block // 2)
    breakdown = {}
    for name, side in (("clozax", cz), ("hf", hf)):
        side.forward_only(index)
        side.sync()
        fwd = time_block(side, index, reps, "forward_only") / reps
        full = time_block(side, index, reps, "step") / reps
        breakdown[name] = {"forward_s": fwd, "step_s": full, "backward_and_update_s": full - fwd,
                           "data_s": data[name]}

    h = hf_dims(shape["preset"])
    glu = h["mlp"] == "geglu"
    keys = visible_keys(rows, h["layers"], h["global_every"], h["local_window"])
    useful = useful_flops_per_step(h["hidden"], h["layers"], h["intermediate"], shape["vocab"],
                                   shape["seq"], shape["batch"], cz.count, glu, keys)
    # HF's SDPA scores every key on every layer (its sliding window is a mask): all seq keys.
    dense = executed_flops_per_step(h["hidden"], h["layers"], h["intermediate"], shape["vocab"],
                                    shape["seq"], shape["batch"], glu)
    cz_med, hf_med = statistics.median(cz_tps), statistics.median(hf_tps)
    steps_per_s_cz, steps_per_s_hf = cz_med / tokens_per_step, hf_med / tokens_per_step
    peak_med = statistics.median(peaks)
    # Peak fraction per block (rate and peak sampled side by side), then the median.
    fractions = [useful * t / tokens_per_step / p for t, p in zip(cz_tps, peaks, strict=True)]
    return {
        "dtype": dtype_name,
        "clozax_tokens_per_s": cz_med,
        "hf_tokens_per_s": hf_med,
        "ratio": statistics.median(ratios),
        "clozax_blocks": cz_tps,
        "hf_blocks": hf_tps,
        "block_ratios": ratios,
        "matmul_peak_flops": peak_med,
        "matmul_peak_blocks": peaks,
        "torch_matmul_peak_flops": torch_matmul_peak(dtype_name, device),
        "useful_flops_per_step": useful,
        "clozax_useful_flops": useful * steps_per_s_cz,
        "clozax_peak_fraction": statistics.median(fractions),
        "hf_useful_flops": useful * steps_per_s_hf,
        "hf_executed_flops": dense * steps_per_s_hf,
        "hf_executed_peak_fraction": dense * steps_per_s_hf / peak_med,
        "breakdown": breakdown,
        "clozax_compile_and_first_step_s": compile_s,
        "first_loss": {"clozax": first_loss_cz, "hf": first_loss_hf},
        "selected_per_sequence": cz.count,
        "mfu": None if not args.peak_tflops else {
            "peak_tflops": args.peak_tflops,
            "clozax": useful * steps_per_s_cz / (args.peak_tflops * 1e12),
            "hf_useful": useful * steps_per_s_hf / (args.peak_tflops * 1e12),
            "hf_executed": dense * steps_per_s_hf / (args.peak_tflops * 1e12),
        },
        "clozax_overrides": list(args.set),
        "batch": shape["batch"],
        "hf_optimizer": hf.opt_kind,
        "hf_attention": hf.attn_impl,
        "hf_model": type(hf.model).__name__,
        "hf_compiled": hf.compiled,
        "hf_candidates": hf_rates,
        "seq": shape["seq"],
    }


def _fmt_rate(x: float) -> str:
    return f"{x / 1e12:.3f} TFLOP/s" if x >= 1e11 else f"{x / 1e9:.1f} GFLOP/s"


def print_result(r: dict) -> None:
    b = r["breakdown"]
    print(f"\n== {r['dtype']}, seq {r['seq']}, batch {r['batch']} ==")
    print(f"  clozax  {r['clozax_tokens_per_s']:10,.0f} tokens/s   blocks "
          + " ".join(f"{x:,.0f}" for x in r["clozax_blocks"]))
    print(f"  HF      {r['hf_tokens_per_s']:10,.0f} tokens/s   blocks "
          + " ".join(f"{x:,.0f}" for x in r["hf_blocks"]))
    print(f"  ratio clozax/HF  {r['ratio']:.2f}x  (median of block pairs: "
          + " ".join(f"{x:.2f}" for x in r["block_ratios"]) + ")")
    print(f"  matmul peak ({r['dtype']}, 2048^3 jnp.dot -> f32, median of blocks)  "
          f"{_fmt_rate(r['matmul_peak_flops'])}"
          f"   (torch.mm: {_fmt_rate(r['torch_matmul_peak_flops'])})")
    print(f"  clozax useful FLOP rate  {_fmt_rate(r['clozax_useful_flops'])}"
          f"  = {100 * r['clozax_peak_fraction']:.0f} % of peak (median per block)"
          f"  ({r['useful_flops_per_step'] / 1e9:.1f} GFLOP/step)")
    print(f"  HF useful FLOP rate      {_fmt_rate(r['hf_useful_flops'])};"
          f" executed (dense head) {_fmt_rate(r['hf_executed_flops'])}"
          f" = {100 * r['hf_executed_peak_fraction']:.0f} % of peak")
    for side in ("clozax", "hf"):
        s = b[side]
        print(f"  {side:6s} step {1e3 * s['step_s']:7.1f} ms = forward {1e3 * s['forward_s']:6.1f}"
              f" + backward/update {1e3 * s['backward_and_update_s']:6.1f}"
              f"; batch prep (in step) {1e3 * s['data_s']:5.1f} ms")
    if r.get("mfu"):
        m = r["mfu"]
        print(f"  MFU vs {m['peak_tflops']:g} TFLOP/s: clozax {100 * m['clozax']:.1f} % (useful); "
              f"HF {100 * m['hf_useful']:.1f} % useful, {100 * m['hf_executed']:.1f} % executed")
    if len(r["hf_candidates"]) > 1:
        print("  HF candidates (one block after warm-up): " + ", ".join(
            f"{k} {v['tokens_per_s']:,.0f} tokens/s (warm-up {v['warmup_s']:.0f} s)"
            for k, v in r["hf_candidates"].items())
            + f"; compared against {'torch.compile' if r['hf_compiled'] else 'eager'}")
    print(f"  clozax compile + first step {r['clozax_compile_and_first_step_s']:.1f} s;"
          f" first losses clozax {r['first_loss']['clozax']:.3f}, HF {r['first_loss']['hf']:.3f}"
          f"; {r['selected_per_sequence']} selected slots/sequence")


# Host allocator settings. Each is fixed at process start (glibc reads them then), so one process
# runs one setting for both sides; ``--allocators`` with several runs one process per setting and
