"""Flash attention with segment ids and a sliding window, as Pallas kernels (Triton on NVIDIA
GPUs; Pallas's interpreter on the CPU, which is how the tests run them).

Why a kernel of clozax's own rather than ``jax.experimental.pallas.ops.gpu.attention.mha``:
that kernel takes segment ids but visits every key block of the row for every query block, so
a ±64-token local layer at 8,192 tokens still does O(n²) work, and packed short documents pay
for every other document's keys. Here each query block visits only the key blocks that can hold
a key it may see — the span of its queries' documents, cut to their windows — and each key
block only the query blocks that can see it (``block_ranges``). Work and memory are then
O(n · w) for a window w and O(Σ document²) for packed documents; no (n, n) array is ever
made (the block tables are (n / 64)² booleans).

What a query sees (the same rule as ``clozax.core.attention.reference``): key ``j`` is visible
to query ``i`` when ``q_seg[i] == k_seg[j]`` and, with a window, ``|q_pos[i] - j| <= half``.
Padding is a segment of its own (id 0 in clozax's rows, or any id no real token has), so a real
query never sees it; a query that sees no key at all gets a zero output and no gradient.

Layout: q, k, v (batch, seq, heads, head_dim) as everywhere in ``clozax.core.attention``; q may
hold fewer rows than k (the sparse last block: queries at the selected positions ``q_pos``).
Softmax statistics, the running output and every gradient accumulate in float32; matmul
operands stay in the input dtype (bfloat16 on the GPU path), at full float32 precision when the
inputs are float32. The forward saves the output and the log-sum-exp per query; the backward is
two kernels, dq over key blocks and dk/dv over query blocks (FlashAttention-2's split), after
``delta = rowsum(dO * O)`` in XLA.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

F32 = jnp.float32
LOG2E = math.log2(math.e)
BLOCK = 64  # query and key rows per block on the GPU (a power of two, at least 16 for tl.dot)
NONE_SEEN = jnp.iinfo(jnp.int32).max


class Blocks(NamedTuple):
    """Which blocks each program visits: (batch, blocks) int32 each, half-open block ranges.

    ``k_lo``/``k_hi``: the key blocks query block ``b`` visits; ``q_lo``/``q_hi``: the query
    blocks key block ``c`` visits (every query block whose key range holds ``c``)."""

    k_lo: jax.Array
    k_hi: jax.Array
    q_lo: jax.Array
    q_hi: jax.Array


def block_ranges(q_pos, q_seg, k_seg, half: int | None, block_q: int, block_k: int) -> Blocks:
    """The block ranges the kernels loop over, from the same visibility rule they mask with.

    q_pos, q_seg: (batch, nq) int, nq a multiple of ``block_q``; k_seg: (batch, nk) int, nk a
    multiple of ``block_k``. A range may be wider than needed (never narrower): segment ids are
    clipped to [-1, nk] for the first/last-key tables, which can only merge segments, and a
    query block's range spans its queries' ranges. The kernels mask every pair exactly.
    """
    batch, nk = k_seg.shape
    nq = q_seg.shape[1]
    index = jnp.arange(nk, dtype=jnp.int32)

    def table_id(seg):  # any int id -> [0, nk + 1]
        return jnp.clip(seg, -1, nk).astype(jnp.int32) + 1

    def first_last(kid):  # (nk,) -> first and last key index of each clipped id, (nk + 2,)
        first = jax.ops.segment_min(index, kid, nk + 2)  # absent ids: int max
        last = jax.ops.segment_max(index, kid, nk + 2)  # absent ids: int min
        return first, last

    first, last = jax.vmap(first_last)(table_id(k_seg))  # (batch, nk + 2)
    qid = table_id(q_seg)
    lo = jnp.take_along_axis(first, qid, axis=1)  # (batch, nq): first key the query may see
    hi = jnp.maximum(jnp.take_along_axis(last, qid, axis=1), -1) + 1  # one past the last
    if half is not None:
        lo = jnp.maximum(lo, q_pos - half)
        hi = jnp.minimum(hi, q_pos + half + 1)
    empty = lo >= hi
    lo = jnp.where(empty, NONE_SEEN, lo).astype(jnp.int32)
    hi = jnp.where(empty, 0, hi).astype(jnp.int32)

    lo_b = lo.reshape(batch, nq // block_q, block_q).min(-1)
    hi_b = hi.reshape(batch, nq // block_q, block_q).max(-1)
    none = lo_b >= hi_b
    k_lo = jnp.where(none, 0, lo_b // block_k)
    k_hi = jnp.where(none, 0, -(-hi_b // block_k))  # (batch, q blocks)

    blocks_k = jnp.arange(nk // block_k)
    hits = (k_lo[:, :, None] <= blocks_k) & (blocks_k < k_hi[:, :, None])  # (b, qb, kb)
    any_hit = hits.any(1)
    q_lo = jnp.where(any_hit, jnp.argmax(hits, axis=1), 0)
    q_hi = jnp.where(any_hit, hits.shape[1] - jnp.argmax(hits[:, ::-1], axis=1), 0)
    return Blocks(k_lo.astype(jnp.int32), k_hi.astype(jnp.int32), q_lo.astype(jnp.int32),
                  q_hi.astype(jnp.int32))


# ----------------------------------------------------------------------------- kernels


def _visible(q_pos, q_seg, k_start, k_seg, half, block_k):
    """(block_q, block_k) bool: the visibility rule for one tile."""
    seen = q_seg[:, None] == k_seg[None, :]
    if half is not None:
        k_pos = k_start + jnp.arange(block_k)
        seen &= jnp.abs(q_pos[:, None] - k_pos[None, :]) <= half
    return seen


def _dot(a, b, *, trans_a=False, trans_b=False):
    """A tile matmul with a float32 result; float32 operands at full precision (no TF32)."""
    precision = lax.Precision.HIGHEST if a.dtype == F32 else None
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=precision)


def _forward_kernel(k_lo_ref, k_hi_ref, q_pos_ref, q_seg_ref, k_seg_ref, q_ref, k_ref, v_ref,
                    o_ref, lse_ref, *, scale, half, block_k):
    q = q_ref[...]  # (block_q, d)
    q_pos, q_seg = q_pos_ref[...], q_seg_ref[...]  # (block_q,)
    block_q, head_dim = q.shape

    def body(j, carry):  # one key block: the online softmax update (log2 domain)
        acc, m, l = carry
        keys = pl.ds(j * block_k, block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]  # (block_k, d)
        seen = _visible(q_pos, q_seg, j * block_k, k_seg_ref[keys], half, block_k)
        s = jnp.where(seen, _dot(q, k, trans_b=True) * (scale * LOG2E), -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no (-inf) - (-inf)
        p = jnp.exp2(s - m_safe[:, None])  # (block_q, block_k) float32, 0 where unseen
        correction = jnp.exp2(m - m_safe)
        l = l * correction + p.sum(axis=1)
        acc = acc * correction[:, None] + _dot(p.astype(v.dtype), v)
        return acc, m_new, l

    start = (jnp.zeros((block_q, head_dim), F32), jnp.full((block_q,), -jnp.inf, F32),
             jnp.zeros((block_q,), F32))
    acc, m, l = lax.fori_loop(k_lo_ref[...], k_hi_ref[...], body, start)
    seen_any = l > 0
    l_safe = jnp.where(seen_any, l, 1.0)
    o_ref[...] = jnp.where(seen_any[:, None], acc / l_safe[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen_any, m + jnp.log2(l_safe), jnp.inf)  # log2 domain


def _dq_kernel(k_lo_ref, k_hi_ref, q_pos_ref, q_seg_ref, k_seg_ref, q_ref, k_ref, v_ref, do_ref,
               lse_ref, delta_ref, dq_ref, *, scale, half, block_k):
    q, do = q_ref[...], do_ref[...]  # (block_q, d)
    q_pos, q_seg = q_pos_ref[...], q_seg_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]  # (block_q,) float32

    def body(j, dq):
        keys = pl.ds(j * block_k, block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        seen = _visible(q_pos, q_seg, j * block_k, k_seg_ref[keys], half, block_k)
        s = _dot(q, k, trans_b=True) * (scale * LOG2E)
        p = jnp.where(seen, jnp.exp2(s - lse[:, None]), 0.0)
        ds = p * (_dot(do, v, trans_b=True) - delta[:, None])  # (block_q, block_k)
        return dq + _dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(k_lo_ref[...], k_hi_ref[...], body, jnp.zeros(q.shape, F32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_lo_ref, q_hi_ref, q_pos_ref, q_seg_ref, k_seg_ref, q_ref, k_ref, v_ref, do_ref,
                lse_ref, delta_ref, dk_ref, dv_ref, *, scale, half, block_q):
    k, v = k_ref[...], v_ref[...]  # (block_k, d)
    k_seg = k_seg_ref[...]
    block_k = k.shape[0]
    k_start = pl.program_id(0) * block_k

    def body(i, carry):
        dk, dv = carry
        rows = pl.ds(i * block_q, block_q)
        q, do = q_ref[rows, :], do_ref[rows, :]  # (block_q, d)
        lse, delta = lse_ref[rows], delta_ref[rows]
        seen = _visible(q_pos_ref[rows], q_seg_ref[rows], k_start, k_seg, half, block_k)
        s = _dot(q, k, trans_b=True) * (scale * LOG2E)
        p = jnp.where(seen, jnp.exp2(s - lse[:, None]), 0.0)  # (block_q, block_k)
        dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
        ds = p * (_dot(do, v, trans_b=True) - delta[:, None])
        dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True)
        return dk, dv

    zeros = jnp.zeros(k.shape, F32)
    dk, dv = lax.fori_loop(q_lo_ref[...], q_hi_ref[...], body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------- calls


def _specs():
    """BlockSpec builders for a grid (blocks, batch, heads): blocks vary fastest, so programs
    that run together share one (batch, head)'s keys and values in L2."""

    def per_block(block, head_dim=None):  # (batch, n, heads, d) or (batch, n) or (batch, heads, n)
        if head_dim is not None:
            return pl.BlockSpec((None, block, None, head_dim), lambda i, b, h: (b, i, h, 0))
        return pl.BlockSpec((None, block), lambda i, b, h: (b, i))

    def whole(n, head_dim=None):
        if head_dim is not None:
            return pl.BlockSpec((None, n, None, head_dim), lambda i, b, h: (b, 0, h, 0))
        return pl.BlockSpec((None, n), lambda i, b, h: (b, 0))

    scalar = pl.BlockSpec((None, None), lambda i, b, h: (b, i))
    return per_block, whole, scalar


