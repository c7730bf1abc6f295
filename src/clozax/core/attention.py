"""Attention: which keys each query may see, and how softmax attention is computed.

Axis names as in ``clozax.core.model``: q, k, v are (batch, seq, heads, head_dim); masks are
bool, broadcastable to (batch, heads, q, k), True where a query may see a key.
"""

from __future__ import annotations

import math

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


def blocked_local_attend(q, k, v, attention_mask, segments, half: int, dtype=None):
    """Sliding-window attention in O(seq * window): the same maths as ``attend`` with the mask
    ``visible(...) & window(seq, half)``, without the (seq, seq) scores.

    q, k, v: (batch, seq, heads, head_dim); attention_mask (batch, seq) bool; segments (batch,
    seq) int or None (None: no per-document restriction). The row is cut into blocks of
    ``half`` queries; block j's queries see at most keys ``[(j-1)*half, (j+2)*half)``, which
    holds every key within ``half`` of them, so scores are (batch, blocks, heads, half,
    3 * half). Plain autodiff; scores and softmax in float32. Returns float32, q's shape.
    Real queries always see themselves; a padding query, which may see no key at all, gets
    a different (meaningless, never read) output than on the full path.
    """
    dtype = q.dtype if dtype is None else dtype
    batch, seq, heads, head_dim = q.shape
    blocks = -(-seq // half)
    pad = blocks * half - seq

    def padded(t, left, right, value):
        widths = [(0, 0)] * t.ndim
        widths[1] = (left, right)
        return jnp.pad(t, widths, constant_values=value)

    def neighbours(t):  # (batch, seq, ...) -> (batch, blocks, 3 * half, ...)
        t = padded(t, half, pad + half, 0).reshape(batch, blocks + 2, half, *t.shape[2:])
        return jnp.concatenate([t[:, :-2], t[:, 1:-1], t[:, 2:]], axis=2)

    qb = padded(q.astype(dtype), 0, pad, 0).reshape(batch, blocks, half, heads, head_dim)
    kb, vb = neighbours(k.astype(dtype)), neighbours(v.astype(dtype))  # (b, j, 3h, n, d)
    scores = jnp.einsum("bjqnd,bjknd->bjnqk", qb, kb, preferred_element_type=jnp.float32)
    # Which (query, key) pairs are visible: distance, real key, same document.
    q_index = jnp.arange(blocks * half).reshape(blocks, half)  # (blocks, half)
    k_index = (q_index[:, :1] - half) + jnp.arange(3 * half)  # (blocks, 3 * half)
    near = jnp.abs(q_index[:, :, None] - k_index[:, None, :]) <= half  # (blocks, q, k)
    real = neighbours(attention_mask)  # (batch, blocks, 3 * half), False off the row
    visible_ = near[None] & real[:, :, None, :]  # (batch, blocks, q, k)
    if segments is not None:
        q_seg = padded(segments, 0, pad, -1).reshape(batch, blocks, half)
        visible_ &= q_seg[:, :, :, None] == neighbours(segments)[:, :, None, :]
    scores = jnp.where(visible_[:, :, None], scores / math.sqrt(head_dim),
                       jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)  # (batch, blocks, heads, q, k) float32
    ctx = jnp.einsum("bjnqk,bjknd->bjqnd", probs.astype(dtype), vb,
                     preferred_element_type=jnp.float32)
    return ctx.reshape(batch, blocks * half, heads, head_dim)[:, :seq]
