"""Pieces of the training pipeline that every stage shares: named keys, the batch masker,
random-init parameters, and the train state with its optimizer.

Training uses them to build its step; evaluation, the audit and the probe use the same ones, so
that what is judged is exactly what was trained (the same masker, the same init key).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from clozax.core import masking
from clozax.core import model as model_lib
from clozax.core.vocab import Vocabulary


class Keys(NamedTuple):
    """Named keys, split once from ``train.seed``; per-step keys come from ``fold_in``."""

    init: jax.Array
    data: int  # numpy seed for the row permutation
    mask: jax.Array

    @staticmethod
    def from_seed(seed: int) -> Keys:
        init_key, data_key, mask_key = jax.random.split(jax.random.key(seed), 3)
        data_seed = int(jax.random.randint(data_key, (), 0, 2**31 - 1))
        return Keys(init_key, data_seed, mask_key)


def init_params(model_config, seed: int) -> model_lib.Params:
    """The architecture at initialisation, drawn with the init key of ``train.seed`` = ``seed``:
    what a run starts from, and the random-init baseline every judge compares against.

    Jitted: one program (which the persistent compilation cache keeps) instead of one compiled
    eager op per tensor (33 compilations, ~3 s on 2 CPU cores). XLA fuses the N(0, std)
    scaling, so a draw can differ from eager ``model.init`` in its last bit (tested).
    """
    return _jitted_init(model_config, Keys.from_seed(seed).init)


_jitted_init = jax.jit(model_lib.init, static_argnums=0)


def make_masker(masking_config, vocab: Vocabulary, seq_len: int):
    """``(key, batch) -> (MaskedBatch, Selection)``, jittable, static selected count.

    ``masking_config`` has ``rate``, ``unit`` ("token" or "word") and ``policy``. Eligible
    positions: real tokens (segment > 0) that are not special ids.
    """
    count = masking.selection_count(masking_config.rate, seq_len)
    special_table = jnp.asarray(vocab.special_table())
    random_ids = jnp.asarray(masking.allowed_random_ids(vocab.size, vocab.special_ids))
    policy = masking_config.policy
    mask_id = int(vocab.specials["mask"])

    def masker(key, batch):
        tokens, segments = batch["tokens"], batch["segments"]
        eligible = ~special_table[tokens] & (segments > 0)  # (batch, seq)
        select_key, corrupt_key = jax.random.split(key)
        if masking_config.unit == "word":
            selection = masking.select_words(select_key, eligible, batch["word_starts"], count)
        else:
            selection = masking.select_fixed(select_key, eligible, count)
        selected = masking.selection_mask(selection, tokens.shape[1])
        masked = masking.corrupt(corrupt_key, tokens, selected, policy, mask_id, random_ids)
        return masked, selection

    return masker


class TrainState(NamedTuple):
    step: jax.Array  # () int32: completed updates
    params: dict
    opt_state: optax.OptState


class ScheduleState(NamedTuple):
    """The learning-rate schedule's position, kept in the optimizer state (so in checkpoints):
    updates done, and the run's total length, which ``--minutes`` and ``--extend-to`` set without
    recompiling the step (it is data, not a constant of the compiled program)."""

    count: jax.Array  # () int32
    total_steps: jax.Array  # () int32


def learning_rate(optim, count, total_steps):
    """The rate of update ``count`` (0-based) of a ``total_steps`` run: linear warm-up over
    ``min(optim.warmup_steps, total_steps - 1)`` updates, then linear or cosine decay to
    ``optim.end_lr_fraction`` of the peak at ``total_steps``. jnp throughout, so ``count`` and
    ``total_steps`` may be traced."""
    count = jnp.asarray(count, jnp.float32)
    total = jnp.asarray(total_steps, jnp.float32)
    peak, end = optim.learning_rate, optim.learning_rate * optim.end_lr_fraction
    warmup = jnp.minimum(float(optim.warmup_steps), jnp.maximum(total - 1.0, 0.0))
    frac = jnp.clip((count - warmup) / jnp.maximum(total - warmup, 1.0), 0.0, 1.0)
    if optim.schedule == "cosine":
        decayed = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
    else:
        decayed = peak + (end - peak) * frac
    warming = peak * count / jnp.maximum(warmup, 1.0)
    return jnp.where(count < warmup, warming, decayed)


def _scale_by_schedule(optim, total_steps: int) -> optax.GradientTransformation:
    """Multiply updates by ``-learning_rate(count, total_steps)``; both live in the state."""

    def init(params):
        return ScheduleState(jnp.zeros((), jnp.int32), jnp.asarray(total_steps, jnp.int32))

    def update(updates, state, params=None):
        lr = learning_rate(optim, state.count, state.total_steps)
        updates = jax.tree.map(lambda u: (-lr * u).astype(u.dtype), updates)
        return updates, ScheduleState(state.count + 1, state.total_steps)

    return optax.GradientTransformation(init, update)


def make_optimizer(optim, steps: int, params) -> tuple:
    """AdamW (no decay on biases, LayerNorm, embeddings) with global-norm clipping and the
    warm-up/decay schedule of ``learning_rate``. ``optim`` is an ``OptimConfig``.

    Returns ``(optimizer, rate)``: ``rate(opt_state)`` is the learning rate of the next update.
    """
    parts = [optax.clip_by_global_norm(optim.clip_norm)] if optim.clip_norm > 0 else []
    parts += [
        optax.scale_by_adam(b1=optim.b1, b2=optim.b2, eps=optim.eps),
        optax.add_decayed_weights(optim.weight_decay, mask=model_lib.decay_mask(params)),
        _scale_by_schedule(optim, steps),
    ]

    def rate(opt_state):
        schedule = opt_state[-1]
        return learning_rate(optim, schedule.count, schedule.total_steps)

    return optax.chain(*parts), rate


def with_total_steps(state: TrainState, steps: int) -> TrainState:
    """``state`` with the schedule's total length set to ``steps`` (``--minutes``,
    ``--extend-to``); the AdamW moments and counts are kept."""
    schedule = state.opt_state[-1]
    total = jnp.asarray(steps, schedule.total_steps.dtype)
    if hasattr(schedule.total_steps, "sharding"):
        total = jax.device_put(total, schedule.total_steps.sharding)
    return state._replace(opt_state=(*state.opt_state[:-1], schedule._replace(total_steps=total)))


def adam_state(opt_state) -> optax.ScaleByAdamState:
    """The AdamW moments (``mu``, ``nu``) and count within ``make_optimizer``'s state."""
    return next(s for s in opt_state if isinstance(s, optax.ScaleByAdamState))


def new_state(params, optimizer) -> TrainState:
    """Step 0 of training from ``params`` (the optimizer state built in one jitted program)."""
    return TrainState(jnp.zeros((), jnp.int32), params, jax.jit(optimizer.init)(params))
