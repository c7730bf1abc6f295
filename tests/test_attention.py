"""Attention, path by path (``clozax.core.attention``): every path against the one reference,
forward and backward; what a query sees (nothing outside its document or window reaches its
output or its gradient); which path ``auto`` picks for a device, a shape and a mask; the flash
kernel's block ranges; the model on every path; and the GPU programs lowered for the ``cuda``
platform on this CPU host.

The ``cudnn`` path cannot run without an NVIDIA GPU; its part here is the lowering test (the
fused cuDNN calls are in the lowered train step, and no host callback). The ``flash`` kernels
run in Pallas's interpreter, with blocks of 16 rows so that rows of 40 tokens span three blocks
and the block ranges skip some.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clozax.core import attention, flash, kernels, model, model_config, pattern
from conftest import two_document_batch

pytestmark = pytest.mark.fast

BATCH, SEQ, HEADS, DIM = 2, 40, 2, 8
HALF = 4
RUNNABLE = ("einsum", "xla", "flash", "blocked")  # cudnn: an NVIDIA GPU only (lowered below)
CASES = {  # name: (per-document attention, window half)
    "padding only": (False, None),
    "documents": (True, None),
    "window": (False, HALF),
    "documents and window": (True, HALF),
}
NVIDIA = ("gpu", "NVIDIA H100 80GB HBM3")


@pytest.fixture(autouse=True)
def small_flash_blocks(monkeypatch):
    monkeypatch.setattr(flash, "BLOCK", 16)


def _rows():
    """Row 0: three documents, no padding; row 1: two documents, then 11 padding tokens."""
    segments = np.array([[1] * 11 + [2] * 17 + [3] * 12, [1] * 5 + [2] * 24 + [0] * 11],
                        np.int32)
    return jnp.asarray(segments > 0), jnp.asarray(segments)


def _qkv(seed, queries=SEQ, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(BATCH, queries, HEADS, DIM))
    k, v = (rng.normal(size=(BATCH, SEQ, HEADS, DIM)) for _ in range(2))
    return tuple(jnp.asarray(t, dtype) for t in (q, k, v))


def _visibility(within, queries):
    real, segments = _rows()
    vis = attention.full_rows(real, segments if within else None)
    if queries == "selected rows":
        rows = jnp.asarray([[0, 3, 11, 20, 27, 30, 39], [1, 4, 5, 17, 28, 29, 35]], jnp.int32)
        vis = attention.at_rows(vis, rows)
    return vis


# the blocked path runs local layers (a window) on full rows only
PARITY = [(path, case, queries) for path in RUNNABLE for case in CASES
          for queries in ("full rows", "selected rows")
          if path != "blocked" or (CASES[case][1] is not None and queries == "full rows")]


@pytest.mark.parametrize("path, case, queries", PARITY)
def test_every_path_gives_the_references_outputs_and_gradients(path, case, queries):
    """At every query that sees a key (a padding query may see none; its output is never
    read), outputs and the gradients of q, k and v equal the float32 reference's."""
    within, half = CASES[case]
    vis = _visibility(within, queries)
    mask = attention.dense_mask(vis, half)
    q, k, v = _qkv(0, vis.q_pos.shape[1])
    sees = np.asarray(jnp.any(mask, axis=-1))[:, 0, :, None, None]  # (batch, q, 1, 1)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=q.shape)) * sees

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * weights)

    def ours(q, k, v):
        return attention.attend(q, k, v, vis, path, half, jnp.float32, interpret=True)

    def reference(q, k, v):
        return attention.reference(q, k, v, mask)

    np.testing.assert_allclose(ours(q, k, v) * sees, reference(q, k, v) * sees,
                               rtol=1e-5, atol=1e-5)
    got = jax.grad(loss(ours), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"d{name}")


