"""The masked objective: cross-entropy at selected positions, returned as ``(sum, count)``.

Only the outermost caller divides, once, after summing numerators and counts over every
microbatch and device. Dividing earlier (a mean per microbatch or per device, then a mean of
means) weights sequences instead of tokens whenever selected counts differ.

Axis names: ``(batch, seq, vocab)`` logits, or ``(batch, count, vocab)`` after sparse gathering.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def masked_nll(logits: jax.Array, targets: jax.Array, selected: jax.Array):
    """Return ``(sum, count)``: summed negative log-likelihood over selected positions.

    logits: (..., vocab); targets: (...) int clean ids; selected: (...) bool.
    ``sum`` is float, ``count`` is int32. The token-weighted mean is ``sum / count``.
    """
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(selected, nll, 0.0)), jnp.sum(selected)


class TargetScores(NamedTuple):
    """How a model scored the clean targets, per position.

    logp: (..., vocab) log-probabilities; nll: (...) the target's negative log-likelihood;
    rank: (...) int, how many ids have a strictly higher logit than the target (0 = top-1);
    finite: (...) bool, whether every logit of the position was finite. A position with a
    non-finite logit is ranked last (rank = vocab): NaN compares false with everything, so
    counting higher logits would otherwise rank it first.
    """

    logp: jax.Array
    nll: jax.Array
    rank: jax.Array
    finite: jax.Array


def score_targets(logits: jax.Array, targets: jax.Array) -> TargetScores:
    """Log-probabilities, target NLL and target rank from (..., vocab) logits: the one place
    evaluation and failure cases turn logits into scores."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)
    finite = jnp.all(jnp.isfinite(logits), axis=-1)
    rank = jnp.where(finite, jnp.sum(logits > target_logit, axis=-1), logits.shape[-1])
    return TargetScores(logp, nll, rank, finite)


def token_weighted_mean(total, count):
    """The token-weighted mean loss, ``sum / count``, taken once by the outermost caller."""
    return total / count


def masked_cross_entropy(logits, targets, selected):
    """Convenience: ``masked_nll`` divided once. Callers that accumulate must not use this."""
    return token_weighted_mean(*masked_nll(logits, targets, selected))


def accumulate(pairs: Iterable[tuple]) -> tuple:
    """Sum ``(sum, count)`` pairs from microbatches (or devices) without dividing."""
    total, count = 0.0, 0
    for s, c in pairs:
        total, count = total + s, count + c
    return total, count


def sequence_weighted_mean(logits, targets, selected):
    """Mean over sequences of each sequence's own selected-token mean.

    A *different* objective from the token-weighted one: it gives every sequence equal
    influence whatever its selected count. Kept so the audit can show that the two differ.
    Sequences with no selected position are left out of the outer mean.
    """
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # (batch, seq)
    per_seq_sum = jnp.sum(jnp.where(selected, nll, 0.0), axis=-1)
    per_seq_count = jnp.sum(selected, axis=-1)
    has = per_seq_count > 0
    per_seq_mean = jnp.where(has, per_seq_sum / jnp.maximum(per_seq_count, 1), 0.0)
    return jnp.sum(per_seq_mean) / jnp.sum(has)


def analytic_logit_gradient(logits, targets, selected):
    """d(sum/count)/d(logits) = (softmax − onehot) × selected / count, without autodiff.

    Zero at every unselected position by construction.
    """
    probs = jax.nn.softmax(logits, axis=-1)
    onehot = jax.nn.one_hot(targets, logits.shape[-1], dtype=probs.dtype)
    return (probs - onehot) * selected[..., None] / jnp.sum(selected)


def check_nonempty(selected) -> None:
    """Reject an empty selection on the host, before any jitted step divides by its count."""
    sel = np.asarray(selected)
    if not sel.any():
        raise ValueError(
            f"batch of {sel.shape[0] if sel.ndim else 0} sequences has no selected position; "
            "an empty selection gives an undefined loss: raise masking.rate or check eligibility"
        )
