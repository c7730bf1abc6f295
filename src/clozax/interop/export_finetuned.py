"""``clozax export`` of a fine-tuned model (``clozax finetune``'s ``model/``): the
``*ForSequenceClassification`` / ``*ForTokenClassification`` class of the encoder's family,
with ``id2label``, loadable by ``AutoModelFor...`` and ``pipeline(...)`` offline.

Head tensors (clozax ``head`` -> HF), by the head style ``clozax.judge.finetune.heads`` chose:
BERT: ``pool`` -> ``bert.pooler.dense``, ``out`` -> ``classifier``; RoBERTa-PreLayerNorm:
``pool`` -> ``classifier.dense``, ``out`` -> ``classifier.out_proj`` (tokens: ``classifier``);
ModernBERT: ``dense``/``norm`` -> ``head.dense``/``head.norm``, ``out`` -> ``classifier``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from clozax.core import files
from clozax.core.files import staged_dir
from clozax.interop.families import for_model
from clozax.interop.family import at_trained_length
from clozax.interop.hf_files import check_fresh_output, special_tokens, write_tokenizer
from clozax.judge.finetune import saved as finetuned

STYLE_OF_FAMILY = {"bert": "bert", "roberta-prelayernorm": "roberta", "modernbert": "modern"}
CLASS_PREFIX = {"bert": "Bert", "roberta-prelayernorm": "RobertaPreLayerNorm",
                "modernbert": "ModernBert"}


def _linear(out: dict, name: str, p: dict) -> None:
    out[f"{name}.weight"] = np.ascontiguousarray(np.asarray(p["kernel"], np.float32).T)
    if "bias" in p:
        out[f"{name}.bias"] = np.ascontiguousarray(np.asarray(p["bias"], np.float32))


def _norm(out: dict, name: str, p: dict) -> None:
    out[f"{name}.weight"] = np.asarray(p["scale"], np.float32)
    if "bias" in p:
        out[f"{name}.bias"] = np.asarray(p["bias"], np.float32)


def head_tensors(head: dict, family_type: str, kind: str, prefix: str) -> dict:
    out: dict = {}
    if family_type == "modernbert":
        _linear(out, "head.dense", head["dense"])
        _norm(out, "head.norm", head["norm"])
        _linear(out, "classifier", head["out"])
    elif kind == "tokens":
        _linear(out, "classifier", head["out"])
    elif family_type == "bert":
        _linear(out, f"{prefix}pooler.dense", head["pool"])
        _linear(out, "classifier", head["out"])
    else:
        _linear(out, "classifier.dense", head["pool"])
        _linear(out, "classifier.out_proj", head["out"])
    return out


def export_finetuned(model_dir: Path, out_dir: Path) -> Path:
    model = finetuned.load(model_dir)
    meta = model.meta
    length = int(meta.get("seq_len", model.model_config.max_positions))
    encoder_params, c = at_trained_length(model.params["encoder"], model.model_config, length)
    family = for_model(c)
    if STYLE_OF_FAMILY[family.model_type] != meta["style"]:
        raise ValueError(f"{model_dir}: its {meta['style']} head does not match the "
                         f"{family.model_type} family its encoder exports as; fine-tune again")
    specials = {k: int(v) for k, v in meta["specials"].items()}
    encoder = family.to_hf_tensors(encoder_params, c, specials["pad"], with_head=False)
    tensors = {f"{family.prefix}{k}": v for k, v in encoder.items()}
    tensors.update(head_tensors(model.params["head"], family.model_type, meta["kind"],
                                family.prefix))
    kind = meta["kind"]
    labels = meta["labels"] or ["LABEL_0"]
    cls = CLASS_PREFIX[family.model_type] + (
        "ForTokenClassification" if kind == "tokens" else "ForSequenceClassification")
    config = family.hf_config(c, specials, with_head=False)
    config.update({
        "architectures": [cls],
        "id2label": {str(i): name for i, name in enumerate(labels)},
        "label2id": {name: i for i, name in enumerate(labels)},
        "problem_type": {"regression": "regression", "tokens": None}.get(
            kind, "single_label_classification"),
        "classifier_dropout": meta.get("dropout", 0.0),
        "finetuning_task": meta.get("task"),
    })
    if family.model_type == "modernbert":
        config["classifier_pooling"] = meta["pooling"]
    config = {k: v for k, v in config.items() if v is not None}
    check_fresh_output(out_dir, "export")
    with staged_dir(out_dir) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"),
                  metadata={"format": "pt", "clozax_finetuned": str(Path(model_dir).absolute())})
        files.write_json(tmp / "config.json", config, sort_keys=True)
        write_tokenizer(tmp, model.tokenizer_path,
                        special_tokens(model.tokenizer_path, specials), length)
    return out_dir
