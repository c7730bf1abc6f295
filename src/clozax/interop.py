"""Hugging Face ``transformers`` interop: export a run, import a checkpoint, with logit parity.

``export_run(run_dir, out_dir)`` writes a directory that ``AutoModelForMaskedLM`` and
``AutoTokenizer`` load offline: post-LN runs as ``BertForMaskedLM``, pre-LN runs as
``RobertaPreLayerNormForMaskedLM``. It needs only numpy + safetensors; torch and transformers
are imported only by ``hf_parity`` (a check, for tests and ``clozax export --verify``).

``import_hf(hf_dir, out_run)`` reads such a directory (safetensors only, never pickle) into a
clozax run directory (config.json, run.json, tokenizer.json, a step-0 checkpoint) that
``load_run`` and ``train --init-from`` accept. A plain ``BertModel`` / ``RobertaPreLayerNormModel``
imports as an encoder: ``run.json`` says ``"has_mlm_head": false`` and the head is an identity
transform with zero bias, so MLM outputs (fill, evaluate) are meaningless but ``probe`` works.

The leaf <-> tensor table is in ``clozax.model``'s docstring. Two things are not a renaming:
- token types: clozax has none. Export writes ``token_type_embeddings`` as zeros (2 rows, so any
  token_type_ids give the same output); import adds row 0 into every position row, which is
  exact for token_type_ids = 0 (HF's default).
- RoBERTa-PreLayerNorm position ids are ``cumsum(input_ids != pad) + pad``: the first token sits
  at row ``pad + 1``. So clozax row ``p`` is HF row ``p + pad + 1`` and the HF table has
  ``max_positions + pad + 1`` rows (rows ``0..pad`` unused by real tokens, written as zeros).
  Parity holds for right-padded batches; with left padding HF shifts real tokens' positions and
  clozax does not (clozax positions are indices).

HF has no document-local attention: a run with ``attention_within_segments`` exports exactly for
one document per sequence, which is how such a model is used downstream. Exported weights are
float32; a ``compute_dtype="bfloat16"`` run then matches in transformers only to bf16 precision.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from clozax.staging import staged_dir

SPECIAL_NAMES = ("pad", "unk", "cls", "sep", "mask")
BERT_SPECIALS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]",
                 "mask": "[MASK]"}
ROBERTA_SPECIALS = {"pad": "<pad>", "unk": "<unk>", "cls": "<s>", "sep": "</s>",
                    "mask": "<mask>"}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

# layer_norm -> HF naming. ``prefix``: the encoder's attribute in the *ForMaskedLM class.
ARCHS = {
    "post": {"model_type": "bert", "mlm": "BertForMaskedLM", "encoder": "BertModel",
             "prefix": "bert.", "head": "cls.predictions.", "head_transform": "transform.dense",
             "head_norm": "transform.LayerNorm"},
    "pre": {"model_type": "roberta-prelayernorm", "mlm": "RobertaPreLayerNormForMaskedLM",
            "encoder": "RobertaPreLayerNormModel", "prefix": "roberta_prelayernorm.",
            "head": "lm_head.", "head_transform": "dense", "head_norm": "layer_norm"},
}
BY_MODEL_TYPE = {a["model_type"]: ln for ln, a in ARCHS.items()}
SUPPORTED = {a[kind]: ln for ln, a in ARCHS.items() for kind in ("mlm", "encoder")}


# ----------------------------------------------------------------------------- the name table


def _layer_table(layer_norm: str) -> list[tuple[tuple[str, ...], str]]:
    """(clozax path under ``layers``, HF name under ``encoder.layer.{i}.``) for one block."""
    post = layer_norm == "post"
    dense = [(("attention", "query"), "attention.self.query"),
             (("attention", "key"), "attention.self.key"),
             (("attention", "value"), "attention.self.value"),
             (("attention", "output"), "attention.output.dense"),
             (("intermediate",), "intermediate.dense"),
             (("output",), "output.dense")]
    norms = [(("attention_norm",), "attention.output.LayerNorm" if post else "attention.LayerNorm"),
             (("mlp_norm",), "output.LayerNorm" if post else "intermediate.LayerNorm")]
    table = [((*ours, "kernel"), f"{hf}.weight") for ours, hf in dense]
    table += [((*ours, "bias"), f"{hf}.bias") for ours, hf in dense]
    table += [((*ours, "scale"), f"{hf}.weight") for ours, hf in norms]
    table += [((*ours, "bias"), f"{hf}.bias") for ours, hf in norms]
    return table


def _top_table(layer_norm: str, with_head: bool) -> list[tuple[tuple[str, ...], str]]:
    """(clozax path, HF name relative to the encoder prefix, or absolute for the head)."""
    a = ARCHS[layer_norm]
    table = [(("embeddings", "word"), "embeddings.word_embeddings.weight"),
             (("embeddings", "layer_norm", "scale"), "embeddings.LayerNorm.weight"),
             (("embeddings", "layer_norm", "bias"), "embeddings.LayerNorm.bias")]
    if layer_norm == "pre":
        table += [(("final_norm", "scale"), "LayerNorm.weight"),
                  (("final_norm", "bias"), "LayerNorm.bias")]
    if with_head:
        h = a["head"]
        table += [(("head", "transform", "kernel"), f"/{h}{a['head_transform']}.weight"),
                  (("head", "transform", "bias"), f"/{h}{a['head_transform']}.bias"),
                  (("head", "layer_norm", "scale"), f"/{h}{a['head_norm']}.weight"),
                  (("head", "layer_norm", "bias"), f"/{h}{a['head_norm']}.bias"),
                  (("head", "bias"), f"/{h}bias")]
    return table


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _put(tree, path, value):
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _position_offset(layer_norm: str, pad_id: int) -> int:
    """HF position row of clozax position 0."""
    return pad_id + 1 if layer_norm == "pre" else 0


def to_hf_tensors(params, model_config, pad_id: int, with_head: bool = True) -> dict:
    """HF tensors (numpy float32, ``(out, in)`` linears) for clozax ``params``.

    Names carry the ``*ForMaskedLM`` prefix when ``with_head``, none for a bare encoder
    (as ``save_pretrained`` writes them). The tied decoder weight is not written: HF ties it.
    """
    c, ln = model_config, model_config.layer_norm
    prefix = ARCHS[ln]["prefix"] if with_head else ""
    out = {}

    def name(hf):
        return hf[1:] if hf.startswith("/") else prefix + hf

    for path, hf in _top_table(ln, with_head):
        value = np.asarray(_get(params, path), np.float32)
        out[name(hf)] = np.ascontiguousarray(value.T if path[-1] == "kernel" else value)
    for path, hf in _layer_table(ln):
        stacked = np.asarray(_get(params["layers"], path), np.float32)  # (layers, ...)
        for i in range(c.layers):
            value = stacked[i].T if path[-1] == "kernel" else stacked[i]  # (in,out) -> (out,in)
            out[f"{prefix}encoder.layer.{i}.{hf}"] = np.ascontiguousarray(value)
    offset = _position_offset(ln, pad_id)
    position = np.zeros((c.max_positions + offset, c.hidden), np.float32)
    position[offset:] = np.asarray(params["embeddings"]["position"], np.float32)
    out[f"{prefix}embeddings.position_embeddings.weight"] = position
    out[f"{prefix}embeddings.token_type_embeddings.weight"] = np.zeros((2, c.hidden), np.float32)
    return out


# ----------------------------------------------------------------------------- export


def _special_tokens(tokenizer_path: Path, specials: dict) -> dict[str, str]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    return {name: tok.id_to_token(int(specials[name])) for name in SPECIAL_NAMES}


def hf_config(model_config, specials: dict, with_head: bool = True) -> dict:
    """``config.json`` for the export of a run with ``model_config``."""
    c, a = model_config, ARCHS[model_config.layer_norm]
    pad = int(specials["pad"])
    return {
        "architectures": [a["mlm"] if with_head else a["encoder"]],
        "model_type": a["model_type"],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "intermediate_size": c.intermediate,
        "max_position_embeddings": c.max_positions + _position_offset(c.layer_norm, pad),
        "hidden_act": "gelu",  # exact erf, as clozax computes it
        # clozax pretrains without dropout; set these to 0.1 for BERT-style fine-tuning.
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "layer_norm_eps": c.layer_norm_eps,
        "initializer_range": c.init_std,
        "type_vocab_size": 2,  # both rows zero: token types change nothing
        "position_embedding_type": "absolute",
        "pad_token_id": pad,
        "bos_token_id": int(specials["cls"]),
        "eos_token_id": int(specials["sep"]),
        "tie_word_embeddings": True,
        "is_decoder": False,
        "dtype": "float32",
    }


def _check_fresh_output(out: Path, what: str) -> None:
    """``out`` must be absent or an empty directory (``staged_dir`` then replaces it)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{what} directory {out} already exists and is not empty; choose a new "
                         "output directory or remove it")


