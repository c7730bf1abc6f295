"""The encoder's per-token pieces: LayerNorm, dense layers, exact-erf GELU and the two MLP
variants (``model.mlp``: ``"gelu"``, BERT's ``dense -> GELU -> dense``; ``"geglu"``,
ModernBERT's ``dense -> GELU(input half) * gate half -> dense``), and the split of the fused
query/key/value projection into its three parts (``split_qkv``).

A parameter dict without a ``"bias"`` leaf (``model.bias=false``) is a bias-free layer.
Dtypes as in ``clozax.core.model``: LayerNorm statistics and GELU in float32, matmul operands
in the compute dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from clozax.core import kernels

MLPS = ("gelu", "geglu")


def layer_norm(x, p, eps):
    """LayerNorm with float32 statistics; returns float32. No shift when ``p`` has no bias."""
    x = x.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"]
    return y + p["bias"] if "bias" in p else y


def dense(x, p, dtype):
    """``x @ kernel (+ bias)`` with matmul operands in the compute dtype.

    On CPU the result is float32 (``kernels.matmul``: YNNPACK takes bf16 only as
    bf16 x bf16 -> f32, and its gradients are laid out for XLA:CPU); elsewhere it is the
    compute dtype, from ``jnp.dot``.
    """
    if kernels.on_cpu():
        y = kernels.matmul(x.astype(jnp.float32), p["kernel"], dtype)
        return y + p["bias"] if "bias" in p else y
    y = jnp.dot(x.astype(dtype), p["kernel"].astype(dtype))
    return y + p["bias"].astype(dtype) if "bias" in p else y


def gelu(x):
    # Exact erf GELU (HF "gelu"), evaluated and returned in float32; the next matmul casts.
    return jax.nn.gelu(x.astype(jnp.float32), approximate=False)


def mlp(h, intermediate, output, kind: str, dtype):
    """The block's MLP on normed inputs h (..., hidden); returns (..., hidden) float32.

    ``"gelu"``: ``intermediate`` kernel (hidden, inter). ``"geglu"``: kernel (hidden,
    2 * inter), the input half first and the gate half second (HF ModernBERT's ``mlp.Wi``,
    split with ``chunk(2)``), and ``GELU(input) * gate`` goes to ``output``.
    """
    u = dense(h, intermediate, dtype)  # (..., inter) or (..., 2 * inter)
    if kind == "geglu":
        u = geglu(u.astype(jnp.float32))  # (..., inter)
    else:
        u = gelu(u)
    return dense(u, output, dtype).astype(jnp.float32)


def plain_geglu(u):
    """``GELU(input half) * gate half`` of u (..., 2 * inter) float32 -> (..., inter)."""
    inner = u.shape[-1] // 2
    return gelu(u[..., :inner]) * u[..., inner:]


@jax.custom_vjp
def geglu(u):
    """``plain_geglu`` whose gradient is one concatenation of the two halves' gradients
    (autodiff writes each half into a zero buffer of the full width and adds the two; the
    modern-small step 1 % faster in interleaved A/B, within its noise).
    d/da GELU(a) = Phi(a) + a phi(a), exact erf as ``gelu``."""
    return plain_geglu(u)


def _geglu_fwd(u):
    return plain_geglu(u), u


def _geglu_bwd(u, dy):
    inner = u.shape[-1] // 2
    a, g = u[..., :inner], u[..., inner:]
    cdf = 0.5 * (1.0 + jax.lax.erf(a * (1.0 / math.sqrt(2.0))))
    pdf = jnp.exp(-0.5 * a * a) * (1.0 / math.sqrt(2.0 * math.pi))
    return (jnp.concatenate([dy * g * (cdf + a * pdf), dy * gelu(a)], axis=-1),)


geglu.defvjp(_geglu_fwd, _geglu_bwd)


@jax.custom_vjp
def split_qkv(qkv):
    """(batch, seq, 3, heads, head_dim) -> q, k, v, each (batch, seq, heads, head_dim).

    Its gradient stacks the three cotangents in one copy; autodiff of the three slices
    writes each into a zero buffer of the fused width and adds them (two passes over the
    (tokens, 3 * hidden) gradient per layer: the modern-small step 8 % faster without them,
    interleaved A/B at seq 1024).
    """
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


def _split_qkv_fwd(qkv):
    return split_qkv(qkv), None


def _split_qkv_bwd(_, cotangents):
    return (jnp.stack(cotangents, axis=2),)


split_qkv.defvjp(_split_qkv_fwd, _split_qkv_bwd)


def keep_mask(key, which: int, rate: float, shape: tuple[int, ...]):
    """Dropout's keep mask, bool ``shape`` (batch first), True with probability ``1 - rate``,
    drawn from ``fold_in(key, which)``. ``key`` may be one key per row (shape (batch,)): each
    row's mask is then drawn from its own key alone, the bits it would get as a batch of one
    (the draw, not the encoder, is vectorised over the rows)."""
    if key.ndim == 1:  # a key per row
        return jax.vmap(lambda k: jax.random.bernoulli(jax.random.fold_in(k, which), 1.0 - rate,
                                                       (1, *shape[1:]))[0])(key)
    return jax.random.bernoulli(jax.random.fold_in(key, which), 1.0 - rate, shape)


def dropout(y, key, which: int, rate: float):
    """Inverted dropout of ``y`` with ``keep_mask(key, which, rate, y.shape)``; ``y`` itself
    without a key (pretraining and evaluation) or at rate 0."""
    if key is None or rate == 0:
        return y
    keep = keep_mask(key, which, rate, y.shape)
    return jnp.where(keep, y / (1.0 - rate), 0.0).astype(y.dtype)
