"""Held-out evaluation on a frozen eval-mask set, aggregated as numerators and counts.

The eval-mask set is the documented mask schedule for held-out numbers: the held-out rows'
selections and corruptions come from a fixed eval key (``train.eval_seed``, never the training
key), are computed once per run in fixed chunks of ``EVAL_MASK_CHUNK`` rows (chunk ``c`` uses
``fold_in(eval_key, c)``), stored in the run directory with their sha256, and reused by every
evaluation. Every metric is a sum over all selected held-out positions divided once by their
count, overall and per corruption kind.

``evaluate_run`` (``clozax evaluate``) puts the trained checkpoint next to two baselines on the
same selected positions — a unigram predictor (train-split frequencies, add-one smoothed over
non-special ids) and the same architecture at random initialisation (the run's init key) — and
saves the positions with the lowest target probability as failure cases.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from clozax import model as model_lib
from clozax.masking import KIND_NAMES, Kind

EVAL_MASK_CHUNK = 256
EVAL_MASKS_FILE = "eval_masks.npz"
EVAL_MASKS_META = "eval_masks.json"


class EvalMasks(NamedTuple):
    """rows: (R,) held-out row indices; inputs: (R, seq) corrupted ids;
    positions/valid/kinds: (R, count) selected slots, their validity and corruption kind."""

    rows: np.ndarray
    inputs: np.ndarray
    positions: np.ndarray
    valid: np.ndarray
    kinds: np.ndarray


def eval_rows(heldout_rows: int, max_rows: int | None) -> np.ndarray:
    """The held-out rows evaluated: all, or the first ``max_rows`` (a fixed, documented prefix)."""
    n = heldout_rows if max_rows is None else min(heldout_rows, max_rows)
    return np.arange(n)


def build_eval_masks(split, masker, eval_seed: int, max_rows: int | None = None) -> EvalMasks:
    """Compute the frozen eval-mask set. ``masker(key, batch) -> (MaskedBatch, Selection)``."""
    rows = eval_rows(split.rows, max_rows)
    if rows.size == 0:
        raise ValueError("the held-out split has no rows; prepare a dataset with held-out data")
    eval_key = jax.random.key(eval_seed)
    masker = jax.jit(masker)
    parts = []
    for c, start in enumerate(range(0, rows.size, EVAL_MASK_CHUNK)):
        chunk = rows[start : start + EVAL_MASK_CHUNK]
        batch = {
            "tokens": np.asarray(split.tokens[chunk], np.int32),
            "segments": np.asarray(split.segments[chunk], np.int32),
            "word_starts": np.asarray(split.word_starts[chunk], bool),
        }
        masked, selection = masker(jax.random.fold_in(eval_key, c), batch)
        kinds = jnp.take_along_axis(masked.kind, selection.positions, axis=-1)
        parts.append(
            (np.asarray(masked.inputs, np.int32), np.asarray(selection.positions, np.int32),
             np.asarray(selection.valid, bool), np.asarray(kinds, np.int8))
        )
    inputs, positions, valid, kinds = (np.concatenate(p) for p in zip(*parts, strict=True))
    return EvalMasks(rows.astype(np.int64), inputs, positions, valid, kinds)


def eval_masks_sha256(masks: EvalMasks) -> str:
    """A hash of the arrays' names, dtypes, shapes and bytes (independent of the file format)."""
    h = hashlib.sha256()
    for name, array in zip(EvalMasks._fields, masks, strict=True):
        a = np.ascontiguousarray(array)
        h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def save_eval_masks(run_dir: Path, masks: EvalMasks, eval_seed: int) -> str:
    digest = eval_masks_sha256(masks)
    np.savez(run_dir / EVAL_MASKS_FILE, **masks._asdict())
    meta = {
        "sha256": digest,
        "eval_seed": eval_seed,
        "rows": int(masks.rows.size),
        "selected": int(masks.valid.sum()),
        "chunk": EVAL_MASK_CHUNK,
        "schedule": "chunk c of the held-out rows uses fold_in(key(eval_seed), c); "
        "rows are the first `rows` held-out rows",
    }
    (run_dir / EVAL_MASKS_META).write_text(json.dumps(meta, indent=2) + "\n")
    return digest


