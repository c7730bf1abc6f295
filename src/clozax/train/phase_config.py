"""One phase of a run in phases: a ``[[phases]]`` table of the run config.

A phase overrides, for its stretch of updates, what the 2024–25 encoder recipes change between
phases (ModernBERT, Ettin, mmBERT): the dataset (a longer ``seq_len`` for context extension),
the batch size or a ramp to it, the masking rate or a ramp, the RoPE bases, the learning rate's
piece (warm-up, stable, decay) and the weight decay; and what it trains (``trains``: everything,
or the MLM head alone, a head warm-up before adapting an encoder imported without one). A
setting a phase leaves unset is the run's own (``[masking]``, ``[optim]``, ``[train]``,
``[model]``). ``train/phases.py`` turns the phases into the run's plan.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from clozax.core.optim import SCHEDULES
from clozax.train.checks import check_choice, check_int, check_name, check_real
from clozax.train.layout import FIXED_EVAL_STEM, phase_eval_stem

DECAYS = ("none", *SCHEDULES)
TRAINS = ("all", "head")


@dataclass(frozen=True)
class PhaseConfig:
    name: str | None = None  # None: "phase1", "phase2", ... by position
    # A prepared dataset directory (the same tokenizer as the run's); None: the run's --data.
    data: str | None = None
    # The phase's length: exactly one of updates or training tokens (rounded up to a step).
    steps: int | None = None
    tokens: int | None = None
    batch_size: int | None = None  # None: train.batch_size
    # A batch ramp: from batch_start to batch_size over the phase's first batch_ramp_steps
    # updates, in batch_ramp_stages equal stages (one compiled program each); sizes are
    # rounded down to a multiple of gcd(batch_start, batch_size).
    batch_start: int | None = None
    batch_ramp_steps: int = 0
    batch_ramp_stages: int = 4
    # Masking: a phase that sets `rate` masks at it, or ramps linearly to `rate_end` over its
    # first `ramp_steps` updates; unset, the run's [masking] applies (a ramp counted from 0).
    rate: float | None = None
    rate_end: float | None = None
    ramp_steps: int = 0
    # RoPE bases of this phase (context extension raises the global one; model.positions="rope")
    rope_theta_global: float | None = None
    rope_theta_local: float | None = None
    # The learning rate's piece: from the rate the previous phase ended at (0 for the first),
    # a linear warm-up of `warmup_steps` to `learning_rate`, the peak, then over the last
    # `decay_fraction` of the post-warm-up updates a `decay` to `end_lr_fraction` of the peak.
    # Unset: optim.learning_rate; optim.warmup_steps for the first phase, 0 after; no decay
    # but in the last phase, which decays as [optim] says (schedule, decay_fraction).
    learning_rate: float | None = None
    warmup_steps: int | None = None
    decay: str | None = None
    decay_fraction: float | None = None
    end_lr_fraction: float | None = None
    weight_decay: float | None = None
    # What the phase's updates move: "all" the parameters, or "head": the MLM head's own
    # (transform, layer norm, bias) alone, the encoder held exactly as it is (its word
    # embeddings, the head's tied decoder, included) and no gradient computed through it.
    trains: str = "all"

    def __post_init__(self):
        if self.name is not None:
            check_name("phases.name", self.name)
        if self.data is not None and (not isinstance(self.data, str) or not self.data):
            raise ValueError(f"phases.data={self.data!r} is not a path; give a prepared "
                             "dataset's directory")
        if (self.steps is None) == (self.tokens is None):
            who = f"phase {self.name}" if self.name else "each [[phases]] table"
            raise ValueError(f"{who} needs exactly one of steps and tokens (got steps="
                             f"{self.steps!r}, tokens={self.tokens!r})")
        for key in ("steps", "tokens", "batch_size", "batch_start"):
            if getattr(self, key) is not None:
                check_int(f"phases.{key}", getattr(self, key), 1)
        check_int("phases.batch_ramp_steps", self.batch_ramp_steps, 0)
        check_int("phases.batch_ramp_stages", self.batch_ramp_stages, 1)
        if (self.batch_start is None) != (self.batch_ramp_steps == 0):
            raise ValueError("phases.batch_start and phases.batch_ramp_steps go together: a "
                             "batch ramp needs its first size and its length")
        if self.batch_start is not None and self.batch_size is not None \
                and self.batch_start >= self.batch_size:
            raise ValueError(f"phases.batch_start={self.batch_start} is not below "
                             f"phases.batch_size={self.batch_size}; a ramp grows the batch")
        if self.steps is not None and self.batch_ramp_steps > self.steps:
            raise ValueError(f"phases.batch_ramp_steps={self.batch_ramp_steps} is longer than "
                             f"the phase ({self.steps} steps)")
        if self.rate is None and (self.rate_end is not None or self.ramp_steps):
            raise ValueError("phases.rate_end or phases.ramp_steps without phases.rate; give "
                             "the phase's first masking rate")
        for key in ("rope_theta_global", "rope_theta_local", "learning_rate"):
            if getattr(self, key) is not None:
                check_real(f"phases.{key}", getattr(self, key), 0.0, math.inf, low_open=True,
                           high_open=True)
        if self.warmup_steps is not None:
            check_int("phases.warmup_steps", self.warmup_steps, 0)
            if self.steps is not None and self.warmup_steps >= self.steps:
                raise ValueError(f"phases.warmup_steps={self.warmup_steps} is not shorter than "
                                 f"the phase ({self.steps} steps)")
        if self.decay is not None:
            check_choice("phases.decay", self.decay, DECAYS)
        if self.decay_fraction is not None:
            check_real("phases.decay_fraction", self.decay_fraction, 0.0, 1.0, low_open=True)
        if self.end_lr_fraction is not None:
            check_real("phases.end_lr_fraction", self.end_lr_fraction, 0.0, 1.0)
        if self.weight_decay is not None:
            check_real("phases.weight_decay", self.weight_decay, 0.0, math.inf, high_open=True)
        check_choice("phases.trains", self.trains, TRAINS)


def phase_names(phases: tuple[PhaseConfig, ...]) -> list[str]:
    """Each phase's name: its own, or ``phaseK`` (1-based) by position; unique (checked)."""
    names = [p.name or f"phase{k + 1}" for k, p in enumerate(phases)]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"phase name(s) {repeated} used twice; give each [[phases]] table its "
                         "own name")
    for name in names:  # a phase's held-out set is eval_masks_NAME: no run file's name
        if phase_eval_stem(name) == FIXED_EVAL_STEM:
            raise ValueError(f"phase name {name!r} would name its held-out set "
                             f"{FIXED_EVAL_STEM}.npz, the fixed-15 % set's file; rename the "
                             "phase")
    return names


