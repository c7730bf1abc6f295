"""What pretraining did to an encoder's sentence features, layer by layer, beside its random
init: the diagnosis behind "`modern-small` does not beat its own random init" (issue 59).

    python benchmarks/representations.py RUN [RUN ...] [--finetune-lr 1e-3] [--out FILE]

For each run and its random init (the run's own init key), on the built-in task (the run's
dataset labels: train split → train, held-out → validation; no test example is read), at every
depth d = 1..layers:

- ``cls_norm_ratio``: the mean norm of ``[CLS]``'s state in the residual stream over the mean
  norm of the other real tokens' (before the final norm). A ratio far above 1 is an attention
  sink: one position that every query can park on, whose state carries little of the text.
- ``effective_rank``: Roy & Vetterli's exp(entropy) of the normalised singular values of the
  documents' centred ``[CLS]`` features (after the final norm, what a head sees), and
  ``mean_cosine``: the mean cosine between two documents' ``[CLS]`` features (uncentred; 1:
  every document looks the same).
- ``probe``: validation accuracy of a linear probe (the one linear baseline,
  ``judge/baselines.py``: logistic regression on standardised features, C chosen on
  validation) on ``[CLS]`` and on the mean over real tokens.

It records the norm of the embeddings and of each block. At the top it also reads the features
the fine-tuning head starts from (the modern head is started from the encoder's MLM head
transform: dense, GELU, LayerNorm). With ``--finetune-lr``, it fine-tunes each encoder once
(the default protocol, seed 0, keeping the best-validation epoch) and reports how far each
layer moved: ‖θ_tuned − θ_0‖ / ‖θ_0‖ per block, for the embeddings, the final norm and the
head.

Writes one JSON document (``--out``, default ``OUT/representations.json`` beside the first run)
and prints a table per run. Bad input (a directory that is not a run) is one line and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import downstream  # noqa: E402

BATCH = 64


def effective_rank(x: np.ndarray) -> float:
    """exp(entropy of the normalised singular values) of ``x`` (n, h) centred over rows: 1 when
    every row is the same direction up to a shift, ``min(n, h)`` when all directions are equal."""
    s = np.linalg.svd(x - x.mean(axis=0), compute_uv=False)
    p = s / max(s.sum(), 1e-30)
    p = p[p > 0]
    return float(np.exp(-(p * np.log(p)).sum()))


def mean_cosine(x: np.ndarray) -> float:
    """The mean cosine between two different rows of ``x`` (n, h), uncentred."""
    u = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    n = len(u)
    total = np.square(u.sum(axis=0)).sum()  # sum over all ordered pairs, the diagonal included
    return float((total - n) / (n * (n - 1)))


def frobenius(tree) -> float:
    """The Frobenius norm over every array of a parameter subtree (float64)."""
    import jax

    return float(np.sqrt(sum(np.square(np.asarray(a, np.float64)).sum()
                             for a in jax.tree.leaves(tree))))


def block(layers: dict, i: int) -> dict:
    """Block ``i`` of the stacked ``(layers, ...)`` parameters."""
    import jax

    return jax.tree.map(lambda a: a[i], layers)


def relative_change(before, after) -> float:
    """‖after − before‖ / ‖before‖ over every array of a parameter subtree."""
    import jax

    moved = jax.tree.map(lambda x, y: np.asarray(y, np.float64) - np.asarray(x, np.float64),
                         before, after)
    return frobenius(moved) / max(frobenius(before), 1e-30)


def norms(params: dict, layers: int) -> dict:
    """The Frobenius norm of the embeddings and of each block's parameters."""
    return {"embeddings": frobenius(params["embeddings"]),
            "blocks": [frobenius(block(params["layers"], i)) for i in range(layers)]}


def depth_features(params: dict, config, depth: int, splits: dict, pad: int,
                   width: int) -> dict:
    """Features of every example of each of ``splits`` (by name; one compile for all) after
    ``depth`` blocks: ``cls``/``mean`` after the
    final norm (pre-norm encoders; the post-norm residual stream is already normalised), the
    ``[CLS]``/token norm ratio of the residual stream, and, at the top, the head transform's
    ``cls_head``/``mean_head`` (the modern head's starting point)."""
    import jax
    import jax.numpy as jnp

    from clozax.core import layers
    from clozax.core import model as model_lib
    from clozax.judge.probe import encoder_features

    pre = config.layer_norm == "pre" and config.final_norm
    cut = dataclasses.replace(config, layers=depth, final_norm=False)
    sub = {**params, "layers": jax.tree.map(lambda a: a[:depth], params["layers"])}
    top = depth == config.layers and "head" in params and "transform" in params["head"]

    @jax.jit
    def features(p, inputs, mask):
        x = model_lib.apply(p, cut, inputs, mask, mask.astype(jnp.int32))  # (b, s, h) raw
        norms = jnp.linalg.norm(x, axis=-1)  # (b, s)
        others = mask.at[:, 0].set(False)
        ratio = norms[:, 0] / (jnp.sum(norms * others, 1) / jnp.maximum(others.sum(1), 1))
        if pre:
            x = layers.layer_norm(x, p["final_norm"], config.layer_norm_eps)
        w = mask.astype(jnp.float32)[..., None]
        out = {"cls": x[:, 0], "mean": jnp.sum(x * w, 1) / jnp.maximum(w.sum(1), 1.0),
               "ratio": ratio}
        if top:
            h = p["head"]

            def transform(v):
                v = layers.gelu(layers.dense(v, h["transform"], config.dtype))
                return layers.layer_norm(v, h["layer_norm"], config.layer_norm_eps)

            out["cls_head"], out["mean_head"] = transform(out["cls"]), transform(out["mean"])
        return out

    return {name: encoder_features(sub, features, split.ids, pad, width, bucket=width,
                                   batch=BATCH) for name, split in splits.items()}


