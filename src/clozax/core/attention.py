"""Attention: which keys each query may see, and the paths that compute softmax attention.

What a query sees is data, ``Visibility``: each key's realness and document (segment) id, each
query's position and document. Key ``j`` is visible to query ``i`` when ``j`` is a real token,
when (with per-document attention) both are in one document, and on a local layer when
``|position(i) - j| <= half`` (``model.local_window = 2 * half``, HF ModernBERT's
``local_attention // 2``). ``dense_mask`` writes that rule out as a (q, k) boolean mask;
``reference`` is softmax attention under it, in float32: the one reference every path is tested
against (forward and backward, ``tests/test_attention.py``).

One function per path; every path is the same maths, so ``model.attention`` is speed-only:

- ``einsum``: batched matmuls over the dense mask with a backward laid out for XLA:CPU
  (``clozax.core.kernels``); O(n²) memory. ``auto`` on a CPU for global layers, and for local
  layers on rows shorter than 4 windows.
- ``xla``: ``jax.nn.dot_product_attention`` over the dense mask; O(n²). ``auto`` on TPUs and
  other GPUs, and for NVIDIA float32 rows without documents.
- ``cudnn``: cuDNN's fused flash kernel given per-row lengths, never a mask; O(n). ``auto`` on
  NVIDIA GPUs for bf16 rows without per-document attention whose shapes it takes
  (``cudnn_fits``; XLA's attention otherwise).
- ``flash``: clozax's Pallas kernel with segment ids and an optional window
  (``clozax.core.flash``); O(n). ``auto`` on NVIDIA GPUs for packed documents and every local
  layer.
- ``blocked``: local layers in XLA, each block of queries against its neighbouring key blocks;
  O(n·w). ``auto`` on CPUs, TPUs and other GPUs for local layers on rows of 4 windows or more.

Why these choices (unmeasured on a GPU until a device is lent; ``benchmarks/gpu_check.sh`` times
every path side by side so the next measurement can move ``choose``):

- Rows without documents: cuDNN with ``query_seq_lengths``/``key_value_seq_lengths``, measured
  1.79x HF at seq 128 on an H200 against 1.32x for ``xla`` (2026-12-04). A boolean mask would
  send cuDNN down a slower path (JAX issues #23349, #28974), so it never gets one; padding is a
  suffix of every clozax row, which lengths express exactly.
- Packed documents (ModernBERT's per-document attention): a fused kernel with segment ids. The
  candidates were JAX's Pallas ``mha`` (segment ids, but every key block visited: O(n²) work for
  a ±64 window), the TPU splash kernel (TPU only), Transformer Engine's THD layout (not
  installable here, no way to test it on a CPU) and cuDNN given a mask (435.6 µs against 169.4
  for a Pallas splash kernel at 4,096 tokens on Hopper, a public JAX benchmark). Chosen: a
  Pallas kernel of clozax's own that skips the blocks no query of a block can see, so packed
  short documents and local windows cost what they attend to. It runs in Pallas's interpreter
  on a CPU (the tests) and lowers to Triton for the ``cuda`` platform on a CPU host (tested).
- ±w local layers: the same kernel with the window, O(n·w). cuDNN's ``local_window_size`` is
  not used: without ``is_causal`` its ``(L, 0)`` window attends to every later token, forward and
  backward (an open JAX bug), and a two-sided window raises.

Axis names as in ``clozax.core.model``: q, k, v are (batch, seq, heads, head_dim); dense masks
are bool, broadcastable to (batch, heads, q, k), True where a query may see a key.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from clozax.core import flash as flash_lib
from clozax.core import kernels

# ``model.attention``: speed-only, every choice the same maths (see ``choose``).
IMPLS = ("auto", "einsum", "xla", "cudnn", "flash")
PATHS = ("einsum", "xla", "cudnn", "flash", "blocked")
DENSE = ("einsum", "xla")  # the paths that take a (q, k) mask
NVIDIA_ONLY = {"cudnn": "cuDNN's fused kernel", "flash": "clozax's Pallas (Triton) kernel"}


def cudnn_available() -> bool:
    """Whether cuDNN's fused attention (and Triton) can run here: the default backend is an
    NVIDIA GPU."""
    if jax.default_backend() != "gpu":
        return False
    return "nvidia" in jax.devices()[0].device_kind.lower()


def runs_here(impl: str) -> bool:
    """Whether ``model.attention=impl`` can run on this machine's default backend."""
    return impl not in NVIDIA_ONLY or cudnn_available()


# ----------------------------------------------------------------------------- visibility


class Visibility(NamedTuple):
    """Which keys each query may see, without a (q, k) mask.

    key_real: (batch, k) bool, True = a real token; k_seg: (batch, k) int document ids, or None
    when attention is not kept inside documents; q_pos: (batch, q) int, each query's position
    in the row; q_seg: (batch, q) int document ids (None with k_seg).
    """

    key_real: jax.Array
    k_seg: jax.Array | None
    q_pos: jax.Array
    q_seg: jax.Array | None


