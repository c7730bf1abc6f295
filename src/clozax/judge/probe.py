"""Downstream probe: does pretraining give features a linear classifier can use?

Task: a label per document and a group per document; the probe is split by *group* (the
classifier is tested on groups it never saw). Default task on a prepared dataset: the ``label``
of each document in the dataset's ``documents.jsonl`` shards (for the built-in corpus, a docstring's
top-level stdlib package; groups are modules), both splits together. A user task is a JSONL file
with ``text``, ``label`` and ``group`` fields.

Kept classes have at least ``MIN_EXAMPLES`` examples in at least ``MIN_GROUPS`` groups (fewer
groups cannot be split into probe-train, validation and test by group); the rest are dropped and
counted. At most ``max_per_class`` examples per class are kept (a keyed-hash choice), so the
default probe of the ``small`` preset runs in well under a minute on 2 CPU cores.

Features: the mean over non-pad tokens of the frozen encoder's final hidden states of
``[CLS] text [SEP]``, truncated to the dataset's ``seq_len``. Classifier: multinomial logistic
regression (scikit-learn) on standardised features, ``C`` chosen on a validation split of the
probe-train groups, then refit on all probe-train groups. The same is done for the random-init
encoder (the run's init key) and for TF-IDF features of the same (truncated) text (l2-normalised,
not standardised). Accuracy on the test groups with a percentile bootstrap 95 % interval over
test examples (paired resamples, so the trained − random difference has its own interval).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from clozax.core import model as model_lib
from clozax.core.train_state import init_params
from clozax.data.tokenizer import load_tokenizer
from clozax.judge import history
from clozax.train.run_dir import load_run, open_run_dataset

PROBE_FILE = "probe.json"
MIN_EXAMPLES = 30
MIN_GROUPS = 3
MAX_PER_CLASS = 100
C_GRID = (0.01, 0.1, 1.0, 10.0, 100.0)
BOOTSTRAP_RESAMPLES = 1000
TEST_FRACTION, VAL_FRACTION = 0.25, 0.15
BATCH = 32
LENGTH_BUCKET = 32  # inputs are padded to a multiple of this (few compiles, little waste)


class Task(NamedTuple):
    """Examples: ``ids`` are ``[CLS] body [SEP]`` token ids; ``text`` the decoded body."""

    ids: list[np.ndarray]
    text: list[str]
    label: list[str]
    group: list[str]
    source: str


def _hash(seed: int, value: str) -> str:
    return hashlib.sha256(f"{seed}\x00{value}".encode()).hexdigest()


# --------------------------------------------------------------------------- tasks


def dataset_task(dataset, tokenizer) -> Task:
    """Each labelled document of both splits, as its first chunk (exactly the piece trained on)."""
    specials = set(dataset.specials.values())
    ids, text, label, group = [], [], [], []
    for name, split in (("train", dataset.train), ("heldout", dataset.heldout)):
        for doc in dataset.documents(name):  # streamed, shard by shard
            if doc.get("label") is None or not doc.get("chunks"):
                continue
            row, segment = doc["chunks"][0]
            piece = np.asarray(split.tokens[row])[np.asarray(split.segments[row]) == segment]
            body = [int(t) for t in piece if int(t) not in specials]
            ids.append(piece.astype(np.int32))
            text.append(tokenizer.decode(body))
            label.append(str(doc["label"]))
            group.append(str(doc.get("group", doc.get("id"))))
    if not label:
        raise ValueError(f"dataset {dataset.path} has no document labels; prepare it with "
                         "--label-field, or pass --task FILE.jsonl with text/label/group fields")
    return Task(ids, text, label, group, f"{dataset.path} documents (label)")


def file_task(path: Path, tokenizer, specials: dict[str, int], seq_len: int) -> Task:
    """A JSONL file of {"text", "label", "group"} lines, encoded with the run's tokenizer."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"probe task file {path} does not exist; pass a JSONL file with "
                         "text/label/group fields")
    ids, text, label, group = [], [], [], []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {n} is not valid JSON ({e.msg}); write one JSON "
                             "object per line") from None
        missing = [f for f in ("text", "label", "group")
                   if not isinstance(record, dict) or record.get(f) is None]
        if missing:
            raise ValueError(f"{path} line {n} lacks field(s) {', '.join(missing)}; every line "
                             "needs text, label and group")
        if not isinstance(record["text"], str):
            raise ValueError(f"{path} line {n}: text must be a string")
        body = tokenizer.encode(record["text"], add_special_tokens=False).ids[: seq_len - 2]
        ids.append(np.asarray([specials["cls"], *body, specials["sep"]], np.int32))
        text.append(tokenizer.decode(body))
        label.append(str(record["label"]))
        group.append(str(record["group"]))
    if len(set(label)) < 2:
        raise ValueError(f"probe task {path} has {len(set(label))} class(es); a probe needs at "
                         "least 2 labels")
    return Task(ids, text, label, group, str(path))


