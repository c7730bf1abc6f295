"""The lesson's one-head fixture, reproduced on clozax's own masking and objective.

Three repeated-token sequences, position 1 selected and replaced by mask id 3 (an input symbol,
not one of the three output classes), a one-head bidirectional attention model without
positions, a zero vocabulary head (so the first loss is exactly log 3), and plain SGD.
This proves the mechanism only: repetition can be solved without any language.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from clozax.core import files, masking, objective
from clozax.report import figures

TOKENS = [[0, 0, 0, 0], [1, 1, 1, 1], [2, 2, 2, 2]]
MASK_ID = 3
NUM_CLASSES = 3
INPUT_VOCAB = 4  # the three classes plus the mask symbol
STEPS = 100
LEARNING_RATE = 0.4

# The unequal-mask audit fixture: one sequence with one selected token, one with three.
AUDIT_PROBS = [
    [[0.8, 0.1, 0.1], [0.2, 0.7, 0.1], [0.2, 0.3, 0.5]],
    [[0.1, 0.6, 0.3], [0.5, 0.2, 0.3], [0.3, 0.4, 0.3]],
]
AUDIT_TARGETS = [[0, 1, 2], [1, 0, 2]]
AUDIT_MASK = [[True, False, False], [True, True, True]]


class LessonCheckFailed(AssertionError):
    """One of the lesson's claims did not hold."""


def _check(condition, message: str) -> None:
    if not condition:
        raise LessonCheckFailed(message)


def mlm_logits(params, inputs):
    """One-head bidirectional attention, no positions, linear head.

    inputs (batch, seq) -> embeddings (batch, seq, 6) -> scores (batch, seq_q, seq_k)
    -> context (batch, seq, 6) -> logits (batch, seq, classes).
    """
    h = params["embedding"][inputs]
    # Query and key axes, not the vocabulary: no causal triangle, every position sees both sides.
    scores = h @ jnp.swapaxes(h, -1, -2) / jnp.sqrt(h.shape[-1])
    context = jax.nn.softmax(scores, axis=-1) @ h
    return context @ params["head"]


def lesson_mask(tokens, selected) -> masking.MaskedBatch:
    """Corrupt with the lesson's policy (always the mask id) through the public boundary."""
    return masking.mask_tokens(
        jax.random.key(0),  # unused randomness: the 1/0/0 policy is deterministic
        tokens,
        selected=selected,
        mask_id=MASK_ID,
        vocab_size=INPUT_VOCAB,
        num_classes=NUM_CLASSES,
        policy=masking.LESSON_POLICY,
    )


def selected_loss(params, batch: masking.MaskedBatch):
    """Token-weighted selected-position cross-entropy, divided once here."""
    return objective.token_weighted_mean(
        *objective.masked_nll(mlm_logits(params, batch.inputs), batch.targets, batch.selected)
    )


def position_mask(position: int) -> np.ndarray:
    mask = np.zeros((len(TOKENS), len(TOKENS[0])), bool)
    mask[:, position] = True
    return mask


@dataclass
class LessonResult:
    history: list[float]
    final_loss: float
    held_loss: float
    changed_position_loss: float
    token_weighted: float
    sequence_weighted: np.float32
    final_probabilities: np.ndarray  # (examples, classes) at the selected position
    corrupted: np.ndarray
    checks: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The lesson's recorded output lines, formatted as the lesson prints them."""
        return [
            f"MLM initial/final/changed-mask: {self.history[0]} {self.history[-1]} "
            f"{self.held_loss}",
            "Unselected output logits have zero direct loss gradient.",
            # str() of a NumPy float32 prints its shortest repr, as the lesson's print() does.
            f"Token-weighted / sequence-weighted: {self.token_weighted} "
            f"{str(self.sequence_weighted)}",
            f"Changed position loss: {self.changed_position_loss}",
            "Empty mask rejected",
            "Independent masked softmax gradient agrees.",
        ]


