"""The slow swapper: a test double of the disk under a real :class:`~infinity.io.Swapper`.

``slow_io(monkeypatch, swapper, kinds)`` makes every block of the given directions ('in': reads,
'out': writes) sleep before it moves, so moves stay in flight while a test issues the next
request, and records what the disk saw: the order in which blocks started and the most blocks of
each direction in flight at once. The bytes still go to and from the swapper's files.
"""

from __future__ import annotations

import dataclasses
import threading
import time


@dataclasses.dataclass
class DiskLog:
    started: list[str] = dataclasses.field(default_factory=list)
    """The direction of every block, in the order the blocks started."""
    in_flight: dict[str, int] = dataclasses.field(default_factory=lambda: {"in": 0, "out": 0})
    most_in_flight: dict[str, int] = dataclasses.field(default_factory=lambda: {"in": 0, "out": 0})
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


def slow_io(monkeypatch, swapper, kinds: str | tuple[str, ...] = ("in", "out"),
            seconds: float = 0.1) -> DiskLog:
    """Slow down ``swapper``'s blocks of ``kinds`` by ``seconds`` each; the log of every block.
    ``swapper``: one :class:`~infinity.io.Swapper`, or the class itself (every swapper an engine
    builds while the test runs)."""
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    real = swapper._move
    on_class = isinstance(swapper, type)
    log = DiskLog()

    def slow(*args):
        op = args[1] if on_class else args[0]  # (self, op, ...) on the class
        with log.lock:
            log.started.append(op.kind)
            log.in_flight[op.kind] += 1
            log.most_in_flight[op.kind] = max(log.most_in_flight[op.kind], log.in_flight[op.kind])
        try:
            if op.kind in kinds:
                time.sleep(seconds)
            return real(*args)
        finally:
            with log.lock:
                log.in_flight[op.kind] -= 1

    monkeypatch.setattr(swapper, "_move", slow)
    return log