def select_and_split(task: Task, seed: int, max_per_class: int) -> tuple[dict, dict]:
    """Keep classes with enough examples and groups, cap them, split by group.

    Returns ({"train"|"val"|"test": example indices}, accounting). Groups are stratified by their
    majority label and ordered by a keyed hash, so the split is deterministic in ``seed``.
    """
    counts = Counter(task.label)
    groups_of = defaultdict(set)
    for lab, grp in zip(task.label, task.group, strict=True):
        groups_of[lab].add(grp)
    few = sorted(c for c in counts if counts[c] < MIN_EXAMPLES)
    few_groups = sorted(c for c in counts if counts[c] >= MIN_EXAMPLES
                        and len(groups_of[c]) < MIN_GROUPS)
    kept = sorted(set(counts) - set(few) - set(few_groups))
    if len(kept) < 2:
        raise ValueError(
            f"probe task {task.source} has {len(kept)} class(es) with >= {MIN_EXAMPLES} examples "
            f"in >= {MIN_GROUPS} groups ({len(counts)} classes in all); a probe needs at least 2 "
            "— add examples or groups"
        )
    by_class = defaultdict(list)
    for i, lab in enumerate(task.label):
        if lab in kept:
            by_class[lab].append(i)
    chosen = []
    for lab in kept:
        order = sorted(by_class[lab], key=lambda i: _hash(seed, f"example:{i}"))
        chosen += order[:max_per_class]
    chosen.sort()

    labels_in_group = defaultdict(Counter)
    for i in chosen:
        labels_in_group[task.group[i]][task.label[i]] += 1
    groups_by_label = defaultdict(list)
    for grp, c in labels_in_group.items():
        groups_by_label[max(sorted(c), key=c.__getitem__)].append(grp)
    part_of = {}
    for groups in groups_by_label.values():
        groups.sort(key=lambda g: _hash(seed, f"group:{g}"))
        n = len(groups)
        n_test = max(1, round(TEST_FRACTION * n)) if n >= 2 else 0
        n_val = max(1, round(VAL_FRACTION * n)) if n >= 3 else 0
        for k, grp in enumerate(groups):
            part_of[grp] = "test" if k < n_test else "val" if k < n_test + n_val else "train"
    parts = {"train": [], "val": [], "test": []}
    for i in chosen:
        parts[part_of[task.group[i]]].append(i)
    # A class never seen in probe-train cannot be predicted; drop it from val/test too.
    seen = set(task.label[i] for i in parts["train"])
    unseen = [i for p in ("val", "test") for i in parts[p] if task.label[i] not in seen]
    for p in ("val", "test"):
        parts[p] = [i for i in parts[p] if task.label[i] in seen]
    if not parts["test"] or not parts["val"] or len(seen) < 2:
        raise ValueError(f"probe task {task.source} cannot be split by group into train/val/test "
                         "with 2+ classes; add groups")
    accounting = {
        "examples": len(task.label),
        "classes": {lab: counts[lab] for lab in kept},
        "dropped_fewer_than_min_examples": {"classes": len(few),
                                            "examples": sum(counts[c] for c in few)},
        "dropped_fewer_than_min_groups": {"classes": len(few_groups),
                                          "examples": sum(counts[c] for c in few_groups),
                                          "names": few_groups},
        "capped_away": sum(counts[c] for c in kept) - len(chosen),
        "unseen_class_in_eval_dropped": len(unseen),
        "split": {p: {"examples": len(ix), "groups": len(set(task.group[i] for i in ix))}
                  for p, ix in parts.items()},
    }
    return parts, accounting


