"""The error types more than one package raises or catches (each package's own errors live with it).

- :class:`InfinityError`: the base of every error the package raises on purpose.
- :class:`SwapIOError` (an ``OSError``): a swap read or write moved the wrong bytes (path, offset,
  expected and actual sizes).
- :class:`TierCapacityError` (a ``RuntimeError``): a tier's byte budget cannot hold a request
  (tier, requested, used and budget bytes).
- :class:`DiskSpaceError` (a ``RuntimeError``): a file system has less free space than what is about
  to be written there (path, needed and free bytes); raised before anything is written.
- :class:`IllegalTransitionError` (a ``RuntimeError``): a state machine was asked for an edge its
  transition table does not have (a bug in the package, never a user mistake); raised by
  :class:`infinity._transitions.TransitionTable`, the one checker every state machine uses.

Nothing here imports torch or any other module of the package: it is the floor of the import graph.
"""

from __future__ import annotations

from typing import Any


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


class DiskSpaceError(InfinityError, RuntimeError):
    """A directory's file system has less free space than what is about to be written there;
    raised before the first byte is written, so nothing is left half-written."""

    def __init__(self, message: str, *, path: str, needed_bytes: int, free_bytes: int):
        super().__init__(message)
        self.message = message
        self.path = path
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes

    def __str__(self) -> str:
        return (f"{self.message} (path={self.path!r}, needed_bytes={self.needed_bytes}, "
                f"free_bytes={self.free_bytes})")


class IllegalTransitionError(InfinityError, RuntimeError):
    """A state change that the record's transition table does not allow: a bug, never a user
    mistake. Names the kind of record, its key, the tier where the record has one, both states,
    and the states allowed from the old one."""

    def __init__(self, *, kind: str, key: Any, old: Any, new: Any, allowed: list[str],
                 tier: Any = None):
        where = f" on {tier.name}" if tier is not None else ""
        super().__init__(f"internal error: {kind} {key!r}{where}: illegal transition "
                         f"{_state_name(old)} -> {_state_name(new)} (from {_state_name(old)} only "
                         f"{', '.join(allowed) or 'nothing'} is allowed); please report this")
        self.kind = kind
        self.key = key
        self.tier = tier
        self.old = old
        self.new = new
        self.allowed = allowed


def _state_name(state: Any) -> str:
    return getattr(state, "name", str(state))
