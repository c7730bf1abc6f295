"""Attention: which keys each query may see, and how softmax attention is computed.

Axis names as in ``clozax.core.model``: q, k, v are (batch, seq, heads, head_dim); masks are
bool, broadcastable to (batch, heads, q, k), True where a query may see a key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from clozax.core import kernels

# ``model.attention``: speed-only, every choice is the same maths (see ``attend``).
IMPLS = ("auto", "einsum", "xla", "cudnn")


def cudnn_available() -> bool:
    """Whether cuDNN's fused attention can run here: the default backend is an NVIDIA GPU."""
    if jax.default_backend() != "gpu":
        return False
    return "nvidia" in jax.devices()[0].device_kind.lower()


def visible(attention_mask, segments, within_segments):
    """Boolean mask broadcastable to (batch, heads, q, k): True where a query may see a key."""
    key_real = attention_mask[:, None, None, :]  # (batch, 1, 1, seq)
    if not within_segments:
        return key_real
    same = segments[:, :, None] == segments[:, None, :]  # (batch, seq, seq)
    return same[:, None, :, :] & key_real  # (batch, 1, seq, seq)


def window(seq: int, half: int):
    """(1, 1, seq, seq) bool: True where |query - key| <= ``half``, the bidirectional sliding
    window of ``model.local_window = 2 * half`` (HF ModernBERT: ``local_attention // 2``)."""
    index = jnp.arange(seq)
    return (jnp.abs(index[:, None] - index[None, :]) <= half)[None, None]


def rows_mask(mask, rows):
    """``mask`` (batch, 1, q or 1, k) restricted to query positions ``rows`` (batch, count)."""
    if mask.shape[2] == 1:
        return mask
    return jnp.take_along_axis(mask, rows[:, None, :, None], axis=2)  # (batch, 1, count, k)


def attend(q, k, v, mask, impl: str = "auto", lengths=None, dtype=None):
    """Scaled dot-product attention. q, k, v: (batch, seq, heads, head_dim); same out.

    ``dtype`` is the compute dtype of the matmul operands (default: q's). ``impl``
    (``model.attention``) chooses how, never what:

    - ``einsum`` (``auto`` on CPU): ``kernels.attention``, explicit batched matmuls in
      (batch, heads, seq, head_dim) layout with a hand-written backward that XLA:CPU runs in
      YNNPACK (see ``clozax.core.kernels``). Scores and softmax in float32; returns float32.
    - ``xla`` (``auto`` elsewhere): ``jax.nn.dot_product_attention`` with the boolean mask.
    - ``cudnn``: cuDNN's fused flash-attention kernel on NVIDIA GPUs, given per-row
      ``lengths`` (batch,) instead of a boolean mask (JAX issues #23349, #28974: a boolean
      mask forces a slower path). Valid when padding is a suffix of every row, which clozax's
      packing guarantees (``apply`` derives the lengths from ``attention_mask``).
    """
    dtype = q.dtype if dtype is None else dtype
    if impl == "auto":
        impl = "einsum" if kernels.on_cpu() else "xla"
    if impl == "einsum":
        q, k, v = (t.astype(jnp.float32) for t in (q, k, v))
        return kernels.attention(q, k, v, mask, dtype)
    q, k, v = (t.astype(dtype) for t in (q, k, v))
    if impl == "xla":
        return jax.nn.dot_product_attention(q, k, v, mask=mask)
    # Queries at selected rows only (``apply(positions=)``) are all real.
    q_lengths = lengths if q.shape[1] == k.shape[1] else jnp.full_like(lengths, q.shape[1])
    return jax.nn.dot_product_attention(q, k, v, query_seq_lengths=q_lengths,
                                        key_value_seq_lengths=lengths, implementation="cudnn")
