"""The model's output at every selected slot of an eval-mask set: target NLL and rank, top-k
ids and probabilities. ``clozax evaluate`` and the report's probability panel read these;
``sums_from_slots`` turns them into the same numerator/count sums training logs."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from clozax.core import model as model_lib
from clozax.core import objective
from clozax.core.masking import Kind
from clozax.data.loader import padded_batches
from clozax.train.heldout import EvalMasks, EvalSums, mask_arrays

TOP_K = 5


def make_slot_fn(model_config, top_k: int = TOP_K):
    """Jitted per-slot outputs: (params, inputs, segments, positions, targets) ->
    nll (batch, count), rank of the target (batch, count; 0 = top-1), top-k ids and
    probabilities (batch, count, k), whether the slot's logits were all finite (batch, count)."""

    def fn(params, inputs, segments, positions, targets):
        logits = model_lib.logits_at(params, model_config, inputs, segments, positions)
        scores = objective.score_targets(logits, targets)  # logp: (batch, count, vocab)
        top_logp, top_ids = jax.lax.top_k(scores.logp, top_k)
        return scores.nll, scores.rank, top_ids, jnp.exp(top_logp), scores.finite

    return jax.jit(fn)


class SlotOutputs(NamedTuple):
    """Per selected slot of an eval-mask set: nll/rank/finite (R, count), top ids/probs
    (R, count, k)."""

    nll: np.ndarray
    rank: np.ndarray
    top_ids: np.ndarray
    top_probs: np.ndarray
    finite: np.ndarray

    def sums(self, masks: EvalMasks) -> EvalSums:
        return sums_from_slots(self.nll, self.rank, masks, self.finite)


def slot_outputs(params, model_config, split, masks: EvalMasks, batch_size: int = 64,
                 slot_fn=None, put=None) -> SlotOutputs:
    """Run the model over a whole eval-mask set in fixed-shape batches (padded tail), each
    placed on the devices by ``put(arrays)`` when given."""
    slot_fn = slot_fn or make_slot_fn(model_config)
    parts = []
    take = functools.partial(mask_arrays, split, masks)
    for idx, arrays in padded_batches(masks.rows.size, batch_size, take):
        out = slot_fn(params, *(arrays if put is None else put(arrays)))
        parts.append([np.asarray(o)[: idx.size] for o in out])
    return SlotOutputs(*(np.concatenate(p) for p in zip(*parts, strict=True)))


def sums_from_slots(nll: np.ndarray, rank: np.ndarray, masks: EvalMasks,
                    finite: np.ndarray | None = None) -> EvalSums:
    """Float64 numerators and counts over valid slots, overall and per corruption kind;
    ``finite`` (R, count) marks slots whose logits were all finite (default: all)."""
    per_kind = [masks.valid] + [masks.valid & (masks.kinds == k)
                                for k in (Kind.MASK, Kind.RANDOM, Kind.KEEP)]
    nll = nll.astype(np.float64)
    return EvalSums(
        nll=np.array([nll[m].sum() for m in per_kind]),
        correct=np.array([float(np.sum(rank[m] == 0)) for m in per_kind]),
        top5=np.array([float(np.sum(rank[m] < 5)) for m in per_kind]),
        count=np.array([float(m.sum()) for m in per_kind]),
        nonfinite=np.array([0.0 if finite is None else float(np.sum(m & ~finite))
                            for m in per_kind]),
    )
