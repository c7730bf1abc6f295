"""Run configuration: frozen dataclasses nested by concern, validated on construction.

A run is ``RunConfig(model, masking, optim, train)``. It loads from a TOML file with
``[model]``/``[masking]``/``[optim]``/``[train]`` tables, takes ``--set section.key=value``
overrides, and a ``--preset`` for the model's shape. Unknown keys are errors that list the
valid ones. The resolved config is written to every run directory and checkpoint.

Settings that change results are kept apart from settings that only change speed
(``SPEED_ONLY``): a resume may change the latter, never the former, and tests prove that the
speed settings leave the numbers unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from clozax.core.masking import CorruptionPolicy, validate_rate
from clozax.core.model_config import PRESETS, ModelConfig

MAX_MASK_RATE = 0.5  # Wettig et al. found up to 0.4 useful for large models


@dataclass(frozen=True)
class MaskingConfig:
    rate: float = 0.15
    mask: float = 0.8
    random: float = 0.1
    keep: float = 0.1
    unit: str = "token"  # "token" or "word" (whole-word selection from prepare's word starts)

    def __post_init__(self):
        validate_rate(self.rate, upper=MAX_MASK_RATE)
        self.policy  # validates the fractions  # noqa: B018
        if self.unit not in ("token", "word"):
            raise ValueError(f"masking.unit={self.unit!r} is not one of 'token', 'word'")

    @property
    def policy(self) -> CorruptionPolicy:
        return CorruptionPolicy(self.mask, self.random, self.keep)


@dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    schedule: str = "linear"  # decay after warm-up: "linear" or "cosine"
    end_lr_fraction: float = 0.0
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-6
    clip_norm: float = 1.0  # global-norm clipping; 0 disables

    def __post_init__(self):
        if not self.learning_rate > 0:
            raise ValueError(f"optim.learning_rate={self.learning_rate} must be > 0")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        if self.schedule not in ("linear", "cosine"):
            raise ValueError(f"optim.schedule={self.schedule!r} is not one of 'linear', 'cosine'")
        if not 0 <= self.end_lr_fraction <= 1:
            raise ValueError(f"optim.end_lr_fraction={self.end_lr_fraction} is outside [0, 1]")
        if self.weight_decay < 0 or self.clip_norm < 0:
            raise ValueError("optim.weight_decay and optim.clip_norm must be >= 0")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1 and self.eps > 0):
            raise ValueError("optim.b1 and optim.b2 must lie in [0, 1) and optim.eps be > 0")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    minutes: float | None = None  # if set, fixes `steps` from measured throughput, once
    batch_size: int = 32  # global, in sequences
    seed: int = 0  # derives init_key, data_key, mask_key
    eval_seed: int = 1234  # the frozen eval-mask set's key: never the training key
    eval_every: int = 100
    eval_rows: int | None = None  # cap on held-out rows evaluated (None: all)
    save_every: int = 100
    # Speed-only settings: they never change the numbers (see SPEED_ONLY).
    microbatches: int = 1
    devices: int | None = None  # None: all local devices
    # Shard parameters and optimiser state over the devices (ZeRO-3 / FSDP style) instead of
    # replicating them: each array along its largest axis the device count divides.
    fsdp: bool = False
    keep_checkpoints: int = 3
    log_every: int = 10
    prefetch: int = 2

    def __post_init__(self):
        for name in ("steps", "batch_size", "microbatches", "eval_every", "save_every",
                     "keep_checkpoints", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"train.{name}={value!r} must be a positive integer")
        if self.minutes is not None and not self.minutes > 0:
            raise ValueError(f"train.minutes={self.minutes} must be > 0")
        if self.devices is not None and self.devices < 1:
            raise ValueError(f"train.devices={self.devices} must be >= 1")
        if self.eval_rows is not None and self.eval_rows < 1:
            raise ValueError(f"train.eval_rows={self.eval_rows} must be >= 1")
        if not isinstance(self.fsdp, bool):
            raise ValueError(f"train.fsdp={self.fsdp!r} is not a bool; use true or false")
        if self.prefetch < 0:
            raise ValueError(f"train.prefetch={self.prefetch} must be >= 0")
        if self.batch_size % self.microbatches:
            raise ValueError(
                f"train.batch_size={self.batch_size} is not divisible by "
                f"train.microbatches={self.microbatches}; choose a divisor of the batch size"
            )


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=lambda: ModelConfig(**PRESETS["small"]))
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

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
    "train.minutes", "model.attention",
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
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ValueError(
            f"unknown config section(s) {unknown}; valid sections: {', '.join(SECTIONS)}"
        )
    return RunConfig(**{name: _section_from_dict(name, data.get(name, {})) for name in SECTIONS})


def _parse_value(text: str):
    """A TOML value if it parses as one (numbers, booleans, quoted strings), else the raw text."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def resolve(
    config_file: Path | None = None,
    preset: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    vocab_size: int | None = None,
) -> RunConfig:
    """Defaults ← preset ← TOML file ← ``--set`` overrides ← the dataset's vocabulary size."""
    data: dict[str, dict] = {name: {} for name in SECTIONS}
    data["model"].update(_preset_fields(preset or "small"))
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist; pass an existing TOML file")
        try:
            loaded = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {path} is not valid TOML: {e}") from None
        unknown = sorted(set(loaded) - set(SECTIONS))
        if unknown:
            raise ValueError(
                f"unknown config section(s) {unknown} in {path}; valid: {', '.join(SECTIONS)}"
            )
        for name, values in loaded.items():
            if not isinstance(values, dict):
                raise ValueError(f"[{name}] in {path} must be a table")
            values = dict(values)
            if name == "model" and "preset" in values:
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
    """Dotted keys whose values differ between two configs and that change results."""
    da, db = a.to_dict(), b.to_dict()
    diffs = []
    for section in SECTIONS:
        for key in sorted(set(da[section]) | set(db[section])):
            dotted = f"{section}.{key}"
            if dotted in SPEED_ONLY:
                continue
            if da[section].get(key) != db[section].get(key):
                diffs.append(f"{dotted}: {da[section].get(key)!r} -> {db[section].get(key)!r}")
    return diffs