def test_flash_in_bfloat16_agrees_with_the_reference_within_bf16_rounding():
    """bf16 operands and output over 1,024 keys and two documents: within bf16 rounding of the
    float32 reference on the same (bf16-rounded) inputs. (The output's own rounding to bf16
    is about this size, so this does not tell float32 statistics from bf16 ones.)"""
    real = jnp.ones((1, 1024), bool)
    segments = jnp.asarray(np.repeat([1, 2], [700, 324])[None], jnp.int32)
    vis = attention.full_rows(real, segments)
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 1024, 1, 16)), jnp.bfloat16) for _ in range(3))
    ours = attention.attend(q, k, v, vis, "flash", None, jnp.bfloat16, interpret=True)
    want = attention.reference(q, k, v, attention.dense_mask(vis))
    np.testing.assert_allclose(ours, want, rtol=2e-2, atol=2e-2)


@functools.cache
def _jitted(path, within, half):
    """Output at query ``i`` and its gradients with respect to q, k and v, jitted once."""

    def out_at(q, k, v, real, segments, i):
        vis = attention.full_rows(real, segments if within else None)
        out = attention.attend(q, k, v, vis, path, half, jnp.float32, interpret=True)
        return jnp.sum(out[0, i] * jnp.arange(1.0, DIM + 1))

    return jax.jit(jax.value_and_grad(out_at, argnums=(0, 1, 2)))


@settings(max_examples=12, deadline=None)
@given(data=st.data())
@pytest.mark.parametrize("path", RUNNABLE)
def test_no_key_outside_a_querys_document_or_window_reaches_its_output_or_gradient(path, data):
    """Random documents, padding and query; every key the query may not see (another document,
    padding, beyond the window) replaced by noise: its output and the gradients of its q and of
    the keys it sees stay bitwise equal, and the unseen keys get exactly zero gradient. (cuDNN's
    one-sided local window, which attends to every later token, fails exactly this.)"""
    within = data.draw(st.booleans(), label="per-document attention")
    half = data.draw(st.sampled_from([None, HALF] if path != "blocked" else [HALF]),
                     label="window half")
    cuts = sorted(data.draw(st.lists(st.integers(1, SEQ - 1), max_size=4, unique=True),
                            label="document starts"))
    real_length = data.draw(st.integers(2, SEQ), label="real tokens")
    segments = np.searchsorted(np.array(cuts), np.arange(SEQ), side="right") + 1
    segments = np.where(np.arange(SEQ) < real_length, segments, 0)[None].repeat(BATCH, 0)
    real = segments > 0
    i = data.draw(st.integers(0, real_length - 1), label="query")
    sees = real[0].copy()
    if within:
        sees &= segments[0] == segments[0, i]
    if half is not None:
        sees &= np.abs(np.arange(SEQ) - i) <= half

    q, k, v = _qkv(data.draw(st.integers(0, 2**16), label="seed"))
    noise = np.random.default_rng(7).normal(size=(SEQ, HEADS, DIM)) * 100
    hide = jnp.asarray(~sees)[:, None, None]
    k2, v2 = (t.at[0].set(jnp.where(hide, noise, t[0])) for t in (k, v))
    fn = _jitted(path, within, half)
    args = (jnp.asarray(real), jnp.asarray(segments, jnp.int32), i)
    (out, (dq, dk, dv)) = fn(q, k, v, *args)
    (out2, (dq2, dk2, dv2)) = fn(q, k2, v2, *args)
    assert float(out) == float(out2)
    np.testing.assert_array_equal(dq[0, i], dq2[0, i])
    for d, d2 in ((dk, dk2), (dv, dv2)):
        np.testing.assert_array_equal(d[0][sees], d2[0][sees])
        assert not np.any(np.asarray(d2[0])[~sees])


# ----------------------------------------------------------------------------- the choice


