"""``ModernBertForMaskedLM`` interop: import and export with logit parity against
``transformers`` itself, on random weights (every tensor perturbed), right-padded batches of
one document per row, at seq 128 (window 16, biases on) and seq 1024 (ModernBERT's window 128,
no biases), fp32 on CPU with HF's SDPA attention.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import perturb_torch

torch = pytest.importorskip("torch", reason="interop tests need torch (the 'bench' extra)")
transformers = pytest.importorskip(
    "transformers", reason="interop tests need transformers (the 'bench' extra)")

import jax  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from clozax import interop  # noqa: E402
from clozax.core import model as model_lib  # noqa: E402
from clozax.core import model_config  # noqa: E402
from clozax.interop.imports import write_run  # noqa: E402
from clozax.train.run_dir import load_run  # noqa: E402

TOL = 1e-4  # max abs, float32
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda omicron sigma tau "
         "upsilon phi chi psi omega river stone cloud light shadow north south").split()
# name: (row lengths in words, HF config overrides); a row of n words is n + 2 tokens.
CASES = {
    "seq128": ((126, 90, 3, 40), {"local_attention": 16, "attention_bias": True,
                                  "mlp_bias": True, "norm_bias": True,
                                  "classifier_bias": True}),
    "seq1024": ((1022, 700, 130), {"local_attention": 128}),
}
FILL_TEXT = "alpha beta [MASK] delta river"


def _texts(lengths, seed):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(n)) for n in lengths]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    """A word-level WordPiece tokenizer over WORDS: one token per word, [CLS] ... [SEP]."""
    from tokenizers.implementations import BertWordPieceTokenizer

    root = tmp_path_factory.mktemp("tok")
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    BertWordPieceTokenizer(str(vocab), lowercase=True).save(str(root / "tokenizer.json"))
    return root / "tokenizer.json"


VOCAB = 5 + len(WORDS)
SPECIALS = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}


def _hf_config(**overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
              intermediate_size=48, max_position_embeddings=1024, pad_token_id=0,
              bos_token_id=2, cls_token_id=2, eos_token_id=3, sep_token_id=3,
              global_attn_every_n_layers=3, attn_implementation="sdpa")
    return transformers.ModernBertConfig(**{**kw, **overrides})


@pytest.fixture(scope="module")
def hf_dirs(tokenizer, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, (name, (_, overrides)) in enumerate(CASES.items()):
        model = perturb_torch(transformers.ModernBertForMaskedLM(_hf_config(**overrides)), i)
        model.save_pretrained(root / name, safe_serialization=True)
        shutil.copyfile(tokenizer, root / name / "tokenizer.json")
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def clozax_run(tokenizer, tmp_path_factory) -> Path:
    """A modern-tiny run (3 layers: global, local, local; window 16) with every parameter
    perturbed, except layer 0's unused attention norm, which training leaves at its init."""
    fields = dict(model_config.PRESETS["modern-tiny"], vocab_size=VOCAB)
    params = model_lib.init(model_config.ModelConfig(**fields), jax.random.key(0))
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(100), len(leaves))
    params = jax.tree.unflatten(tree, [np.array(x + 0.2 * jax.random.normal(k, x.shape))
                                       for x, k in zip(leaves, keys, strict=True)])
    params["layers"]["attention_norm"]["scale"][0] = 1.0
    run = tmp_path_factory.mktemp("runs") / "modern"
    run.mkdir()
    shutil.copyfile(tokenizer, run / "tokenizer.json")
    write_run(run, params, fields, {"specials": SPECIALS, "has_mlm_head": True})
    return run


