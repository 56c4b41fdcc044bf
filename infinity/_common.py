"""Shared errors, one-time warnings and small helpers used by every layer.

Nothing here imports torch-heavy modules of the package: it sits at the bottom of the import graph
(see ``DESIGN.md``: ``config, _common`` are the floor).
"""

from __future__ import annotations

import json
import logging
import threading
import warnings

logger = logging.getLogger(__name__)

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


class InfinityError(Exception):
    """Base class of the errors this package raises on purpose."""


class SwapIOError(InfinityError, OSError):
    """A swap read or write did not move the bytes it should have.

    Carries the path, the file offset, and the expected and actual byte counts so that the user can
    tell a full disk from a truncated file from a file written for another tensor.
    """

    def __init__(self, message: str, *, path: str, offset: int = 0, expected_bytes: int = 0,
                 actual_bytes: int = 0, errno_: int | None = None):
        super().__init__(errno_ or 0, message)
        self.message = message
        self.path = path
        self.offset = offset
        self.expected_bytes = expected_bytes
        self.actual_bytes = actual_bytes
        self.errno = errno_

    def __str__(self) -> str:
        return (f"{self.message} (path={self.path!r}, offset={self.offset}, "
                f"expected_bytes={self.expected_bytes}, actual_bytes={self.actual_bytes})")


class TierCapacityError(InfinityError, RuntimeError):
    """A tier's byte budget cannot hold a request even after evicting everything evictable."""

    def __init__(self, message: str, *, tier: str, requested_bytes: int, used_bytes: int,
                 budget_bytes: int):
        super().__init__(message)
        self.message = message
        self.tier = tier
        self.requested_bytes = requested_bytes
        self.used_bytes = used_bytes
        self.budget_bytes = budget_bytes

    def __str__(self) -> str:
        return (f"{self.message} (tier={self.tier}, requested_bytes={self.requested_bytes}, "
                f"used_bytes={self.used_bytes}, budget_bytes={self.budget_bytes})")


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(key: str, message: str, category: type[Warning] = UserWarning) -> None:
    """Emit ``message`` once per process for ``key`` (an option that has no effect, a fallback taken)."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, category, stacklevel=3)
    logger.debug("warned once: %s", message)


def reset_warnings_for_tests() -> None:
    """Forget which one-time warnings were emitted (tests assert on them)."""
    with _warned_lock:
        _warned.clear()


def read_json_object(path: str, what: str) -> dict:
    """The JSON object in ``path``; a ValueError naming ``what`` (e.g. "config file") and the path
    when the file is missing, not JSON, or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{what} {path!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path!r} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{what} {path!r}: expected a JSON object at the top level")
    return raw


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def format_bytes(num_bytes: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{int(num_bytes)} B"