def optimizer_apart(phases: tuple[PhaseConfig, ...]) -> str | None:
    """The parameters whose optimizer state a run keeps apart (``core/optim.py``'s ``apart``):
    the MLM head's (its top-level entry, ``"head"``) when a phase trains the head alone, so the
    encoder's Adam moments and count stand still through that phase; None otherwise (one
    state, as every run without such a phase has always had)."""
    return "head" if any(p.trains == "head" for p in phases) else None


def phase_masking(masking, phase: PhaseConfig):
    """The masking of ``phase``: the run's, with the phase's rate or ramp when it sets one."""
    if phase.rate is None:
        return masking
    return dataclasses.replace(masking, rate=phase.rate, rate_end=phase.rate_end,
                               ramp_steps=phase.ramp_steps)


def phases_from_list(values) -> tuple[PhaseConfig, ...]:
    if not isinstance(values, list | tuple) or not all(isinstance(v, dict) for v in values):
        raise ValueError("phases must be a list of tables ([[phases]] in TOML)")
    valid = [f.name for f in dataclasses.fields(PhaseConfig)]
    for table in values:
        unknown = sorted(set(table) - set(valid))
        if unknown:
            raise ValueError(f"unknown phases key(s) {unknown}; valid phases keys are: "
                             f"{', '.join(valid)}")
    return tuple(PhaseConfig(**table) for table in values)


def check_steps_beside(train, tables: list, where: str) -> None:
    """Refuse a ``[train]`` table's ``steps`` beside ``[[phases]]`` tables (whose lengths give
    the run's, and once replaced it without a word) in one line, unless it is their total."""
    steps = train.get("steps") if isinstance(train, dict) else None
    if steps is None:
        return
    lengths = [t.get("steps") if isinstance(t, dict) else None for t in tables]
    total = sum(lengths) if all(isinstance(n, int) for n in lengths) else None
    if steps == total:
        return
    given = f", whose steps total {total}" if total is not None else ""
    raise ValueError(f"{where} sets [train] steps = {steps!r} beside [[phases]]{given}: a run "
                     "in phases has the length its phases give; drop [train] steps (or set "
                     "each phase's steps)")


def as_table_list(value) -> list:
    if not isinstance(value, list):
        raise ValueError("phases must be [[phases]] tables (an array of tables)")
    return value
