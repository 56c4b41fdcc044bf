"""Field checks shared by the config sections: each raises ``ValueError`` naming the field's config
path, what was expected, what was found, and (where there is one) the fix."""

from __future__ import annotations

from typing import Any

AUTO = "auto"
"""Marker for values resolved later from the model (DeepSpeed accepts ``"auto"`` in the same places)."""


def fail(path: str, expected: str, got: Any, fix: str = "") -> None:
    msg = f"{path}: expected {expected}, got {got!r}"
    if fix:
        msg += f"; {fix}"
    raise ValueError(msg)


def check_choice(path: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        fail(path, "one of " + ", ".join(repr(c) for c in choices), value)


def check_int(path: str, value: Any, *, minimum: int = 0, allow_auto: bool = False,
               allow_none: bool = False) -> None:
    if allow_auto and value == AUTO:
        return
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = f"an integer >= {minimum}"
        if allow_auto:
            what += " or 'auto'"
        if allow_none:
            what += " or null"
        fail(path, what, value)


def check_float(path: str, value: Any, *, minimum: float = 0.0, allow_auto: bool = False,
                 strictly_positive: bool = False) -> None:
    if allow_auto and value == AUTO:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(path, "a number" + (" or 'auto'" if allow_auto else ""), value)
    if value < minimum or (strictly_positive and value <= 0):
        fail(path, f"a number {'>' if strictly_positive else '>='} {minimum}", value)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