def _write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def export_run(run_dir: Path, out_dir: Path, step: int | None = None) -> Path:
    """Write ``run_dir``'s checkpoint (default: latest) as a ``transformers`` directory.

    Files: config.json, model.safetensors, tokenizer.json (the run's, byte for byte),
    tokenizer_config.json and special_tokens_map.json (``PreTrainedTokenizerFast``).
    Returns ``out_dir``.
    """
    from safetensors.numpy import save_file

    from clozax.run import load_run

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    run = load_run(run_dir, step)
    if not run.tokenizer_path.is_file():
        raise ValueError(f"run {run_dir} has no tokenizer.json; it is damaged, re-train or "
                         "re-import it")
    with_head = bool(run.info.get("has_mlm_head", True))
    specials = run.specials
    tokens = _special_tokens(run.tokenizer_path, specials)
    model_config = run.config.model
    tensors = to_hf_tensors(run.params, model_config, specials["pad"], with_head)
    _check_fresh_output(out_dir, "export")
    with staged_dir(out_dir) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"),
                  metadata={"format": "pt", "clozax_run": str(run_dir.absolute()),
                            "clozax_step": str(run.step)})
        _write_json(tmp / "config.json", hf_config(model_config, specials, with_head))
        shutil.copyfile(run.tokenizer_path, tmp / "tokenizer.json")
        token_fields = {f"{name}_token": tokens[name] for name in SPECIAL_NAMES}
        _write_json(tmp / "special_tokens_map.json", token_fields)
        _write_json(tmp / "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **token_fields,
            "model_max_length": model_config.max_positions,
            "padding_side": "right",  # RoBERTa-PreLayerNorm parity needs right padding
            "clean_up_tokenization_spaces": False,
        })
    return out_dir