@pytest.mark.parametrize("where, row, expected", [
    (("cpu", "cpu"), dict(within=False, half=None, seq=128, bf16=False), ("einsum", None)),
    (("cpu", "cpu"), dict(within=True, half=64, seq=1024, bf16=True), ("einsum", "blocked")),
    (("cpu", "cpu"), dict(within=True, half=64, seq=256, bf16=False), ("einsum", "einsum")),
    (("cpu", "cpu"), dict(within=True, half=64, seq=1024, bf16=False, rows=True),
     ("einsum", "einsum")),
    (NVIDIA, dict(within=False, half=None, seq=512, bf16=True), ("cudnn", None)),
    (NVIDIA, dict(within=False, half=None, seq=512, bf16=False), ("xla", None)),
    (NVIDIA, dict(within=True, half=64, seq=8192, bf16=True), ("flash", "flash")),
    (NVIDIA, dict(within=True, half=64, seq=1024, bf16=True, rows=True), ("flash", "flash")),
    (NVIDIA, dict(within=False, half=64, seq=1024, bf16=True), ("cudnn", "flash")),
    # shapes cuDNN's training kernel refuses: an odd row, a head dim not a multiple of 8
    (NVIDIA, dict(within=False, half=None, seq=33, bf16=True), ("xla", None)),
    (NVIDIA, dict(within=False, half=None, seq=512, bf16=True, head_dim=12), ("xla", None)),
    (("tpu", "TPU v5 lite"), dict(within=True, half=64, seq=8192, bf16=True),
     ("xla", "blocked")),
    (("gpu", "AMD Instinct MI300X"), dict(within=True, half=64, seq=512, bf16=True),
     ("xla", "blocked")),
])
def test_auto_picks_a_path_by_device_shape_and_mask(where, row, expected):
    plan = attention.choose("auto", platform=where[0], device_kind=where[1],
                            within_segments=row["within"], local_half=row["half"], seq=row["seq"],
                            bf16=row["bf16"], rows=row.get("rows", False),
                            head_dim=row.get("head_dim", 64))
    assert (plan.global_, plan.local) == expected
    assert plan.interpret == (where[0] == "cpu")


def test_a_named_path_is_kept_and_blocked_never_takes_selected_rows():
    for impl, local in (("einsum", "blocked"), ("xla", "blocked"), ("flash", "flash")):
        plan = attention.choose(impl, platform="cpu", device_kind="cpu", within_segments=True,
                                local_half=64, seq=1024, bf16=False)
        assert (plan.global_, plan.local) == (impl, local)
        rows = attention.choose(impl, platform="cpu", device_kind="cpu", within_segments=True,
                                local_half=64, seq=1024, bf16=False, rows=True)
        assert rows.local == impl