def load_eval_masks(run_dir: Path) -> tuple[EvalMasks, dict]:
    """Load and verify the stored eval-mask set against its recorded sha256."""
    path, meta_path = run_dir / EVAL_MASKS_FILE, run_dir / EVAL_MASKS_META
    if not path.is_file() or not meta_path.is_file():
        raise ValueError(f"run {run_dir} has no frozen eval-mask set; train it with `clozax train`")
    with np.load(path, allow_pickle=False) as f:
        masks = EvalMasks(*(f[name] for name in EvalMasks._fields))
    meta = json.loads(meta_path.read_text())
    if eval_masks_sha256(masks) != meta["sha256"]:
        raise ValueError(
            f"eval-mask set in {run_dir} does not match its recorded sha256; it was modified — "
            "restore it or delete both eval_masks files to rebuild them"
        )
    return masks, meta


@dataclass(frozen=True)
class EvalSums:
    """Host-side float64 numerators and counts, per corruption kind (index 0 = all kinds)."""

    nll: np.ndarray  # (4,)
    correct: np.ndarray
    top5: np.ndarray
    count: np.ndarray

    def metrics(self) -> dict:
        def one(i):
            n = int(self.count[i])
            if n == 0:
                return {"count": 0}
            loss = float(self.nll[i] / n)
            return {
                "loss": loss,
                "accuracy": float(self.correct[i] / n),
                "top5_accuracy": float(self.top5[i] / n),
                "perplexity": float(math.exp(min(loss, 700.0))),
                "count": n,
                "nll_sum": float(self.nll[i]),
            }

        out = one(0)
        out["by_kind"] = {KIND_NAMES[k]: one(int(k)) for k in (Kind.MASK, Kind.RANDOM, Kind.KEEP)}
        return out


def make_eval_fn(model_config):
    """Jitted per-batch sums: (params, batch) -> (nll, correct, top5, count), each (4,)."""

    def fn(params, inputs, segments, positions, targets, valid, kinds):
        hidden = model_lib.apply(params, model_config, inputs, segments > 0, segments)
        logits = model_lib.mlm_logits(params, model_config, model_lib.gather(hidden, positions))
        logp = jax.nn.log_softmax(logits, axis=-1)  # (batch, count, vocab)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)
        rank = jnp.sum(logits > target_logit, axis=-1)  # 0 = top-1
        per_kind = [valid] + [valid & (kinds == k) for k in (Kind.MASK, Kind.RANDOM, Kind.KEEP)]
        stack = jnp.stack(per_kind)  # (4, batch, count)
        return (
            jnp.sum(jnp.where(stack, nll[None], 0.0), axis=(1, 2)),
            jnp.sum(stack & (rank == 0)[None], axis=(1, 2)),
            jnp.sum(stack & (rank < 5)[None], axis=(1, 2)),
            jnp.sum(stack, axis=(1, 2)),
        )

    return jax.jit(fn)


def evaluate_masks(params, model_config, split, masks: EvalMasks, batch_size: int = 64,
                   eval_fn=None) -> EvalSums:
    """Sum the eval metrics over the whole eval-mask set (fixed batch shape; padded tail)."""
    eval_fn = eval_fn or make_eval_fn(model_config)
    sums = [np.zeros(4, np.float64) for _ in range(4)]
    n = masks.rows.size
    for start in range(0, n, batch_size):
        idx = np.arange(start, min(start + batch_size, n))
        pad = batch_size - idx.size
        rows = masks.rows[idx]
        segments = np.asarray(split.segments[rows], np.int32)
        targets = np.take_along_axis(
            np.asarray(split.tokens[rows], np.int32), masks.positions[idx], axis=-1
        )
        arrays = [masks.inputs[idx], segments, masks.positions[idx], targets, masks.valid[idx],
                  masks.kinds[idx]]
        if pad:  # padded rows have no valid slot, so they add nothing to any sum
            arrays = [np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) for a in arrays]
        out = eval_fn(params, *arrays)
        for acc, value in zip(sums, out, strict=True):
            acc += np.asarray(value, np.float64)
    return EvalSums(*sums)


# --------------------------------------------------------------------------- evaluating a run

EVAL_FILE = "eval.json"
FAILURES_FILE = "failures.jsonl"
TOP_K = 5
CONTEXT_TOKENS = 30  # failure-case context on each side, within the target's own segment