# ----------------------------------------------------------------------------- reading HF files


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} {path} is not readable JSON ({str(e).splitlines()[0]}); "
                         "re-save the model with save_pretrained") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path} is not a JSON object; re-save it with save_pretrained")
    return data


def _weight_files(hf_dir: Path) -> list[Path]:
    single, index = hf_dir / "model.safetensors", hf_dir / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = _read_json(index, "safetensors index").get("weight_map", {})
        return sorted({hf_dir / name for name in weight_map.values()})
    pickles = sorted(p.name for p in hf_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(
            f"{hf_dir} has only pickle weights ({', '.join(pickles)}); clozax does not load "
            "pickle files because unpickling can execute arbitrary code: convert them to "
            "safetensors (model.save_pretrained(dir, safe_serialization=True)) and import that")
    raise ValueError(f"{hf_dir} has no model.safetensors; pass a directory written by "
                     "save_pretrained(..., safe_serialization=True)")


def _bf16_tensor(path: Path, name: str) -> np.ndarray:
    """numpy cannot hold bfloat16: widen its bits to float32 (exact)."""
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(n))[name]
        start, end = info["data_offsets"]
        f.seek(8 + n + start)
        bits = np.frombuffer(f.read(end - start), "<u2").astype(np.uint32) << 16
    return bits.view(np.float32).reshape(info["shape"])


