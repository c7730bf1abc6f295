"""Run configuration: frozen dataclasses nested by concern, validated on construction.

A run is ``RunConfig(model, masking, optim, train, phases)``. It loads from a TOML file with
``[model]``/``[masking]``/``[optim]``/``[train]`` tables (and ``[[phases]]`` tables for a run
in phases: ``train/phase_config.py``), takes ``--set section.key=value``
overrides, and a ``--preset`` for the model's shape. Unknown keys are errors that list the
valid ones. The resolved config is written to every run directory and checkpoint.

Settings that change results are kept apart from settings that only change speed
(``SPEED_ONLY``): a resume may change the latter, never the former, and tests prove that the
speed settings leave the numbers unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from clozax.core.masking import CorruptionPolicy, validate_rate
from clozax.core.model_config import PRESETS, ModelConfig
from clozax.core.optim import OPTIMIZERS, SCHEDULES
from clozax.train.checks import check_bool, check_choice, check_int, check_name, check_real
from clozax.train.phase_config import (
    PhaseConfig,
    as_table_list,
    check_steps_beside,
    phase_masking,
    phase_names,
    phases_from_list,
)

MAX_MASK_RATE = 0.5  # Wettig et al. found up to 0.4 useful for large models
SEED_LIMIT = 2**32  # jax.random.key folds larger seeds onto smaller ones (2**32 gives seed 0)


# Masking settings a model preset brings with it (ModernBERT masks 30 %), applied where the
# preset is (``resolve``); the file and ``--set`` still override them.
PRESET_MASKING: dict[str, dict] = {name: {"rate": 0.3} for name in PRESETS
                                   if name.startswith("modern-")}


@dataclass(frozen=True)
class MaskingConfig:
    rate: float = 0.15  # the selection rate (a ramp's first)
    # A linear ramp from `rate` to `rate_end` over the first `ramp_steps` updates (30 % -> 15 %
    # as ModernBERT-era recipes do); the frozen held-out masks use `rate_end` (`heldout_rate`).
    rate_end: float | None = None
    ramp_steps: int = 0
    mask: float = 0.8
    random: float = 0.1
    keep: float = 0.1
    unit: str = "token"  # "token" or "word" (whole-word selection from prepare's word starts)

    def __post_init__(self):
        check_real("masking.rate", self.rate, -math.inf, math.inf)  # a finite number ...
        validate_rate(self.rate, upper=MAX_MASK_RATE)  # ... in (0, MAX_MASK_RATE]
        if self.rate_end is not None:
            check_real("masking.rate_end", self.rate_end, 0.0, MAX_MASK_RATE, low_open=True)
            check_int("masking.ramp_steps", self.ramp_steps, 1)
        elif self.ramp_steps:
            raise ValueError(f"masking.ramp_steps={self.ramp_steps} without masking.rate_end; "
                             "set masking.rate_end (the ramp's last rate) or drop ramp_steps")
        for name in ("mask", "random", "keep"):
            check_real(f"masking.{name}", getattr(self, name), 0.0, 1.0)
        self.policy  # validates the fractions' sum  # noqa: B018
        check_choice("masking.unit", self.unit, ("token", "word"))

    @property
    def policy(self) -> CorruptionPolicy:
        return CorruptionPolicy(self.mask, self.random, self.keep)

    @property
    def heldout_rate(self) -> float:
        """The rate of the frozen held-out masks: the ramp's end, or the one rate."""
        return self.rate if self.rate_end is None else self.rate_end


