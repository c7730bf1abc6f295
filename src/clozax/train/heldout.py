"""The frozen held-out set: the eval-mask schedule, and held-out sums as numerators and counts.

The frozen set is the documented mask schedule for held-out numbers. Its rows are a keyed
random sample of ``train.eval_rows`` held-out rows (default 4,096; all of them when the split
has fewer, or when ``eval_rows`` is None): ``sample_rows``, a pure function of the eval seed and
the split's row count, so the same rows on any number of devices or processes, spread over
every held-out document rather than the first files'. 4,096 rows at seq 128 and 15 % are
~78,000 scored positions: an accuracy near 0.3 has a binomial standard error of ~0.16 points,
below the differences the report draws, at a few seconds of a small model on a CPU core.

The rows' selections and corruptions come from a fixed eval key (``train.eval_seed``, never the
training key), in fixed chunks of ``EVAL_MASK_CHUNK`` rows (chunk ``c`` uses
``fold_in(eval_key, c)``). The set stores selections, not inputs: per selected slot its
position, validity, corruption kind and the id the encoder saw there; the corrupted input row
is the clean row with those ids written at those positions (``mask_arrays``), ~10 bytes per slot
instead of 4 per token. It is hashed chunk by chunk (``chunk_sha256``), so a streamed set (every
held-out row, ``iter_chunks``: ``clozax evaluate --full``) has the stored set's hash when it
holds the same rows. Every metric is a sum over selected held-out positions divided once by
their count, overall and per corruption kind.

Training evaluates with it every ``train.eval_every`` steps; ``clozax evaluate``
(``clozax.judge.evaluate``) reads the same set and adds baselines and failure cases.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from clozax.core import files, objective
from clozax.core import model as model_lib
from clozax.core.masking import KIND_NAMES, Kind
from clozax.data.loader import padded_batches
from clozax.train.layout import EVAL_STEM, FIXED_EVAL_STEM

EVAL_MASK_CHUNK = 256
EVAL_MASKS_FILE = "eval_masks.npz"
EVAL_MASKS_META = "eval_masks.json"
STEM = EVAL_STEM  # the run's own set; FIXED_STEM: the fixed-rate set beside it
FIXED_RATE = 0.15  # held-out numbers comparable across training rates (ModernBERT's practice)
FIXED_STEM = FIXED_EVAL_STEM


def fixed_rate(masking):
    """``masking`` at ``FIXED_RATE`` without a ramp (the same unit and corruption mix): the
    masks of the set that compares runs trained at any rate; None when the run's own set
    already is at that rate."""
    if masking.heldout_rate == FIXED_RATE:
        return None
    return dataclasses.replace(masking, rate=FIXED_RATE, rate_end=None, ramp_steps=0)
FORMAT = 2  # 1 (before): whole corrupted input rows, hashed field by field
SCHEDULE = ("rows: sorted(numpy Generator(PCG64([eval_seed, 2])).choice(heldout_rows, rows, "
            "replace=False)), all held-out rows when there are no more than `rows`; chunk c of "
            "those rows uses fold_in(key(eval_seed), c)")


class EvalMasks(NamedTuple):
    """rows: (R,) held-out row indices; positions/valid/kinds: (R, count) selected slots, their
    validity and corruption kind; slot_inputs: (R, count) the id the encoder sees at each slot
    (the mask id, a random id, or the clean one)."""

    rows: np.ndarray
    positions: np.ndarray
    valid: np.ndarray
    kinds: np.ndarray
    slot_inputs: np.ndarray

    def chunk(self, c: int) -> EvalMasks:
        return EvalMasks(*(a[c * EVAL_MASK_CHUNK : (c + 1) * EVAL_MASK_CHUNK] for a in self))


def sample_rows(heldout_rows: int, size: int | None, eval_seed: int) -> np.ndarray:
    """The held-out rows of the frozen set: a sorted keyed sample of ``size`` rows, or all rows
    (``size`` None or >= the split's rows). A pure function of its arguments."""
    if size is None or size >= heldout_rows:
        return np.arange(heldout_rows, dtype=np.int64)
    rng = np.random.default_rng([eval_seed, 2])
    return np.sort(rng.choice(heldout_rows, size, replace=False)).astype(np.int64)


def iter_chunks(split, masker, eval_seed: int, rows: np.ndarray) -> Iterator[EvalMasks]:
    """The eval masks of ``rows``, chunk by chunk (chunk ``c`` drawn with
    ``fold_in(key(eval_seed), c)``): memory of one chunk, whatever the number of rows.
    ``masker(key, batch) -> (MaskedBatch, Selection)``."""
    eval_key = jax.random.key(eval_seed)
    masker = jax.jit(masker)
    for c, start in enumerate(range(0, rows.size, EVAL_MASK_CHUNK)):
        chunk = np.asarray(rows[start : start + EVAL_MASK_CHUNK], np.int64)
        tokens = np.asarray(split.tokens[chunk], np.int32)
        batch = {"tokens": tokens, "segments": np.asarray(split.segments[chunk], np.int32),
                 "word_starts": np.asarray(split.word_starts[chunk], bool)}
        masked, selection = masker(jax.random.fold_in(eval_key, c), batch)
        inputs, kind, positions = jax.device_get((masked.inputs, masked.kind,
                                                  selection.positions))
        positions = np.asarray(positions, np.int32)
        masks = EvalMasks(chunk, positions, np.asarray(selection.valid, bool),
                          np.take_along_axis(np.asarray(kind, np.int8), positions, axis=-1),
                          np.take_along_axis(np.asarray(inputs, np.int32), positions, axis=-1))
        if not np.array_equal(corrupted_inputs(tokens, masks), inputs):  # the stored form is exact
            raise AssertionError("the masker corrupted a position it did not select")
        yield masks


def build_eval_masks(split, masker, eval_seed: int, max_rows: int | None = None) -> EvalMasks:
    """The frozen eval-mask set of ``sample_rows(split.rows, max_rows, eval_seed)``, in memory."""
    rows = sample_rows(split.rows, max_rows, eval_seed)
    if rows.size == 0:
        raise ValueError("the held-out split has no rows; prepare a dataset with held-out data")
    parts = list(iter_chunks(split, masker, eval_seed, rows))
    return EvalMasks(*(np.concatenate(p) for p in zip(*parts, strict=True)))


def corrupted_inputs(tokens: np.ndarray, masks: EvalMasks) -> np.ndarray:
    """(R, seq) the encoder's input: the clean ``tokens`` of the set's rows with each slot's
    input id written at its position (unselected positions are never corrupted)."""
    inputs = np.array(tokens, np.int32)
    np.put_along_axis(inputs, masks.positions, masks.slot_inputs, axis=-1)
    return inputs


def chunk_sha256(h, masks: EvalMasks) -> None:
    """Add one chunk to a running hash: each array's name, dtype, shape and bytes."""
    for name, array in zip(EvalMasks._fields, masks, strict=True):
        a = np.ascontiguousarray(array)
        h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
        h.update(a.tobytes())


def eval_masks_sha256(masks: EvalMasks) -> str:
    """The set's hash, chunk by chunk of ``EVAL_MASK_CHUNK`` rows (a streamed set of the same
    rows hashes the same; independent of the file format)."""
    h = hashlib.sha256()
    for c in range(math.ceil(masks.rows.size / EVAL_MASK_CHUNK)):
        chunk_sha256(h, masks.chunk(c))
    return h.hexdigest()


def _legacy_sha256(fields: dict) -> str:
    """The hash of a format-1 set (rows, inputs, positions, valid, kinds; field by field)."""
    h = hashlib.sha256()
    for name in ("rows", "inputs", "positions", "valid", "kinds"):
        a = np.ascontiguousarray(fields[name])
        h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def set_sha256(masks: EvalMasks, meta: dict, split) -> str:
    """``masks``'s hash by the rule of the file ``meta`` describes (format 1 or 2)."""
    if meta.get("format", 1) >= FORMAT:
        return eval_masks_sha256(masks)
    inputs = corrupted_inputs(np.asarray(split.tokens[masks.rows], np.int32), masks)
    return _legacy_sha256({**masks._asdict(), "inputs": inputs})


class EvalMasksUnreadable(ValueError):
    """The eval-mask file is missing or damaged (not modified: that is a plain ValueError)."""


def save_eval_masks(run_dir: Path, masks: EvalMasks, *, eval_seed: int, fingerprint: str,
                    seq_len: int, heldout_rows: int, stem: str = STEM) -> dict:
    """Write the set and its description as one file, atomically (``eval_masks.npz`` holds the
    arrays and the metadata), then a readable copy of the metadata (``eval_masks.json``).
    Returns the metadata."""
    meta = {
        "format": FORMAT,
        "sha256": eval_masks_sha256(masks),
        "eval_seed": eval_seed,
        "dataset_fingerprint": fingerprint,
        "seq_len": seq_len,
        "rows": int(masks.rows.size),
        "heldout_rows": int(heldout_rows),
        "selected": int(masks.valid.sum()),
        "chunk": EVAL_MASK_CHUNK,
        "schedule": SCHEDULE,
    }
    buffer = io.BytesIO()
    np.savez(buffer, **masks._asdict(), meta=np.array(json.dumps(meta, sort_keys=True)))
    files.write_bytes(run_dir / f"{stem}.npz", buffer.getvalue())
    files.write_json(run_dir / f"{stem}.json", meta)
    return meta


def load_eval_masks(run_dir: Path, dataset=None, stem: str = STEM) -> tuple[EvalMasks, dict]:
    """Load the stored eval-mask set and verify it against its recorded sha256, and, given the
    ``dataset`` it is used with, against that dataset's fingerprint and ``seq_len``. A format-1
    file (whole input rows) is read into the slot form after its own hash is checked."""
    path = Path(run_dir) / f"{stem}.npz"
    if not path.is_file():
        raise EvalMasksUnreadable(f"run {run_dir} has no frozen eval-mask set ({path.name}); "
                                  "`clozax train` or `clozax evaluate` builds it")
    try:
        with np.load(path, allow_pickle=False) as f:
            fields = {name: np.asarray(f[name]) for name in f.files if name != "meta"}
            meta = json.loads(str(f["meta"]))
        legacy = meta.get("format", 1) < FORMAT
        if legacy:
            fields["slot_inputs"] = np.take_along_axis(fields["inputs"], fields["positions"], -1)
        masks = EvalMasks(*(fields[name] for name in EvalMasks._fields))
    except Exception as e:  # BadZipFile, EOFError, KeyError, ValueError, OSError, ...
        raise EvalMasksUnreadable(f"{path} is damaged ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:120] if str(e) else ''})") from None
    sha = _legacy_sha256(fields) if legacy else eval_masks_sha256(masks)
    if sha != meta.get("sha256"):
        raise ValueError(
            f"eval-mask set in {run_dir} does not match its recorded sha256; it was modified — "
            f"restore it, or delete {path.name} to have it rebuilt from the eval seed"
        )
    if dataset is not None and (meta.get("dataset_fingerprint"), meta.get("seq_len")) != (
            dataset.fingerprint, dataset.seq_len):
        raise ValueError(
            f"the eval-mask set of {run_dir} was built on dataset "
            f"{str(meta.get('dataset_fingerprint'))[:12]} (seq_len {meta.get('seq_len')}), not "
            f"{dataset.path} {dataset.fingerprint[:12]} (seq_len {dataset.seq_len}); use the "
            "dataset the run was trained on"
        )
    return masks, meta


def ensure_eval_masks(run_dir: Path, dataset, masker, eval_seed: int,
                      max_rows: int | None = None, say=None, write: bool = True,
                      built: EvalMasks | None = None,
                      stem: str = STEM) -> tuple[EvalMasks, dict]:
    """The run's eval-mask set: loaded when intact; built when missing or damaged (a kill
    while writing, a truncated file) — deterministically from the eval seed, so a rebuilt set
    has the sha256 ``eval_masks.json`` recorded before, which is checked (by the recorded
    format's rule). ``built``: the set already computed this run (``--minutes`` measured its
    cost). Without ``write`` (every process but the first of a job) nothing is written."""
    run_dir = Path(run_dir)
    try:
        masks, meta = load_eval_masks(run_dir, dataset, stem)
        if write and files.read_json(run_dir / f"{stem}.json") != meta:  # the readable copy
            files.write_json(run_dir / f"{stem}.json", meta)
        return masks, meta
    except EvalMasksUnreadable as e:
        damaged = (run_dir / f"{stem}.npz").exists()
        recorded_meta = files.read_json(run_dir / f"{stem}.json") or {}
        recorded = recorded_meta.get("sha256")
        masks = built if built is not None else build_eval_masks(dataset.heldout, masker,
                                                                 eval_seed, max_rows)
        if recorded is not None:
            sha = set_sha256(masks, recorded_meta, dataset.heldout)
            if sha != recorded:
                raise ValueError(f"{e}; rebuilding it from eval seed {eval_seed} gave sha256 "
                                 f"{sha[:12]}, not the recorded {recorded[:12]}: the run's "
                                 "settings or data changed") from None
        if not write:
            return masks, {"sha256": eval_masks_sha256(masks), "format": FORMAT}
        meta = save_eval_masks(run_dir, masks, eval_seed=eval_seed,
                               fingerprint=dataset.fingerprint, seq_len=dataset.seq_len,
                               heldout_rows=dataset.heldout.rows, stem=stem)
        if (damaged or recorded is not None) and say is not None:
            say(f"{e}; rebuilt it from eval seed {eval_seed} (sha256 {recorded[:12]}, as recorded)"
                if recorded else f"{e}; rebuilt it from eval seed {eval_seed}")
        return masks, meta


class NonFiniteScores(ValueError):
    """The model produced non-finite logits on held-out positions: it has diverged."""


@dataclass(frozen=True)
class EvalSums:
    """Host-side float64 numerators and counts, per corruption kind (index 0 = all kinds)."""

    nll: np.ndarray  # (4,)
    correct: np.ndarray
    top5: np.ndarray
    count: np.ndarray
    nonfinite: np.ndarray  # positions whose logits were not all finite (scored as wrong)

    def metrics(self) -> dict:
        """Loss, accuracy, top-5, perplexity and counts, overall and ``by_kind``. Non-finite
        scores are never a result: ``NonFiniteScores`` names how many positions had them."""
        bad = int(self.nonfinite[0])
        if bad or not np.isfinite(self.nll[0]):
            raise NonFiniteScores(
                f"the model's logits are not finite at {bad} of {int(self.count[0])} held-out "
                "positions (its parameters diverged); use an earlier checkpoint, or retrain with "
                "a lower optim.learning_rate")

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
    """Jitted per-batch sums: (params, batch) -> (nll, correct, top5, count, nonfinite),
    each (4,)."""

    def fn(params, inputs, segments, positions, targets, valid, kinds):
        logits = model_lib.logits_at(params, model_config, inputs, segments, positions)
        scores = objective.score_targets(logits, targets)  # (batch, count)
        per_kind = [valid] + [valid & (kinds == k) for k in (Kind.MASK, Kind.RANDOM, Kind.KEEP)]
        stack = jnp.stack(per_kind)  # (4, batch, count)
        return (
            jnp.sum(jnp.where(stack, scores.nll[None], 0.0), axis=(1, 2)),
            jnp.sum(stack & (scores.rank == 0)[None], axis=(1, 2)),
            jnp.sum(stack & (scores.rank < 5)[None], axis=(1, 2)),
            jnp.sum(stack, axis=(1, 2)),
            jnp.sum(stack & ~scores.finite[None], axis=(1, 2)),
        )

    return jax.jit(fn)


def sample_indices(n: int, sample: int | None, eval_seed: int) -> np.ndarray:
    """The entries of an ``n``-row eval-mask set evaluated during training: a sorted sample of
    ``sample`` of them keyed by the eval seed (all when ``sample`` is None or >= n). A pure
    function of its arguments: the same rows on any number of devices or processes."""
    if sample is None or sample >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng([eval_seed, 1]).choice(n, sample, replace=False))