def read_safetensors(files: list[Path]) -> dict[str, np.ndarray]:
    """All tensors of ``files`` as float32 numpy arrays; ``ValueError`` on a damaged file."""
    from safetensors import safe_open

    tensors = {}
    for path in files:
        try:
            with safe_open(str(path), framework="np") as f:
                for key in f.keys():
                    if f.get_slice(key).get_dtype() == "BF16":
                        tensors[key] = _bf16_tensor(path, key)
                    else:
                        tensors[key] = np.asarray(f.get_tensor(key))
        except Exception as e:  # safetensors raises its own error type, or OSError/TypeError
            raise ValueError(
                f"{path} is not a valid safetensors file ({str(e).splitlines()[0][:160]}); it "
                "may be truncated: re-download it or re-save with safe_serialization=True"
            ) from None
    return tensors


def _check_hf_config(cfg: dict, hf_dir: Path) -> tuple[str, str]:
    """(layer_norm, architecture name) after refusing what clozax cannot represent."""
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    arch = archs[0] if archs else None
    if arch is not None and arch not in SUPPORTED:
        raise ValueError(f"{hf_dir} holds a {arch}; clozax imports only "
                         f"{', '.join(sorted(SUPPORTED))}")
    if model_type not in BY_MODEL_TYPE:
        raise ValueError(f"{hf_dir} has model_type {model_type!r}; clozax imports only "
                         f"{', '.join(sorted(BY_MODEL_TYPE))}")
    layer_norm = BY_MODEL_TYPE[model_type]
    if arch is not None and SUPPORTED[arch] != layer_norm:
        raise ValueError(f"{hf_dir}: architecture {arch} does not match model_type "
                         f"{model_type!r}; fix config.json")
    act = cfg.get("hidden_act", "gelu")
    if act != "gelu":
        raise ValueError(f"{hf_dir} uses hidden_act={act!r}; clozax computes only exact-erf "
                         "'gelu', so outputs would differ")
    pet = cfg.get("position_embedding_type", "absolute")
    if pet != "absolute":
        raise ValueError(f"{hf_dir} uses position_embedding_type={pet!r}; clozax has only "
                         "learned absolute positions")
    if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
        raise ValueError(f"{hf_dir} is configured as a decoder; clozax imports encoders only")
    return layer_norm, arch or ARCHS[layer_norm]["mlm"]


def _strip_prefix(tensors: dict, prefix: str) -> dict:
    """Encoder tensors without the ``bert.``-style prefix (a saved ``BertModel`` has none)."""
    if any(k.startswith(prefix) for k in tensors):
        return {k[len(prefix):] if k.startswith(prefix) else "/" + k: v
                for k, v in tensors.items()}
    return {k if k.startswith(("embeddings.", "encoder.", "LayerNorm.", "pooler.")) else "/" + k: v
            for k, v in tensors.items()}


def _config_int(cfg: dict, key: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.json {key}={value!r} is missing or not a positive integer; "
                         "re-save the model with save_pretrained")
    return value


