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