def evaluate_masks(params, model_config, split, masks: EvalMasks, batch_size: int = 64,
                   eval_fn=None, indices: np.ndarray | None = None, put=None) -> EvalSums:
    """Sum the eval metrics over the eval-mask set's entries ``indices`` (default: all), in
    batches of one shape (padded tail: padded rows have no valid slot, so they add nothing to
    any sum), each placed on the devices by ``put(arrays)`` when given (a mesh's ``data``
    axis; the sums then add over every device and process before anything is divided)."""
    eval_fn = eval_fn or make_eval_fn(model_config)
    indices = np.arange(masks.rows.size) if indices is None else np.asarray(indices)
    sums = [np.zeros(4, np.float64) for _ in EvalSums.__dataclass_fields__]

    def take(idx):
        return mask_arrays(split, masks, indices[idx], with_kinds=True)

    outs = []
    for _, arrays in padded_batches(indices.size, batch_size, take):
        if put is not None:
            arrays = put(arrays)
        outs.append(eval_fn(params, *arrays))  # dispatched; read back once, below
    for out in jax.device_get(outs):
        for acc, value in zip(sums, out, strict=True):
            acc += np.asarray(value, np.float64)
    return EvalSums(*sums)


def mask_arrays(split, masks: EvalMasks, idx: np.ndarray, with_kinds: bool = False) -> list:
    """The model's inputs for entries ``idx`` of an eval-mask set: corrupted inputs and segments
    (batch, seq), slot positions and clean targets (batch, count), and with ``with_kinds`` the
    slots' validity and corruption kind (batch, count)."""
    sub = EvalMasks(*(a[idx] for a in masks))
    tokens = np.asarray(split.tokens[sub.rows], np.int32)
    arrays = [corrupted_inputs(tokens, sub), np.asarray(split.segments[sub.rows], np.int32),
              sub.positions, np.take_along_axis(tokens, sub.positions, axis=-1)]
    return arrays + [sub.valid, sub.kinds] if with_kinds else arrays