def from_hf_tensors(tensors: dict, cfg: dict, layer_norm: str, pad_id: int):
    """(clozax params as numpy, ModelConfig fields, has_mlm_head) from HF tensors + config."""
    a = ARCHS[layer_norm]
    named = _strip_prefix(tensors, a["prefix"])
    has_head = f"/{a['head']}bias" in named
    layers = _config_int(cfg, "num_hidden_layers")

    def take(name, shape=None):
        if name not in named:
            raise ValueError(f"the checkpoint lacks tensor {name.lstrip('/')!r}; it is not a "
                             f"complete {a['mlm']}/{a['encoder']}")
        value = np.asarray(named[name], np.float32)
        if shape is not None and value.shape != shape:
            raise ValueError(f"tensor {name.lstrip('/')!r} has shape {value.shape}, config.json "
                             f"implies {shape}; the checkpoint and config disagree")
        return value

    vocab, hidden = _config_int(cfg, "vocab_size"), _config_int(cfg, "hidden_size")
    word = take("embeddings.word_embeddings.weight")
    if word.shape != (vocab, hidden):
        raise ValueError(f"word embeddings have shape {word.shape} but config.json says "
                         f"vocab_size={vocab}, hidden_size={hidden}; fix config.json")
    params: dict = {}
    for path, hf in _top_table(layer_norm, has_head):
        value = take(hf)
        _put(params, path, value.T if path[-1] == "kernel" else value)  # (out,in) -> (in,out)
    for path, hf in _layer_table(layer_norm):
        per_layer = [take(f"encoder.layer.{i}.{hf}") for i in range(layers)]
        if path[-1] == "kernel":
            per_layer = [w.T for w in per_layer]  # (out, in) -> (in, out)
        _put(params, ("layers", *path), np.stack(per_layer))  # (layers, ...)
    # Tied decoder: an untied one cannot be represented.
    decoder = named.get(f"/{a['head']}decoder.weight")
    if has_head and decoder is not None and not np.array_equal(decoder, word):
        raise ValueError("the checkpoint's MLM decoder weight is not tied to the word "
                         "embeddings; clozax ties them, so it cannot import this model")
    if has_head and cfg.get("tie_word_embeddings", True) is False and decoder is None:
        raise ValueError("config.json has tie_word_embeddings=false but no decoder weight; "
                         "the checkpoint is incomplete")
    offset = _position_offset(layer_norm, pad_id)
    position = take("embeddings.position_embeddings.weight")
    if position.shape[0] <= offset:
        raise ValueError(f"the position table has {position.shape[0]} rows, not more than the "
                         f"pad offset {offset}; the checkpoint is not usable")
    type_row = take("embeddings.token_type_embeddings.weight")[0]
    _put(params, ("embeddings", "position"), position[offset:] + type_row)
    if not has_head:  # identity transform, zero bias: defined but meaningless MLM outputs
        _put(params, ("head", "transform", "kernel"), np.eye(hidden, dtype=np.float32))
        _put(params, ("head", "transform", "bias"), np.zeros(hidden, np.float32))
        _put(params, ("head", "layer_norm", "scale"), np.ones(hidden, np.float32))
        _put(params, ("head", "layer_norm", "bias"), np.zeros(hidden, np.float32))
        _put(params, ("head", "bias"), np.zeros(vocab, np.float32))
    fields = {
        "vocab_size": vocab, "hidden": hidden, "layers": layers,
        "heads": _config_int(cfg, "num_attention_heads"),
        "intermediate": _config_int(cfg, "intermediate_size"),
        "max_positions": int(position.shape[0] - offset), "layer_norm": layer_norm,
        "layer_norm_eps": float(cfg.get("layer_norm_eps", 1e-12)),
        "init_std": float(cfg.get("initializer_range", 0.02)),
    }
    return params, fields, has_head


def _hf_special_strings(hf_dir: Path) -> dict[str, list[str]]:
    """Candidate token strings per special name: the HF files' declarations first."""
    candidates = {name: [] for name in SPECIAL_NAMES}
    for fname in ("special_tokens_map.json", "tokenizer_config.json"):
        path = hf_dir / fname
        if not path.is_file():
            continue
        data = _read_json(path, fname)
        for name in SPECIAL_NAMES:
            value = data.get(f"{name}_token")
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                candidates[name].append(value)
    for name in SPECIAL_NAMES:
        candidates[name] += [BERT_SPECIALS[name], ROBERTA_SPECIALS[name]]
    return candidates