@pytest.fixture(scope="module")
def exported(clozax_run, tmp_path_factory) -> Path:
    return interop.export_run(clozax_run, tmp_path_factory.mktemp("exported") / "modern")


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("case", CASES)
def test_imported_modernbert_logits_match_transformers(case, hf_dirs, tokenizer, tmp_path):
    lengths, overrides = CASES[case]
    texts = _texts(lengths, seed=len(lengths))
    ids, mask = interop.encode_batch(tokenizer, texts, SPECIALS["pad"])
    assert ids.shape[1] == max(lengths) + 2 and (~mask).any()  # right-padded, seq 128 / 1024
    run = load_run(interop.import_hf(hf_dirs[case], tmp_path / "run"))
    c = run.config.model
    assert (c.positions, c.mlp, c.local_window, c.global_every) == (
        "rope", "geglu", overrides["local_attention"], 3)
    assert c.bias is overrides.get("attention_bias", False)
    assert interop.hf_parity(run.path, hf_dirs[case], texts) < TOL


def test_exported_modern_run_logits_match_transformers(exported, clozax_run):
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["ModernBertForMaskedLM"]
    assert config["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
    assert config["local_attention"] == 16
    texts = _texts((126, 90, 3, 40), seed=7)
    assert interop.hf_parity(clozax_run, exported, texts) < TOL


def test_export_writes_modernbert_tensor_names(exported):
    names = set(load_file(str(exported / "model.safetensors")))
    assert {"model.embeddings.tok_embeddings.weight", "model.embeddings.norm.weight",
            "model.layers.0.attn.Wqkv.weight", "model.layers.1.attn_norm.weight",
            "model.layers.2.mlp.Wi.weight", "model.final_norm.weight", "head.dense.weight",
            "head.norm.weight", "decoder.bias"} <= names
    assert "model.layers.0.attn_norm.weight" not in names  # HF's layer 0 has none
    assert not [n for n in names if n.endswith(".bias") and n != "decoder.bias"]
    wi = load_file(str(exported / "model.safetensors"))["model.layers.0.mlp.Wi.weight"]
    assert wi.shape == (2 * 48, 32)  # input half, then gate half


def test_export_then_import_gives_back_the_same_parameters(exported, clozax_run, tmp_path):
    back = load_run(interop.import_hf(exported, tmp_path / "back"))
    original = load_run(clozax_run)
    assert back.config.model == original.config.model
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(original.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fill_mask_pipeline_top5_matches_clozax_fill(exported, clozax_run):
    from clozax.judge.fill import fill

    out = str(exported)
    results = transformers.pipeline("fill-mask", model=out, tokenizer=out, top_k=5)(FILL_TEXT)
    ours = fill(clozax_run, FILL_TEXT, top_k=5)[0]["predictions"]
    assert [p["id"] for p in ours] == [r["token"] for r in results]
    np.testing.assert_allclose([p["probability"] for p in ours], [r["score"] for r in results],
                               atol=1e-5)


@pytest.mark.fast
def test_modern_base_has_modernbert_base_parameter_count():
    """HF ModernBERT-base (vocab 50368) built on the meta device; clozax keeps one unused
    attention-norm row for layer 0 (768 scalars) that HF does not have."""
    config = model_config.preset("modern-base", vocab_size=50368)
    ours = model_lib.param_count(jax.eval_shape(lambda: model_lib.init(config,
                                                                       jax.random.key(0))))
    with torch.device("meta"):
        hf = transformers.ModernBertForMaskedLM(transformers.ModernBertConfig())
    assert ours == sum(p.numel() for p in hf.parameters()) + 768


def test_a_bert_layout_run_with_a_modern_option_refuses_to_export(tmp_path):
    from clozax.interop.families import for_model

    with pytest.raises(ValueError, match="no transformers family represents"):
        for_model(model_config.preset("small", positions="rope"))
    assert for_model(model_config.preset("modern-small")).mlm == "ModernBertForMaskedLM"
    assert for_model(model_config.preset("small")).mlm == "RobertaPreLayerNormForMaskedLM"


def test_sentence_transformers_loads_the_modern_export_and_embeds_as_clozax(clozax_run,
                                                                            tmp_path):
    pytest.importorskip("sentence_transformers")
    from clozax.interop.sentence import sentence_parity

    out = interop.export_run(clozax_run, tmp_path / "st", pooling="mean")
    texts = ["the quick brown fox jumps over the lazy dog", "a short one", "hello world"]
    assert sentence_parity(clozax_run, out, texts) < 1e-4