def open_run_dataset(run):
    """The dataset a loaded run was trained on, checked against the run's provenance."""
    from clozax.data import open_dataset

    path = Path(run.info.get("dataset", ""))
    if not run.info.get("dataset") or not path.is_dir():
        raise ValueError(
            f"run {run.path} was trained on dataset {str(path)!r}, which does not exist here; "
            "restore that directory (or re-run `clozax prepare` with the same options)"
        )
    dataset = open_dataset(path)
    mismatches = []
    if run.info.get("dataset_fingerprint") != dataset.fingerprint:
        mismatches.append(f"fingerprint {str(run.info.get('dataset_fingerprint'))[:12]} vs "
                          f"{dataset.fingerprint[:12]}")
    if run.info.get("tokenizer_sha256") != dataset.tokenizer_sha256:
        mismatches.append(f"tokenizer sha256 {str(run.info.get('tokenizer_sha256'))[:12]} vs "
                          f"{dataset.tokenizer_sha256[:12]}")
    if run.config.model.vocab_size != dataset.vocab_size:
        mismatches.append(f"vocab_size {run.config.model.vocab_size} vs {dataset.vocab_size}")
    if dataset.seq_len > run.config.model.max_positions:
        mismatches.append(f"seq_len {dataset.seq_len} > max_positions "
                          f"{run.config.model.max_positions}")
    if mismatches:
        raise ValueError(
            f"checkpoint whose config does not match the data: run {run.path} vs dataset {path} "
            f"({'; '.join(mismatches)}); evaluate with the dataset the run was trained on"
        )
    return dataset


def random_init_params(config):
    """The run's architecture at initialisation, drawn with the run's own init key."""
    from clozax.train import Keys  # train imports this module; import at call time

    return model_lib.init(config.model, Keys.from_seed(config.train.seed).init)


def make_slot_fn(model_config, top_k: int = TOP_K):
    """Jitted per-slot outputs: (params, inputs, segments, positions, targets) ->
    nll (batch, count), rank of the target (batch, count; 0 = top-1), top-k ids and
    probabilities (batch, count, k)."""

    def fn(params, inputs, segments, positions, targets):
        hidden = model_lib.apply(params, model_config, inputs, segments > 0, segments)
        logits = model_lib.mlm_logits(params, model_config, model_lib.gather(hidden, positions))
        logp = jax.nn.log_softmax(logits, axis=-1)  # (batch, count, vocab)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)
        rank = jnp.sum(logits > target_logit, axis=-1)
        top_logp, top_ids = jax.lax.top_k(logp, top_k)
        return nll, rank, top_ids, jnp.exp(top_logp)

    return jax.jit(fn)


class SlotOutputs(NamedTuple):
    """Per selected slot of an eval-mask set: nll/rank (R, count), top ids/probs (R, count, k)."""

    nll: np.ndarray
    rank: np.ndarray
    top_ids: np.ndarray
    top_probs: np.ndarray


def slot_outputs(params, model_config, split, masks: EvalMasks, batch_size: int = 64,
                 slot_fn=None) -> SlotOutputs:
    """Run the model over a whole eval-mask set in fixed-shape batches (padded tail)."""
    slot_fn = slot_fn or make_slot_fn(model_config)
    parts = []
    n = masks.rows.size
    for start in range(0, n, batch_size):
        idx = np.arange(start, min(start + batch_size, n))
        pad = batch_size - idx.size
        rows = masks.rows[idx]
        arrays = [masks.inputs[idx], np.asarray(split.segments[rows], np.int32),
                  masks.positions[idx], _targets(split, masks, idx)]
        if pad:
            arrays = [np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) for a in arrays]
        out = slot_fn(params, *arrays)
        parts.append([np.asarray(o)[: idx.size] for o in out])
    return SlotOutputs(*(np.concatenate(p) for p in zip(*parts, strict=True)))


def _targets(split, masks: EvalMasks, idx: np.ndarray) -> np.ndarray:
    tokens = np.asarray(split.tokens[masks.rows[idx]], np.int32)
    return np.take_along_axis(tokens, masks.positions[idx], axis=-1)  # (batch, count)


def sums_from_slots(nll: np.ndarray, rank: np.ndarray, masks: EvalMasks) -> EvalSums:
    """Float64 numerators and counts over valid slots, overall and per corruption kind."""
    per_kind = [masks.valid] + [masks.valid & (masks.kinds == k)
                                for k in (Kind.MASK, Kind.RANDOM, Kind.KEEP)]
    nll = nll.astype(np.float64)
    return EvalSums(
        nll=np.array([nll[m].sum() for m in per_kind]),
        correct=np.array([float(np.sum(rank[m] == 0)) for m in per_kind]),
        top5=np.array([float(np.sum(rank[m] < 5)) for m in per_kind]),
        count=np.array([float(m.sum()) for m in per_kind]),
    )