def test_a_local_layer_visits_only_the_key_blocks_of_its_window():
    """At 8,192 tokens with a ±64 window and 64-row blocks, every query block visits at most
    3 key blocks (O(n·w), not 128); with documents of 200 tokens and no window, at most the
    blocks their documents span (not 128); every visible pair lies inside the visited ranges."""
    n, block = 8192, 64
    pos = jnp.arange(n)[None]
    one = jnp.ones((1, n), jnp.int32)
    ranges = flash.block_ranges(pos, one, one, 64, block, block)
    assert int(jnp.max(ranges.k_hi - ranges.k_lo)) == 3
    assert int(jnp.max(ranges.q_hi - ranges.q_lo)) == 3
    docs = (jnp.arange(n)[None] // 200 + 1).astype(jnp.int32)
    ranges = flash.block_ranges(pos, docs, docs, None, block, block)
    # a block's queries lie in at most two documents: at most 64 + 2 x 199 keys, 9 blocks
    assert int(jnp.max(ranges.k_hi - ranges.k_lo)) <= 9
    seen = np.zeros((n // block, n // block), bool)  # visited (q block, k block) pairs
    for b, (lo, hi) in enumerate(zip(ranges.k_lo[0], ranges.k_hi[0], strict=True)):
        seen[b, int(lo):int(hi)] = True
    d = np.asarray(docs[0]).reshape(-1, block)
    needed = (d[:, None, :, None] == d[None, :, None, :]).any((2, 3))
    assert not (needed & ~seen).any()


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_visible_pair_lies_inside_the_block_ranges_the_kernels_visit(data):
    """Any query positions (scattered, unsorted, repeated), any segment ids (not contiguous,
    negative, past the row), any window: every (query, key) pair the kernels' rule makes
    visible is inside the key blocks its query block visits (forward, dq) and inside the query
    blocks its key block visits (dk, dv)."""
    bq, bk = data.draw(st.sampled_from([4, 8])), data.draw(st.sampled_from([4, 8]))
    nq, nk = bq * data.draw(st.integers(1, 6)), bk * data.draw(st.integers(1, 6))
    ids = st.integers(-3, nk + 3)
    q_seg = np.array(data.draw(st.lists(ids, min_size=nq, max_size=nq)))[None]
    k_seg = np.array(data.draw(st.lists(ids, min_size=nk, max_size=nk)))[None]
    q_pos = np.array(data.draw(st.lists(st.integers(0, nk - 1), min_size=nq, max_size=nq)))[None]
    half = data.draw(st.one_of(st.none(), st.integers(0, nk + 2)))
    r = flash.block_ranges(jnp.asarray(q_pos), jnp.asarray(q_seg), jnp.asarray(k_seg), half,
                           bq, bk)
    seen = q_seg[0][:, None] == k_seg[0][None, :]
    if half is not None:
        seen &= np.abs(q_pos[0][:, None] - np.arange(nk)[None, :]) <= half
    for i, j in zip(*np.nonzero(seen), strict=True):
        b, c = i // bq, j // bk
        assert r.k_lo[0, b] <= c < r.k_hi[0, b], (i, j)
        assert r.q_lo[0, c] <= b < r.q_hi[0, c], (i, j)


# ----------------------------------------------------------------------------- attention dropout


@pytest.mark.parametrize("queries, keys, dim", [(8, 8, 16), (40, 40, 8)])
def test_attention_dropout_is_the_reference_with_its_kept_probabilities_scaled(queries, keys,
                                                                               dim):
    """``kernels.attention`` with a keep mask: outputs and q, k, v gradients are autodiff's of
    softmax(QK^T / sqrt(d)) * keep / (1 - rate) @ V under the mask, on both of the backward's
    transpose layouts (8 x 8 scores against 8 x 16 operands: the scores transposed; 40 x 40
    against 40 x 8: the operands)."""
    rate = 0.25
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.normal(size=(BATCH, n, HEADS, dim)), jnp.float32)
               for n in (queries, keys, keys))
    assert kernels._transposes_scores(queries, keys, dim) == (queries == 8)
    mask = jnp.asarray(rng.random((BATCH, 1, queries, keys)) < 0.8).at[..., 0].set(True)
    keep = jnp.asarray(rng.random((BATCH, HEADS, queries, keys)) >= rate)
    weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def reference(q, k, v):
        scores = jnp.einsum("bqnd,bknd->bnqk", q, k) / np.sqrt(dim)
        probs = jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(jnp.float32).min), axis=-1)
        return jnp.einsum("bnqk,bknd->bqnd", jnp.where(keep, probs / (1 - rate), 0.0), v)

    def ours(q, k, v):
        return kernels.attention(q, k, v, mask, jnp.float32, keep, rate)

    np.testing.assert_allclose(ours(q, k, v), reference(q, k, v), rtol=1e-5, atol=1e-5)
    got, want = (jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v) * weights), (0, 1, 2))(q, k, v)
                 for f in (ours, reference))
    for name, a, b in zip("qkv", got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"d{name}")
    assert not np.allclose(ours(q, k, v), kernels.attention(q, k, v, mask, jnp.float32))