def probe(train: np.ndarray, validation: np.ndarray, task) -> float:
    """Validation accuracy of the one linear baseline on these features (C on validation).
    The test split is never read: validation stands in for it."""
    from clozax.judge.baselines import linear_classifier

    seen = dataclasses.replace(task, splits={**task.splits, "test": task.splits["validation"]})
    x = {"train": train, "validation": validation, "test": validation}
    return float(linear_classifier(x, seen, "accuracy", standardise=True)["validation"]
                 ["accuracy"])


def encoder_rows(params: dict, config, task, pad: int, width: int) -> list[dict]:
    """One row per depth (see the module docstring)."""
    splits = {s: task.splits[s] for s in ("train", "validation")}
    rows = []
    for depth in range(1, config.layers + 1):
        f = depth_features(params, config, depth, splits, pad, width)
        v = f["validation"]
        row = {"depth": depth, "cls_norm_ratio": float(v["ratio"].mean()),
               "cls_effective_rank": effective_rank(v["cls"]),
               "mean_effective_rank": effective_rank(v["mean"]),
               "cls_mean_cosine": mean_cosine(v["cls"]),
               "mean_mean_cosine": mean_cosine(v["mean"]),
               "probe_cls": probe(f["train"]["cls"], v["cls"], task),
               "probe_mean": probe(f["train"]["mean"], v["mean"], task)}
        if "cls_head" in v:
            row.update({"head_cls_effective_rank": effective_rank(v["cls_head"]),
                        "head_cls_mean_cosine": mean_cosine(v["cls_head"]),
                        "probe_head_cls": probe(f["train"]["cls_head"], v["cls_head"], task),
                        "probe_head_mean": probe(f["train"]["mean_head"], v["mean_head"],
                                                 task)})
        rows.append(row)
        print(f"  depth {depth}: [CLS]/token norm {row['cls_norm_ratio']:.2f}, [CLS] rank "
              f"{row['cls_effective_rank']:.1f}, cosine {row['cls_mean_cosine']:.2f}, probe "
              f"[CLS] {row['probe_cls']:.3f} mean {row['probe_mean']:.3f}", flush=True)
    return rows


def movement(run, params: dict, task, lr: float) -> dict:
    """Fine-tune ``params`` once (the default protocol at ``lr``, seed 0, best-validation epoch)
    and measure each part's relative change."""
    import jax

    from clozax.judge.finetune import jobs

    protocol = jobs.Protocol(learning_rates=(lr,), seeds=1, control=False)
    setup = jobs.make_setup(run.config.model, task, protocol, run.specials["pad"],
                            run.trained_length)
    before = jax.device_get(params)
    record, tuned = jobs.run_job(setup, task, params, lr, 0, keep_best=True)
    enc = tuned["encoder"]
    blocks = [relative_change(block(before["layers"], i), block(enc["layers"], i))
              for i in range(run.config.model.layers)]
    out = {"learning_rate": lr, "validation_accuracy": record["per_epoch"][
               jobs.best_epoch(record, "accuracy") - 1]["validation"]["accuracy"],
           "embeddings": relative_change(before["embeddings"], enc["embeddings"]),
           "blocks": blocks}
    if "final_norm" in enc:
        out["final_norm"] = relative_change(before["final_norm"], enc["final_norm"])
    head_before = before.get("head", {})
    if "dense" in tuned["head"] and "transform" in head_before:
        out["head_transform"] = relative_change(head_before["transform"],
                                                tuned["head"]["dense"])
    return out


def diagnose(run_dir: Path, lr: float | None) -> dict:
    from clozax.core.train_state import init_params
    from clozax.data.tokenizer import load_tokenizer
    from clozax.judge.task_load import TaskSpec, load_task
    from clozax.train.run_dir import load_run

    run = load_run(run_dir)
    task = load_task(TaskSpec(name="labels"), run, load_tokenizer(run.tokenizer_path))
    out = {"run": str(run_dir), "step": run.step, "examples": {
        s: len(task.splits[s]) for s in ("train", "validation")}, "encoders": {}}
    for name, params in (("trained", run.params),
                         ("random_init", init_params(run.config.model, run.config.train.seed))):
        print(f"{run_dir} — {name}", flush=True)
        entry = {"norms": norms(params, run.config.model.layers),
                 "depths": encoder_rows(params, run.config.model, task, run.specials["pad"],
                                        run.trained_length)}
        if lr is not None:
            entry["finetune_movement"] = movement(run, params, task, lr)
            m = entry["finetune_movement"]
            print(f"  fine-tuned at {lr:g}: validation {m['validation_accuracy']:.3f}; moved "
                  f"embeddings {m['embeddings']:.3f}, blocks "
                  + " ".join(f"{b:.3f}" for b in m["blocks"]), flush=True)
        out["encoders"][name] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--finetune-lr", type=float, default=None,
                        help="also fine-tune each encoder once at this rate and report how far "
                        "each layer moved")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    for run in args.runs:
        if not (run / "run.json").is_file():
            return downstream.error(f"{run} is not a run directory (no run.json); give "
                                    "clozax train output directories")
    if args.finetune_lr is not None and not 0 < args.finetune_lr < 1:
        return downstream.error(f"--finetune-lr {args.finetune_lr:g} must be in (0, 1), e.g. 1e-3")
    from clozax.train import compile_cache

    compile_cache.enable()
    try:
        result = {"runs": [diagnose(run, args.finetune_lr) for run in args.runs]}
    except (ValueError, FileNotFoundError) as e:  # a run without labels, a damaged run
        return downstream.error(str(e).splitlines()[0])
    out = args.out or args.runs[0].parent / "representations.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
