"""Downstream probe: does pretraining give features a linear classifier can use?

The task comes from the one task stack of ``probe`` and ``finetune`` (``judge/task_load.py``):
by default the ``label`` of each document of the run's dataset (for the built-in corpus, a
docstring's top-level stdlib package; groups are modules) — trained on documents of the train
split, validated and tested on documents of the held-out split, so no evaluated text was
pretrained on; classes with at least ``MIN_EXAMPLES`` training documents that the held-out split
also has, at most ``max_per_class`` per class (a keyed-hash choice), every drop counted. A user
task is a JSONL file with ``text`` and ``label`` (and optionally ``group``) fields, split by a
keyed hash of the group; its validation and test examples that the encoder read in pretraining
are dropped unless ``keep_pretraining_overlap``.

Features: the mean over non-pad tokens of the frozen encoder's final hidden states of
``[CLS] text [SEP]``, truncated to the run's trained length. Classifier: the one linear
baseline (``judge/baselines.py``): logistic regression on standardised features, ``C`` chosen
on validation. The same is done for the random-init encoder (the run's init key) and for TF-IDF
features of the same text (l2-normalised, not standardised). Accuracy on the test split with a
percentile bootstrap 95 % interval over test examples (paired resamples, so the trained −
random difference has its own interval).
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from clozax.core import model as model_lib
from clozax.core.train_state import init_params
from clozax.data.tokenizer import load_tokenizer
from clozax.judge import history
from clozax.judge.baselines import C_GRID, linear_classifier, tfidf_baseline
from clozax.judge.claims import accounting_lines
from clozax.judge.finetune import tasks
from clozax.judge.task_load import MAX_PER_CLASS, MIN_EXAMPLES, TaskSpec, load_task
from clozax.train.run_dir import load_run

PROBE_FILE = "probe.json"
BOOTSTRAP_RESAMPLES = 1000
BATCH = 32
LENGTH_BUCKET = 32  # inputs are padded to a multiple of this (few compiles, little waste)


# --------------------------------------------------------------------------- features


def make_pool_fn(model_config):
    """Jitted (params, inputs, mask) -> (batch, hidden) mean of final hidden states over mask."""

    def fn(params, inputs, mask):
        segments = mask.astype(jnp.int32)  # one document per row
        hidden = model_lib.apply(params, model_config, inputs, mask, segments)  # (b, seq, h)
        weights = mask.astype(jnp.float32)[..., None]
        return jnp.sum(hidden * weights, axis=1) / jnp.maximum(jnp.sum(weights, axis=1), 1.0)

    return jax.jit(fn)


def encoder_features(params, pool_fn, ids: list[np.ndarray], pad_id: int, max_width: int,
                     bucket: int = LENGTH_BUCKET, batch: int = BATCH):
    """(n, ...) float64 features, or a dict of them where ``pool_fn`` returns one; examples
    batched ``batch`` at a time by length, each batch padded to a multiple of ``bucket`` (at
    most ``max_width``; speed only: a bucket of ``max_width`` compiles one width)."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out = [None] * len(ids)
    for start in range(0, len(order), batch):
        idx = order[start : start + batch]
        width = -(-max(len(ids[i]) for i in idx) // bucket) * bucket
        width = min(width, max_width)
        inputs = np.full((batch, width), pad_id, np.int32)
        mask = np.zeros((batch, width), bool)
        for r, i in enumerate(idx):
            inputs[r, : len(ids[i])] = ids[i]
            mask[r, : len(ids[i])] = True
        feats = jax.tree.map(lambda a: np.asarray(a, np.float64), pool_fn(params, inputs, mask))
        for r, i in enumerate(idx):
            out[i] = jax.tree.map(lambda a, r=r: a[r], feats)
    return jax.tree.map(lambda *rows: np.stack(rows), *out)


# --------------------------------------------------------------------------- the probe


def bootstrap_ci(correct: np.ndarray, resamples: np.ndarray) -> list[float]:
    acc = correct[resamples].mean(axis=1)
    return [float(np.percentile(acc, 2.5)), float(np.percentile(acc, 97.5))]


def probe_run(run_dir: Path, *, task: Path | None = None, seed: int = 0,
              max_per_class: int = MAX_PER_CLASS, step: int | None = None,
              keep_pretraining_overlap: bool = False) -> dict:
    """Probe a run's checkpoint ``step`` (default: the latest), its random init and TF-IDF on
    one task; record it in ``history/probe-{step}.json`` and, unless a later step's is there,
    as ``probe.json`` (``judge/history.py``); return it."""
    started = time.perf_counter()
    run_dir = Path(run_dir)
    run = load_run(run_dir, step)
    tokenizer = load_tokenizer(run.tokenizer_path)
    spec = TaskSpec(train=task, fields=tasks.Fields(group="group"), name="probe",
                    metric="accuracy", split_seed=seed, max_per_class=max_per_class,
                    keep_pretraining_overlap=keep_pretraining_overlap)
    probe_task = load_task(spec, run, tokenizer)
    splits = probe_task.splits
    y_test = np.asarray(splits["test"].y)

    pool_fn = make_pool_fn(run.config.model)
    pad = run.specials["pad"]
    results, correct_of = {}, {}
    for name, params in (("trained", run.params),
                         ("random_init", init_params(run.config.model, run.config.train.seed))):
        feats = {s: encoder_features(params, pool_fn, splits[s].ids, pad,
                                     run.config.model.max_positions) for s in tasks.SPLITS}
        fit = linear_classifier(feats, probe_task, "accuracy", standardise=True)
        correct_of[name] = fit["test_pred"] == y_test
        results[name] = {"C": fit["C"], "val_accuracy": fit["validation_by_C"]}
    fit = tfidf_baseline(probe_task, "accuracy")
    correct_of["tfidf"] = fit["test_pred"] == y_test
    results["tfidf"] = {"C": fit["C"], "val_accuracy": fit["validation_by_C"]}

    rng = np.random.default_rng(seed)
    resamples = rng.integers(0, y_test.size, size=(BOOTSTRAP_RESAMPLES, y_test.size))
    for name, correct in correct_of.items():
        results[name] = {"accuracy": float(correct.mean()),
                         "ci95": bootstrap_ci(correct, resamples), **results[name]}
    diff = correct_of["trained"].astype(float) - correct_of["random_init"].astype(float)
    train_counts = Counter(probe_task.labels[i] for i in splits["train"].y)
    majority = probe_task.labels.index(train_counts.most_common(1)[0][0])
    groups = (probe_task.accounting.get("selection") or {}).get("groups", {})
    out = {
        "run": str(run_dir),
        "step": run.step,
        "task": {"source": probe_task.source, "seed": seed, "max_per_class": max_per_class,
                 "min_examples": MIN_EXAMPLES,
                 "classes": {lab: train_counts[lab] for lab in probe_task.labels},
                 "split": {s: {"examples": len(splits[s]), "groups": groups.get(s)}
                           for s in tasks.SPLITS},
                 **probe_task.accounting},
        "features": "mean of final hidden states over non-pad tokens of [CLS] text [SEP], "
                    f"truncated to {run.trained_length} tokens; frozen encoder",
        "classifier": "multinomial logistic regression (scikit-learn), standardised features "
                      f"(TF-IDF: l2-normalised), C from {list(C_GRID)} chosen on the validation "
                      "split, fitted on the training split",
        "bootstrap": {"resamples": BOOTSTRAP_RESAMPLES, "seed": seed, "unit": "test examples",
                      "interval": "percentile 95%"},
        "majority_class_accuracy": float(np.mean(y_test == majority)),
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
    groups = split["test"].get("groups")
    table = Table(title=f"probe at step {result['step']}: {len(result['task']['classes'])} "
                        f"classes; test {split['test']['examples']} examples"
                        + (f" in {groups} groups unseen in training" if groups else "")
                        + ("; PRETRAINING OVERLAP KEPT" if result["task"].get(
                            "pretraining_overlap", {}).get("excluded") is False else ""))
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
    table.caption = "\n".join(accounting_lines(result["task"]))
    return table