def run_lesson() -> LessonResult:
    """Train the fixture and run every check the lesson makes; raise on any failure."""
    checks: list[str] = []
    tokens = jnp.array(TOKENS, jnp.int32)
    selected = position_mask(1)
    batch = lesson_mask(tokens, selected)
    corrupted = np.asarray(batch.inputs)
    _check((corrupted[:, 1] == MASK_ID).all(), "selected position is not the mask id")
    _check((np.asarray(batch.targets) == np.asarray(TOKENS)).all(), "targets were modified")
    checks.append("corrupted input holds the mask id at the selected position; targets clean")

    params = {
        "embedding": jax.random.normal(jax.random.key(7), (INPUT_VOCAB, 6)) * 0.2,
        "head": jnp.zeros((6, NUM_CLASSES)),
    }
    step = jax.jit(jax.value_and_grad(lambda p: selected_loss(p, batch)))
    history: list[float] = []
    for _ in range(STEPS):
        value, grads = step(params)
        history.append(float(value))
        params = jax.tree.map(lambda a, b: a - LEARNING_RATE * b, params, grads)

    _check(abs(history[0] - np.log(NUM_CLASSES)) <= 1e-6, f"initial loss {history[0]} != log 3")
    checks.append("initial loss equals log 3 to 1e-6 (zero head: uniform start)")
    _check(history[-1] < history[0] * 0.15, f"final loss {history[-1]} not below 15% of initial")
    checks.append("final loss is below 15% of the initial loss")

    # Changing the clean targets after corruption cannot change the forward pass, only the loss.
    changed = batch._replace(targets=tokens.at[:, 1].set((tokens[:, 1] + 1) % NUM_CLASSES))
    _check(
        not np.isclose(float(selected_loss(params, changed)), history[-1]),
        "changing the clean targets at selected positions did not change the loss",
    )
    checks.append("changing the clean targets at selected positions changes the loss")

    held_loss = float(selected_loss(params, lesson_mask(tokens, position_mask(2))))
    _check(held_loss < 0.2, f"held-out mask position loss {held_loss} is not below 0.2")
    checks.append("a held-out mask position (index 2) has loss below 0.2 without more updates")

    # Unselected output logits: perturbing them changes nothing; their gradient is exactly zero.
    logits = mlm_logits(params, batch.inputs)
    sel = jnp.asarray(selected)
    perturbed = jnp.where(sel[..., None], logits, logits + jnp.array([100.0, -50.0, 7.0]))
    base_loss = objective.masked_cross_entropy(logits, tokens, sel)
    _check(
        abs(float(objective.masked_cross_entropy(perturbed, tokens, sel)) - float(base_loss))
        <= 1e-6,
        "perturbing unselected logits changed the loss",
    )
    grad_logits = np.asarray(jax.grad(objective.masked_cross_entropy)(logits, tokens, sel))
    _check((grad_logits[~selected] == 0.0).all(), "an unselected logit has a nonzero gradient")
    checks.append("unselected logits leave the loss unchanged and get exactly zero gradient")

    # Unequal masks: token-weighted equals the host computation and differs from sequence-weighted.
    audit_probs = jnp.array(AUDIT_PROBS)
    audit_targets = jnp.array(AUDIT_TARGETS)
    audit_mask = jnp.array(AUDIT_MASK)
    audit_logits = jnp.log(audit_probs)
    host_probs = np.asarray(audit_probs)
    host_losses = -np.log(
        host_probs[np.arange(2)[:, None], np.arange(3)[None, :], np.asarray(audit_targets)]
    )
    host_mask = np.asarray(audit_mask)
    token_weighted = float(objective.masked_cross_entropy(audit_logits, audit_targets, audit_mask))
    _check(
        abs(token_weighted - host_losses[host_mask].mean()) <= 1e-6,
        "token-weighted loss disagrees with the host computation",
    )
    sequence_weighted = np.mean([host_losses[i][host_mask[i]].mean() for i in range(2)])
    library_sequence = float(
        objective.sequence_weighted_mean(audit_logits, audit_targets, audit_mask)
    )
    _check(
        abs(library_sequence - float(sequence_weighted)) <= 1e-6,
        "sequence_weighted_mean disagrees with the host computation",
    )
    _check(
        not np.isclose(token_weighted, sequence_weighted),
        "token-weighted and sequence-weighted means coincide on unequal masks",
    )
    checks.append("token-weighted equals the host mean and differs from sequence-weighted")

    changed_position_loss = float(selected_loss(params, lesson_mask(tokens, position_mask(0))))
    _check(changed_position_loss < 0.2, f"position-0 loss {changed_position_loss} not below 0.2")
    checks.append("a changed mask position (index 0) has loss below 0.2")

    try:
        lesson_mask(tokens, np.zeros_like(selected))
    except ValueError:
        checks.append("an empty mask is rejected at the public boundary")
    else:
        raise LessonCheckFailed("empty mask accepted")

    analytic = objective.analytic_logit_gradient(audit_logits, audit_targets, audit_mask)
    autodiff = jax.grad(objective.masked_cross_entropy)(audit_logits, audit_targets, audit_mask)
    _check(
        np.allclose(np.asarray(autodiff), np.asarray(analytic), rtol=0, atol=1e-6),
        "analytic masked-softmax gradient disagrees with autodiff",
    )
    checks.append("analytic gradient (softmax - onehot) x selected / count equals autodiff")

    final_probabilities = np.asarray(jax.nn.softmax(mlm_logits(params, batch.inputs)[:, 1, :]))
    return LessonResult(
        history=history,
        final_loss=history[-1],
        held_loss=held_loss,
        changed_position_loss=changed_position_loss,
        token_weighted=token_weighted,
        sequence_weighted=sequence_weighted,
        final_probabilities=final_probabilities,
        corrupted=corrupted,
        checks=checks,
    )


