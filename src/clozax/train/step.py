"""The train step: on-device corruption, sparse prediction, token-weighted accumulation.

``make_train_step`` builds the pure step ``(state, batch, mask_key) -> (state, metrics)``.
Inside it the batch is corrupted with ``fold_in(mask_key, step)``, the vocabulary head runs only
at the static number of selected slots, and the loss numerator and selected count are summed over
microbatches (and, through the global-array semantics of ``jit`` over a device mesh, over
devices) before one division. A step that trains the MLM head alone (a phase's ``trains =
"head"``) stops the gradient at the encoder's parameters and zeroes their updates, weight decay
included, so the encoder stays bitwise as it was and its backward pass is not computed; the
encoder's optimizer state (kept apart from the head's, ``core/optim.py``) is held too, so its
first updates after the phase are a fresh Adam's, not scaled by a count of steps it never took.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from clozax.core import model as model_lib
from clozax.core.masker import make_masker
from clozax.core.objective import masked_nll
from clozax.core.optim import keep_rest
from clozax.core.train_state import TrainState
from clozax.core.vocab import Vocabulary
from clozax.train.config import RunConfig

HEAD = "head"  # the MLM head's own parameters (its decoder is the tied word embeddings)


def hold_encoder(tree: dict, hold) -> dict:
    """``tree`` (parameters, or updates) with ``hold`` applied to every leaf outside the MLM
    head's own parameters: ``jax.lax.stop_gradient`` on parameters, ``jnp.zeros_like`` on
    updates."""
    return {k: v if k == HEAD else jax.tree.map(hold, v) for k, v in tree.items()}


def make_loss(model_config, trains: str = "all"):
    """``(params, *micro) -> (sum, (sum, count))`` on one microbatch; the head runs sparsely.

    The gradient taken is that of the *sum*; the caller divides summed gradients by the summed
    count once. ``trains="head"``: the gradient reaches the MLM head's own parameters only.
    """

    def loss_fn(params, inputs, segments, positions, targets, valid):
        if trains == "head":
            params = hold_encoder(params, jax.lax.stop_gradient)
        hidden_sel = model_lib.apply(params, model_config, inputs, segments > 0, segments,
                                     positions=positions)  # (batch, count, hidden)
        logits = model_lib.mlm_logits(params, model_config, hidden_sel)
        total, count = masked_nll(logits, targets, valid)  # logits: (batch, count, vocab)
        return total, (total, count)  # differentiate the numerator; carry the count

    return loss_fn


def make_loss_and_grads(config: RunConfig, vocab: Vocabulary, seq_len: int,
                        mesh: Mesh | None = None, trains: str = "all"):
    """``(params, batch, step_key, step) -> (sum, count, grad_sum)`` over the global batch.

    The batch is corrupted once with ``step_key``; the microbatches (``train.microbatches``)
    only split the forward/backward work, so they cannot change the masks. Numerators,
    counts and gradient numerators are summed; nothing is divided here.
    """
    masker = make_masker(config.masking, vocab, seq_len)
    loss_fn = make_loss(config.model, trains)
    grad_fn = jax.grad(loss_fn, has_aux=True)
    k = config.train.microbatches
    micro_sharding = NamedSharding(mesh, P(None, "data")) if mesh is not None else None

    def split_micro(x):
        # Microbatch j takes rows j, j+k, j+2k, ...: every microbatch spans every device.
        x = x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
        if micro_sharding is not None:
            x = jax.lax.with_sharding_constraint(x, micro_sharding)
        return x

    def loss_and_grads(params, batch: dict, step_key, step=None):
        masked, selection = masker(step_key, batch, step)  # step: a masking-rate ramp's place
        targets = jnp.take_along_axis(batch["tokens"], selection.positions, axis=-1)
        micro = (masked.inputs, batch["segments"], selection.positions, targets, selection.valid)
        if k == 1:
            grad_sum, (total, count) = grad_fn(params, *micro)
            return total, count, grad_sum

        def body(carry, mb):
            g_acc, s_acc, c_acc = carry
            g, (s, c) = grad_fn(params, *mb)
            return (jax.tree.map(jnp.add, g_acc, g), s_acc + s, c_acc + c), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
        (grad_sum, total, count), _ = jax.lax.scan(body, init, tuple(map(split_micro, micro)))
        return total, count, grad_sum

    return loss_and_grads


def make_train_step(config: RunConfig, vocab: Vocabulary, seq_len: int, optimizer, schedule,
                    mesh: Mesh | None = None, mask_offset: int = 0, trains: str = "all"):
    """The pure train step ``(state, batch, mask_key) -> (state, metrics)`` (not yet jitted).

    ``schedule(opt_state)`` gives the learning rate of the update (``make_optimizer``'s second
    result), reported as ``metrics["lr"]``. A masking-rate ramp counts updates from
    ``mask_offset`` (a phase's first update); the mask key is always ``fold_in(key, step)``.
    ``trains="head"``: only the MLM head's own parameters move (``hold_encoder``).
    """
    loss_and_grads = make_loss_and_grads(config, vocab, seq_len, mesh, trains)

    def step(state: TrainState, batch: dict, mask_key):
        total, count, grad_sum = loss_and_grads(
            state.params, batch, jax.random.fold_in(mask_key, state.step),
            state.step - mask_offset if mask_offset else state.step,
        )
        # One division, after every microbatch and device has contributed. Every row has an
        # eligible token (checked on the host), so count >= batch; the guard only avoids a NaN.
        denom = jnp.maximum(count, 1).astype(jnp.float32)
        grads = jax.tree.map(lambda g: g / denom, grad_sum)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        if trains == "head":  # the encoder's updates are its weight decay alone: none of it,
            updates = hold_encoder(updates, jnp.zeros_like)  # and its moments and count stay
            opt_state = keep_rest(opt_state, state.opt_state)
        params = optax.apply_updates(state.params, updates)
        grad_norm = optax.tree.norm(grads)
        metrics = {
            "loss": total / denom,
            "loss_sum": total,
            "selected": count,
            "grad_norm": grad_norm,
            "lr": schedule(state.opt_state),  # the rate this update used
            # Checked on the host before anything is logged or saved: a diverged update
            # (an infinite learning rate, an overflow) must never reach a checkpoint.
            "finite": jnp.isfinite(total) & jnp.isfinite(grad_norm) & all_finite(params),
        }
        return TrainState(state.step + 1, params, opt_state), metrics

    return step


def all_finite(tree) -> jax.Array:
    """() bool: every element of every array of ``tree`` is finite (one reduction each)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))
