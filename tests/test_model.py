"""Encoder specs: shapes, dtypes, masking isolation, LayerNorm orderings, bf16, decay mask, size."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clozax.core import attention, model, model_config
from conftest import assert_sparse_block_matches_full, two_document_batch

pytestmark = pytest.mark.fast  # make test-fast; tests marked slow stay out

VOCAB = 97
BATCH, SEQ, COUNT = 3, 16, 4
LENGTHS = np.array([16, 11, 5])  # right-padded real lengths per sequence


def _config(**overrides) -> model_config.ModelConfig:
    return model_config.preset("tiny", vocab_size=VOCAB, **overrides)


def _forward(config):
    """Jitted (params, inputs, mask, segments, positions) -> (hidden, logits)."""

    def run(params, inputs, mask, segments, positions):
        hidden = model.apply(params, config, inputs, mask, segments)
        return hidden, model.mlm_logits(params, config, model.gather(hidden, positions))

    return jax.jit(run)


@pytest.fixture(scope="module")
def batch():
    return two_document_batch(VOCAB, LENGTHS, COUNT)


# One compiled forward per configuration, shared by every test in the module.
CONFIGS = {
    "pre": _config(),
    "post": _config(layer_norm="post"),
    "pre_segments": _config(attention_within_segments=True),
    "post_segments": _config(layer_norm="post", attention_within_segments=True),
    "pre_bf16": _config(compute_dtype="bfloat16"),
    "post_bf16": _config(layer_norm="post", compute_dtype="bfloat16"),
}


@pytest.fixture(scope="module")
def forward():
    return {name: _forward(config) for name, config in CONFIGS.items()}


@pytest.fixture(scope="module")
def params():
    return {ln: model.init(CONFIGS[ln], jax.random.key(0)) for ln in ("pre", "post")}


def _run(forward, params, name, batch, **changes):
    b = {**batch, **changes}
    ln = "post" if name.startswith("post") else "pre"
    hidden, logits = forward[name](
        params[ln], b["inputs"], b["mask"], b["segments"], b["positions"]
    )
    return np.asarray(hidden), np.asarray(logits)


def test_hidden_and_logit_shapes_and_dtypes(forward, params, batch):
    for name in ("pre", "post", "pre_bf16"):
        hidden, logits = _run(forward, params, name, batch)
        assert hidden.shape == (BATCH, SEQ, 32) and hidden.dtype == np.float32
        assert logits.shape == (BATCH, COUNT, VOCAB) and logits.dtype == np.float32


def test_params_are_float32_and_layers_are_stacked(params):
    p = params["pre"]
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(p))
    assert p["layers"]["attention"]["query"]["kernel"].shape == (2, 32, 32)
    assert p["layers"]["intermediate"]["kernel"].shape == (2, 32, 64)
    assert p["layers"]["output"]["kernel"].shape == (2, 64, 32)
    assert "final_norm" in p and "final_norm" not in params["post"]


def test_init_is_deterministic_per_key_and_differs_across_keys():
    config = CONFIGS["pre"]
    a, b = model.init(config, jax.random.key(7)), model.init(config, jax.random.key(7))
    c = model.init(config, jax.random.key(8))
    jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)
    assert not np.array_equal(a["embeddings"]["word"], c["embeddings"]["word"])
    assert not np.array_equal(
        a["layers"]["attention"]["key"]["kernel"], c["layers"]["attention"]["key"]["kernel"]
    )


def test_init_uses_a_distinct_draw_for_each_tensor(params):
    att = params["pre"]["layers"]["attention"]
    assert not np.array_equal(att["query"]["kernel"], att["key"]["kernel"])
    std = float(np.std(params["pre"]["embeddings"]["word"]))
    assert 0.015 < std < 0.025  # init_std 0.02
    assert not np.any(params["pre"]["layers"]["intermediate"]["bias"])
    assert np.all(params["pre"]["layers"]["mlp_norm"]["scale"] == 1.0)


@pytest.mark.parametrize("name", ["pre", "post", "pre_segments", "post_segments", "pre_bf16"])
def test_padding_never_influences_real_tokens(forward, params, batch, name):
    hidden, logits = _run(forward, params, name, batch)
    noisy = np.where(batch["mask"], batch["inputs"], (batch["inputs"] * 7 + 3) % VOCAB)
    assert not np.array_equal(noisy, batch["inputs"])
    hidden2, logits2 = _run(forward, params, name, batch, inputs=noisy)
    real = batch["mask"]
    np.testing.assert_array_equal(hidden[real], hidden2[real])  # bit-identical
    np.testing.assert_array_equal(logits, logits2)  # selected positions are all real


def _change_document_one(batch):
    doc1 = batch["segments"] == 1
    return np.where(doc1, (batch["inputs"] + 1) % VOCAB, batch["inputs"]), doc1


@pytest.mark.parametrize("name", ["pre_segments", "post_segments"])
def test_segments_isolate_packed_documents_when_enabled(forward, params, batch, name):
    changed, doc1 = _change_document_one(batch)
    hidden, _ = _run(forward, params, name, batch)
    hidden2, _ = _run(forward, params, name, batch, inputs=changed)
    doc2 = batch["segments"] == 2
    np.testing.assert_array_equal(hidden[doc2], hidden2[doc2])
    assert not np.array_equal(hidden[doc1], hidden2[doc1])


def test_scan_unroll_is_speed_only(params, batch):
    config, p = CONFIGS["post"], params["post"]
    args = (batch["inputs"], batch["mask"])
    rolled = jax.jit(lambda p, i, m: model.apply(p, config, i, m, unroll=1))(p, *args)
    unrolled = jax.jit(lambda p, i, m: model.apply(p, config, i, m))(p, *args)  # default: True
    # Not bitwise: XLA fuses an unrolled stack differently (measured max diff 2.4e-7).
    np.testing.assert_allclose(unrolled, rolled, rtol=1e-5, atol=1e-5)


def test_segments_are_ignored_when_disabled(forward, params, batch):
    changed, _ = _change_document_one(batch)
    hidden, _ = _run(forward, params, "pre", batch)
    hidden2, _ = _run(forward, params, "pre", batch, inputs=changed)
    doc2 = batch["segments"] == 2
    assert not np.array_equal(hidden[doc2], hidden2[doc2])


def test_pre_and_post_layer_norm_differ_and_are_finite(forward, batch):
    # A larger init so the residual branches are not swamped by the embeddings; at
    # init_std=0.02 the two orderings agree to ~1e-3 because every block is near-identity.
    key = jax.random.key(3)
    pre = model.init(_config(init_std=0.2), key)
    post = model.init(_config(layer_norm="post", init_std=0.2), key)
    # Same draws: the orderings share every tensor except the pre-LN final norm.
    np.testing.assert_array_equal(pre["embeddings"]["word"], post["embeddings"]["word"])
    args = (batch["inputs"], batch["mask"], batch["segments"], batch["positions"])
    h_pre, l_pre = forward["pre"](pre, *args)
    h_post, l_post = forward["post"](post, *args)
    for x in (h_pre, l_pre, h_post, l_post):
        assert np.all(np.isfinite(x))
    real = batch["mask"]
    assert np.max(np.abs(np.asarray(h_pre)[real] - np.asarray(h_post)[real])) > 0.1


# bf16 has an 8-bit significand (eps 2**-8 = 0.0039). At the default init (tiny preset, seeds
# 0-4, padded batches) the measured worst-case |logit_bf16 - logit_fp32| is 0.40-0.49% of
# max |logit_fp32|, pre and post alike, i.e. about one bf16 rounding of the logit scale. The
# bound is 4 bf16 epsilons (1.6%), about 3x the worst measurement.
BF16_RELATIVE_BOUND = 4 * 2.0**-8


@pytest.mark.parametrize("ln", ["pre", "post"])
def test_bf16_compute_gives_finite_float32_logits_close_to_fp32(forward, params, batch, ln):
    _, l32 = _run(forward, params, ln, batch)
    _, l16 = _run(forward, params, f"{ln}_bf16", batch)
    assert l16.dtype == np.float32 and np.all(np.isfinite(l16))
    error = np.max(np.abs(l16 - l32)) / np.max(np.abs(l32))
    assert error < BF16_RELATIVE_BOUND, error
    assert error > 0  # bf16 really was used


def test_logits_use_the_tied_word_embeddings(params, batch):
    config = CONFIGS["pre"]
    hidden_sel = jnp.ones((1, 1, 32))
    p = params["pre"]
    bumped = jax.tree_util.tree_map(lambda x: x, p)
    # Not a constant bump: LayerNorm output has zero mean, so a constant would cancel.
    bump = jnp.linspace(-1.0, 1.0, 32)
    bumped["embeddings"]["word"] = p["embeddings"]["word"].at[5].add(bump)
    a = model.mlm_logits(p, config, hidden_sel)
    b = model.mlm_logits(bumped, config, hidden_sel)
    changed = np.nonzero(np.asarray(a != b))[-1]
    np.testing.assert_array_equal(np.unique(changed), [5])


def test_gather_takes_hidden_states_at_positions():
    hidden = jnp.arange(2 * 5 * 3, dtype=jnp.float32).reshape(2, 5, 3)
    positions = jnp.array([[4, 0], [2, 2]])
    out = model.gather(hidden, positions)
    assert out.shape == (2, 2, 3)
    np.testing.assert_array_equal(out[0, 0], hidden[0, 4])
    np.testing.assert_array_equal(out[1, 1], hidden[1, 2])


def test_decay_mask_is_true_exactly_for_dense_kernels(params):
    mask = model.decay_mask(params["pre"])
    flat = jax.tree_util.tree_flatten_with_path(mask)[0]
    decayed = sorted(jax.tree_util.keystr(path) for path, flag in flat if flag)
    assert decayed == sorted(
        [
            "['head']['transform']['kernel']",
            "['layers']['attention']['key']['kernel']",
            "['layers']['attention']['output']['kernel']",
            "['layers']['attention']['query']['kernel']",
            "['layers']['attention']['value']['kernel']",
            "['layers']['intermediate']['kernel']",
            "['layers']['output']['kernel']",
        ]
    )
    assert jax.tree_util.tree_structure(mask) == jax.tree_util.tree_structure(params["pre"])


def test_base_preset_matches_bert_base_parameter_count():
    config = model_config.preset("base", vocab_size=30522, layer_norm="post")
    shapes = jax.eval_shape(lambda: model.init(config, jax.random.key(0)))
    count = model.param_count(shapes)
    # HF BertForMaskedLM(bert-base-uncased) has 109,514,298 parameters (no pooler);
    # clozax has no token-type embeddings (2 x 768 = 1,536 fewer).
    assert count == 109_514_298 - 2 * 768
    assert abs(count - 109.5e6) / 109.5e6 < 0.01
    pre = model_config.preset("base", vocab_size=30522)
    pre_count = model.param_count(jax.eval_shape(lambda: model.init(pre, jax.random.key(0))))
    assert pre_count == count + 2 * 768  # the final encoder LayerNorm


def test_presets_have_the_documented_shapes():
    assert model_config.preset("small") == model_config.ModelConfig()
    base = model_config.preset("base")
    assert (base.hidden, base.layers, base.heads, base.intermediate) == (768, 12, 12, 3072)
    assert model_config.preset("tiny", heads=4).head_dim == 8


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"heads": 3}, "model.heads=3 does not divide model.hidden=32"),
        ({"hidden": 0}, "model.hidden=0"),
        ({"layers": -1}, "model.layers=-1"),
        ({"intermediate": 2.5}, "model.intermediate=2.5"),
        ({"layer_norm": "sandwich"}, "model.layer_norm='sandwich'"),
        ({"compute_dtype": "float16"}, "model.compute_dtype='float16'"),
        ({"attention_within_segments": "yes"}, "model.attention_within_segments='yes'"),
        ({"layer_norm_eps": 0.0}, "model.layer_norm_eps=0.0"),
        ({"init_std": float("nan")}, "model.init_std=nan"),
        ({"dropout": 1.0}, "model.dropout=1.0 is not in [0, 1)"),
    ],
)
def test_invalid_config_raises_value_error_naming_the_value(overrides, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        _config(**overrides)


def test_unknown_preset_or_key_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown model preset 'huge'.*'base', 'modern-base', "
                       r"'modern-small', 'modern-tiny', 'small', 'tiny'"):
        model_config.preset("huge")
    with pytest.raises(ValueError, match=r"unknown model config key\(s\) \['hiden'\]"):
        model_config.preset("tiny", hiden=64)


def test_apply_rejects_bad_inputs_before_tracing(params, batch):
    config, p = CONFIGS["pre"], params["pre"]
    with pytest.raises(ValueError, match="exceeds model.max_positions=128"):
        model.apply(p, config, np.zeros((1, 129), np.int32), np.ones((1, 129), bool))
    with pytest.raises(ValueError, match="attention_mask shape"):
        model.apply(p, config, batch["inputs"], batch["mask"][:, :-1])
    with pytest.raises(ValueError, match="additive float mask"):
        model.apply(p, config, batch["inputs"], batch["mask"].astype(np.float32))
    with pytest.raises(ValueError, match="no segments were given"):
        model.apply(p, CONFIGS["pre_segments"], batch["inputs"], batch["mask"])


@pytest.mark.parametrize("within_segments", [False, True])
def test_head_major_attention_matches_dot_product_attention(batch, within_segments):
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(BATCH, SEQ, 2, 8)), jnp.float32) for _ in range(3))
    vis = attention.full_rows(jnp.asarray(batch["mask"]),
                              jnp.asarray(batch["segments"]) if within_segments else None)
    mask = attention.dense_mask(vis)
    ours = attention.einsum(q, k, v, mask, jnp.float32)
    reference = jax.nn.dot_product_attention(q, k, v, mask=mask)
    assert ours.shape == reference.shape == (BATCH, SEQ, 2, 8)
    np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["pre", "post_segments", "pre_bf16"])
def test_apply_at_positions_equals_the_gathered_full_apply(params, batch, name):
    """The sparse last block (queries, attention output and MLP only at the selected
    positions) gives the gathered hidden states and their parameter gradients."""
    config = CONFIGS[name]
    params = params["post" if name.startswith("post") else "pre"]
    tol = 1e-5 if config.compute_dtype == "float32" else 2e-2
    b = assert_sparse_block_matches_full(params, config, batch, tol)
    assert b.shape == (BATCH, COUNT, config.hidden) and b.dtype == jnp.float32


def test_apply_at_positions_rejects_misshaped_positions(params, batch):
    with pytest.raises(ValueError, match="pass \\(batch, count\\) int positions"):
        model.apply(params["pre"], CONFIGS["pre"], batch["inputs"], batch["mask"],
                    positions=batch["positions"][0])


@pytest.mark.parametrize("overrides, message", [
    ({"attention": "splash"}, r"model.attention='splash' is not one of \('auto', 'einsum', "
                              r"'xla', 'cudnn', 'flash'\)"),
    ({"attention": "cudnn", "compute_dtype": "bfloat16", "attention_within_segments": True},
     r"cannot keep attention inside packed documents"),
    ({"attention": "cudnn"}, r"needs model.compute_dtype='bfloat16'"),
])
def test_attention_choice_is_validated_with_the_fix_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        model_config.preset("tiny", **overrides)


def test_every_cpu_attention_choice_gives_the_same_hidden_states(batch):
    config = model_config.preset("tiny", vocab_size=VOCAB)
    params = model.init(config, jax.random.key(0))
    outs = [model.apply(params, model_config.preset("tiny", vocab_size=VOCAB, attention=a),
                        batch["inputs"], batch["mask"]) for a in ("auto", "einsum", "xla")]
    for out in outs[1:]:
        np.testing.assert_allclose(np.asarray(out), np.asarray(outs[0]), rtol=1e-5, atol=1e-5)


SPEED_VARIANTS = {  # name: (config overrides, apply keywords); each must change no number
    "rolled scan": ({}, {"unroll": 1}),
    "scan unrolled by 2": ({"unroll": 2}, {}),
    "remat per block": ({"remat": "block"}, {}),
    "remat keeping dots": ({"remat": "dots"}, {}),
    "padded query slots": ({}, {"query_multiple": 8}),
}


@pytest.mark.parametrize("variant", SPEED_VARIANTS)
def test_speed_settings_give_the_same_values_and_gradients(batch, variant):
    """Scan unrolling, remat and the cuDNN query padding of the sparse last block (3 slots
    padded to 8 here, as cuDNN needs an even count) are speed-only: same hidden states and
    parameter gradients to float32 rounding."""
    overrides, keywords = SPEED_VARIANTS[variant]
    base = _config(layers=3)
    params = model.init(base, jax.random.key(1))
    args = (jnp.asarray(batch["inputs"]), jnp.asarray(batch["mask"]),
            jnp.asarray(batch["segments"]))
    positions = jnp.asarray(batch["positions"])[:, :3]

    def loss(config, **kw):
        def f(p):
            return jnp.sum(jnp.sin(model.apply(p, config, *args, positions=positions, **kw)))

        return jax.jit(jax.value_and_grad(f))(params)

    (la, ga) = loss(base)
    (lb, gb) = loss(_config(layers=3, **overrides), **keywords)
    np.testing.assert_allclose(lb, la, rtol=1e-5)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(ga))
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        np.testing.assert_allclose(y, x, atol=1e-5 * scale)


@pytest.mark.parametrize("overrides, message", [
    ({"unroll": 0}, "model.unroll=0 is not a positive integer"),
    ({"unroll": True}, "model.unroll=True is not a positive integer"),
    ({"remat": "all"}, "model.remat='all' is not one of"),
])
def test_speed_settings_are_validated(overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(**overrides)


def test_jitted_init_draws_the_eager_parameters_to_float32_rounding():
    """XLA fuses the N(0, std) scaling, so single draws may differ in the last bit."""
    from clozax.core.keys import Keys
    from clozax.core.train_state import init_params

    config = _config()
    eager = model.init(config, Keys.from_seed(5).init)
    jitted = init_params(config, 5)
    for x, y in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-6, atol=0)
    for x, y in zip(jax.tree.leaves(jitted), jax.tree.leaves(init_params(config, 5)),
                    strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))  # deterministic


def test_fine_tuning_dropout_is_the_configs_and_only_with_a_key(params, batch):
    b = batch
    plain = np.asarray(model.apply(params["pre"], CONFIGS["pre"], b["inputs"], b["mask"]))
    key = jax.random.key(3)
    # a config of 0 (every clozax preset: pretraining has none) drops nothing, key or not
    assert np.array_equal(plain, np.asarray(model.apply(
        params["pre"], CONFIGS["pre"], b["inputs"], b["mask"], dropout_key=key)))
    bert = _config(dropout=0.1)  # BERT's hidden_dropout_prob
    assert np.array_equal(plain, np.asarray(model.apply(params["pre"], bert, b["inputs"],
                                                        b["mask"])))  # evaluation: none
    dropped = [np.asarray(model.apply(params["pre"], bert, b["inputs"], b["mask"],
                                      dropout_key=k)) for k in (key, key, jax.random.key(4))]
    assert np.array_equal(dropped[0], dropped[1]) and not np.array_equal(dropped[0], dropped[2])
    assert not np.allclose(dropped[0], plain)
