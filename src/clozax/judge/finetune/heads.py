"""Task heads as the export targets have them, their loss as (sum, count), and the metrics.

Head styles (``style_for``), chosen by the encoder's architecture so that an exported
fine-tuned model is the ``transformers`` class of its family:

- ``bert`` (``BertFor*``): sequence tasks pool ``[CLS]`` through the pooler (dense, tanh), then
  dropout and the classifier; token tasks: dropout, classifier.
- ``roberta`` (``RobertaPreLayerNormFor*``): sequence tasks: dropout, dense, tanh, dropout,
  ``out_proj`` on ``[CLS]``; token tasks: dropout, classifier.
- ``modern`` (``ModernBertFor*``): ``[CLS]`` or the mean over real tokens
  (``classifier_pooling``), then the prediction head (dense, GELU, LayerNorm; started from the
  encoder's MLM head, which is what ``ModernBertForSequenceClassification`` loads from an MLM
  checkpoint), dropout, classifier; token tasks the same per token.

Shapes: ``hidden`` (batch, seq, hidden) float32; ``mask`` (batch, seq) bool; logits (batch,
out) for sequence tasks, (batch, seq, out) for token tasks; ``out`` is the class count, 1 for
regression.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from clozax.core import layers

STYLES = ("bert", "roberta", "modern")
POOLINGS = ("cls", "mean")


def style_for(model_config) -> str:
    c = model_config
    if c.positions == "rope" or c.mlp == "geglu" or not c.bias:
        return "modern"
    return "bert" if c.layer_norm == "post" else "roberta"


def init_head(style: str, model_config, kind: str, outputs: int, key: jax.Array,
              mlm_head: dict | None = None) -> dict:
    """Fresh float32 head parameters: N(0, init_std) kernels, zero biases, as HF's
    ``_init_weights``; the modern style's prediction head copies ``mlm_head`` when given."""
    c = model_config
    k_pool, k_out = jax.random.split(key)

    def dense(k, fan_out, bias=True):
        p = {"kernel": c.init_std * jax.random.normal(k, (c.hidden, fan_out), jnp.float32)}
        if bias:
            p["bias"] = jnp.zeros((fan_out,), jnp.float32)
        return p

    head = {"out": dense(k_out, outputs)}
    if style == "modern":
        if mlm_head is not None:
            head["dense"] = jax.tree.map(jnp.array, mlm_head["transform"])  # copies: steps donate
            head["norm"] = jax.tree.map(jnp.array, mlm_head["layer_norm"])
        else:
            head["dense"] = dense(k_pool, c.hidden, bias=c.bias)
            head["norm"] = {"scale": jnp.ones((c.hidden,), jnp.float32)}
            if c.bias:
                head["norm"]["bias"] = jnp.zeros((c.hidden,), jnp.float32)
    elif kind != "tokens":
        head["pool"] = dense(k_pool, c.hidden)
    return head


def _dropout(x, rate: float, key):
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def apply_head(head: dict, style: str, model_config, kind: str, hidden, mask, *,
               pooling: str = "cls", dropout: float = 0.0, key=None):
    """Logits (see the module docstring); ``key`` None means evaluation (no dropout)."""
    c, dtype = model_config, model_config.dtype
    keys = [None, None] if key is None else list(jax.random.split(key))
    if kind == "tokens":
        x = hidden
    elif pooling == "mean":
        w = mask.astype(jnp.float32)[..., None]
        x = jnp.sum(hidden * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1.0)  # (batch, hidden)
    else:
        x = hidden[:, 0]  # (batch, hidden)
    if style == "modern":
        x = layers.layer_norm(layers.gelu(layers.dense(x, head["dense"], dtype)), head["norm"],
                              c.layer_norm_eps)
    elif kind != "tokens" and style == "bert":
        x = jnp.tanh(layers.dense(x, head["pool"], dtype))
    elif kind != "tokens":  # roberta
        x = _dropout(x, dropout, keys[1])
        x = jnp.tanh(layers.dense(x, head["pool"], dtype))
    x = _dropout(x.astype(jnp.float32), dropout, keys[0])
    return layers.dense(x, head["out"], dtype).astype(jnp.float32)


def loss_sum_count(kind: str, logits, y, weight):
    """(sum, count) of the task loss: cross-entropy of classes, squared error of regression,
    cross-entropy of labelled tokens. ``weight`` (batch,) is 0 for padding rows; token labels
    below 0 are ignored."""
    if kind == "regression":
        err = jnp.square(logits[:, 0] - y) * weight
        return jnp.sum(err), jnp.sum(weight)
    if kind == "tokens":
        valid = (y >= 0) & (weight[:, None] > 0)  # (batch, seq)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, jnp.maximum(y, 0)[..., None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(valid, nll, 0.0)), jnp.sum(valid).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, y[:, None], axis=-1)[:, 0]
    return jnp.sum(nll * weight), jnp.sum(weight)