# --------------------------------------------------------------------------- features


def make_pool_fn(model_config):
    """Jitted (params, inputs, mask) -> (batch, hidden) mean of final hidden states over mask."""

    def fn(params, inputs, mask):
        segments = mask.astype(jnp.int32)  # one document per row
        hidden = model_lib.apply(params, model_config, inputs, mask, segments)  # (b, seq, h)
        weights = mask.astype(jnp.float32)[..., None]
        return jnp.sum(hidden * weights, axis=1) / jnp.maximum(jnp.sum(weights, axis=1), 1.0)

    return jax.jit(fn)


def encoder_features(params, pool_fn, ids: list[np.ndarray], pad_id: int,
                     max_width: int) -> np.ndarray:
    """(n, hidden) float64 features; examples batched by length bucket (speed only)."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out = [None] * len(ids)
    for start in range(0, len(order), BATCH):
        idx = order[start : start + BATCH]
        width = -(-max(len(ids[i]) for i in idx) // LENGTH_BUCKET) * LENGTH_BUCKET
        width = min(width, max_width)
        inputs = np.full((BATCH, width), pad_id, np.int32)
        mask = np.zeros((BATCH, width), bool)
        for r, i in enumerate(idx):
            inputs[r, : len(ids[i])] = ids[i]
            mask[r, : len(ids[i])] = True
        feats = np.asarray(pool_fn(params, inputs, mask), np.float64)
        for r, i in enumerate(idx):
            out[i] = feats[r]
    return np.stack(out)


# --------------------------------------------------------------------------- classifier


def fit_predict(features_of, y: np.ndarray, parts: dict, standardise: bool) -> tuple:
    """Choose C on val, refit on train+val, predict test. ``features_of(fit_idx, idx_list)``
    returns the matrices for each index list, fitted (e.g. a vectoriser) on ``fit_idx`` only."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from threadpoolctl import threadpool_limits

    def model(c):
        clf = LogisticRegression(C=c, max_iter=2000)
        return make_pipeline(StandardScaler(), clf) if standardise else clf

    train, val, test = (np.asarray(parts[p]) for p in ("train", "val", "test"))
    # One BLAS thread: on a small, busy machine threaded BLAS is ~10x slower for these sizes.
    with threadpool_limits(limits=1):
        x_train, x_val = features_of(train, [train, val])
        val_acc = {}
        for c in C_GRID:
            pred = model(c).fit(x_train, y[train]).predict(x_val)
            val_acc[f"{c:g}"] = float(np.mean(pred == y[val]))
        best = max(C_GRID, key=lambda c: (val_acc[f"{c:g}"], -c))  # ties: stronger regularisation
        fit = np.concatenate([train, val])
        x_fit, x_test = features_of(fit, [fit, test])
        pred = model(best).fit(x_fit, y[fit]).predict(x_test)
    return pred == y[test], best, val_acc


def bootstrap_ci(correct: np.ndarray, resamples: np.ndarray) -> list[float]:
    acc = correct[resamples].mean(axis=1)
    return [float(np.percentile(acc, 2.5)), float(np.percentile(acc, 97.5))]


# --------------------------------------------------------------------------- the probe