def _import_tokenizer(hf_dir: Path, dest: Path):
    """Copy (or build from vocab.txt) the tokenizer into ``dest``; return it loaded and the
    list of changes made to it (padding/truncation switched off)."""
    from tokenizers import Tokenizer

    source = hf_dir / "tokenizer.json"
    if source.is_file():
        try:
            tok = Tokenizer.from_file(str(source))
        except Exception as e:  # tokenizers raises a bare Exception
            raise ValueError(f"{source} is not a valid tokenizer.json "
                             f"({str(e).splitlines()[0][:160]})") from None
        changes = [name for name, on in (("padding", tok.padding), ("truncation", tok.truncation))
                   if on]
        if changes:  # clozax pads and truncates itself; a fixed-length tokenizer breaks packing
            tok.no_padding()
            tok.no_truncation()
            tok.save(str(dest))
        else:
            shutil.copyfile(source, dest)  # byte for byte: `prepare --tokenizer` hashes match
        return tok, [f"{name} disabled" for name in changes]
    vocab = hf_dir / "vocab.txt"
    if not vocab.is_file():
        raise ValueError(f"{hf_dir} has neither tokenizer.json nor vocab.txt; save the "
                         "tokenizer next to the model (tokenizer.save_pretrained)")
    from tokenizers.implementations import BertWordPieceTokenizer

    tok_cfg = hf_dir / "tokenizer_config.json"
    lower = _read_json(tok_cfg, "tokenizer config").get("do_lower_case", True) \
        if tok_cfg.is_file() else True
    BertWordPieceTokenizer(str(vocab), lowercase=bool(lower)).save(str(dest))
    return Tokenizer.from_file(str(dest)), ["built from vocab.txt"]


def _find_specials(tok, hf_dir: Path) -> dict[str, int]:
    specials, missing = {}, []
    for name, strings in _hf_special_strings(hf_dir).items():
        ids = [tok.token_to_id(s) for s in strings]
        found = [i for i in ids if i is not None]
        if found:
            specials[name] = int(found[0])
        else:
            missing.append(strings[0])
    if missing:
        raise ValueError(f"the tokenizer in {hf_dir} lacks special token(s) "
                         f"{', '.join(missing)}; clozax needs pad/unk/cls/sep/mask tokens")
    return specials


# ----------------------------------------------------------------------------- import


def import_hf(hf_dir: Path, out_run: Path) -> Path:
    """Import a local HF ``BertForMaskedLM`` / ``RobertaPreLayerNormForMaskedLM`` (or their
    bare encoders) into a new clozax run directory ``out_run`` with a step-0 checkpoint.
    Returns ``out_run``."""
    hf_dir, out_run = Path(hf_dir), Path(out_run)
    if not hf_dir.is_dir():
        raise ValueError(f"{hf_dir} is not a directory; pass a local save_pretrained directory")
    if not (hf_dir / "config.json").is_file():
        raise ValueError(f"{hf_dir} has no config.json; pass a save_pretrained directory")
    cfg = _read_json(hf_dir / "config.json", "config")
    layer_norm, arch = _check_hf_config(cfg, hf_dir)
    files = _weight_files(hf_dir)
    _check_fresh_output(out_run, "run")
    with staged_dir(out_run) as tmp:
        tok, tokenizer_changes = _import_tokenizer(hf_dir, tmp / "tokenizer.json")
        specials = _find_specials(tok, hf_dir)
        vocab = _config_int(cfg, "vocab_size")
        if vocab != tok.get_vocab_size():
            raise ValueError(f"config.json vocab_size={vocab} disagrees with the tokenizer's "
                             f"{tok.get_vocab_size()} tokens; use the tokenizer the model was "
                             "trained with")
        pad = specials["pad"]
        if layer_norm == "pre" and int(cfg.get("pad_token_id", pad)) != pad:
            raise ValueError(f"config.json pad_token_id={cfg.get('pad_token_id')} is not the "
                             f"tokenizer's pad id {pad}; RoBERTa position ids depend on it")
        params, fields, has_head = from_hf_tensors(read_safetensors(files), cfg, layer_norm, pad)
        _write_run(tmp, params, fields, {
            "specials": specials,
            "imported_from": str(hf_dir.absolute()),
            "imported_architecture": arch if has_head else ARCHS[layer_norm]["encoder"],
            "has_mlm_head": has_head,
            "tokenizer_changes": tokenizer_changes,
        })
    return out_run