def unigram_logprobs(split, vocab_size: int, special_ids) -> np.ndarray:
    """(vocab,) float64 log-probabilities: counts of non-pad, non-special tokens of ``split``,
    add-one smoothed over the non-special ids; special ids get -inf."""
    counts = np.zeros(vocab_size, np.int64)
    for start in range(0, split.rows, 4096):
        tokens = np.asarray(split.tokens[start : start + 4096])
        real = np.asarray(split.segments[start : start + 4096]) > 0
        counts += np.bincount(tokens[real].astype(np.int64), minlength=vocab_size)
    special = np.zeros(vocab_size, bool)
    special[list(special_ids)] = True
    counts[special] = 0
    probs = (counts + 1.0) / (counts.sum() + np.count_nonzero(~special))
    with np.errstate(divide="ignore"):
        return np.where(special, -np.inf, np.log(probs))


def unigram_sums(logprobs: np.ndarray, split, masks: EvalMasks) -> EvalSums:
    """The unigram predictor on the same selected positions (it ignores the input)."""
    targets = _targets(split, masks, np.arange(masks.rows.size))
    target_logp = logprobs[targets]  # (R, count)
    ascending = np.sort(logprobs)
    rank = logprobs.size - np.searchsorted(ascending, target_logp, side="right")
    return sums_from_slots(-target_logp, rank, masks)


def token_text(tokenizer, token_id: int) -> str:
    text = tokenizer.decode([int(token_id)], skip_special_tokens=False)
    return text if text else str(tokenizer.id_to_token(int(token_id)))


def marked_context(tokenizer, tokens: np.ndarray, segments: np.ndarray, position: int,
                   special_ids, width: int = CONTEXT_TOKENS) -> str:
    """The target's segment around ``position`` (at most ``width`` tokens each side) decoded,
    with the target marked ``⟦target⟧``."""
    same = np.nonzero(segments == segments[position])[0]
    lo, hi = max(int(same[0]), position - width), min(int(same[-1]), position + width)
    specials = set(int(i) for i in special_ids)
    left = [int(t) for t in tokens[lo:position] if int(t) not in specials]
    right = [int(t) for t in tokens[position + 1 : hi + 1] if int(t) not in specials]
    target = int(tokens[position])
    # Decode growing prefixes so spacing between pieces is the tokenizer's own.
    text_left = tokenizer.decode(left)
    text_with = tokenizer.decode(left + [target])
    text_all = tokenizer.decode(left + [target] + right)
    if text_with.startswith(text_left) and text_all.startswith(text_with):
        piece, rest = text_with[len(text_left):], text_all[len(text_with):]
    else:
        piece, rest = " " + token_text(tokenizer, target), " " + tokenizer.decode(right)
    space = piece[: len(piece) - len(piece.lstrip())]
    first_real = next((int(i) for i in same if int(tokens[i]) not in specials), lo)
    last_real = max((int(i) for i in same if int(tokens[i]) not in specials), default=hi)
    head = "… " if lo > first_real else ""
    tail = " …" if hi < last_real else ""
    return f"{head}{text_left}{space}⟦{piece.strip()}⟧{rest}{tail}".strip()


def failure_cases(tokenizer, split, masks: EvalMasks, slots: SlotOutputs, special_ids,
                  k: int) -> list[dict]:
    """The ``k`` valid slots with the lowest target probability (ties: mask-set order)."""
    mask_idx, slot = np.nonzero(masks.valid)
    nll = slots.nll[mask_idx, slot]
    order = np.lexsort((slot, mask_idx, -nll.astype(np.float64)))[:k]
    cases = []
    for o in order:
        i, j = int(mask_idx[o]), int(slot[o])
        row, position = int(masks.rows[i]), int(masks.positions[i, j])
        tokens = np.asarray(split.tokens[row])
        target = int(tokens[position])
        cases.append({
            "row": row,
            "position": position,
            "text": marked_context(tokenizer, tokens, np.asarray(split.segments[row]), position,
                                   special_ids),
            "target": token_text(tokenizer, target),
            "target_id": target,
            "target_probability": float(np.exp(-float(slots.nll[i, j]))),
            "target_rank": int(slots.rank[i, j]),
            "top5": [[token_text(tokenizer, t), float(p)]
                     for t, p in zip(slots.top_ids[i, j], slots.top_probs[i, j], strict=True)],
            "kind": KIND_NAMES[Kind(int(masks.kinds[i, j]))],
            "input_token": token_text(tokenizer, int(masks.inputs[i, position])),
        })
    return cases