# --------------------------------------------------------------------------- metrics


def entities(tags: list[str]) -> set[tuple[str, int, int]]:
    """(type, start, end) chunks of a BIO/IOB2 tag sequence, as seqeval's default (conlleval)
    mode reads them: a chunk starts at ``B-X``, or at ``I-X`` after ``O`` or another type, and
    ends before the next ``B-``, ``O`` or change of type. ``E-``/``S-`` are read as IOBES."""
    out, start, kind = set(), None, None
    for i, tag in enumerate([*tags, "O"]):
        prefix, _, typ = tag.partition("-") if tag != "O" else ("O", "", "")
        ends = start is not None and (prefix in ("O", "B", "S") or typ != kind)
        if ends:
            out.add((kind, start, i - 1))
            start, kind = None, None
        if prefix in ("B", "S") or (prefix in ("I", "E") and start is None):
            start, kind = i, typ
        if prefix in ("E", "S") and start is not None:
            out.add((kind, start, i))
            start, kind = None, None
    return out


def entity_f1(gold: list[list[str]], pred: list[list[str]]) -> dict:
    """Micro precision, recall and F1 over entity chunks (seqeval's definition)."""
    tp = n_pred = n_gold = 0
    for g, p in zip(gold, pred, strict=True):
        eg, ep = entities(g), entities(p)
        tp += len(eg & ep)
        n_pred += len(ep)
        n_gold += len(eg)
    precision = tp / n_pred if n_pred else 0.0
    recall = tp / n_gold if n_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"entity_f1": f1, "entity_precision": precision, "entity_recall": recall}


def metrics(kind: str, y_true, y_pred, labels: list[str] | None = None) -> dict:
    """Every metric of a task kind. Classes: accuracy, macro-F1, Matthews correlation, and
    for two classes (``labels``) F1 of the positive one (class 1).
    Regression: Pearson, Spearman and their mean. Tokens: entity F1 (and precision, recall)
    and accuracy over labelled words; ``y_true``/``y_pred`` are lists of per-word class ids."""
    from scipy import stats
    from sklearn.metrics import f1_score, matthews_corrcoef

    if kind == "regression":
        t, p = np.asarray(y_true, np.float64), np.asarray(y_pred, np.float64)
        if np.ptp(p) == 0 or np.ptp(t) == 0:  # a constant prediction correlates with nothing
            pearson = spearman = 0.0
        else:
            pearson = float(np.nan_to_num(stats.pearsonr(t, p).statistic))
            spearman = float(np.nan_to_num(stats.spearmanr(t, p).statistic))
        return {"pearson": pearson, "spearman": spearman,
                "pearson_spearman": (pearson + spearman) / 2}
    if kind == "tokens":
        gold = [[labels[k] for k in seq] for seq in y_true]
        pred = [[labels[k] for k in seq] for seq in y_pred]
        flat_t = np.concatenate([np.asarray(s) for s in y_true]) if y_true else np.zeros(0)
        flat_p = np.concatenate([np.asarray(s) for s in y_pred]) if y_pred else np.zeros(0)
        return {**entity_f1(gold, pred), "accuracy": float(np.mean(flat_t == flat_p))}
    t, p = np.asarray(y_true), np.asarray(y_pred)
    out = {"accuracy": float(np.mean(t == p)),
           "macro_f1": float(f1_score(t, p, average="macro", zero_division=0)),
           "matthews": float(matthews_corrcoef(t, p))}
    if labels is not None and len(labels) == 2:  # GLUE's MRPC/QQP F1: of the positive class
        out["f1"] = float(f1_score(t, p, pos_label=1, average="binary", zero_division=0))
    return out


# Every metric a task kind scores (``metrics``), its default first; ``f1`` (of
# the positive class: the second label in sorted order, GLUE's 1) only for two classes.
METRICS = {
    "classification": ("accuracy", "macro_f1", "matthews", "f1"),
    "pair": ("accuracy", "macro_f1", "matthews", "f1"),
    "regression": ("pearson_spearman", "pearson", "spearman"),
    "tokens": ("entity_f1", "entity_precision", "entity_recall", "accuracy"),
}


def default_metric(kind: str, labels: list[str] | None = None) -> str:
    """The kind's first metric; a token task whose tags are not BIO chunks (part of speech)
    scores ``accuracy``, where entity F1 would read a constant 0."""
    if kind == "tokens" and labels and not any(
            t[:2] in ("B-", "I-", "E-", "S-") for t in labels):
        return "accuracy"
    return METRICS[kind][0]
