"""``clozax evaluate``: a run's checkpoint on its frozen eval-mask set, next to baselines.

The eval-mask set and the held-out sums are ``clozax.train.heldout``'s (the same numbers
training logs). ``evaluate_run`` puts the trained checkpoint next to two baselines on the same
selected positions — a unigram predictor (train-split frequencies, add-one smoothed over
non-special ids) and the same architecture at random initialisation (the run's init key) — and
saves the positions with the lowest target probability as failure cases
(``clozax.judge.failures``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from clozax.core import files
from clozax.core.pipeline import init_params, make_masker
from clozax.core.vocab import Vocabulary
from clozax.data.tokenizer import load_tokenizer
from clozax.judge import history
from clozax.judge.failures import failure_cases
from clozax.judge.slots import make_slot_fn, slot_outputs, sums_from_slots
from clozax.train.heldout import (
    EvalMasks,
    EvalSums,
    build_eval_masks,
    ensure_eval_masks,
    eval_masks_sha256,
    mask_arrays,
)
from clozax.train.run_dir import load_run, open_run_dataset, warn

EVAL_FILE = "eval.json"
FAILURES_FILE = "failures.jsonl"


def unigram_logprobs(counts: np.ndarray, special_ids) -> np.ndarray:
    """(vocab,) float64 log-probabilities from ``counts`` (the train split's real-token counts,
    stored at prepare time), add-one smoothed over the non-special ids; specials get -inf."""
    counts = np.array(counts, np.int64)
    vocab_size = counts.size
    special = np.zeros(vocab_size, bool)
    special[list(special_ids)] = True
    counts[special] = 0
    probs = (counts + 1.0) / (counts.sum() + np.count_nonzero(~special))
    with np.errstate(divide="ignore"):
        return np.where(special, -np.inf, np.log(probs))


def unigram_sums(logprobs: np.ndarray, split, masks: EvalMasks) -> EvalSums:
    """The unigram predictor on the same selected positions (it ignores the input)."""
    targets = mask_arrays(split, masks, np.arange(masks.rows.size))[3]  # (R, count)
    target_logp = logprobs[targets]  # (R, count)
    ascending = np.sort(logprobs)
    rank = logprobs.size - np.searchsorted(ascending, target_logp, side="right")
    return sums_from_slots(-target_logp, rank, masks)


def schedule_description(config, meta: dict, masks: EvalMasks) -> dict:
    m = config.masking
    return {
        "eval_seed": meta.get("eval_seed"),
        "rows": int(masks.rows.size),
        "selected": int(masks.valid.sum()),
        "slots_per_row": int(masks.positions.shape[1]),
        "rate": m.heldout_rate,  # the held-out masks' rate (a ramp's end)
        "unit": m.unit,
        "corruption": {"mask": m.mask, "random": m.random, "keep": m.keep},
        "chunk": meta.get("chunk"),
        "rule": meta.get("schedule"),
    }


def _delta(a: dict, b: dict) -> dict:
    keys = ("loss", "accuracy", "top5_accuracy")
    return {key: b[key] - a[key] for key in keys if key in a and key in b}


def evaluate_run(run_dir: Path, *, mask_seed: int | None = None, failures: int = 20,
                 batch_size: int = 64, step: int | None = None) -> dict:
    """Evaluate a run's checkpoint ``step`` (default: the latest) on its frozen eval-mask set;
    record it in ``history/eval-{step}.json`` and, unless a later step's is there, as
    ``eval.json`` with ``failures.jsonl`` (``judge/history.py``); return the result.

    Baselines on the same selected positions: a unigram predictor (train-split frequencies) and
    the same architecture at random initialisation (the run's init key). ``mask_seed`` also
    evaluates on a second mask set drawn with that eval seed ("corruption transfer": same
    held-out text, different corruption; not a new-language test).
    """
    if failures < 0 or batch_size < 1:
        raise ValueError(f"failures={failures} must be >= 0 and batch_size={batch_size} >= 1")
    run_dir = Path(run_dir)
    run = load_run(run_dir, step)
    run.require_mlm_head("evaluate")
    dataset = open_run_dataset(run)
    cfg = run.config
    vocab = Vocabulary(dataset.vocab_size, dataset.specials)
    masker = make_masker(cfg.masking, vocab, dataset.seq_len)
    masks, meta = ensure_eval_masks(run_dir, dataset, masker, cfg.train.eval_seed,
                                    cfg.train.eval_rows, say=warn)
    split = dataset.heldout
    special_ids = sorted(set(dataset.specials.values()))
    slot_fn = make_slot_fn(cfg.model)

    trained = slot_outputs(run.params, cfg.model, split, masks, batch_size, slot_fn)
    random = slot_outputs(init_params(cfg.model, cfg.train.seed), cfg.model, split, masks,
                          batch_size, slot_fn)
    unigram = unigram_logprobs(dataset.unigram_counts("train"), special_ids)
    trained_metrics = trained.sums(masks).metrics()

    transfer = None
    if mask_seed is not None:
        other = build_eval_masks(split, masker, mask_seed, cfg.train.eval_rows)
        out = slot_outputs(run.params, cfg.model, split, other, batch_size, slot_fn)
        other_metrics = out.sums(other).metrics()
        transfer = {
            "label": "corruption transfer (same held-out text, masks from another eval seed; "
                     "not a new-language test)",
            "mask_seed": mask_seed,
            "eval_masks_sha256": eval_masks_sha256(other),
            "same_as_frozen": eval_masks_sha256(other) == meta["sha256"],
            "trained": other_metrics,
            "difference": _delta(trained_metrics, other_metrics),
        }

    result = {
        "run": str(run_dir),
        "dataset": str(dataset.path),
        "step": run.step,
        "checkpoint_step": run.step,
        "tokens_seen": run.step * cfg.train.batch_size * dataset.seq_len,
        "eval_masks_sha256": meta["sha256"],
        "trained": trained_metrics,
        "unigram": unigram_sums(unigram, split, masks).metrics(),
        "random_init": random.sums(masks).metrics(),
        "transfer": transfer,
        "schedule": schedule_description(cfg, meta, masks),
    }
    tokenizer = load_tokenizer(run.tokenizer_path)
    cases = failure_cases(tokenizer, split, masks, trained, special_ids, failures)
    if history.record(run_dir, "eval", result):  # the newest step scored: its failures too
        files.write_jsonl(run_dir / FAILURES_FILE, cases)
    return result


def evaluate_checkpoints(run_dir: Path, **options) -> list[dict]:
    """``evaluate_run`` at every committed checkpoint, oldest first (a learning curve)."""
    from clozax.train.checkpoint import Checkpointer

    checkpointer = Checkpointer(Path(run_dir), read_only=True)
    try:
        steps = checkpointer.all_steps()
    finally:
        checkpointer.close()
    if not steps:
        raise ValueError(f"run {run_dir} has no checkpoint yet; train it (or let a save "
                         "complete) first")
    return [evaluate_run(run_dir, step=s, **options) for s in steps]


def summary_table(result: dict):
    """A rich table of ``evaluate_run``'s result: one row per predictor, accuracy by kind."""
    from rich import box
    from rich.table import Table

    kinds = ("mask", "random", "keep")
    counts = ", ".join(f"{k} {result['trained']['by_kind'][k]['count']}" for k in kinds)
    table = Table(title=f"held-out masked tokens, step {result['step']}: "
                        f"{result['trained']['count']} positions ({counts}); accuracy overall "
                        "and by corruption kind", box=box.SIMPLE_HEAD)
    table.add_column("predictor", no_wrap=True)
    for name in ("acc", *kinds, "top-5", "loss"):
        table.add_column(name, justify="right", no_wrap=True)
    rows = [(name.replace("_", " "), result[name])
            for name in ("trained", "unigram", "random_init")]
    if result.get("transfer"):
        rows.append((f"seed {result['transfer']['mask_seed']} masks",
                     result["transfer"]["trained"]))
    for name, m in rows:
        by_kind = [f"{m['by_kind'][k]['accuracy']:.4f}" if m["by_kind"][k]["count"] else "-"
                   for k in kinds]
        table.add_row(name, f"{m['accuracy']:.4f}", *by_kind, f"{m['top5_accuracy']:.4f}",
                      f"{m['loss']:.3f}")
    return table
