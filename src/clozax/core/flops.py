"""Matmul FLOPs of a training step, for throughput as a fraction of a peak (MFU).

Counted as in the benchmarks (``benchmarks/compare_hf.py``): dense layers and attention,
forward + backward = 3 × forward; element-wise work (norms, activations, softmax, the
optimizer) is not counted. ``model_flops_per_token`` is what the training log's MFU uses.
"""

from __future__ import annotations

# Dense peak FLOP/s per device by its kind (the vendors' data sheets, no sparsity), for the
# compute dtype's matmuls: bfloat16, and float32 as the TF32 / default-precision path takes
# it. A kind not listed (every CPU) has no stated peak unless ``train.peak_tflops`` gives one.
PEAKS = {  # substring of jax's device_kind: (bfloat16, float32) TFLOP/s
    "H200": (989.0, 494.5), "H100": (989.0, 494.5), "A100": (312.0, 156.0),
    "L4": (121.0, 60.0), "TPU v4": (275.0, 275.0), "TPU v5 lite": (197.0, 197.0),
    "TPU v5p": (459.0, 459.0), "TPU v6 lite": (918.0, 918.0),
}


def peak_flops(device_kind: str, dtype: str, devices: int, stated_tflops: float | None = None,
               ) -> tuple[float | None, str]:
    """The job's peak FLOP/s and a phrase saying which: ``stated_tflops`` per device when
    given, else ``PEAKS`` by kind; ``(None, why not)`` when unknown."""
    if stated_tflops is not None:
        return stated_tflops * 1e12 * devices, \
            f"MFU against train.peak_tflops {stated_tflops:g} per device"
    for kind, (bf16, fp32) in PEAKS.items():
        if kind in device_kind:
            tflops = bf16 if dtype == "bfloat16" else fp32
            return tflops * 1e12 * devices, \
                f"MFU against {kind} {dtype} {tflops:g} TFLOP/s per device"
    return None, f"no MFU (no stated peak for {device_kind!r}: set train.peak_tflops)"


def _layer_forward_flops_per_token(hidden: int, intermediate: int, seq: int,
                                   glu: bool = False) -> int:
    """One encoder layer's forward matmul FLOPs per token: dense layers + attention over
    ``seq`` keys (a local layer's keys: its window, ``layer_keys``). A GLU MLP's input matmul
    is twice as wide (input and gate halves)."""
    mlp = (3 if glu else 2) * hidden * intermediate
    return 2 * (4 * hidden * hidden + mlp) + 4 * seq * hidden


def layer_keys(seq: int, layers: int, global_every: int = 1, window: int = 0) -> list[int]:
    """Keys each query attends to, per layer: ``seq`` on global layers, the ``window + 1``
    keys within ``window // 2`` on each side on local ones (fewer only near the row's ends,
    ignored here: an upper bound by < window / seq)."""
    return [seq if i % global_every == 0 else min(seq, window + 1) for i in range(layers)]


def useful_flops_per_step(hidden: int, layers: int, intermediate: int, vocab: int, seq: int,
                          batch: int, selected: int, glu: bool = False,
                          keys: list[int] | None = None) -> float:
    """Useful training FLOPs of one step (forward + backward = 3 x forward): the matmul work
    the MLM loss depends on.

    Per token per layer, ``2 * (4 H^2 + 2 H I)`` forward for the dense layers (QKV, attention
    output, MLP in and out; embeddings excluded) and ``4 * seq * H`` for attention scores and
    values, all over ``T = batch * seq`` tokens in every layer but the last. The loss reads the
    last layer's output only at the ``S = batch * selected`` selected positions, so there the
    keys and values count for all T tokens (``2 * 2 H^2``) and the query, attention, output
    projection and MLP only for S. Plus the MLM head on S (transform and tied decoder,
    ``2 * (H^2 + H V)``). Element-wise work (LayerNorm, GELU, softmax, AdamW) is not counted.
    HF executes the full last layer and a dense head over all T (``executed_flops_per_step``).
    ``keys`` (``layer_keys``) gives each layer's attended keys per query (default: ``seq``).
    """
    tokens, sel = batch * seq, batch * selected
    keys = keys or [seq] * layers
    per_token = [_layer_forward_flops_per_token(hidden, intermediate, k, glu) for k in keys]
    last_kv = 2 * 2 * hidden * hidden * tokens
    last_rows = (per_token[-1] - 2 * 2 * hidden * hidden) * sel  # all but the keys and values
    head = 2 * (hidden * hidden + hidden * vocab) * sel
    return float(3 * (sum(per_token[:-1]) * tokens + last_kv + last_rows + head))


def executed_flops_per_step(hidden: int, layers: int, intermediate: int, vocab: int, seq: int,
                            batch: int, glu: bool = False,
                            keys: list[int] | None = None) -> float:
    """Training FLOPs of a full encoder and a head over every position (what HF executes)."""
    tokens = batch * seq
    keys = keys or [seq] * layers
    per_token = sum(_layer_forward_flops_per_token(hidden, intermediate, k, glu) for k in keys)
    return float(3 * (per_token + 2 * (hidden * hidden + hidden * vocab)) * tokens)


def model_flops_per_token(model, seq: int) -> float:
    """Training FLOPs per token of a ``ModelConfig`` at rows of ``seq``: every layer over every
    token (local layers over their window) and the MLM head at every position, 3 × forward."""
    keys = layer_keys(seq, model.layers, model.global_every, model.local_window)
    glu = model.mlp == "geglu"
    layers = sum(_layer_forward_flops_per_token(model.hidden, model.intermediate, k, glu)
                 for k in keys)
    head = 2 * (model.hidden * model.hidden + model.hidden * model.vocab_size)
    return float(3 * (layers + head))
