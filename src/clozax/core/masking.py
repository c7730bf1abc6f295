"""Selection and corruption: which positions are predicted, and what the encoder sees there.

Everything here is a pure function of an explicit PRNG key. The clean ids (``targets``) are
never modified; only ``inputs`` differ from them, and only at selected positions.

Axis names: ``batch`` sequences of ``seq`` positions; ``count`` selected slots per sequence.

Two layers:

* jittable cores (``select_fixed``, ``select_words``, ``corrupt``) that assume valid input and
  keep shapes static, used inside the train step;
* the public boundary ``mask_tokens`` that validates eagerly on the host (shapes, dtypes,
  ranges, emptiness) and raises ``ValueError`` naming the value and the fix, then calls the cores.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Kind(enum.IntEnum):
    """Corruption applied at a position. ``NONE`` marks unselected positions."""

    NONE = 0
    MASK = 1
    RANDOM = 2
    KEEP = 3


KIND_NAMES = {Kind.MASK: "mask", Kind.RANDOM: "random", Kind.KEEP: "keep"}


@dataclass(frozen=True)
class CorruptionPolicy:
    """Fractions of selected positions replaced by the mask id, by a random id, or kept."""

    mask: float = 0.8
    random: float = 0.1
    keep: float = 0.1

    def __post_init__(self):
        for name in ("mask", "random", "keep"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(
                    f"corruption fraction {name}={value!r} is outside [0, 1]; "
                    "give each of mask/random/keep as a fraction between 0 and 1"
                )
        total = self.mask + self.random + self.keep
        if not math.isclose(total, 1.0, abs_tol=1e-6):
            raise ValueError(
                f"corruption fractions mask={self.mask} random={self.random} keep={self.keep} "
                f"sum to {total:g}, not 1; adjust them so they sum to 1 (BERT uses 0.8/0.1/0.1)"
            )


BERT_POLICY = CorruptionPolicy(0.8, 0.1, 0.1)
# The lesson always replaces a selected token with the mask id.
LESSON_POLICY = CorruptionPolicy(1.0, 0.0, 0.0)


class Selection(NamedTuple):
    """A static number of selected slots per sequence.

    positions: (batch, count) int32 position of each slot in its sequence.
    valid:     (batch, count) bool; False pads slots where fewer positions were eligible.
    """

    positions: jax.Array
    valid: jax.Array


class MaskedBatch(NamedTuple):
    """The result of masking. Only ``inputs`` may enter the encoder.

    inputs:   (batch, seq) int32 corrupted ids.
    targets:  (batch, seq) int32 the untouched clean ids.
    selected: (batch, seq) bool, the positions that are scored.
    kind:     (batch, seq) int8 ``Kind`` per position (NONE where unselected).
    """

    inputs: jax.Array
    targets: jax.Array
    selected: jax.Array
    kind: jax.Array


def selection_count(rate: float, seq_len: int) -> int:
    """Selected slots per sequence: ``max(1, round(rate × seq_len))``."""
    validate_rate(rate)
    return max(1, round(rate * seq_len))


def ramp_rate(start: float, end: float, ramp_steps: int, step):
    """The masking rate of update ``step`` (0-based, may be traced) of a linear ramp from
    ``start`` to ``end`` over ``ramp_steps`` updates, ``end`` after it."""
    frac = jnp.clip(jnp.asarray(step, jnp.float32) / max(ramp_steps, 1), 0.0, 1.0)
    return start + (end - start) * frac


def ramp_count(start: float, end: float, ramp_steps: int, step, seq_len: int):
    """() int32 slots in use at ``step``: ``max(1, round(rate × seq_len))`` of ``ramp_rate``."""
    rate = ramp_rate(start, end, ramp_steps, step)
    return jnp.maximum(1, jnp.round(rate * seq_len)).astype(jnp.int32)


def validate_rate(rate: float, upper: float = 1.0) -> None:
    if not isinstance(rate, (int, float)) or not 0.0 < rate <= upper:
        raise ValueError(
            f"masking rate {rate!r} is outside (0, {upper:g}]; choose a fraction such as 0.15"
        )


# --------------------------------------------------------------------------- jittable cores


def select_fixed(key: jax.Array, eligible: jax.Array, count: int,
                 active: jax.Array | None = None) -> Selection:
    """Choose ``count`` eligible positions per sequence uniformly without replacement.

    eligible: (batch, seq) bool. Where a sequence has fewer than ``count`` eligible positions,
    the surplus slots point at ineligible positions and are marked ``valid=False``.
    ``active`` (a traced () int <= ``count``, for a masking-rate ramp): only that many slots
    are selected (the highest-scoring, so still a uniform sample); the rest are invalid, and
    the static slot count keeps one compiled program for every rate of the ramp.
    """
    # Uniform scores in [0, 1) for eligible positions, -1 for the rest: the top ``count``
    # scores are a uniform sample of the eligible positions, and ineligible ones come last.
    scores = jnp.where(eligible, jax.random.uniform(key, eligible.shape), -1.0)  # (batch, seq)
    _, positions = jax.lax.top_k(scores, count)  # (batch, count), best score first
    if active is None:
        positions = jnp.sort(positions, axis=-1).astype(jnp.int32)
        valid = jnp.take_along_axis(eligible, positions, axis=-1)
        return Selection(positions, valid)
    in_use = jnp.broadcast_to(jnp.arange(count) < active, positions.shape)  # the best `active`
    order = jnp.argsort(positions, axis=-1)
    positions = jnp.take_along_axis(positions, order, axis=-1).astype(jnp.int32)
    valid = (jnp.take_along_axis(eligible, positions, axis=-1)
             & jnp.take_along_axis(in_use, order, axis=-1))
    return Selection(positions, valid)


def select_words(
    key: jax.Array, eligible: jax.Array, word_starts: jax.Array, count: int,
    active: jax.Array | None = None,
) -> Selection:
    """Whole-word selection: choose words in random order, all of their tokens, up to ``count``.

    word_starts: (batch, seq) bool, True at the first token of each word; a word runs from a
    start to the token before the next start. A word is eligible only if all its tokens are.
    Words are taken in random order until the next one would not fit in the ``count`` slots,
    so no word is ever partly selected; slots left over are ``valid=False``. ``active``
    (traced, <= ``count``) caps the selected tokens below the slot count (a rate ramp).
    """
    batch, seq = eligible.shape
    words = seq + 1  # word ids are 0 (before the first start) .. seq
    word_id = jnp.cumsum(word_starts.astype(jnp.int32), axis=-1)  # (batch, seq)

    def per_word_sum(values):  # (batch, seq) -> (batch, words)
        return jax.vmap(lambda w, v: jnp.zeros(words, jnp.int32).at[w].add(v))(
            word_id, values.astype(jnp.int32)
        )

    size = per_word_sum(jnp.ones_like(eligible))  # (batch, words)
    word_ok = (per_word_sum(~eligible) == 0) & (size > 0)
    score = jnp.where(word_ok, jax.random.uniform(key, (batch, words)), -1.0)
    order = jnp.argsort(-score, axis=-1)  # (batch, words), random order, ineligible last
    sorted_size = jnp.take_along_axis(jnp.where(word_ok, size, 0), order, axis=-1)
    fits = jnp.cumsum(sorted_size, axis=-1) <= (count if active is None else active)
    sorted_take = fits & jnp.take_along_axis(word_ok, order, axis=-1)
    take_word = jnp.zeros((batch, words), bool).at[jnp.arange(batch)[:, None], order].set(
        sorted_take
    )
    selected = jnp.take_along_axis(take_word, word_id, axis=-1) & eligible  # (batch, seq)
    # Selected positions first, in position order, then the first ``count`` slots.
    slot = jnp.argsort(~selected, axis=-1, stable=True)[:, :count].astype(jnp.int32)
    return Selection(slot, jnp.take_along_axis(selected, slot, axis=-1))


def selection_mask(selection: Selection, seq_len: int) -> jax.Array:
    """Scatter a ``Selection`` into a (batch, seq) bool mask."""
    batch = selection.positions.shape[0]
    rows = jnp.arange(batch)[:, None]
    mask = jnp.zeros((batch, seq_len), bool)
    # Invalid slots scatter False with ``max`` so they never clear a valid slot's True.
    return mask.at[rows, selection.positions].max(selection.valid)


def corrupt(
    key: jax.Array,
    tokens: jax.Array,
    selected: jax.Array,
    policy: CorruptionPolicy,
    mask_id: int,
    random_ids: jax.Array,
) -> MaskedBatch:
    """Corrupt selected positions: mask id, random allowed id, or unchanged, per ``policy``.

    tokens: (batch, seq) int clean ids; selected: (batch, seq) bool;
    random_ids: (n,) int ids a random replacement may take (never special ids).
    """
    kind_key, random_key = jax.random.split(key)
    u = jax.random.uniform(kind_key, tokens.shape)
    not_mask = jnp.where(u < policy.mask + policy.random, Kind.RANDOM, Kind.KEEP)
    kind = jnp.where(u < policy.mask, Kind.MASK, not_mask)
    kind = jnp.where(selected, kind, Kind.NONE).astype(jnp.int8)
    if policy.random > 0:
        draw = jax.random.randint(random_key, tokens.shape, 0, random_ids.shape[0])
        random_tokens = jnp.take(random_ids, draw).astype(tokens.dtype)
    else:
        random_tokens = tokens
    inputs = jnp.where(
        kind == Kind.MASK,
        jnp.asarray(mask_id, tokens.dtype),
        jnp.where(kind == Kind.RANDOM, random_tokens, tokens),
    )
    return MaskedBatch(inputs, tokens, selected, kind)


# --------------------------------------------------------------------------- public boundary


def allowed_random_ids(vocab_size: int, special_ids) -> np.ndarray:
    """All ids in ``[0, vocab_size)`` that are not special: the pool for random replacement."""
    special = set(int(i) for i in special_ids)
    return np.array([i for i in range(vocab_size) if i not in special], np.int32)


def validate_masking_inputs(
    tokens,
    *,
    eligible=None,
    selected=None,
    mask_id: int,
    vocab_size: int,
    num_classes: int | None = None,
    random_ids=None,
    special_ids=(),
) -> None:
    """Host-side checks before any jitted code. Raises ``ValueError`` naming value and fix."""
    tokens = np.asarray(tokens)
    num_classes = vocab_size if num_classes is None else num_classes
    if tokens.ndim != 2:
        raise ValueError(
            f"tokens have shape {tokens.shape}; pass a (batch, seq) array of token ids"
        )
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens have dtype {tokens.dtype}; pass integer token ids")
    if (eligible is None) == (selected is None):
        raise ValueError("pass exactly one of `eligible` (to sample) or `selected` (explicit)")
    mask_name, mask = ("selected", selected) if selected is not None else ("eligible", eligible)
    mask = np.asarray(mask)
    if mask.shape != tokens.shape:
        raise ValueError(
            f"{mask_name} mask has shape {mask.shape} but tokens have shape {tokens.shape}; "
            "give one flag per token"
        )
    if mask.dtype != np.bool_:
        raise ValueError(
            f"{mask_name} mask has dtype {mask.dtype}; pass a boolean mask (e.g. `ids == mask_id`"
            " style comparisons), not 0/1 integers or -100 labels"
        )
    if not mask.any():
        raise ValueError(
            f"batch of {tokens.shape[0]} sequences has no {mask_name} position; "
            "an empty mask gives an undefined loss: raise masking.rate or check eligibility"
        )
    if not 0 <= mask_id < vocab_size:
        raise ValueError(
            f"mask id {mask_id} is not a valid input id for vocabulary size {vocab_size}; "
            "use an id inside the vocabulary"
        )
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ValueError(
            f"token ids span [{tokens.min()}, {tokens.max()}], outside the vocabulary "
            f"[0, {vocab_size}); check the tokenizer and vocab_size"
        )
    scored = tokens[mask]
    if (scored == mask_id).any():
        raise ValueError(
            f"mask id {mask_id} appears as a clean target at a {mask_name} position; "
            "the mask id is an input symbol only: exclude it from eligibility"
        )
    if scored.max() >= num_classes:
        raise ValueError(
            f"target id {scored.max()} at a {mask_name} position is not an output class "
            f"(num_classes={num_classes}); exclude it from eligibility or widen the head"
        )
    if random_ids is not None:
        r = np.asarray(random_ids)
        if r.ndim != 1 or r.size == 0:
            raise ValueError("random_ids must be a non-empty 1-d array of allowed replacement ids")
        bad = sorted(set(r.tolist()) & ({int(mask_id)} | {int(s) for s in special_ids}))
        if bad:
            raise ValueError(
                f"random replacement pool contains special id(s) {bad}; "
                "build it with allowed_random_ids(vocab_size, special_ids)"
            )
        if r.min() < 0 or r.max() >= num_classes:
            raise ValueError(
                f"random replacement ids span [{r.min()}, {r.max()}], outside [0, {num_classes})"
            )


def mask_tokens(
    key: jax.Array,
    tokens,
    *,
    mask_id: int,
    vocab_size: int,
    eligible=None,
    selected=None,
    rate: float = 0.15,
    policy: CorruptionPolicy = BERT_POLICY,
    random_ids=None,
    special_ids=(),
    num_classes: int | None = None,
) -> MaskedBatch:
    """Public entry point: validate, select (unless ``selected`` is given), corrupt.

    With ``eligible`` the count per sequence is ``selection_count(rate, seq)``, clipped to the
    eligible count. With ``selected`` the caller's mask is used as is (the lesson's case).
    """
    if not isinstance(policy, CorruptionPolicy):
        raise ValueError(f"policy {policy!r} is not a CorruptionPolicy")
    if eligible is not None:
        validate_rate(rate)
    if policy.random > 0 and random_ids is None:
        random_ids = allowed_random_ids(
            num_classes if num_classes is not None else vocab_size,
            (*special_ids, mask_id),
        )
    validate_masking_inputs(
        tokens,
        eligible=eligible,
        selected=selected,
        mask_id=mask_id,
        vocab_size=vocab_size,
        num_classes=num_classes,
        random_ids=random_ids,
        special_ids=special_ids,
    )
    tokens = jnp.asarray(tokens, jnp.int32)
    select_key, corrupt_key = jax.random.split(key)
    if selected is None:
        eligible = jnp.asarray(eligible)
        count = min(selection_count(rate, tokens.shape[1]), tokens.shape[1])
        selected = selection_mask(select_fixed(select_key, eligible, count), tokens.shape[1])
    pool = jnp.asarray(random_ids if random_ids is not None else np.zeros(1, np.int32))
    return corrupt(corrupt_key, tokens, jnp.asarray(selected), policy, mask_id, pool)
