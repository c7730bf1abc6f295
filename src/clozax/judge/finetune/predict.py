"""``clozax finetune --predict``: a fine-tuned model's predictions for the inputs of a file,
what ``transformers``' ``pipeline("text-classification")`` / ``pipeline("token-classification")``
give for its export: the top label and its softmax probability (regression: the value), and
per word (its first piece) the tag and its probability."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import jax
import numpy as np

from clozax.core import model as model_lib
from clozax.data.tokenizer import load_tokenizer
from clozax.judge.finetune import heads, tasks
from clozax.judge.finetune import jobs as jobs_lib
from clozax.judge.finetune import saved as finetuned

BATCH = 32


@partial(jax.jit, static_argnames=("config", "style", "kind", "pooling"))
def _logits(params, inputs, mask, *, config, style, kind, pooling):
    hidden = model_lib.apply(params["encoder"], config, inputs, mask, mask.astype(np.int32))
    return heads.apply_head(params["head"], style, config, kind, hidden, mask, pooling=pooling)


def logits_of(model: finetuned.Finetuned, split: tasks.Split) -> list[np.ndarray]:
    """Per example: (outputs,) logits, or (length, outputs) for token tasks."""
    meta, out = model.meta, [None] * len(split)
    kind = meta["kind"]
    for idx in jobs_lib.batches(split, BATCH, meta["seq_len"]):
        b = jobs_lib.arrays(split, idx, BATCH, kind, meta["specials"]["pad"], meta["seq_len"])
        logits = np.asarray(_logits(model.params, b["inputs"], b["mask"],
                                    config=model.model_config, style=meta["style"], kind=kind,
                                    pooling=meta["pooling"]))
        for r, i in enumerate(idx):
            out[i] = logits[r, : len(split.ids[i])] if kind == "tokens" else logits[r]
    return out


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def predict_file(model_dir: Path, path: Path, fields: tasks.Fields | None = None) -> list:
    """One record per input of ``path`` (a task file; labels, if any, are not read)."""
    fields = fields or tasks.Fields()
    model = finetuned.load(model_dir)
    meta = model.meta
    kind, labels = meta["kind"], meta["labels"]
    tokenizer = load_tokenizer(model.tokenizer_path)
    if Path(path).suffix.lower() in tasks.CONLL_SUFFIXES:
        raw = tasks.read_conll(Path(path))
        raw.targets = [None] * len(raw.targets)
    else:
        if not Path(path).is_file():
            raise ValueError(f"input file {path} does not exist; pass an existing file")
        raw = tasks.read_table(Path(path), kind, fields, pair=meta.get("pair", kind == "pair"),
                               labelled=False)
    split, _ = tasks.encode(tokenizer, raw, kind, labels, meta["specials"], meta["seq_len"],
                            "input")
    out = []
    for i, logits in enumerate(logits_of(model, split)):
        if kind == "regression":
            out.append({"score": float(logits[0])})
        elif kind == "tokens":
            first = np.flatnonzero(np.asarray(split.y[i]) >= 0)  # each kept word's first piece
            p = _softmax(logits[first])
            read = {int(w): q for w, q in zip(split.word_of[i], p, strict=True)}
            # a word with no piece to read (it tokenizes to nothing, or truncation cut it)
            # gets no tag rather than its neighbour's
            out.append({"tokens": [
                {"word": w, "tag": labels[int(read[j].argmax())], "score": float(read[j].max())}
                if j in read else {"word": w, "tag": None, "score": None}
                for j, w in enumerate(raw.words[i])]})
        else:
            p = _softmax(logits)
            out.append({"label": labels[int(p.argmax())], "score": float(p.max())})
    return out
