"""Seconds the disk had reads in flight, writes in flight, and both at once.

[Note: disk activity] The mixed disk roofline ([Note: the mixed disk roofline] in
infinity/bench/io.py) credits a step with the disk's both-at-once rate only as far as its reads
and writes can overlap; whether the engine keeps both directions busy is a matter of time, not of
bytes (a move's bytes are counted when it completes, often in a later phase than the one that
issued it). :class:`DiskActivity` keeps the seconds during which at least one read block, at
least one write block, and at least one of each were inside a ``pread``/``pwrite`` of the
swapper's I/O threads; a benchmark differences two snapshots to get them for a phase.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

READ, WRITE = "in", "out"
"""The swapper's op kinds."""


class DiskActivity:
    """Busy seconds per direction and both at once, over the life of one swapper. Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight = {READ: 0, WRITE: 0}
        self._since = clock()
        self._busy_s = {READ: 0.0, WRITE: 0.0}
        self._both_s = 0.0

    def _advance_locked(self) -> None:
        now = self._clock()
        elapsed, self._since = now - self._since, now
        reading, writing = self._in_flight[READ] > 0, self._in_flight[WRITE] > 0
        if reading:
            self._busy_s[READ] += elapsed
        if writing:
            self._busy_s[WRITE] += elapsed
        if reading and writing:
            self._both_s += elapsed

    def begin(self, kind: str) -> None:
        """A block of ``kind`` ('in' or 'out') enters the kernel."""
        with self._lock:
            self._advance_locked()
            self._in_flight[kind] += 1

    def end(self, kind: str) -> None:
        """That block is done (or failed)."""
        with self._lock:
            self._advance_locked()
            self._in_flight[kind] -= 1

    def snapshot(self) -> dict[str, float]:
        """Seconds so far: ``read_busy_s``, ``write_busy_s``, ``both_busy_s``."""
        with self._lock:
            self._advance_locked()
            return {"read_busy_s": self._busy_s[READ], "write_busy_s": self._busy_s[WRITE],
                    "both_busy_s": self._both_s}