def _stat_spec(block):  # (batch, heads, n) float32 per-query statistics
    return pl.BlockSpec((None, None, block), lambda i, b, h: (b, h, i))


def _stat_whole(n):
    return pl.BlockSpec((None, None, n), lambda i, b, h: (b, h, 0))


class _Static(NamedTuple):
    scale: float
    half: int | None
    block_q: int
    block_k: int
    interpret: bool
    num_warps: int


def _params(static: _Static):
    if static.interpret:
        return {"interpret": True}
    return {"compiler_params": plgpu.CompilerParams(num_warps=static.num_warps, num_stages=2)}


def _forward(static, q, k, v, q_pos, q_seg, k_seg, blocks):
    batch, nq, heads, d = q.shape
    nk = k.shape[1]
    per_block, whole, scalar = _specs()
    kernel = functools.partial(_forward_kernel, scale=static.scale, half=static.half,
                               block_k=static.block_k)
    o, lse = pl.pallas_call(
        kernel,
        grid=(nq // static.block_q, batch, heads),
        in_specs=[scalar, scalar, per_block(static.block_q), per_block(static.block_q),
                  whole(nk), per_block(static.block_q, d), whole(nk, d), whole(nk, d)],
        out_specs=[per_block(static.block_q, d), _stat_spec(static.block_q)],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((batch, heads, nq), F32)],
        name="clozax_flash_forward",
        **_params(static),
    )(blocks.k_lo, blocks.k_hi, q_pos, q_seg, k_seg, q, k, v)
    return o, lse


