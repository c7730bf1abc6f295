"""The config's validators: each accepts one value or raises a one-line ``ValueError`` that
names the key, the value and what to give instead (the CLI prints it as the error); and
``validate_for_data``, the config against the dataset it trains on."""

from __future__ import annotations

import math


def check_int(key: str, value, minimum: int | None = None, maximum: int | None = None) -> None:
    """A whole number (not a bool, not 1.5) within [minimum, maximum]; one-line error."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}={value!r} is not a whole number; give an integer")
    if minimum is not None and value < minimum or maximum is not None and value > maximum:
        bounds = (f">= {minimum}" if maximum is None else
                  f"in [{minimum}, {maximum}]" if minimum is not None else f"<= {maximum}")
        raise ValueError(f"{key}={value!r} must be {bounds}")


def check_real(key: str, value, low: float, high: float, *, low_open: bool = False,
               high_open: bool = False) -> None:
    """A finite number (not a bool, not inf or nan) within the interval; one-line error."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{key}={value!r} is not a finite number; give a number such as 0.5")
    if value < low or value > high or low_open and value == low or high_open and value == high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{key}={value!r} is outside {interval}")


def check_choice(key: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{key}={value!r} is not one of {', '.join(map(repr, choices))}")


def check_bool(key: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{key}={value!r} is not a bool; use true or false")


def check_name(key: str, value) -> None:
    """A non-empty string without whitespace or ``/`` (a project's name); one-line error."""
    if not isinstance(value, str) or not value or "/" in value or any(map(str.isspace, value)):
        raise ValueError(f"{key}={value!r} is not a name; give a non-empty string without "
                         "whitespace or '/' (e.g. clozax-small)")


def validate_for_data(config, dataset, n_devices: int) -> None:
    """Config/data consistency checks that need the dataset, before any compilation."""
    if dataset.seq_len > config.model.max_positions:
        raise ValueError(
            f"dataset seq_len {dataset.seq_len} exceeds model.max_positions="
            f"{config.model.max_positions}; raise model.max_positions or prepare shorter rows"
        )
    if config.model.has_local_layers and config.model.local_window > dataset.seq_len:
        raise ValueError(
            f"model.local_window={config.model.local_window} is larger than the dataset's "
            f"{dataset.seq_len}-token rows, so its local layers would attend like global ones; "
            f"set model.local_window <= {dataset.seq_len} (even), or model.global_every=1"
        )
    if config.model.vocab_size != dataset.vocab_size:
        raise ValueError(
            f"model.vocab_size={config.model.vocab_size} does not match the dataset's tokenizer "
            f"({dataset.vocab_size}); leave model.vocab_size unset so it is taken from the data"
        )
    per_step = n_devices * config.train.microbatches
    if config.train.batch_size % per_step:
        raise ValueError(
            f"train.batch_size={config.train.batch_size} is not divisible by devices "
            f"({n_devices}) x microbatches ({config.train.microbatches}); choose a multiple of "
            f"{per_step}"
        )
    if dataset.train.rows < config.train.batch_size:
        raise ValueError(
            f"the training split has {dataset.train.rows} rows, fewer than one batch of "
            f"{config.train.batch_size}; lower train.batch_size or prepare more data"
        )
