"""CPU-layout kernels: each equals autodiff of its plain twin, and bf16 reaches YNNPACK as bf16."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clozax.core import kernels, layers, model_config
from clozax.core import model as model_lib

pytestmark = pytest.mark.fast  # make test-fast; tests marked slow stay out

BATCH, SEQ, HEADS, HEAD_DIM = 2, 16, 2, 8


def _inputs_matmul(fan_in, fan_out):
    kx, kw = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (3, 5, fan_in))  # (batch, seq, in)
    w = jax.random.normal(kw, (fan_in, fan_out))
    return (x, w), (3, 5, fan_out)


def _inputs_attention(mask, head_dim=HEAD_DIM, queries=SEQ):
    kq, kk, kv = jax.random.split(jax.random.key(4), 3)
    q = jax.random.normal(kq, (BATCH, queries, HEADS, head_dim))
    k, v = (jax.random.normal(key, (BATCH, SEQ, HEADS, head_dim)) for key in (kk, kv))
    return (q, k, v, mask), (BATCH, queries, HEADS, head_dim)


def _inputs_decode():
    kh, kw = jax.random.split(jax.random.key(5))
    return (jax.random.normal(kh, (3, 5, 32)), jax.random.normal(kw, (50, 32))), (3, 5, 50)


KEY_PADDING = (jnp.arange(SEQ)[None, :] < jnp.array([16, 9])[:, None])[:, None, None, :]
# Per-query mask with whole rows masked out (padding queries under within-segment attention).
ROWS_MASKED = jnp.zeros((BATCH, 1, SEQ, SEQ), bool).at[:, :, :8, :8].set(True)

CASES = {
    "matmul transposes x": (kernels.matmul, kernels.plain_matmul, _inputs_matmul(16, 48)),
    "matmul transposes dy": (kernels.matmul, kernels.plain_matmul, _inputs_matmul(48, 16)),
    "attention, key padding": (kernels.attention, kernels.plain_attention,
                               _inputs_attention(KEY_PADDING)),
    "attention, masked rows": (kernels.attention, kernels.plain_attention,
                               _inputs_attention(ROWS_MASKED)),
    # Rows long against head_dim (16 x 16 scores, 16 x 4 operands): the backward transposes
    # dC and Q, not P and dS; also with fewer queries than keys (the sparse last block).
    "attention, long rows": (kernels.attention, kernels.plain_attention,
                             _inputs_attention(KEY_PADDING, head_dim=4)),
    "attention, long rows, 5 queries": (kernels.attention, kernels.plain_attention,
                                        _inputs_attention(KEY_PADDING, head_dim=4, queries=5)),
    "decode": (kernels.decode, kernels.plain_decode, _inputs_decode()),
}


def test_the_attention_backward_transposes_the_smaller_side():
    assert kernels._transposes_scores(128, 128, 64)  # seq 128: P is 128 x 128, dC 128 x 64
    assert not kernels._transposes_scores(1024, 1024, 64)  # seq 1024: P is 8x dC and Q
    assert not kernels._transposes_scores(*_inputs_attention(KEY_PADDING, 4)[0][0].shape[1:2],
                                          SEQ, 4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_value_and_gradients_equal_autodiff_of_the_plain_version(case, dtype):
    """fp32: the same sums in another order (measured <= 3.4e-7 relative). bf16: the kernels
    round the incoming gradient to bf16 before each backward matmul (as torch autocast does),
    autodiff of the plain version multiplies it in float32 instead; measured <= 5.4e-3
    relative, so 1e-2 bounds one bf16 rounding."""
    fast, plain, (args, out_shape) = CASES[case]
    n_diff = 2 if fast is not kernels.attention else 3  # the mask is not differentiated
    cotangent = jax.random.normal(jax.random.key(6), out_shape)

    def pulled(f):
        def run(*diff):
            y, vjp = jax.vjp(lambda *d: f(*d, *args[n_diff:], dtype), *diff)
            return (y, *vjp(cotangent))
        return jax.jit(run)(*args[:n_diff])

    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    for a, b in zip(pulled(fast), pulled(plain), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype == jnp.float32
        scale = float(jnp.max(jnp.abs(b)))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol * scale, rtol=0)


def test_transpose_is_a_plain_swap_of_the_last_two_axes():
    x = jnp.arange(2 * 3 * 5, dtype=jnp.float32).reshape(2, 3, 5)
    np.testing.assert_array_equal(kernels.transpose(x), np.swapaxes(np.asarray(x), -1, -2))
    np.testing.assert_array_equal(kernels.transpose(x[0]), np.asarray(x[0]).T)


def test_materialize_returns_its_input_even_when_the_first_element_is_not_finite():
    x = jnp.array([[1.5, -2.0], [0.0, 3.0]])
    np.testing.assert_array_equal(jax.jit(kernels.materialize)(x), x)
    y = x.at[0, 0].set(jnp.nan)  # the other branch of the conditional
    np.testing.assert_array_equal(jax.jit(kernels.materialize)(y), y)
    z = jnp.array([1, 2], jnp.bfloat16)
    assert jax.jit(kernels.materialize)(z).dtype == jnp.bfloat16
    assert kernels.materialize(jnp.zeros((0, 3))).shape == (0, 3)


def _fused_transposes_with_arithmetic(hlo: str) -> list[str]:
    """Headers of the optimised module's computations that transpose *and* multiply."""
    computations = re.split(r"\n(?=\S)", hlo)
    return [c.splitlines()[0][:80] for c in computations
            if " transpose(" in c and " multiply(" in c]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU fusion contract")