def probe_run(run_dir: Path, *, task: Path | None = None, seed: int = 0,
              max_per_class: int = MAX_PER_CLASS, step: int | None = None) -> dict:
    """Probe a run's checkpoint ``step`` (default: the latest), its random init and TF-IDF on
    one task; record it in ``history/probe-{step}.json`` and, unless a later step's is there,
    as ``probe.json`` (``judge/history.py``); return it."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    if max_per_class < MIN_EXAMPLES:
        raise ValueError(f"max_per_class={max_per_class} is below {MIN_EXAMPLES}; raise it")
    started = time.perf_counter()
    run_dir = Path(run_dir)
    run = load_run(run_dir, step)
    tokenizer = load_tokenizer(run.tokenizer_path)
    seq_len = min(int(run.info.get("seq_len", run.config.model.max_positions)),
                  run.config.model.max_positions)
    if task is None:
        probe_task = dataset_task(open_run_dataset(run), tokenizer)
    else:
        probe_task = file_task(task, tokenizer, run.specials, seq_len)
    parts, accounting = select_and_split(probe_task, seed, max_per_class)
    y = np.asarray(probe_task.label)
    used = sorted(set(i for p in parts.values() for i in p))

    pool_fn = make_pool_fn(run.config.model)
    pad = run.specials["pad"]
    results = {}
    test = np.asarray(parts["test"])
    rng = np.random.default_rng(seed)
    resamples = rng.integers(0, test.size, size=(BOOTSTRAP_RESAMPLES, test.size))
    correct_of = {}
    for name, params in (("trained", run.params),
                         ("random_init", init_params(run.config.model, run.config.train.seed))):
        feats = np.zeros((len(probe_task.label), run.config.model.hidden))
        feats[used] = encoder_features(params, pool_fn, [probe_task.ids[i] for i in used], pad,
                                       run.config.model.max_positions)
        correct_of[name], c, val_acc = fit_predict(
            lambda fit, lists, f=feats: [f[ix] for ix in lists], y, parts, standardise=True)
        results[name] = {"C": c, "val_accuracy": val_acc}

    texts = np.asarray(probe_task.text, dtype=object)

    def tfidf(fit, lists):
        vec = TfidfVectorizer(sublinear_tf=True).fit(texts[fit])
        return [vec.transform(texts[ix]) for ix in lists]

    correct_of["tfidf"], c, val_acc = fit_predict(tfidf, y, parts, standardise=False)
    results["tfidf"] = {"C": c, "val_accuracy": val_acc}
    for name, correct in correct_of.items():
        results[name] = {"accuracy": float(correct.mean()),
                         "ci95": bootstrap_ci(correct, resamples), **results[name]}
    diff = correct_of["trained"].astype(float) - correct_of["random_init"].astype(float)
    majority = Counter(y[parts["train"]]).most_common(1)[0][0]

    out = {
        "run": str(run_dir),
        "step": run.step,
        "task": {"source": probe_task.source, "seed": seed, "max_per_class": max_per_class,
                 "min_examples": MIN_EXAMPLES, "min_groups": MIN_GROUPS, **accounting},
        "features": "mean of final hidden states over non-pad tokens of [CLS] text [SEP], "
                    f"truncated to {seq_len} tokens; frozen encoder",
        "classifier": "multinomial logistic regression (scikit-learn), standardised features "
                      f"(TF-IDF: l2-normalised), C from {list(C_GRID)} chosen on the validation "
                      "groups, refit on train+validation groups",
        "bootstrap": {"resamples": BOOTSTRAP_RESAMPLES, "seed": seed, "unit": "test examples",
                      "interval": "percentile 95%"},
        "majority_class_accuracy": float(np.mean(y[test] == majority)),
        "results": results,
        "trained_minus_random_init": {"accuracy": float(diff.mean()),
                                      "ci95": bootstrap_ci(diff, resamples)},
        "seconds": round(time.perf_counter() - started, 2),
    }
    history.record(run_dir, "probe", out)
    return out


def summary_table(result: dict):
    """A rich table of ``probe_run``'s result."""
    from rich.table import Table

    split = result["task"]["split"]
    table = Table(title=f"probe at step {result['step']}: {len(result['task']['classes'])} "
                        f"classes; test {split['test']['examples']} examples in "
                        f"{split['test']['groups']} unseen groups")
    for name, justify in (("features", "left"), ("accuracy", "right"), ("95% CI", "right"),
                          ("C", "right")):
        table.add_column(name, justify=justify)
    for name, r in result["results"].items():
        lo, hi = r["ci95"]
        table.add_row(name, f"{r['accuracy']:.3f}", f"[{lo:.3f}, {hi:.3f}]", f"{r['C']:g}")
    d = result["trained_minus_random_init"]
    table.add_row("trained − random_init", f"{d['accuracy']:+.3f}",
                  f"[{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]", "")
    table.add_row("majority class", f"{result['majority_class_accuracy']:.3f}", "", "")
    return table
