"""The copy lane: one thread that completes the store's host<->device copies in issue order.

[Note: device copies complete on the copy lane]
A copy between HOST and DEVICE is issued on a copy thread (CUDA: on the store's copy stream,
then an event is recorded) and completes later. Waiting for it used to be that copy thread's
job (``event.synchronize()``): with two copy threads, two copies in flight left none for the
NVMe completions and write-backs queued behind them. Copies on one stream complete in the order
they were issued, so one thread can wait for them all, oldest first: the copy threads issue and
go back to the pool, and this lane's thread sleeps on each copy's event (or, under a modeled
link, until the copy's modeled end) and then runs what completes it (releasing its source,
finishing a move to HOST).

A modeled link ([Note: the modeled link] in infinity/_modeled_link.py) on a CPU engine makes
these copies take time here too: the bytes land at the copy's modeled end, on this thread, and
the destination holds NaN until then where the link asks for it (``poison_until_wait``).
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Callable

logger = logging.getLogger(__name__)


class CopyLane:
    """A FIFO of (wait, then) pairs run on one daemon thread: ``wait()`` blocks until a copy has
    completed, ``then()`` finishes it. Started on first use; :meth:`close` drains it."""

    def __init__(self, name: str = "infinity-copy-lane"):
        self._name = name
        self._queue: collections.deque[tuple[Callable[[], None], Callable[[], None]]] = \
            collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False

    def submit(self, wait: Callable[[], None], then: Callable[[], None]) -> None:
        with self._cond:
            if self._closing:
                raise RuntimeError("the copy lane is closed")
            self._queue.append((wait, then))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                wait, then = self._queue[0]
            try:
                wait()
            finally:  # ``then`` delivers the outcome; it must run for every entry
                try:
                    then()
                except BaseException:  # noqa: BLE001 - a bug in a completion: make it visible
                    logger.exception("internal error in a copy completion")
                with self._cond:
                    self._queue.popleft()
                    self._cond.notify_all()

    @property
    def pending(self) -> bool:
        """Entries submitted and not yet completed."""
        with self._cond:
            return bool(self._queue)

    def drain(self) -> None:
        """Wait until every submitted copy has completed."""
        with self._cond:
            while self._queue:
                self._cond.wait()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
