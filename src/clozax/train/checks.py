"""The config's validators: each accepts one value or raises a one-line ``ValueError`` that
names the key, the value and what to give instead (the CLI prints it as the error)."""

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