@pytest.mark.parametrize("preset", ["tiny", "modern-tiny"])
def test_attention_dropout_drops_only_with_a_key_and_draws_each_rows_as_a_batch_of_one(preset):
    """``model.attention_dropout``: nothing without a key (evaluation) or at 0; a key drops, the
    same key the same; a key per row gives each row what it gets alone; a plan that names a
    fused path (flash) computes the same, since dropout runs the einsum path whatever the plan
    (modern-tiny: local and global layers, packed documents)."""
    batch = two_document_batch(97, np.array([48, 37, 20]), 5)
    inputs, mask, segments = (jnp.asarray(batch[n]) for n in ("inputs", "mask", "segments"))
    config = model_config.preset(preset, vocab_size=97, attention_dropout=0.2)
    params = model.init(config, jax.random.key(0))

    def apply(cfg, key, rows=slice(None)):
        return np.asarray(model.apply(params, cfg, inputs[rows], mask[rows], segments[rows],
                                      dropout_key=key))

    plain = apply(model_config.preset(preset, vocab_size=97), None)
    key = jax.random.key(3)
    assert np.array_equal(apply(config, None), plain)  # no key: none
    off = model_config.preset(preset, vocab_size=97)
    assert np.array_equal(apply(off, key), plain)  # rate 0: none, key or not
    dropped = apply(config, key)
    assert np.array_equal(dropped, apply(config, key)) and not np.allclose(dropped, plain)
    assert not np.array_equal(dropped, apply(config, jax.random.key(4)))
    flash_plan = model_config.preset(preset, vocab_size=97, attention_dropout=0.2,
                                     attention="flash")
    np.testing.assert_allclose(apply(flash_plan, key), dropped, rtol=1e-5, atol=1e-5)
    keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(3))
    together = apply(config, keys)
    for r in range(3):
        np.testing.assert_allclose(together[r], apply(config, keys[r:r + 1], slice(r, r + 1))[0],
                                   rtol=1e-5, atol=1e-6)


def test_attention_dropout_outside_0_to_1_is_refused_naming_the_setting():
    for bad in (1.0, -0.1, True):
        with pytest.raises(ValueError, match=r"model.attention_dropout=.* is not in \[0, 1\)"):
            model_config.preset("tiny", attention_dropout=bad)


# ----------------------------------------------------------------------------- the model


@pytest.mark.parametrize("preset", ["tiny", "modern-tiny"])
def test_the_model_gives_the_same_hidden_states_and_gradients_on_every_path(preset):
    """The whole encoder, full rows and the sparse last block, with ``model.attention`` set to
    each path a CPU runs (flash in the interpreter): modern-tiny has packed documents and ±8
    windows on two layers of three, at 48 tokens (three 16-row flash blocks)."""
    lengths = np.array([48, 37, 20])
    batch = two_document_batch(97, lengths, 5)
    positions = jnp.asarray(batch["positions"])

    def run(impl):
        config = model_config.preset(preset, vocab_size=97, attention=impl)
        params = model.init(config, jax.random.key(0))

        def loss(p):
            full = model.apply(p, config, batch["inputs"], batch["mask"], batch["segments"])
            sparse = model.apply(p, config, batch["inputs"], batch["mask"], batch["segments"],
                                 positions=positions)
            real = jnp.asarray(batch["mask"])[:, :, None]
            return jnp.sum(jnp.sin(full) * real) + jnp.sum(jnp.cos(sparse)), (full, sparse)

        (_, outs), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return outs, grads

    (full, sparse), grads = run("einsum")
    real = np.asarray(batch["mask"])[:, :, None]
    for impl in ("flash",):  # xla against einsum: test_model.py
        (f, s), g = run(impl)
        np.testing.assert_allclose(np.asarray(f) * real, np.asarray(full) * real,
                                   rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(s, sparse, rtol=1e-4, atol=1e-4)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(grads), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)


# ----------------------------------------------------------------------------- GPU programs


