"""``clozax evaluate``: a run's checkpoint on its frozen eval-mask set, next to baselines.

The eval-mask set and the held-out sums are ``clozax.train.heldout``'s (the same numbers
training logs). ``evaluate_run`` puts the trained checkpoint next to two baselines on the same
selected positions — a unigram predictor (train-split frequencies, add-one smoothed over
non-special ids) and the same architecture at random initialisation (the run's init key) — and
saves the positions with the lowest target probability as failure cases
(``clozax.judge.failures``). With ``full`` it scores every held-out row instead, its masks drawn
chunk by chunk by the same rule: every array is one chunk's, the sums float64 numerators and
counts, the failures a bounded top-k — memory does not grow with the held-out split.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from clozax.core import files
from clozax.core.masker import make_masker
from clozax.core.train_state import init_params
from clozax.core.vocab import Vocabulary
from clozax.data.tokenizer import load_tokenizer
from clozax.judge import history
from clozax.judge.failures import WorstSlots
from clozax.judge.slots import make_slot_fn, slot_outputs, sums_from_slots
from clozax.train.heldout import (
    EVAL_MASK_CHUNK,
    FIXED_RATE,
    FIXED_STEM,
    SCHEDULE,
    EvalMasks,
    EvalSums,
    chunk_sha256,
    ensure_eval_masks,
    evaluate_masks,
    fixed_rate,
    iter_chunks,
    make_eval_fn,
    mask_arrays,
)
from clozax.train.mesh import evaluation_placement
from clozax.train.phases import tokens_at
from clozax.train.run_dir import load_run, open_run_dataset, warn

EVAL_FILE = "eval.json"
FAILURES_FILE = "failures.jsonl"
FULL_FILE = "eval_full.json"  # ``--full``: every held-out row
FULL_FAILURES_FILE = "failures_full.jsonl"


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


def added(a: EvalSums | None, b: EvalSums) -> EvalSums:
    """Two sets of sums as one (numerators and counts add)."""
    if a is None:
        return b
    return EvalSums(*(x + y for x, y in zip(vars(a).values(), vars(b).values(), strict=True)))


def score_chunks(chunks, run, model_config, split, *, unigram: np.ndarray, failures: int,
                 batch_size: int, progress=None, random_init: bool = True) -> dict:
    """Stream an eval-mask set's chunks through the trained model (per-slot outputs: its sums
    and the worst slots), the random-init model (sums only) and the unigram predictor; hash it
    as it goes. Holds one chunk at a time; batches are split over this process's devices."""
    slot_fn, eval_fn = make_slot_fn(model_config), make_eval_fn(model_config)
    put, replicate, batch_size = evaluation_placement(batch_size)
    params = replicate(run.params)
    random_params = replicate(init_params(model_config, run.config.train.seed))
    sums = {"trained": None, "random_init": None, "unigram": None}
    worst, h = WorstSlots(failures), hashlib.sha256()
    rows = selected = 0
    for masks in chunks:
        out = slot_outputs(params, model_config, split, masks, batch_size, slot_fn, put)
        sums["trained"] = added(sums["trained"], out.sums(masks))
        if random_init:
            sums["random_init"] = added(sums["random_init"], evaluate_masks(
                random_params, model_config, split, masks, batch_size, eval_fn, put=put))
        sums["unigram"] = added(sums["unigram"], unigram_sums(unigram, split, masks))
        worst.add(masks, out, rows)
        chunk_sha256(h, masks)
        rows, selected = rows + masks.rows.size, selected + int(masks.valid.sum())
        slots_per_row = int(masks.positions.shape[1])
        if progress is not None:
            progress(rows)
    return {"sums": sums, "worst": worst, "sha256": h.hexdigest(), "rows": rows,
            "selected": selected, "slots_per_row": slots_per_row}