def full_rows(attention_mask, segments=None) -> Visibility:
    """Every position of the row a query. attention_mask (batch, seq) bool; segments
    (batch, seq) int (0 = padding), or None for no per-document restriction."""
    q_pos = jnp.broadcast_to(jnp.arange(attention_mask.shape[1], dtype=jnp.int32),
                             attention_mask.shape)
    return Visibility(attention_mask, segments, q_pos, segments)


def at_rows(vis: Visibility, rows) -> Visibility:
    """The queries at positions ``rows`` (batch, count) of a full-row ``vis``."""
    q_seg = None if vis.k_seg is None else jnp.take_along_axis(vis.k_seg, rows, axis=1)
    return vis._replace(q_pos=rows.astype(jnp.int32), q_seg=q_seg)


def dense_mask(vis: Visibility, half: int | None = None):
    """The visibility rule as a bool mask (batch, 1, q or 1, k); (batch, 1, 1, k) when only
    padding is masked."""
    mask = vis.key_real[:, None, None, :]  # (batch, 1, 1, k)
    keys = jnp.arange(vis.key_real.shape[1])
    if vis.k_seg is not None:
        same = vis.q_seg[:, :, None] == vis.k_seg[:, None, :]  # (batch, q, k)
        mask = mask & same[:, None]
    if half is not None:
        near = jnp.abs(vis.q_pos[:, :, None] - keys[None, None, :]) <= half  # (batch, q, k)
        mask = mask & near[:, None]
    return mask


# ----------------------------------------------------------------------------- paths


def reference(q, k, v, mask):
    """Softmax attention under a dense bool ``mask``, in float32: the one reference.

    q, k, v: (batch, seq, heads, head_dim). Returns float32, q's shape; a query that sees no key
    gets zeros (its row of probabilities is masked to 0)."""
    q, k, v = (t.astype(jnp.float32) for t in (q, k, v))
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(q.shape[-1])
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jnp.where(mask, jax.nn.softmax(scores, axis=-1), 0.0)  # (batch, heads, q, k)
    return jnp.einsum("bnqk,bknd->bqnd", probs, v)


def einsum(q, k, v, mask, dtype, keep=None, rate: float = 0.0):
    """``kernels.attention``: batched matmuls with a hand-written backward that XLA:CPU runs in
    YNNPACK; scores and softmax in float32. Returns float32. ``keep`` (bool (batch, heads, q,
    k)) and ``rate``: attention-probability dropout, the one path that has it."""
    q, k, v = (t.astype(jnp.float32) for t in (q, k, v))
    return kernels.attention(q, k, v, mask, dtype, keep, rate)


def xla(q, k, v, mask, dtype):
    """``jax.nn.dot_product_attention`` with the dense mask (XLA picks the kernel)."""
    q, k, v = (t.astype(dtype) for t in (q, k, v))
    return jax.nn.dot_product_attention(q, k, v, mask=mask).astype(jnp.float32)


def cudnn(q, k, v, vis: Visibility, dtype):
    """cuDNN's fused kernel given per-row lengths (never a mask): real keys must be a prefix of
    each row, which clozax's rows are. Queries at selected rows (``at_rows``) are all real."""
    if vis.k_seg is not None:
        raise ValueError("the cudnn attention path takes per-row lengths and cannot keep "
                         "attention inside documents; use 'flash'")
    q, k, v = (t.astype(dtype) for t in (q, k, v))
    lengths = jnp.sum(vis.key_real, axis=-1, dtype=jnp.int32)  # (batch,)
    q_lengths = lengths if q.shape[1] == k.shape[1] else jnp.full_like(lengths, q.shape[1])
    return jax.nn.dot_product_attention(q, k, v, query_seq_lengths=q_lengths,
                                        key_value_seq_lengths=lengths,
                                        implementation="cudnn").astype(jnp.float32)


def flash(q, k, v, vis: Visibility, half: int | None, dtype, interpret: bool | None = None):
    """``clozax.core.flash``: segment ids and the window in one Pallas kernel, O(n) memory.

    The visibility becomes segment ids: a key's id is its document (1 without documents) when
    real and -1 when not; a query's is its document (1 without documents), so each query sees
    exactly the keys ``dense_mask`` gives it. ``interpret``: run the kernels in Pallas's
    interpreter (default: on a CPU, which has no Triton). Returns float32."""
    q, k, v = (t.astype(dtype) for t in (q, k, v))
    within = vis.k_seg is not None
    k_seg = jnp.where(vis.key_real, vis.k_seg if within else 1, -1)
    q_seg = vis.q_seg if within else jnp.ones_like(vis.q_pos)
    out = flash_lib.flash_attention(q, k, v, vis.q_pos, q_seg, k_seg, half, interpret=interpret)
    return out.astype(jnp.float32)