def _write_run(run_dir: Path, params: dict, model_fields: dict, extra: dict) -> None:
    """config.json, run.json (train's keys + ``extra``) and a step-0 checkpoint."""
    import jax
    import jax.numpy as jnp

    from clozax import __version__
    from clozax import checkpoint as ckpt
    from clozax import config as config_lib
    from clozax.data.tokenizer import file_sha256
    from clozax.train import TrainState, make_optimizer

    config = config_lib.from_dict({"model": model_fields})
    _write_json(run_dir / "config.json", config.to_dict())
    _write_json(run_dir / "run.json", {
        "clozax_version": __version__,
        "jax_version": jax.__version__,
        "dataset": None,
        "dataset_fingerprint": None,
        "tokenizer_sha256": file_sha256(run_dir / "tokenizer.json"),
        "seq_len": config.model.max_positions,
        "seed": config.train.seed,
        "eval_seed": config.train.eval_seed,
        "init_from": None,
        **extra,
    })
    params = jax.tree.map(jnp.asarray, params)
    optimizer, _ = make_optimizer(config.optim, config.train.steps, params)
    state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
    checkpointer = ckpt.Checkpointer(run_dir, keep=config.train.keep_checkpoints)
    try:
        checkpointer.save(0, state, {"step": 0, "config": config.to_dict(),
                                     "imported_from": extra.get("imported_from")})
    finally:
        checkpointer.close()


# ----------------------------------------------------------------------------- parity check


def hf_parity(run_dir: Path, hf_dir: Path, texts: list[str]) -> float:
    """Max |clozax - transformers| MLM logit (hidden state for an encoder-only run) over the
    non-pad positions of ``texts``, right-padded into one batch. Needs torch + transformers."""
    try:
        import torch
        import transformers
    except ImportError:
        raise ValueError("the parity check needs torch and transformers; install the "
                         "'bench' extra or drop --verify") from None
    import jax.numpy as jnp

    from clozax import model as model_lib
    from clozax.run import load_run

    run = load_run(run_dir)
    ids, mask = encode_batch(run.tokenizer_path, texts, run.specials["pad"])
    c = run.config.model
    if ids.shape[1] > c.max_positions:
        raise ValueError(f"texts tokenize to {ids.shape[1]} tokens, over model.max_positions="
                         f"{c.max_positions}; pass shorter texts")
    segments = jnp.asarray(mask.astype(np.int32))  # one document per row
    hidden = model_lib.apply(run.params, c, jnp.asarray(ids), jnp.asarray(mask), segments)
    with_head = bool(run.info.get("has_mlm_head", True))
    auto = transformers.AutoModelForMaskedLM if with_head else transformers.AutoModel
    hf = auto.from_pretrained(str(hf_dir)).eval()
    with torch.no_grad():
        out = hf(input_ids=torch.from_numpy(ids).long(),
                 attention_mask=torch.from_numpy(mask).long())
    if with_head:
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        ours = np.asarray(model_lib.mlm_logits(run.params, c, model_lib.gather(hidden, positions)))
        theirs = out.logits.numpy()
    else:
        ours, theirs = np.asarray(hidden), out.last_hidden_state.numpy()
    return float(np.abs(ours - theirs)[mask].max())


def encode_batch(tokenizer_path: Path, texts: list[str], pad_id: int):
    """(ids, mask): (batch, seq) int32 right-padded token ids and bool real-token mask."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    tok.no_padding()
    tok.no_truncation()
    rows = [tok.encode(t).ids for t in texts]
    seq = max(len(r) for r in rows)
    ids = np.full((len(rows), seq), pad_id, np.int32)
    mask = np.zeros((len(rows), seq), bool)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = r, True
    return ids, mask