@dataclass(frozen=True)
class OptimConfig:
    optimizer: str = "adamw"  # "adamw", "stable_adamw" or "lamb" (core/optim.py says how)
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    schedule: str = "linear"  # the decay's shape: "linear", "cosine" or "1-sqrt"
    # Share of the post-warm-up updates spent decaying; below 1 the rate stays at its peak
    # until then (warmup-stable-decay).
    decay_fraction: float = 1.0
    # The decay's first update, exactly (a decay branch sets it: train/branch.py); None: from
    # decay_fraction.
    decay_start_step: int | None = None
    end_lr_fraction: float = 0.0
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-6
    clip_norm: float = 1.0  # global-norm clipping; 0 disables

    def __post_init__(self):
        check_real("optim.learning_rate", self.learning_rate, 0.0, math.inf, low_open=True,
                   high_open=True)
        check_choice("optim.optimizer", self.optimizer, OPTIMIZERS)
        check_int("optim.warmup_steps", self.warmup_steps, 0)
        check_choice("optim.schedule", self.schedule, SCHEDULES)
        check_real("optim.decay_fraction", self.decay_fraction, 0.0, 1.0, low_open=True)
        if self.decay_start_step is not None:
            check_int("optim.decay_start_step", self.decay_start_step, self.warmup_steps)
            if self.decay_fraction != 1.0:
                raise ValueError("optim.decay_start_step and optim.decay_fraction both set; "
                                 "give one of them")
        check_real("optim.end_lr_fraction", self.end_lr_fraction, 0.0, 1.0)
        for name in ("weight_decay", "clip_norm"):
            check_real(f"optim.{name}", getattr(self, name), 0.0, math.inf, high_open=True)
        for name in ("b1", "b2"):
            check_real(f"optim.{name}", getattr(self, name), 0.0, 1.0, high_open=True)
        check_real("optim.eps", self.eps, 0.0, 1.0, low_open=True)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    minutes: float | None = None  # if set, `steps` from measured costs, re-estimated (budget.py)
    batch_size: int = 32  # global, in sequences
    seed: int = 0  # derives init_key, data_key, mask_key
    eval_seed: int = 1234  # the frozen eval-mask set's key: never the training key
    eval_every: int = 100
    # Held-out rows of the frozen eval-mask set: a keyed sample of the split (the reason for
    # 4,096: ``train/heldout.py``); None: every held-out row. `clozax evaluate --full` scores
    # every row, streamed, whatever this is.
    eval_rows: int | None = 4096
    # Rows of the frozen set evaluated during training: a keyed sample (the same rows at every
    # evaluation), bounding its cost; `clozax evaluate` uses the whole frozen set. None: all.
    eval_sample: int | None = 1024
    save_every: int = 100
    # Steps at which ``clozax train --extend-to`` continued a finished run with a schedule
    # re-created for the new ``steps`` (provenance; the AdamW state was kept).
    extended_from: tuple[int, ...] = ()
    # (step, steps) pairs: after ``step`` updates a ``--minutes`` run set its length to
    # ``steps`` (at 0 its first estimate, later re-estimates from its measured speed). The
    # schedule's total is data in the optimizer state, so this recompiles nothing; recorded so
    # that a resume applies each at the same step (``schedule_length``).
    budget_revisions: tuple[tuple[int, int], ...] = ()
    # Speed-only settings: they never change the numbers (see SPEED_ONLY).
    microbatches: int = 1
    devices: int | None = None  # None: all local devices
    # Shard parameters and optimiser state over the devices (ZeRO-3 / FSDP style) instead of
    # replicating them: each array along its largest axis the device count divides.
    fsdp: bool = False
    save_every_minutes: float | None = None  # also save when this much time has passed
    keep_checkpoints: int = 3
    log_every: int = 10
    prefetch: int = 2
    # Peak TFLOP/s per device for the log's MFU; None: the device's data-sheet figure when
    # clozax knows its kind (``core/flops.py``), else no MFU (every CPU).
    peak_tflops: float | None = None
    # Also send the logged scalars, the config and the run's identity to this Weights & Biases
    # project (the ``wandb`` extra; offline without an API key: ``train/wandb_log.py``).
    wandb_project: str | None = None

    def __post_init__(self):
        for name in ("steps", "batch_size", "microbatches", "eval_every", "save_every",
                     "keep_checkpoints", "log_every"):
            check_int(f"train.{name}", getattr(self, name), 1)
        if self.minutes is not None:
            check_real("train.minutes", self.minutes, 0.0, math.inf, low_open=True,
                       high_open=True)
        for name in ("seed", "eval_seed"):
            check_int(f"train.{name}", getattr(self, name), 0, SEED_LIMIT - 1)
        if self.save_every_minutes is not None:
            check_real("train.save_every_minutes", self.save_every_minutes, 0.0, math.inf,
                       low_open=True, high_open=True)
        for name in ("devices", "eval_rows", "eval_sample"):
            if getattr(self, name) is not None:
                check_int(f"train.{name}", getattr(self, name), 1)
        check_bool("train.fsdp", self.fsdp)
        if self.peak_tflops is not None:
            check_real("train.peak_tflops", self.peak_tflops, 0.0, math.inf, low_open=True,
                       high_open=True)
        check_int("train.prefetch", self.prefetch, 0)
        if self.wandb_project is not None:
            check_name("train.wandb_project", self.wandb_project)
        if not isinstance(self.extended_from, tuple):  # JSON gives a list
            object.__setattr__(self, "extended_from", tuple(self.extended_from))
        for step in self.extended_from:
            check_int("train.extended_from", step, 1, self.steps - 1)
        revisions = tuple(tuple(r) for r in self.budget_revisions)  # JSON gives lists
        object.__setattr__(self, "budget_revisions", revisions)
        for revision in revisions:
            if len(revision) != 2:
                raise ValueError(f"train.budget_revisions entry {revision!r} is not (step, steps)")
            check_int("train.budget_revisions step", revision[0], 0)
            check_int("train.budget_revisions steps", revision[1], revision[0])
        if self.batch_size % self.microbatches:
            raise ValueError(
                f"train.batch_size={self.batch_size} is not divisible by "
                f"train.microbatches={self.microbatches}; choose a divisor of the batch size"
            )


