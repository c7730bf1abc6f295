"""The encoder's matmul-shaped pieces with hand-written gradients laid out for XLA:CPU.

Each function here is the same maths as autodiff of the plain ``plain_*`` function beside it;
only the operand layouts of the backward matmuls differ. Why it matters (measured on the 2-core
Sapphire Rapids box with jax 0.10.2; see ``benchmarks/README.md``):

- XLA:CPU hands a dot to YNNPACK only when its left operand contracts its *last* axis and
  neither operand is column-major (``xla/backends/cpu/ynn_support.cc``). Autodiff's weight,
  key and value gradients contract over tokens, the left operand's *first* axis, so XLA either
  inserts a transpose fused with element-wise work (slow) or falls back to its own loop emitter.
- YNNPACK takes bfloat16 only as ``bf16 x bf16 -> f32``: then it uses AMX (1.0-1.6 TFLOP/s on
  2 cores, against 0.29 for float32). A bf16 dot with a bf16 result, or one whose operand is a
  transpose, is silently upcast to float32 before it gets there.

So every matmul below returns float32 and takes its left operand with the contraction last:
where a gradient needs the transposed operand, ``transpose`` makes a physical copy (reshape ->
transpose -> reshape, which XLA cannot fold back into the dot), of the smaller operand. A plain
``.T`` on a dot's *result* is no better: XLA rewrites it into a dot with swapped, transposed
operands, which for bfloat16 fails at run time in jax 0.10.2 ("Unsupported element type for
DotThunk::Execute: BF16 x BF16 = F32"), so results are transposed with ``transpose`` too.

The operand a weight gradient transposes is kept a buffer of its own (``materialize``): XLA
would otherwise fuse its producer's element-wise work (a LayerNorm's affine output) into the
transpose, which XLA:CPU runs about 6x slower than a pure one.

All functions take float32 inputs and return float32; ``dtype`` is the compute dtype the
matmul operands are cast to (float32 or bfloat16). Softmax and its gradient stay float32.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

F32 = jnp.float32


def on_cpu() -> bool:
    """XLA:CPU gets the layouts of ``clozax.core.kernels``; other backends keep the plain ops."""
    return jax.default_backend() == "cpu"


def permute(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """``x.transpose(axes)`` as a physical copy with row-major layout.

    A plain transpose reaches XLA as a layout change that it folds into the consuming dot,
    which is what the functions here must avoid. Going through a unit axis and a rank change
    forces a copy.
    """
    first = next(i for i, a in enumerate(axes) if a != i)  # first axis that moves
    order = (*axes[:first], x.ndim, *axes[first:])  # the unit axis just before the moved block
    return x[..., None].transpose(order).reshape(tuple(x.shape[a] for a in axes))


def transpose(x: jax.Array) -> jax.Array:
    """Swap the last two axes, physically (``permute``). (..., m, n) -> (..., n, m)."""
    r = x.ndim
    return permute(x, (*range(r - 2), r - 1, r - 2))


def swap_seq_heads(x: jax.Array) -> jax.Array:
    """(batch, seq, heads, d) <-> (batch, heads, seq, d), physically (``permute``): a
    layout-changing transpose feeding a bf16 dot makes XLA:CPU upcast that dot to float32."""
    return permute(x, (0, 2, 1, 3))


def materialize(x: jax.Array) -> jax.Array:
    """``x`` unchanged, as a buffer of its own that XLA cannot fuse ``x``'s producer into.

    XLA duplicates cheap element-wise producers (a LayerNorm's affine output, a dtype cast)
    into every consumer, and XLA:CPU emits a transpose with element-wise work fused in as a
    plain loop, about 6x slower than a pure transpose ((4096, 256) float32: 2.4 ms vs 0.4 ms;
    the train step 4-5 % faster). ``jax.lax.optimization_barrier`` does not stop it (XLA:CPU
    expands barriers before fusion); a conditional is a fusion boundary XLA keeps, so this is
    one. Its branches are the same function (the second adds 0.0, which only turns -0.0 into
    0.0, so that XLA does not merge identical branches and drop the conditional); the
    predicate reads one element so that XLA cannot decide it at compile time.
    """
    if x.size == 0:
        return x
    pred = jnp.isfinite(x.reshape(-1)[0])
    return jax.lax.cond(pred, lambda t: t, lambda t: t + jnp.zeros((), t.dtype), x)


def _dot(a, b, dtype):
    return jnp.dot(a.astype(dtype), b.astype(dtype), preferred_element_type=F32)


# ----------------------------------------------------------------------------- dense


def plain_matmul(x, w, dtype):
    """x (..., in) @ w (in, out) in ``dtype`` with a float32 result; autodiff gradients."""
    return _dot(x, w, dtype)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul(x, w, dtype):
    """``plain_matmul`` whose gradients are two row-major matmuls and one small transpose.

    x (..., in) float32, w (in, out) float32 -> (..., out) float32.
    dx = dy @ w^T (w is the right operand, contracted on its last axis: YNNPACK takes it);
    dW = x^T @ dy, computed as the smaller of x and dy transposed times the other.
    """
    return _dot(x, w, dtype)


def _transposes_x(in_dim: int, out_dim: int) -> bool:
    """Whether ``_weight_grad`` transposes x (tokens, in) rather than dy (tokens, out)."""
    return in_dim <= out_dim


def _matmul_fwd(x, w, dtype):
    xc, wc = x.astype(dtype), w.astype(dtype)
    if _transposes_x(*w.shape):  # the backward transposes it: keep it a buffer of its own
        xc = materialize(xc)
    return jnp.dot(xc, wc, preferred_element_type=F32), (xc, wc)


def _weight_grad(x2, dy2):
    """x2^T @ dy2 for x2 (tokens, in), dy2 (tokens, out): the smaller one transposed. f32."""
    if _transposes_x(x2.shape[1], dy2.shape[1]):
        return jnp.dot(transpose(x2), dy2, preferred_element_type=F32)  # (in, out)
    return transpose(jnp.dot(transpose(dy2), x2, preferred_element_type=F32))  # (out, in)^T


def _matmul_bwd(dtype, residuals, dy):
    xc, wc = residuals
    x2 = xc.reshape(-1, xc.shape[-1])  # (tokens, in)
    dy2 = dy.astype(dtype).reshape(-1, dy.shape[-1])  # (tokens, out)
    dx = jax.lax.dot_general(dy2, wc, (((1,), (1,)), ((), ())), preferred_element_type=F32)
    return dx.reshape(xc.shape), _weight_grad(x2, dy2)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


# ----------------------------------------------------------------------------- attention


def plain_attention(q, k, v, mask, dtype):
    """Softmax attention. q, k, v: (batch, seq, heads, head_dim) float32 -> same, float32.

    mask: bool, broadcastable to (batch, heads, q, k), True where a query may see a key.
    Scores, softmax and the context are float32; matmul operands are ``dtype``.
    """
    return _attention_fwd(q, k, v, mask, dtype)[0]


@partial(jax.custom_vjp, nondiff_argnums=(4, 6))
def attention(q, k, v, mask, dtype, keep=None, rate=0.0):
    """``plain_attention`` with a backward of four row-major batched matmuls.

    Forward: S = Q K^T (K contracted on its last axis), P = softmax(S), C = P V.
    Backward: dP = dC V^T and dQ = dS K need no transpose; dV = P^T dC and dK = dS^T Q need
    one, of whichever side is smaller (``_transposes_scores``): the (q, k) P and dS (short
    rows: 128 x 128 per head at seq 128 against 128 x 64), or else dC and Q, with dV^T = dC^T P
    and dK^T = Q^T dS transposed back (long rows: at seq 1024 the scores are 8x the (q, d)
    operands; the modern-small step 11 % faster, interleaved A/B).
    dS = P (dP - rowsum(dP P)) / sqrt(head_dim), zero wherever the mask is False, as autodiff
    of ``where`` gives.

    ``keep`` (bool, broadcastable to (batch, heads, q, k)) drops the probabilities it is False
    at and scales the rest by 1 / (1 - ``rate``), BERT's attention-probability dropout:
    C = (P * D) V with D = keep / (1 - rate), so dV = (P * D)^T dC and dP = (dC V^T) * D.
    """
    return _attention_fwd(q, k, v, mask, dtype, keep, rate)[0]


def _dropped(probs, keep, rate):
    """The probabilities after attention dropout (``attention``'s P * D); P without ``keep``."""
    return probs if keep is None else jnp.where(keep, probs / (1.0 - rate), 0.0)


def _attention_fwd(q, k, v, mask, dtype, keep=None, rate=0.0):
    qh, kh, vh = (swap_seq_heads(t.astype(dtype)) for t in (q, k, v))  # (b, n, s, d)
    scores = jnp.einsum("bnqd,bnkd->bnqk", qh, kh, preferred_element_type=F32)
    scores = jnp.where(mask, scores / math.sqrt(q.shape[-1]), jnp.finfo(F32).min)
    probs = jax.nn.softmax(scores, axis=-1)  # (b, n, q, k) float32
    ctx = jnp.einsum("bnqk,bnkd->bnqd", _dropped(probs, keep, rate).astype(dtype), vh,
                     preferred_element_type=F32)
    return swap_seq_heads(ctx), (qh, kh, vh, probs, mask, keep)


def _transposes_scores(queries: int, keys: int, head_dim: int) -> bool:
    """Whether the attention backward transposes the (q, k) score-shaped operands rather than
    the (q, d) ones and the (d, k) results: whichever copies fewer elements."""
    return queries * keys <= (queries + keys) * head_dim


def _attention_bwd(dtype, rate, residuals, dctx):
    qh, kh, vh, probs, mask, keep = residuals
    dc = swap_seq_heads(dctx.astype(dtype))  # (b, n, q, d)
    dp = _dropped(jnp.einsum("bnqd,bnkd->bnqk", dc, vh, preferred_element_type=F32), keep, rate)
    ds = probs * (dp - jnp.sum(dp * probs, axis=-1, keepdims=True))
    ds = jnp.where(mask, ds / math.sqrt(qh.shape[-1]), 0.0).astype(dtype)  # (b, n, q, k)
    dq = jnp.einsum("bnqk,bnkd->bnqd", ds, kh, preferred_element_type=F32)
    used = _dropped(probs, keep, rate).astype(dtype)  # what multiplied V
    if _transposes_scores(*probs.shape[-2:], qh.shape[-1]):
        dv = jnp.einsum("bnkq,bnqd->bnkd", transpose(used), dc, preferred_element_type=F32)
        dk = jnp.einsum("bnkq,bnqd->bnkd", transpose(ds), qh, preferred_element_type=F32)
        return (*(swap_seq_heads(t) for t in (dq, dk, dv)), None, None)  # (b, s, n, d) each
    dvt = jnp.einsum("bndq,bnqk->bndk", transpose(dc), used,
                     preferred_element_type=F32)  # (b, n, d, k)
    dkt = jnp.einsum("bndq,bnqk->bndk", transpose(qh), ds, preferred_element_type=F32)
    return (swap_seq_heads(dq), *(permute(t, (0, 3, 1, 2)) for t in (dkt, dvt)), None, None)


attention.defvjp(_attention_fwd, _attention_bwd)


# ----------------------------------------------------------------------------- decoder


def plain_decode(h, word, dtype):
    """Tied decoder logits h @ word^T. h (..., hidden), word (vocab, hidden) -> (..., vocab)."""
    return jnp.einsum("...h,vh->...v", h.astype(dtype), word.astype(dtype),
                      preferred_element_type=F32)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def decode(h, word, dtype):
    """``plain_decode`` whose embedding gradient is (h^T dlogits)^T: the transposed operand is
    the (selected, hidden) block, not the (selected, vocab) logits gradient."""
    return plain_decode(h, word, dtype)


def _decode_fwd(h, word, dtype):
    hc, wc = h.astype(dtype), word.astype(dtype)
    if _transposes_x(*word.shape[::-1]):  # (hidden, vocab): the backward transposes h
        hc = materialize(hc)
    return plain_decode(hc, wc, dtype), (hc, wc)


def _decode_bwd(dtype, residuals, dlogits):
    hc, wc = residuals
    h2 = hc.reshape(-1, hc.shape[-1])  # (rows, hidden)
    dl = dlogits.astype(dtype).reshape(-1, dlogits.shape[-1])  # (rows, vocab)
    dh = jnp.dot(dl, wc, preferred_element_type=F32)  # (rows, hidden)
    dword = transpose(_weight_grad(h2, dl))  # (vocab, hidden)
    return dh.reshape(hc.shape), dword


decode.defvjp(_decode_fwd, _decode_bwd)