def schedule_description(config, meta: dict, scored: dict, heldout_rows: int) -> dict:
    m = config.masking
    return {
        "eval_seed": meta.get("eval_seed", config.train.eval_seed),
        "rows": scored["rows"],
        "heldout_rows": heldout_rows,
        "selected": scored["selected"],
        "slots_per_row": scored["slots_per_row"],
        "rate": m.heldout_rate,  # the held-out masks' rate (a ramp's end)
        "unit": m.unit,
        "corruption": {"mask": m.mask, "random": m.random, "keep": m.keep},
        "chunk": meta.get("chunk", EVAL_MASK_CHUNK),
        "rule": meta.get("schedule", SCHEDULE),
    }


def _delta(a: dict, b: dict) -> dict:
    keys = ("loss", "accuracy", "top5_accuracy")
    return {key: b[key] - a[key] for key in keys if key in a and key in b}


def _fixed_rate(run, dataset, vocab, unigram, batch_size: int, full: bool,
                baselines: dict) -> dict | None:
    """The same checkpoint on the fixed-15 % set beside the run's own (``heldout.fixed_rate``:
    the same rows, eval seed and corruption mix): the number that compares runs trained at
    different rates. None when the run's own set is at 15 %."""
    cfg = run.config
    masking = fixed_rate(cfg.masking)
    if masking is None:
        return None
    masker = make_masker(masking, vocab, dataset.seq_len)
    split, key = dataset.heldout, "full-15" if full else "frozen-15"
    if full:
        chunks, meta = iter_chunks(split, masker, cfg.train.eval_seed, np.arange(split.rows)), {}
    else:
        masks, meta = ensure_eval_masks(run.path, dataset, masker, cfg.train.eval_seed,
                                        cfg.train.eval_rows, say=warn, stem=FIXED_STEM)
        chunks = _stored_chunks(masks)
    scored = score_chunks(chunks, run, cfg.model, split, unigram=unigram, failures=0,
                          batch_size=batch_size, random_init=key not in baselines)
    if key not in baselines:
        baselines[key] = scored["sums"]["random_init"].metrics()
    return {"rate": FIXED_RATE, "unit": masking.unit,
            "eval_masks_sha256": scored["sha256"] if full else meta["sha256"],
            "selected": scored["selected"], "trained": scored["sums"]["trained"].metrics(),
            "unigram": scored["sums"]["unigram"].metrics(), "random_init": baselines[key]}