def schedule_length(train: TrainConfig, step: int) -> int:
    """The learning-rate schedule's total length in effect after ``step`` updates: the latest
    ``--minutes`` choice or revision (``budget_revisions``) or ``--extend-to`` extension
    (``extended_from``) made at or before ``step``; ``train.steps`` when there is none."""
    ends = (*train.extended_from[1:], train.steps)[:len(train.extended_from)]
    extensions = zip(train.extended_from, ends, strict=True)
    events = sorted([*train.budget_revisions, *extensions])
    past = [total for at, total in events if at <= step]
    return past[-1] if past else train.steps


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=lambda: ModelConfig(**PRESETS["small"]))
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # A run in phases (``train/phases.py``); empty: one stretch of ``train.steps`` updates.
    phases: tuple[PhaseConfig, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "phases", tuple(self.phases))
        if not self.phases:
            return
        phase_names(self.phases)  # unique
        refused = {"train.minutes": self.train.minutes is not None,
                   "--extend-to": bool(self.train.extended_from),
                   "optim.decay_start_step": self.optim.decay_start_step is not None}
        for what, present in refused.items():
            if present:
                raise ValueError(f"{what} cannot be combined with [[phases]]: a run in phases "
                                 "has the length its phases give; set each phase's steps")
        for phase in self.phases:
            if phase.rate is not None:  # the run's masking with the phase's rate (validated)
                phase_masking(self.masking, phase)
            if self.model.positions != "rope" and (phase.rope_theta_global or
                                                   phase.rope_theta_local):
                raise ValueError("phases.rope_theta_* needs model.positions='rope' (a modern "
                                 "preset); this model has learned positions")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def replace(self, **sections) -> RunConfig:
        return dataclasses.replace(self, **sections)


SECTIONS = {"model": ModelConfig, "masking": MaskingConfig, "optim": OptimConfig,
            "train": TrainConfig}
# Fields that change only speed or bookkeeping: a resume may change these.
SPEED_ONLY = {
    "train.microbatches", "train.devices", "train.fsdp", "train.keep_checkpoints",
    "train.log_every", "train.prefetch", "train.save_every", "train.eval_every",
    "train.minutes", "train.save_every_minutes", "model.attention", "model.unroll",
    "model.remat", "train.peak_tflops", "train.wandb_project",
}


def _section_from_dict(name: str, values: dict):
    cls = SECTIONS[name]
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown {name} key(s) {unknown}; valid {name} keys are: {', '.join(valid)}"
        )
    try:
        return cls(**values)
    except TypeError as e:
        raise ValueError(f"invalid [{name}] values: {e}") from None


def from_dict(data: dict) -> RunConfig:
    """Build a RunConfig from nested dicts; unknown sections or keys are errors."""
    unknown = sorted(set(data) - set(SECTIONS) - {"phases"})
    if unknown:
        raise ValueError(
            f"unknown config section(s) {unknown}; valid sections: {', '.join(SECTIONS)}, "
            "phases"
        )
    return RunConfig(**{name: _section_from_dict(name, data.get(name, {})) for name in SECTIONS},
                     phases=phases_from_list(data.get("phases", [])))