def blocked(q, k, v, vis: Visibility, half: int, dtype):
    """Local attention in O(seq * window) with XLA ops: the same maths as a dense path under
    ``dense_mask(vis, half)``, without the (seq, seq) scores. Full rows only.

    The row is cut into blocks of ``half`` queries; block j's queries see at most keys
    ``[(j-1)*half, (j+2)*half)``, which holds every key within ``half`` of them, so scores are
    (batch, blocks, heads, half, 3 * half). Plain autodiff; scores and softmax in float32.
    Returns float32. A padding query, which may see no key at all, gets a different
    (meaningless, never read) output than on a dense path.
    """
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
    real = neighbours(vis.key_real)  # (batch, blocks, 3 * half), False off the row
    visible_ = near[None] & real[:, :, None, :]  # (batch, blocks, q, k)
    if vis.k_seg is not None:
        q_seg = padded(vis.k_seg, 0, pad, -1).reshape(batch, blocks, half)
        visible_ &= q_seg[:, :, :, None] == neighbours(vis.k_seg)[:, :, None, :]
    scores = jnp.where(visible_[:, :, None], scores / math.sqrt(head_dim),
                       jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)  # (batch, blocks, heads, q, k) float32
    ctx = jnp.einsum("bjnqk,bjknd->bjqnd", probs.astype(dtype), vb,
                     preferred_element_type=jnp.float32)
    return ctx.reshape(batch, blocks * half, heads, head_dim)[:, :seq]


def attend(q, k, v, vis: Visibility, path: str, half: int | None = None, dtype=None,
           mask=None, interpret: bool | None = None):
    """Attention by ``path`` (one of ``PATHS``) under ``vis`` and, on a local layer, the window
    ``half``. q: (batch, q, heads, head_dim); k, v: (batch, k, heads, head_dim). Returns
    float32, q's shape. ``mask`` is ``dense_mask(vis, half)`` when the caller has it already
    (dense paths only; built here otherwise). ``interpret`` (the ``flash`` path; default: on a
    CPU) runs Pallas kernels in the interpreter."""
    dtype = q.dtype if dtype is None else dtype
    if path in DENSE:
        mask = dense_mask(vis, half) if mask is None else mask
        return (einsum if path == "einsum" else xla)(q, k, v, mask, dtype)
    if path == "cudnn":
        if half is not None:
            raise ValueError("the cudnn attention path has no two-sided window; use 'flash'")
        return cudnn(q, k, v, vis, dtype)
    if path == "flash":
        return flash(q, k, v, vis, half, dtype, interpret)
    if path == "blocked":
        if half is None or q.shape[1] != k.shape[1]:
            raise ValueError("the blocked attention path runs local layers on full rows only")
        return blocked(q, k, v, vis, half, dtype)
    raise ValueError(f"attention path {path!r} is not one of {PATHS}")


# ----------------------------------------------------------------------------- choice


class Plan(NamedTuple):
    """The paths of a model's global and local layers (``local`` None without local layers),
    and whether Pallas kernels run in the interpreter (the plan is for a CPU)."""

    global_: str
    local: str | None
    interpret: bool = False

    def describe(self) -> str:
        return self.global_ if self.local is None else f"{self.global_} (global), " \
                                                       f"{self.local} (local)"

    def record(self) -> dict:
        return {"global": self.global_, "local": self.local}

    def paths(self) -> tuple[str, ...]:
        return (self.global_,) if self.local is None else (self.global_, self.local)


def cudnn_fits(head_dim: int, seq: int) -> bool:
    """Whether cuDNN's fused training kernel takes these shapes: a head dim that is a multiple
    of 8 and at most 128 (JAX's ``check_is_flash_attention``), and rows whose length is a
    multiple of 8 (it refuses an odd query count in training: 19 slots crashed an H200 run)."""
    return head_dim % 8 == 0 and head_dim <= 128 and seq % 8 == 0


def choose(impl: str, *, platform: str, device_kind: str, within_segments: bool,
           local_half: int | None, seq: int, bf16: bool, rows: bool = False,
           head_dim: int = 64) -> Plan:
    """The path of each layer kind: ``impl`` unless ``auto``, which picks by device, shape and
    mask (the table in this module's docstring; cuDNN only where ``cudnn_fits``).
    ``local_half`` is None without local layers; ``rows``: the queries are the selected
    positions only (``apply(positions=)``'s last block, which ``blocked`` cannot run). Pure:
    the tests ask what a GPU would get on a CPU."""
    nvidia = platform == "gpu" and "nvidia" in device_kind.lower()
    dense = "einsum" if platform == "cpu" else "xla"
    long_row = local_half is not None and not rows and seq >= 8 * local_half  # 4 windows
    if impl == "auto":
        if nvidia:
            unpacked = not within_segments
            fits = bf16 and cudnn_fits(head_dim, seq)
            global_ = "cudnn" if unpacked and fits else "xla" if unpacked else "flash"
            local = "flash"
        else:
            global_, local = dense, "blocked" if long_row else dense
    elif impl in DENSE:
        global_, local = impl, "blocked" if long_row else impl
    elif impl == "cudnn":
        global_, local = "cudnn", "flash"
    elif impl == "flash":
        global_ = local = "flash"
    else:
        raise ValueError(f"model.attention={impl!r} is not one of {IMPLS}")
    return Plan(global_, local if local_half is not None else None, platform == "cpu")
