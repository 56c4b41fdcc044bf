"""Timing of work that may run asynchronously on a GPU: wall clock on a CPU, CUDA events on a GPU.

[Note: timing asynchronous GPU work] On a GPU, ``perf_counter`` around a unit's forward or the
optimizer step measures how long the host took to *launch* the work, not how long the work ran:
the prefetch planner's time model (how long a unit computes, so how early to fetch) and the
engine's ``optimizer_step_s`` would be wrong there. On CUDA, :class:`EventTimer` records an event
pair on the current stream around each interval and reads the elapsed times lazily, once the
events have completed (after a sync point: the caller's next ``stats()``, the end of a step), so
timing never adds a host sync of its own. On a CPU the work is synchronous and the wall clock is
the truth (:class:`WallTimer`). :func:`timer_for` picks one from the engine's device.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Hashable, Sequence

import torch


class WallTimer:
    """Intervals by ``perf_counter`` (CPU work: synchronous, so the wall clock is exact)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._start: float | None = None
        self._total_s = 0.0
        self._intervals: list[tuple[Hashable, float]] = []

    def start(self) -> None:
        self._start = self._clock()

    def stop(self, label: Hashable = None) -> None:
        if self._start is None:
            return
        seconds = self._clock() - self._start
        self._start = None
        self._total_s += seconds
        self._intervals.append((label, seconds))

    def total_s(self) -> float:
        """Seconds of every stopped interval."""
        return self._total_s

    def take(self) -> list[tuple[Hashable, float | None]]:
        """The intervals stopped since the last ``take``, ``(label, seconds)`` in order."""
        out, self._intervals = self._intervals, []
        return out

    def take_carried(self) -> list[tuple[Hashable, float]]:
        """Nothing: the wall clock knows every interval at its stop (see EventTimer's)."""
        return []


class EventTimer:
    """Intervals by event pairs on the current stream of ``device``; read when complete.

    ``new_event`` and ``current_stream`` are CUDA's unless a test fakes them (an event needs
    ``record(stream)``, ``query()`` and ``elapsed_time(end)`` in milliseconds, as CUDA's)."""

    def __init__(self, device: torch.device, *, new_event: Callable[[], Any] | None = None,
                 current_stream: Callable[[torch.device], Any] | None = None):
        self.device = device
        self._new_event = new_event or (lambda: torch.cuda.Event(enable_timing=True))
        self._current_stream = current_stream or torch.cuda.current_stream
        self._open: Any = None
        self._pending: list[tuple[Hashable, Any, Any]] = []
        """Stopped intervals whose events may not have run yet: (label, start, end)."""
        self._total_s = 0.0
        self._done: list[tuple[Hashable, float | None]] = []
        self._carried: list[tuple[Hashable, Any, Any]] = []
        """Intervals a :meth:`take` returned as unknown, read by :meth:`take_carried` once run."""

    def _record(self) -> Any:
        event = self._new_event()
        event.record(self._current_stream(self.device))
        return event

    def start(self) -> None:
        self._open = self._record()

    def stop(self, label: Hashable = None) -> None:
        if self._open is None:
            return
        self._pending.append((label, self._open, self._record()))
        self._open = None

    def _resolve(self, *, wait: bool) -> None:
        """Move completed intervals (in order: a stream runs them in order) to the totals."""
        self._done += self._completed(self._pending, wait=wait)

    def _completed(self, queue: list[tuple[Hashable, Any, Any]], *, wait: bool
                   ) -> list[tuple[Hashable, float]]:
        """Take from the front of ``queue`` the intervals whose end event has run (all of them,
        the host waiting, with ``wait``), counted in the total: ``(label, seconds)`` in order."""
        out = []
        while queue:
            label, start, end = queue[0]
            if not wait and not end.query():
                break
            if wait:
                end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
            self._total_s += seconds
            out.append((label, seconds))
            queue.pop(0)
        return out

    def total_s(self) -> float:
        """Seconds of the stopped intervals whose work has completed (no host sync)."""
        self._resolve(wait=False)
        return self._total_s

    def take(self, *, wait: bool = False) -> list[tuple[Hashable, float | None]]:
        """The intervals stopped since the last ``take``, ``(label, seconds)`` in order; those not
        complete yet have None unless ``wait`` (then the host waits for them)."""
        self._resolve(wait=wait)
        out = self._done + [(label, None) for label, _s, _e in self._pending]
        self._carried.extend(self._pending)  # not lost: take_carried() reads them once run
        self._done, self._pending = [], []
        return out

    def take_carried(self) -> list[tuple[Hashable, float]]:
        """The intervals earlier :meth:`take` calls returned as unknown (None) whose work has
        completed since, ``(label, seconds)`` in order; the rest stay carried. A backward's units
        are still running on the GPU when the step's trace is committed (right after the
        backward is launched): their times arrive here during the next step."""
        return self._completed(self._carried, wait=False)


def timer_for(device: torch.device | str | None) -> WallTimer | EventTimer:
    """[Note: timing asynchronous GPU work]: event pairs on a CUDA device, the wall clock else."""
    if device is not None and torch.device(device).type == "cuda":
        return EventTimer(torch.device(device))
    return WallTimer()


def fill_unknown_times(measured: Sequence[tuple[Hashable, float | None]],
                       carried: Sequence[tuple[Hashable, float]]
                       ) -> list[tuple[Hashable, float | None]]:
    """``measured`` with each unknown (None) time of a unit replaced by that unit's next time in
    ``carried`` (:meth:`EventTimer.take_carried`: the same units of an earlier step, measured
    late), matched in order per unit."""
    late: dict[Hashable, list[float]] = {}
    for label, seconds in carried:
        late.setdefault(label, []).append(seconds)
    out = []
    for label, seconds in measured:
        if seconds is None and late.get(label):
            seconds = late[label].pop(0)
        out.append((label, seconds))
    return out


def apply_unit_times(entries: Sequence[Any], measured: Sequence[tuple[Hashable, float | None]]
                     ) -> list[Any]:
    """Entries of a recorded trace (``unit`` and ``compute_s`` fields) with each unit's
    ``compute_s`` replaced by its measured time (``measured``: ``(unit, seconds)`` in the order
    the units ran; None: not known yet, the recorded time stays). Entries and measurements are
    matched in order by unit, so a unit without a measurement keeps its time."""
    from dataclasses import replace

    out, k = [], 0
    for entry in entries:
        j = k
        while j < len(measured) and measured[j][0] != entry.unit:
            j += 1
        if j < len(measured):
            seconds = measured[j][1]
            if seconds is not None:
                entry = replace(entry, compute_s=seconds)
            k = j + 1
        out.append(entry)
    return out
