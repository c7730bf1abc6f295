"""Learning-rate schedules and optimizers, composed from optax pieces.

Schedules (``learning_rate``): a linear warm-up, then a stable stretch at the peak, then a decay
(``linear | cosine | 1-sqrt``) to ``end_lr_fraction`` of the peak at the run's last update.
``decay_fraction`` is the share of the post-warm-up updates spent decaying: 1 (the default) is the
classic warm-up-then-decay; below 1 it is warmup-stable-decay (WSD, Hu et al. 2024), whose
``1-sqrt`` cool-down (Hägele et al. 2024: lr = peak * (1 - sqrt(t)) over the decay's progress t)
is what ModernBERT, Ettin and mmBERT end with. ``decay_start_step`` fixes the decay's first
update exactly (a decay branch, ``train/branch.py``). A run in phases (``train/phases.py``) has
one piece of that shape per phase (``RatePiece``, ``piecewise_rate``): its own peak, a warm-up
from where the previous piece ended, a stable stretch and a decay.

Optimizers (``make_optimizer``), every one with decoupled weight decay on dense kernels only
(``model.decay_mask``: biases, norms and embeddings are not decayed) and the schedule last:

- ``adamw``: ``scale_by_adam`` -> ``add_decayed_weights`` (Loshchilov & Hutter).
- ``stable_adamw``: AdamW whose step size, per tensor, is divided by ``max(1, RMS_t)`` with
  ``RMS_t = sqrt(mean(g_t^2 / max(v_hat_t, eps^2)))`` (Wortsman et al. 2023, Algorithm 2; the
  update clipping ModernBERT's trainer uses in place of gradient clipping); the division also
  scales that tensor's weight decay, as the step size does in the paper.
- ``lamb``: AdamW's direction (with the weight decay) rescaled per tensor by the trust ratio
  ``||w|| / ||u||`` (1 where either norm is 0), as ``optax.lamb`` composes it (You et al. 2020).

``apart``: one top-level entry of the parameters (the MLM head, for a run with a head-only phase)
keeps an optimizer state of its own (``Groups``), so ``keep_rest`` can hold the others' moments
*and count* still while only it trains: Adam's bias correction then never counts updates that
did not reach those parameters.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from clozax.core import model as model_lib

OPTIMIZERS = ("adamw", "stable_adamw", "lamb")
SCHEDULES = ("linear", "cosine", "1-sqrt")


class Groups(NamedTuple):
    """The optimizer state of a run whose ``apart`` entry trains on its own: that entry's
    state, and the state of every other top-level entry of the parameters."""

    apart: optax.OptState
    rest: optax.OptState


class ScheduleState(NamedTuple):
    """The learning-rate schedule's position, kept in the optimizer state (so in checkpoints):
    updates done, and the run's total length, which ``--minutes`` and ``--extend-to`` set without
    recompiling the step (it is data, not a constant of the compiled program)."""

    count: jax.Array  # () int32
    total_steps: jax.Array  # () int32


def learning_rate(optim, count, total_steps):
    """The rate of update ``count`` (0-based) of a ``total_steps`` run: linear warm-up over
    ``min(optim.warmup_steps, total_steps - 1)`` updates, the peak until the decay starts
    (``decay_fraction`` of the post-warm-up updates before the end), then the decay to
    ``optim.end_lr_fraction`` of the peak at ``total_steps``. jnp throughout, so ``count`` and
    ``total_steps`` may be traced."""
    count = jnp.asarray(count, jnp.float32)
    total = jnp.asarray(total_steps, jnp.float32)
    peak, end = optim.learning_rate, optim.learning_rate * optim.end_lr_fraction
    warmup = jnp.minimum(float(optim.warmup_steps), jnp.maximum(total - 1.0, 0.0))
    start = decay_start(optim, total, warmup)
    frac = jnp.clip((count - start) / jnp.maximum(total - start, 1.0), 0.0, 1.0)
    if optim.schedule == "cosine":
        decayed = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
    elif optim.schedule == "1-sqrt":
        decayed = end + (peak - end) * (1.0 - jnp.sqrt(frac))
    else:
        decayed = peak + (end - peak) * frac
    warming = peak * count / jnp.maximum(warmup, 1.0)
    return jnp.where(count < warmup, warming, decayed)


def decay_start(optim, total, warmup=None):
    """The update count the decay starts at: ``optim.decay_start_step`` when set (a decay
    branch's ``S``, exactly), else ``decay_fraction`` of the post-warm-up updates before the
    end. jnp or plain numbers alike."""
    if optim.decay_start_step is not None:
        return float(optim.decay_start_step)
    if warmup is None:
        warmup = min(float(optim.warmup_steps), max(total - 1.0, 0.0))
    if optim.decay_fraction == 1.0:  # the classic program as it was: the warm-up's end, exactly
        return warmup
    return total - optim.decay_fraction * (total - warmup)


class RatePiece(NamedTuple):
    """One phase's learning rate over its updates ``[start, start + steps)``: a linear warm-up
    from ``begin`` (the rate the previous piece ended at; 0 for the first) to ``peak`` over
    ``warmup`` updates, the peak, then over the last ``decay_fraction`` of the post-warm-up
    updates a ``decay`` (``none | linear | cosine | 1-sqrt``) to ``end``."""

    start: int
    steps: int
    peak: float
    warmup: int
    decay: str
    decay_fraction: float
    end: float
    begin: float = 0.0


def piece_decay_start(piece: RatePiece) -> float:
    """The local update at which ``piece`` starts to decay (its length when it does not):
    the last ``decay_fraction`` of its post-warm-up updates, or all of them at 1.0."""
    warmup, n = float(piece.warmup), float(piece.steps)
    if piece.decay == "none":
        return n
    return warmup if piece.decay_fraction == 1.0 else n - piece.decay_fraction * (n - warmup)


def piece_rate(piece: RatePiece, local):
    """The rate of update ``local`` (0-based within the piece; traced or a plain number): the
    classic ``learning_rate``'s formula with the piece's own peak, start rate and length."""
    local = jnp.asarray(local, jnp.float32)
    warmup, n = float(piece.warmup), float(piece.steps)
    warming = piece.begin + (piece.peak - piece.begin) * local / max(warmup, 1.0)
    if piece.decay == "none":
        settled = jnp.full_like(local, piece.peak)
    else:
        start = piece_decay_start(piece)
        frac = jnp.clip((local - start) / max(n - start, 1.0), 0.0, 1.0)
        if piece.decay == "cosine":
            settled = piece.end + (piece.peak - piece.end) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
        elif piece.decay == "1-sqrt":
            settled = piece.end + (piece.peak - piece.end) * (1.0 - jnp.sqrt(frac))
        else:
            settled = piece.peak + (piece.end - piece.peak) * frac
    return jnp.where(local < warmup, warming, settled)


def piecewise_rate(pieces: tuple[RatePiece, ...]):
    """``rate(count, total_steps)`` of a run in phases: piece ``k``'s rate from its first
    update on (the total is unused: a phased run's length is fixed by its phases)."""

    def rate(count, total_steps=None):
        count = jnp.asarray(count, jnp.float32)
        out = piece_rate(pieces[0], count - pieces[0].start)
        for piece in pieces[1:]:
            out = jnp.where(count >= piece.start, piece_rate(piece, count - piece.start), out)
        return out

    return rate


def scale_by_schedule(rate, total_steps: int) -> optax.GradientTransformation:
    """Multiply updates by ``-rate(count, total_steps)``; both live in the state."""

    def init(params):
        return ScheduleState(jnp.zeros((), jnp.int32), jnp.asarray(total_steps, jnp.int32))

    def update(updates, state, params=None):
        lr = rate(state.count, state.total_steps)
        updates = jax.tree.map(lambda u: (-lr * u).astype(u.dtype), updates)
        return updates, ScheduleState(state.count + 1, state.total_steps)

    return optax.GradientTransformation(init, update)


def clip_by_update_rms(inner: optax.GradientTransformation, b2: float,
                       eps: float) -> optax.GradientTransformation:
    """StableAdamW's update clipping around ``inner`` = chain(scale_by_adam, weight decay):
    each tensor's update divided by ``max(1, sqrt(mean(g^2 / max(v_hat, eps^2))))``, with
    ``v_hat`` the bias-corrected second moment ``scale_by_adam`` has just updated."""

    def update(grads, state, params=None):
        updates, state = inner.update(grads, state, params)
        adam = state[0]
        nu_hat = optax.tree.bias_correction(adam.nu, b2, adam.count)

        def clipped(u, g, v):
            g = g.astype(jnp.float32)
            rms = jnp.sqrt(jnp.mean(g * g / jnp.maximum(v, eps * eps)))
            return (u / jnp.maximum(1.0, rms)).astype(u.dtype)

        return jax.tree.map(clipped, updates, grads, nu_hat), state

    return optax.GradientTransformation(inner.init, update)


def make_optimizer(optim, steps: int, params, schedule=None, apart: str | None = None) -> tuple:
    """``optim.optimizer`` (see the module docstring) with global-norm clipping (``clip_norm``;
    0 disables) first and the schedule of ``learning_rate`` last (or ``schedule(count,
    total_steps)``: a phased run's ``piecewise_rate``). ``optim`` is an ``OptimConfig``. The
    state's structure depends on ``optim.optimizer``, ``clip_norm`` and ``apart`` only, so a
    phase may change the rate and the weight decay and keep the state. ``apart``: the top-level
    entry of ``params`` whose moments and count are kept apart from the rest's (``Groups``).

    Returns ``(optimizer, rate)``: ``rate(opt_state)`` is the learning rate of the next update.
    """
    parts = [optax.clip_by_global_norm(optim.clip_norm)] if optim.clip_norm > 0 else []
    if apart is None:
        parts.append(_moments(optim, params))
    else:
        parts.append(_in_groups(lambda tree: _moments(optim, tree), apart))
    if schedule is None:
        def schedule(count, total_steps):
            return learning_rate(optim, count, total_steps)
    parts.append(scale_by_schedule(schedule, steps))

    def rate(opt_state):
        state = opt_state[-1]
        return schedule(state.count, state.total_steps)

    return optax.chain(*parts), rate


def _moments(optim, params) -> optax.GradientTransformation:
    """The optimizer proper over ``params``: Adam's moments, the decoupled weight decay on its
    dense kernels and ``optim.optimizer``'s per-tensor rescaling."""
    adam = optax.scale_by_adam(b1=optim.b1, b2=optim.b2, eps=optim.eps)
    decay = optax.add_decayed_weights(optim.weight_decay, mask=model_lib.decay_mask(params))
    if optim.optimizer == "stable_adamw":
        return clip_by_update_rms(optax.chain(adam, decay), optim.b2, optim.eps)
    if optim.optimizer == "lamb":
        return optax.chain(adam, decay, optax.scale_by_trust_ratio())
    return optax.chain(adam, decay)


def _split(tree: dict, apart: str) -> tuple[dict, dict]:
    return {apart: tree[apart]}, {k: v for k, v in tree.items() if k != apart}


def _in_groups(make, apart: str) -> optax.GradientTransformation:
    """``make(tree)``'s transformation run separately on ``params[apart]`` and on the other
    top-level entries, each with its own state (``Groups``); the updates merged back."""

    def init(params):
        one, rest = _split(params, apart)
        return Groups(make(one).init(one), make(rest).init(rest))

    def update(updates, state, params=None):
        (u_one, u_rest), (p_one, p_rest) = _split(updates, apart), _split(params, apart)
        u_one, s_one = make(p_one).update(u_one, state.apart, p_one)
        u_rest, s_rest = make(p_rest).update(u_rest, state.rest, p_rest)
        return {**u_rest, **u_one}, Groups(s_one, s_rest)

    return optax.GradientTransformation(init, update)


def keep_rest(new_state, old_state):
    """``new_state`` with every ``Groups``' ``rest`` state taken from ``old_state``: an update
    that trained only the ``apart`` entry leaves the others' moments and count where they
    were."""
    if isinstance(new_state, Groups):
        return new_state._replace(rest=old_state.rest)
    if isinstance(new_state, tuple) and not hasattr(new_state, "_fields"):
        return tuple(keep_rest(n, o) for n, o in zip(new_state, old_state, strict=True))
    return new_state


def with_total_steps(opt_state, steps: int):
    """``opt_state`` with the schedule's total length set to ``steps`` (``--minutes``,
    ``--extend-to``); the moments and counts are kept."""
    schedule = opt_state[-1]
    total = jnp.asarray(steps, schedule.total_steps.dtype)
    if hasattr(schedule.total_steps, "sharding"):
        total = jax.device_put(total, schedule.total_steps.sharding)
    return (*opt_state[:-1], schedule._replace(total_steps=total))


def adam_state(opt_state) -> optax.ScaleByAdamState:
    """The Adam moments (``mu``, ``nu``) and count within ``make_optimizer``'s state, however
    deeply the optimizer nests them."""
    if isinstance(opt_state, optax.ScaleByAdamState):
        return opt_state
    if isinstance(opt_state, tuple) and not hasattr(opt_state, "_fields"):
        for part in opt_state:
            found = adam_state(part)
            if found is not None:
                return found
    return None