@pytest.mark.parametrize("materialized", [True, False], ids=["kernel", "without materialize"])
def test_dense_weight_gradient_transposes_a_buffer_not_a_fused_layer_norm(materialized,
                                                                          monkeypatch):
    """The x that the dense backward transposes is a buffer of its own: XLA:CPU runs a
    transpose with the LayerNorm's affine fused in ~6x slower. Without ``materialize`` the
    detector finds that fusion, so the check can fail."""
    if not materialized:
        monkeypatch.setattr(kernels, "materialize", lambda x: x)

    def loss(x, scale, bias, w):
        return jnp.sum(kernels.matmul(x * scale + bias, w, jnp.float32))

    args = (jnp.ones((64, 32)), jnp.ones(32), jnp.ones(32), jnp.ones((32, 96)))  # in < out
    hlo = jax.jit(jax.grad(loss, argnums=(0, 3))).lower(*args).compile().as_text()
    assert bool(_fused_transposes_with_arithmetic(hlo)) is not materialized


def _dot_operand_types(hlo: str) -> list[tuple[str, str, str]]:
    """(lhs, rhs, result) element types of every dot in an optimised HLO module's text."""
    types, dots = {}, []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[", line)
        if m:
            types[m.group(1)] = m.group(2)
        d = re.match(r"\s*(?:ROOT )?%[\w.\-]+ = (\w+)\[[^=]*\bdot\(%([\w.\-]+), %([\w.\-]+)\)",
                     line)
        if d:
            dots.append((d.group(2), d.group(3), d.group(1)))
    return [(types[a], types[b], out) for a, b, out in dots]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU layout contract")
def test_bf16_train_matmuls_reach_the_cpu_library_as_bf16_with_float32_results():
    """Every matmul of the bf16 forward+backward stays bf16 x bf16 -> f32 after XLA's
    passes: a transposed operand or a bf16 result would make XLA:CPU upcast it to float32
    (5x slower on AMX) or, for a folded result transpose, fail at run time."""
    config = model_config.preset("tiny", vocab_size=64, compute_dtype="bfloat16")
    params = model_lib.init(config, jax.random.key(0))
    inputs = jax.random.randint(jax.random.key(1), (4, 16), 0, 64)
    mask = jnp.ones((4, 16), bool)
    positions = jnp.tile(jnp.arange(0, 16, 4), (4, 1))

    def loss(p):
        hidden = model_lib.apply(p, config, inputs, mask, positions=positions)
        return jnp.sum(model_lib.mlm_logits(p, config, hidden))

    compiled = jax.jit(jax.grad(loss)).lower(params).compile()
    types = _dot_operand_types(compiled.as_text())
    assert len(types) >= 20  # forward and backward matmuls of 2 layers and the head
    assert set(types) == {("bf16", "bf16", "f32")}, sorted(set(types))
    jax.block_until_ready(compiled(params))  # and it runs


def _vjp(f, args, cotangent):
    y, pull = jax.vjp(f, *args)
    return (y, *pull(cotangent))


def test_geglu_value_and_gradient_equal_autodiff_of_the_plain_version():
    """Float32 throughout: the hand-written derivative Phi(a) + a phi(a) of exact-erf GELU
    against autodiff's."""
    u = 3.0 * jax.random.normal(jax.random.key(7), (3, 5, 2 * 12))
    dy = jax.random.normal(jax.random.key(8), (3, 5, 12))
    fast = jax.jit(lambda u: _vjp(layers.geglu, (u,), dy))(u)
    plain = jax.jit(lambda u: _vjp(layers.plain_geglu, (u,), dy))(u)
    for a, b in zip(fast, plain, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0,
                                   atol=1e-6 * float(jnp.max(jnp.abs(b))))


def test_split_qkv_gradient_is_the_three_cotangents_stacked():
    qkv = jax.random.normal(jax.random.key(9), (2, 7, 3, HEADS, HEAD_DIM))
    cotangents = tuple(jax.random.normal(k, (2, 7, HEADS, HEAD_DIM))
                       for k in jax.random.split(jax.random.key(10), 3))
    fast = _vjp(layers.split_qkv, (qkv,), cotangents)
    plain = _vjp(lambda t: (t[:, :, 0], t[:, :, 1], t[:, :, 2]), (qkv,), cotangents)
    for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