def _lowered_for_cuda(monkeypatch, stdlib_data, preset, *sets) -> str:
    """The train step of ``preset`` (bf16) traced as on an NVIDIA GPU and lowered for the
    ``cuda`` platform on this CPU host: StableHLO text.

    Three things are replaced for the trace, none of them the program's maths: the device the
    attention plan is made for (``pattern.device``), the CPU-only matmul kernels
    (``kernels.on_cpu``), and JAX's cuDNN version check, which asks the CUDA libraries a CPU
    host does not have (the lowering rule itself needs none of them)."""
    from jax._src.cudnn import fused_attention_stablehlo

    from clozax.core import optim as optim_lib
    from clozax.core.train_state import TrainState
    from clozax.core.vocab import Vocabulary
    from clozax.data import open_dataset
    from clozax.data.loader import batch_rows, host_batch
    from clozax.train import config as config_lib
    from clozax.train import step as step_lib

    monkeypatch.setattr(flash, "BLOCK", 64)  # the GPU's own block, not the tests' 16
    monkeypatch.setattr(pattern, "device", lambda: NVIDIA)
    monkeypatch.setattr(kernels, "on_cpu", lambda: False)
    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda *a: None)
    ds = open_dataset(stdlib_data)
    cfg = config_lib.resolve(preset=preset, overrides=[
        'model.compute_dtype="bfloat16"', "train.batch_size=4", f"model.vocab_size="
        f"{ds.vocab_size}", *sets])
    params = jax.eval_shape(lambda: model.init(cfg.model, jax.random.key(0)))
    optimizer, schedule = optim_lib.make_optimizer(cfg.optim, 10, params)
    step = step_lib.make_train_step(cfg, Vocabulary(ds.vocab_size, ds.specials), ds.seq_len,
                                    optimizer, schedule)
    state = jax.eval_shape(lambda p: TrainState(jnp.zeros((), jnp.int32), p,
                                                optimizer.init(p)), params)
    batch = host_batch(ds.train, batch_rows(0, 0, ds.train.rows, 4))
    traced = jax.jit(step).trace(state, batch, jax.random.key(0))
    return traced.lower(lowering_platforms=("cuda",)).as_text()


def _custom_calls(text: str) -> list[str]:
    return re.findall(r"stablehlo\.custom_call @([^\(\s]+)\(", text)


def _assert_no_host_callback(text: str):
    calls = _custom_calls(text)
    assert not [c for c in calls if "callback" in c.lower()], calls
    for op in ("stablehlo.send", "stablehlo.recv", "stablehlo.infeed", "stablehlo.outfeed"):
        assert op not in text


def test_the_modern_gpu_train_step_lowers_to_the_flash_kernels_and_nothing_quadratic(
        monkeypatch, stdlib_data):
    """Packed documents and windows on a GPU: every attention of the step (forward, dq, dk/dv)
    is a Triton call of clozax's kernel, there is no host callback, and no tensor of the step
    has two axes of the row's length (no (seq, seq) scores or mask: attention memory is linear
    in the row)."""
    # hidden 48: no axis of the model (48, 96, 144, 24) is the row's 64 tokens
    text = _lowered_for_cuda(monkeypatch, stdlib_data, "modern-tiny", "model.hidden=48")
    names = re.findall(r'name = "(clozax_flash_[a-z]+)"', text)
    assert set(names) == {"clozax_flash_forward", "clozax_flash_dq", "clozax_flash_dkv"}
    assert "__gpu$xla.gpu.triton" in _custom_calls(text)
    _assert_no_host_callback(text)
    seq = 64
    shapes = re.findall(r"tensor<((?:\d+x)+)[a-z]", text)
    square = [s for s in shapes if s.split("x")[:-1].count(str(seq)) >= 2]
    assert not square, sorted(set(square))


def test_the_classic_gpu_train_step_lowers_to_cudnns_fused_attention(monkeypatch, stdlib_data):
    text = _lowered_for_cuda(monkeypatch, stdlib_data, "tiny")
    calls = set(_custom_calls(text))
    assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= calls, calls
    _assert_no_host_callback(text)