def _stored_chunks(masks: EvalMasks):
    for c in range(-(-masks.rows.size // EVAL_MASK_CHUNK)):
        yield masks.chunk(c)


def evaluate_run(run_dir: Path, *, mask_seed: int | None = None, failures: int = 20,
                 batch_size: int = 64, step: int | None = None, full: bool = False,
                 progress=None, baselines: dict | None = None) -> dict:
    """Evaluate a run's checkpoint ``step`` (default: the latest) on its frozen eval-mask set;
    record it in ``history/eval-{step}.json`` and, unless a later step's is there, as
    ``eval.json`` with ``failures.jsonl`` (``judge/history.py``); return the result.

    Baselines on the same selected positions: a unigram predictor (train-split frequencies) and
    the same architecture at random initialisation (the run's init key). ``mask_seed`` also
    evaluates on a second mask set drawn with that eval seed ("corruption transfer": same
    held-out text, different corruption; not a new-language test). ``full``: every held-out
    row, streamed (``eval_full.json``, ``failures_full.jsonl``); ``progress(rows_done, rows)``
    is called after each chunk. ``baselines``: a dict shared by the evaluations of one run's
    checkpoints, which keeps the random-init numbers (the same for every step) once scored.
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
    unigram = unigram_logprobs(dataset.unigram_counts("train"), special_ids)
    if full:
        chunks = iter_chunks(split, masker, cfg.train.eval_seed, np.arange(split.rows))
    else:
        chunks = _stored_chunks(masks)
    total = split.rows if full else masks.rows.size
    baselines = {} if baselines is None else baselines
    kept = baselines.get("full" if full else "frozen")
    scored = score_chunks(chunks, run, cfg.model, split, unigram=unigram, failures=failures,
                          batch_size=batch_size, random_init=kept is None,
                          progress=progress and (lambda done: progress(done, total)))
    random_metrics = kept or scored["sums"]["random_init"].metrics()
    baselines["full" if full else "frozen"] = random_metrics
    trained_metrics = scored["sums"]["trained"].metrics()
    fixed = _fixed_rate(run, dataset, vocab, unigram, batch_size, full, baselines)

    transfer = None
    if mask_seed is not None:
        other_rows = np.arange(split.rows) if full else masks.rows
        other = score_chunks(iter_chunks(split, masker, mask_seed, other_rows), run, cfg.model,
                             split, unigram=unigram, failures=0, batch_size=batch_size,
                             random_init=False)
        other_metrics = other["sums"]["trained"].metrics()
        transfer = {
            "label": "corruption transfer (same held-out text, masks from another eval seed; "
                     "not a new-language test)",
            "mask_seed": mask_seed,
            "eval_masks_sha256": other["sha256"],
            "same_as_frozen": other["sha256"] == scored["sha256"],
            "trained": other_metrics,
            "difference": _delta(trained_metrics, other_metrics),
        }

    result = {
        "run": str(run_dir),
        "dataset": str(dataset.path),
        "step": run.step,
        "checkpoint_step": run.step,
        "tokens_seen": tokens_at(run.info, run.step) or run.step * cfg.train.batch_size
        * dataset.seq_len,
        "set": "full" if full else "frozen",
        "eval_masks_sha256": scored["sha256"] if full else meta["sha256"],
        "trained": trained_metrics,
        "unigram": scored["sums"]["unigram"].metrics(),
        "random_init": random_metrics,
        "transfer": transfer,
        "fixed_rate": fixed,
        "schedule": schedule_description(cfg, {} if full else meta, scored, split.rows),
    }
    if full:
        result["schedule"]["rule"] = ("every held-out row; chunk c of them uses "
                                      "fold_in(key(eval_seed), c)")
    cases = scored["worst"].cases(load_tokenizer(run.tokenizer_path), split, special_ids)
    name, failures_file = ("eval_full", FULL_FAILURES_FILE) if full else ("eval", FAILURES_FILE)
    history.record_lines(run_dir, failures_file.split(".")[0], run.step, cases)
    if history.record(run_dir, name, result):  # the newest step scored: its failures too
        files.write_jsonl(run_dir / failures_file, cases)
    return result


def evaluate_checkpoints(run_dir: Path, **options) -> list[dict]:
    """``evaluate_run`` at every committed checkpoint, oldest first (a learning curve)."""
    baselines = {}
    return [evaluate_run(run_dir, step=s, baselines=baselines, **options)
            for s in history.committed_steps(run_dir)]


def summary_table(result: dict):
    """A rich table of ``evaluate_run``'s result: one row per predictor, accuracy by kind."""
    from rich import box
    from rich.table import Table

    kinds = ("mask", "random", "keep")
    counts = ", ".join(f"{k} {result['trained']['by_kind'][k]['count']}" for k in kinds)
    sched = result["schedule"]
    which = ("every held-out row" if result.get("set") == "full" else
             f"frozen sample, {sched['rows']:,} of {sched.get('heldout_rows', sched['rows']):,} "
             "held-out rows")
    table = Table(title=f"held-out masked tokens ({which}), step {result['step']}: "
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
    if result.get("fixed_rate"):
        rows += [(f"{name} (15 % masks)", result["fixed_rate"][key])
                 for name, key in (("trained", "trained"), ("unigram", "unigram"),
                                   ("random init", "random_init"))]
    for name, m in rows:
        by_kind = [f"{m['by_kind'][k]['accuracy']:.4f}" if m["by_kind"][k]["count"] else "-"
                   for k in kinds]
        table.add_row(name, f"{m['accuracy']:.4f}", *by_kind, f"{m['top5_accuracy']:.4f}",
                      f"{m['loss']:.3f}")
    return table