def _backward(static, q, k, v, q_pos, q_seg, k_seg, blocks, o, lse, do):
    batch, nq, heads, d = q.shape
    nk = k.shape[1]
    per_block, whole, scalar = _specs()
    delta = jnp.einsum("bqhd,bqhd->bhq", o.astype(F32), do.astype(F32))  # (batch, heads, nq)
    do = do.astype(q.dtype)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=static.scale, half=static.half,
                          block_k=static.block_k),
        grid=(nq // static.block_q, batch, heads),
        in_specs=[scalar, scalar, per_block(static.block_q), per_block(static.block_q),
                  whole(nk), per_block(static.block_q, d), whole(nk, d), whole(nk, d),
                  per_block(static.block_q, d), _stat_spec(static.block_q),
                  _stat_spec(static.block_q)],
        out_specs=per_block(static.block_q, d),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="clozax_flash_dq",
        **_params(static),
    )(blocks.k_lo, blocks.k_hi, q_pos, q_seg, k_seg, q, k, v, do, lse, delta)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=static.scale, half=static.half,
                          block_q=static.block_q),
        grid=(nk // static.block_k, batch, heads),
        in_specs=[scalar, scalar, whole(nq), whole(nq), per_block(static.block_k),
                  whole(nq, d), per_block(static.block_k, d), per_block(static.block_k, d),
                  whole(nq, d), _stat_whole(nq), _stat_whole(nq)],
        out_specs=[per_block(static.block_k, d), per_block(static.block_k, d)],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                   jax.ShapeDtypeStruct(v.shape, v.dtype)],
        name="clozax_flash_dkv",
        **_params(static),
    )(blocks.q_lo, blocks.q_hi, q_pos, q_seg, k_seg, q, k, v, do, lse, delta)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(static, q, k, v, q_pos, q_seg, k_seg, blocks):
    return _forward(static, q, k, v, q_pos, q_seg, k_seg, blocks)[0]