def _parse_value(text: str):
    """A TOML value if it parses as one (numbers, booleans, quoted strings), ``none`` / ``null``
    as None (an optional setting's "off" or "all", e.g. ``train.eval_rows=none``), else the
    raw text."""
    if text.strip().lower() in ("none", "null"):
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def resolve(
    config_file: Path | None = None,
    preset: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    vocab_size: int | None = None,
    run_model: ModelConfig | None = None,
) -> RunConfig:
    """Defaults ← preset ← TOML file ← ``--set`` overrides ← the dataset's vocabulary size.

    ``run_model`` is an existing run's saved model section: re-running into that run starts
    from it instead of the default preset, so the same command resumes (also a run whose model
    came from ``--init-from``); an explicit ``--preset`` or ``model.*`` override still applies
    and is then checked against the run like any other difference.
    """
    data: dict = {name: {} for name in SECTIONS}
    if run_model is not None:
        data["model"].update(dataclasses.asdict(run_model))
    if run_model is None or preset is not None:
        data["model"].update(_preset_fields(preset or "small"))
        data["masking"].update(PRESET_MASKING.get(preset or "small", {}))
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist; pass an existing TOML file")
        try:
            loaded = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {path} is not valid TOML: {e}") from None
        unknown = sorted(set(loaded) - set(SECTIONS) - {"phases"})
        if unknown:
            raise ValueError(f"unknown config section(s) {unknown} in {path}; valid: "
                             f"{', '.join(SECTIONS)}, [[phases]]")
        if "phases" in loaded:  # a phase's dataset path is relative to the config file
            data["phases"] = [{**t, "data": str((path.parent / t["data"]).absolute())}
                              if isinstance(t, dict) and isinstance(t.get("data"), str) else t
                              for t in as_table_list(loaded.pop("phases"))]
            check_steps_beside(loaded.get("train"), data["phases"], f"config file {path}")
        for name, values in loaded.items():
            if not isinstance(values, dict):
                raise ValueError(f"[{name}] in {path} must be a table")
            values = dict(values)
            if name == "model" and "preset" in values:
                in_file = loaded.get("masking") if isinstance(loaded.get("masking"), dict) else {}
                data["masking"].update({k: v for k, v in PRESET_MASKING.get(values["preset"],
                                                                             {}).items()
                                        if k not in in_file})  # the file's own masking wins
                data["model"].update(_preset_fields(values.pop("preset")))
            data[name].update(values)
    for item in overrides:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot:
            raise ValueError(
                f"override {item!r} is not of the form section.key=value (e.g. model.layers=2)"
            )
        if section not in SECTIONS:
            raise ValueError(
                f"unknown config section {section!r} in {item!r}; valid: {', '.join(SECTIONS)}"
            )
        data[section][name.strip()] = _parse_value(value.strip())
    if vocab_size is not None:
        data["model"]["vocab_size"] = vocab_size
    return from_dict(data)


def _preset_fields(name: str) -> dict:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return dict(PRESETS[name])


def load_json(path: Path) -> RunConfig:
    return from_dict(json.loads(Path(path).read_text()))


def result_differences(a: RunConfig, b: RunConfig) -> list[str]:
    """Dotted keys whose values differ between two configs and that change results.

    A phase's ``data`` path is not one of them: where a dataset lies changes no number, and the
    phases' datasets are compared by fingerprint and row length (``phases.run_records``), so a
    run's datasets may move."""
    da, db = a.to_dict(), b.to_dict()
    for d in (da, db):
        d["phases"] = [{k: v for k, v in p.items() if k != "data"} for p in d["phases"]]
    diffs = []
    for section in SECTIONS:
        for key in sorted(set(da[section]) | set(db[section])):
            dotted = f"{section}.{key}"
            if dotted in SPEED_ONLY:
                continue
            if da[section].get(key) != db[section].get(key):
                diffs.append(f"{dotted}: {da[section].get(key)!r} -> {db[section].get(key)!r}")
    for k in range(max(len(da["phases"]), len(db["phases"]))):
        pa, pb = (d["phases"][k] if k < len(d["phases"]) else None for d in (da, db))
        if pa != pb and pa and pb:
            changed = sorted(key for key in pa if pa[key] != pb[key])
            diffs.append(f"phases[{k}]: {', '.join(changed)}")
        elif pa != pb:
            diffs.append(f"phases[{k}]: added or removed")
    return diffs
