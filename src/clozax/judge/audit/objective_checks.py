"""Checks of the objective on the model's own outputs: no leak of clean ids, the uniform start,
gradients only at selected logits and equal to the analytic form, an empty selection refused.
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np

from clozax.core import masking, objective
from clozax.core.masking import Kind, Selection
from clozax.judge.audit.pipeline import CheckResult, Pipeline, take_rows

LOSS_TOL = 1e-5  # |loss - log V| with a zeroed head
GRAD_RTOL = 1e-5  # analytic vs autodiff, relative to the largest gradient entry


def check_no_leak(pipe: Pipeline, items) -> CheckResult:
    """Clean ids at replaced positions must not reach the inputs or the logits."""
    masker, logits_fn = jax.jit(pipe.masker), jax.jit(pipe.logits_fn)
    special = pipe.vocab.special_table()
    pool = masking.allowed_random_ids(pipe.vocab.size, pipe.vocab.special_ids)
    changed = input_diffs = logit_diffs = selection_diffs = 0
    for key, batch in items:
        masked, selection = masker(key, batch)
        tokens = batch["tokens"]
        kind = np.asarray(masked.kind)
        # Only non-special clean ids are changed, to other non-special ids, so eligibility
        # (and with it the selection) must stay the same.
        replaced = (np.asarray(masked.selected) & ~special[tokens]
                    & ((kind == Kind.MASK) | (kind == Kind.RANDOM)))
        other = pool[(np.searchsorted(pool, tokens) + 1) % pool.size]
        modified = {**batch, "tokens": np.where(replaced, other, tokens).astype(tokens.dtype)}
        masked2, selection2 = masker(key, modified)
        changed += int(replaced.sum())
        input_diffs += int((np.asarray(masked.inputs) != np.asarray(masked2.inputs)).sum())
        selection_diffs += int(
            (np.asarray(selection.positions) != np.asarray(selection2.positions)).sum()
            + (np.asarray(masked.kind) != np.asarray(masked2.kind)).sum()
        )
        a = np.asarray(logits_fn(pipe.params, batch, masked, selection))
        b = np.asarray(logits_fn(pipe.params, modified, masked2, selection2))
        logit_diffs += int((a.shape != b.shape) or (a != b).sum())
    value = {"changed_positions": changed, "input_diffs": input_diffs,
             "logit_diffs": logit_diffs, "selection_diffs": selection_diffs}
    if changed == 0:
        return CheckResult("no_leak", False, value, "no selected position was replaced; the "
                           "check could not change any clean id (is masking.mask 0?)")
    passed = input_diffs == logit_diffs == selection_diffs == 0
    detail = (f"changed {changed} clean ids at replaced positions: inputs, selection and logits "
              "identical bit for bit" if passed else
              f"changing {changed} clean ids at replaced positions changed {input_diffs} input "
              f"ids, {selection_diffs} selections/kinds and {logit_diffs} logits: clean ids leak")
    return CheckResult("no_leak", passed, value, detail)


def check_initial_loss(pipe: Pipeline, key, batch) -> CheckResult:
    masked, selection = jax.jit(pipe.masker)(key, batch)
    params = pipe.zero_head(pipe.params)
    logits = jax.jit(pipe.logits_fn)(params, batch, masked, selection)
    positions = np.asarray(selection.positions)
    targets = np.take_along_axis(np.asarray(batch["tokens"]), positions, axis=-1)
    # Sequence by sequence: the property is the uniform start, and a float32 sum over a whole
    # batch of ~log(V)-sized terms (1,632 of them at rate 0.4) would itself drift past 1e-5.
    loss_fn = jax.jit(pipe.loss_fn)
    valid = np.asarray(selection.valid)
    losses = []
    for r in range(targets.shape[0]):
        if valid[r].any():
            total, count = loss_fn(logits[r : r + 1], targets[r : r + 1], valid[r : r + 1])
            losses.append(float(total) / float(count))
    expected = math.log(pipe.config.model.vocab_size)
    worst = max(losses, key=lambda x: abs(x - expected))
    diff = abs(worst - expected)
    return CheckResult("initial_loss", diff <= LOSS_TOL,
                       {"loss": worst, "log_vocab": expected, "abs_diff": diff,
                        "sequences": len(losses)},
                       f"zeroed-head loss {worst:.7f} (worst of {len(losses)} sequences) vs "
                       f"log({pipe.config.model.vocab_size}) = {expected:.7f} "
                       f"(|diff| {diff:.1e}, tolerance {LOSS_TOL:g})")


def dense_logit_gradients(pipe: Pipeline, key, batch, rows: int = 4):
    """Logits at every position of ``rows`` sequences, autodiff and analytic gradients of the
    token-weighted mean loss with respect to them. Returns (grad, analytic, selected)."""
    masked, selection = jax.jit(pipe.masker)(key, batch)
    batch, masked = take_rows(batch, rows), take_rows(masked, rows)
    n, seq = masked.inputs.shape
    everywhere = Selection(np.broadcast_to(np.arange(seq, dtype=np.int32), (n, seq)),
                           np.ones((n, seq), bool))
    logits = jax.jit(pipe.logits_fn)(pipe.params, batch, masked, everywhere)  # (rows, seq, vocab)
    targets, selected = np.asarray(batch["tokens"]), masked.selected
    grad = _mean_loss_grad(pipe.loss_fn)(logits, targets, selected)
    analytic = _analytic_gradient(logits, targets, selected)
    return np.asarray(grad), np.asarray(analytic), np.asarray(selected)


_analytic_gradient = jax.jit(objective.analytic_logit_gradient)


@functools.lru_cache(maxsize=8)
def _mean_loss_grad(loss_fn):
    def mean_loss(logits, targets, selected):
        total, count = loss_fn(logits, targets, selected)
        return total / count

    return jax.jit(jax.grad(mean_loss))


def check_unselected_zero_grad(grad, selected) -> CheckResult:
    outside = np.abs(grad[~selected])
    nonzero = int(np.count_nonzero(outside))
    largest = float(outside.max()) if outside.size else 0.0
    return CheckResult("unselected_zero_grad", nonzero == 0,
                       {"nonzero": nonzero, "max_abs": largest,
                        "unselected_positions": int((~selected).sum())},
                       f"{nonzero} nonzero gradient entries (max |g| {largest:.1e}) over "
                       f"{int((~selected).sum())} unselected positions x vocab")


def check_analytic_gradient(grad, analytic) -> CheckResult:
    scale = float(np.abs(analytic).max())
    diff = float(np.abs(grad - analytic).max())
    rel = diff / scale if scale else diff
    return CheckResult("analytic_gradient", rel <= GRAD_RTOL,
                       {"max_abs_diff": diff, "max_abs": scale, "rel": rel},
                       f"max |autodiff - analytic| {diff:.2e} = {rel:.1e} of the largest entry "
                       f"(tolerance {GRAD_RTOL:g}) on dense {grad.shape} logits")


def check_empty_selection(pipe: Pipeline, batch) -> CheckResult:
    """An all-False selection must be refused on the host, naming the problem."""
    tokens = np.asarray(batch["tokens"])
    empty = np.zeros(tokens.shape, bool)
    outcomes = {}
    for name, call in (
        ("boundary", lambda: pipe.boundary(tokens, empty)),
        ("mask_tokens", lambda: masking.mask_tokens(
            jax.random.key(0), tokens, eligible=empty, mask_id=int(pipe.vocab.specials["mask"]),
            vocab_size=pipe.vocab.size, special_ids=pipe.vocab.special_ids)),
    ):
        try:
            call()
            outcomes[name] = "accepted"
        except ValueError as e:
            message = str(e)
            outcomes[name] = "rejected" if "no " in message and "position" in message else \
                f"unclear error: {message}"
    passed = all(v == "rejected" for v in outcomes.values())
    detail = ("an all-False selection is rejected with ValueError by the boundary and by "
              "mask_tokens" if passed else
              "; ".join(f"{k}: {v}" for k, v in outcomes.items() if v != "rejected"))
    return CheckResult("empty_selection", passed, outcomes, detail)