def _flash_fwd(static, q, k, v, q_pos, q_seg, k_seg, blocks):
    o, lse = _forward(static, q, k, v, q_pos, q_seg, k_seg, blocks)
    return o, (q, k, v, q_pos, q_seg, k_seg, blocks, o, lse)


def _flash_bwd(static, residuals, do):
    q, k, v, q_pos, q_seg, k_seg, blocks, o, lse = residuals
    dq, dk, dv = _backward(static, q, k, v, q_pos, q_seg, k_seg, blocks, o, lse, do)
    return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def flash_attention(q, k, v, q_pos, q_seg, k_seg, half: int | None = None, *,
                    block: int | None = None, interpret: bool | None = None):
    """Softmax attention where query ``i`` sees key ``j`` iff ``q_seg[i] == k_seg[j]`` and
    (with ``half``) ``|q_pos[i] - j| <= half``.

    q: (batch, nq, heads, head_dim); k, v: (batch, nk, heads, head_dim), same dtype;
    q_pos, q_seg: (batch, nq) int; k_seg: (batch, nk) int. Returns (batch, nq, heads, head_dim)
    in q's dtype; a query that sees no key gets zeros. ``block`` (default ``BLOCK``): query and
    key rows per program. ``interpret`` (default: on a CPU) runs the kernels in Pallas's
    interpreter. Rows are padded to whole blocks (padded queries and
    keys get segment ids -2 and -1, which clozax's rows never use, and are dropped again), the
    head dimension to a power of two (zeros: scores and outputs unchanged). float32 inputs with
    a head dim over 64 take 32-row blocks: the dk/dv kernel's tiles would otherwise fill the
    GPU's shared memory.
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if block is None:
        block = BLOCK // 2 if q.dtype == F32 and q.shape[-1] > 64 else BLOCK
    batch, nq, heads, head_dim = q.shape
    nk = k.shape[1]
    block_q = min(block, max(16, _power_of_two(nq)))
    block_k = min(block, max(16, _power_of_two(nk)))
    d = max(16, _power_of_two(head_dim))
    pad_q, pad_k = -nq % block_q, -nk % block_k

    def pad_rows(t, n, value):
        widths = [(0, 0)] * t.ndim
        widths[1] = (0, n)
        if t.ndim == 4:
            widths[3] = (0, d - head_dim)
        return jnp.pad(t, widths, constant_values=value)

    q_pos = pad_rows(jnp.asarray(q_pos, jnp.int32), pad_q, 0)
    q_seg = pad_rows(jnp.asarray(q_seg, jnp.int32), pad_q, -2)  # sees no key, not even -1s
    k_seg = pad_rows(jnp.asarray(k_seg, jnp.int32), pad_k, -1)
    q, k, v = pad_rows(q, pad_q, 0), pad_rows(k, pad_k, 0), pad_rows(v, pad_k, 0)
    blocks = block_ranges(q_pos, q_seg, k_seg, half, block_q, block_k)  # ints: no gradient
    static = _Static(1.0 / math.sqrt(head_dim), half, block_q, block_k, bool(interpret),
                     4 if d <= 64 else 8)
    out = _flash(static, q, k, v, q_pos, q_seg, k_seg, blocks)
    return out[:, :nq, :, :head_dim]