def schedule_description(config, meta: dict, masks: EvalMasks) -> dict:
    m = config.masking
    return {
        "eval_seed": meta.get("eval_seed"),
        "rows": int(masks.rows.size),
        "selected": int(masks.valid.sum()),
        "slots_per_row": int(masks.positions.shape[1]),
        "rate": m.rate,
        "unit": m.unit,
        "corruption": {"mask": m.mask, "random": m.random, "keep": m.keep},
        "chunk": meta.get("chunk"),
        "rule": meta.get("schedule"),
    }


def _delta(a: dict, b: dict) -> dict:
    keys = ("loss", "accuracy", "top5_accuracy")
    return {key: b[key] - a[key] for key in keys if key in a and key in b}


def _write_json(path: Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)


def evaluate_run(run_dir: Path, *, mask_seed: int | None = None, failures: int = 20,
                 batch_size: int = 64) -> dict:
    """Evaluate a run's latest checkpoint on its frozen eval-mask set; write ``eval.json`` and
    ``failures.jsonl`` in the run directory and return the ``eval.json`` content.

    Baselines on the same selected positions: a unigram predictor (train-split frequencies) and
    the same architecture at random initialisation (the run's init key). ``mask_seed`` also
    evaluates on a second mask set drawn with that eval seed ("corruption transfer": same
    held-out text, different corruption; not a new-language test).
    """
    from clozax.data.tokenizer import load_tokenizer
    from clozax.run import load_run
    from clozax.train import Vocabulary, make_masker

    if failures < 0 or batch_size < 1:
        raise ValueError(f"failures={failures} must be >= 0 and batch_size={batch_size} >= 1")
    run_dir = Path(run_dir)
    run = load_run(run_dir)
    run.require_mlm_head("evaluate")
    dataset = open_run_dataset(run)
    masks, meta = load_eval_masks(run_dir)
    split = dataset.heldout
    if masks.inputs.shape[1] != dataset.seq_len or int(masks.rows.max()) >= split.rows:
        raise ValueError(
            f"eval-mask set of {run_dir} (rows up to {int(masks.rows.max())}, seq "
            f"{masks.inputs.shape[1]}) does not fit dataset {dataset.path}; it belongs to "
            "another dataset — delete eval_masks.* to rebuild them by resuming training"
        )
    cfg = run.config
    special_ids = sorted(set(dataset.specials.values()))
    slot_fn = make_slot_fn(cfg.model)

    trained = slot_outputs(run.params, cfg.model, split, masks, batch_size, slot_fn)
    random = slot_outputs(random_init_params(cfg), cfg.model, split, masks, batch_size, slot_fn)
    unigram = unigram_logprobs(dataset.train, dataset.vocab_size, special_ids)
    trained_metrics = sums_from_slots(trained.nll, trained.rank, masks).metrics()

    transfer = None
    if mask_seed is not None:
        masker = make_masker(cfg.masking, Vocabulary(dataset.vocab_size, dataset.specials),
                             dataset.seq_len)
        other = build_eval_masks(split, masker, mask_seed, cfg.train.eval_rows)
        out = slot_outputs(run.params, cfg.model, split, other, batch_size, slot_fn)
        other_metrics = sums_from_slots(out.nll, out.rank, other).metrics()
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
        "random_init": sums_from_slots(random.nll, random.rank, masks).metrics(),
        "transfer": transfer,
        "schedule": schedule_description(cfg, meta, masks),
    }
    tokenizer = load_tokenizer(run.tokenizer_path)
    cases = failure_cases(tokenizer, split, masks, trained, special_ids, failures)
    _write_json(run_dir / EVAL_FILE, result)
    tmp = run_dir / (FAILURES_FILE + ".tmp")
    tmp.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in cases),
                   encoding="utf-8")
    tmp.replace(run_dir / FAILURES_FILE)
    return result


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
