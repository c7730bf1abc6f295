"""Each claim of the lesson, as its own test, on clozax's masking and objective."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clozax.app import lesson
from clozax.core import objective
from commands import clozax

pytestmark = pytest.mark.fast  # make test-fast; tests marked slow stay out

RECORDED = [
    "MLM initial/final/changed-mask: 1.0986123085021973 0.010633035562932491 "
    "0.010457751341164112",
    "Unselected output logits have zero direct loss gradient.",
    "Token-weighted / sequence-weighted: 0.6577723026275635 0.51289606",
    "Changed position loss: 0.010457751341164112",
    "Empty mask rejected",
    "Independent masked softmax gradient agrees.",
]


@pytest.fixture(scope="module")
def result():
    return lesson.run_lesson()


def test_lesson_prints_the_recorded_lines_to_the_digit(result):
    assert result.lines() == RECORDED


def test_initial_loss_is_log3_with_a_zero_head(result):
    assert abs(result.history[0] - np.log(3)) <= 1e-6


def test_final_loss_is_below_15_percent_of_initial(result):
    assert len(result.history) == 100
    assert result.history[-1] < 0.15 * result.history[0]


def test_corrupted_input_holds_mask_id_and_targets_stay_clean():
    batch = lesson.lesson_mask(jnp.array(lesson.TOKENS), lesson.position_mask(1))
    assert (np.asarray(batch.inputs)[:, 1] == lesson.MASK_ID).all()
    assert (np.asarray(batch.targets) == np.asarray(lesson.TOKENS)).all()
    unselected = ~lesson.position_mask(1)
    assert (np.asarray(batch.inputs)[unselected] == np.asarray(lesson.TOKENS)[unselected]).all()


def test_held_out_and_changed_mask_positions_have_low_loss(result):
    assert result.held_loss < 0.2
    assert result.changed_position_loss < 0.2


def test_final_probabilities_put_their_mass_on_each_target(result):
    probs = result.final_probabilities
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-6)
    assert (probs.argmax(-1) == np.arange(3)).all()


def test_changing_clean_targets_at_selected_positions_changes_the_loss():
    logits = jnp.log(jnp.array(lesson.AUDIT_PROBS))
    targets = jnp.array(lesson.AUDIT_TARGETS)
    mask = jnp.array(lesson.AUDIT_MASK)
    before = objective.masked_cross_entropy(logits, targets, mask)
    after = objective.masked_cross_entropy(logits, targets.at[1, 1].set(2), mask)
    assert not np.isclose(float(before), float(after))
    # ...while changing an unselected target changes nothing.
    same = objective.masked_cross_entropy(logits, targets.at[0, 1].set(2), mask)
    assert float(same) == float(before)


def test_unselected_logits_get_zero_gradient_and_do_not_move_the_loss():
    logits = jnp.log(jnp.array(lesson.AUDIT_PROBS))
    targets = jnp.array(lesson.AUDIT_TARGETS)
    mask = jnp.array(lesson.AUDIT_MASK)
    perturbed = jnp.where(mask[..., None], logits, logits + jnp.array([100.0, -50.0, 7.0]))
    assert float(objective.masked_cross_entropy(perturbed, targets, mask)) == pytest.approx(
        float(objective.masked_cross_entropy(logits, targets, mask)), abs=1e-6
    )
    grad = np.asarray(jax.grad(objective.masked_cross_entropy)(logits, targets, mask))
    assert (grad[~np.asarray(mask)] == 0.0).all()
    assert (np.abs(grad[np.asarray(mask)]) > 0).any()


def test_token_weighted_mean_differs_from_sequence_weighted_on_unequal_masks(result):
    assert result.token_weighted == pytest.approx(0.6577723026275635, abs=1e-7)
    assert not np.isclose(result.token_weighted, float(result.sequence_weighted))


def test_lessons_worked_example_token_vs_sequence_weighting():
    # One sequence: one token of loss 2; the other: three tokens of loss 1 -> 1.25 vs 1.5.
    p2, p1 = np.exp(-2.0), np.exp(-1.0)
    probs = np.array(
        [[[p2, 1 - p2], [0.5, 0.5], [0.5, 0.5]], [[p1, 1 - p1], [p1, 1 - p1], [p1, 1 - p1]]]
    )
    logits = jnp.log(jnp.array(probs, jnp.float32))
    targets = jnp.zeros((2, 3), jnp.int32)
    mask = jnp.array([[True, False, False], [True, True, True]])
    token = float(objective.masked_cross_entropy(logits, targets, mask))
    sequence = float(objective.sequence_weighted_mean(logits, targets, mask))
    assert token == pytest.approx(1.25, rel=1e-5)
    assert sequence == pytest.approx(1.5, rel=1e-5)


def test_empty_mask_is_rejected_at_the_public_boundary():
    with pytest.raises(ValueError, match="no selected position"):
        lesson.lesson_mask(jnp.array(lesson.TOKENS), np.zeros((3, 4), bool))


def test_analytic_gradient_equals_autodiff():
    logits = jnp.log(jnp.array(lesson.AUDIT_PROBS))
    targets = jnp.array(lesson.AUDIT_TARGETS)
    mask = jnp.array(lesson.AUDIT_MASK)
    np.testing.assert_allclose(
        jax.grad(objective.masked_cross_entropy)(logits, targets, mask),
        objective.analytic_logit_gradient(logits, targets, mask),
        rtol=0,
        atol=1e-6,
    )


def test_lesson_cli_writes_json_and_two_figures(tmp_path, capsys):
    out = tmp_path / "lesson"
    ran = clozax(capsys, "lesson", "--out", out)
    assert ran.code == 0, ran
    assert ran.out.splitlines()[:6] == RECORDED
    record = json.loads((out / "lesson.json").read_text())
    assert len(record["loss_history"]) == 100
    assert record["lines"] == RECORDED
    for name in ("lesson_loss.png", "lesson_probabilities.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