def write_outputs(result: LessonResult, out: Path) -> list[Path]:
    """Write lesson.json and the two figures; return the written paths."""
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "loss_history": result.history,
        "initial_loss": result.history[0],
        "final_loss": result.final_loss,
        "held_mask_loss": result.held_loss,
        "changed_position_loss": result.changed_position_loss,
        "token_weighted": result.token_weighted,
        "sequence_weighted": float(result.sequence_weighted),
        "final_probabilities": result.final_probabilities.tolist(),
        "corrupted_inputs": result.corrupted.tolist(),
        "checks": result.checks,
        "lines": result.lines(),
        "jax_version": jax.__version__,
    }
    paths = [out / "lesson.json", out / "lesson_loss.png", out / "lesson_probabilities.png"]
    files.write_json(paths[0], record)
    figures.line_plot(
        paths[1],
        {"training loss (selected positions)": (list(range(len(result.history))), result.history)},
        xlabel="completed parameter updates",
        ylabel="selected-token cross-entropy (nats)",
        title="Lesson fixture: loss before each update",
        hlines={"log 3 (uniform)": float(np.log(NUM_CLASSES))},
    )
    figures.heatmap(
        paths[2],
        result.final_probabilities,
        rows=[f"example {i} / target {i}" for i in range(NUM_CLASSES)],
        columns=[f"class {c}" for c in range(NUM_CLASSES)],
        xlabel="predicted vocabulary class",
        ylabel="masked example (target)",
        title="Final probabilities at the selected position",
        colorbar_label="masked-token probability",
    )
    return paths


def run(out: Path | None = None) -> LessonResult:
    """CLI body: run, print the lesson's lines, optionally write outputs."""
    result = run_lesson()
    for line in result.lines():
        print(line)
    if out is not None:
        for path in write_outputs(result, Path(out)):
            print(f"wrote {path}")
    return result
