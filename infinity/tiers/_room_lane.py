"""The room lane: one thread that runs the store's reads ahead that must wait for room.

[Note: a read ahead never waits for room on its caller] in infinity/tiers/store.py: where a read
issued ahead would wait (for a write-back, another move, room), the store hands its fetch here
and returns; the caller's handle resolves with the fetch's own future. One thread, so reads ahead
take room in the order they were issued. It allocates like any caller and is never waited for by
a completion ([Note: store locking] in infinity/tiers/_shard_table.py).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable


class RoomLane:
    """Runs fetches that may wait on one thread, in submission order."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="infinity-tiers-room")

    def fetch(self, fetch_now: Callable[[], Future]) -> Future:
        """Run ``fetch_now`` (which may wait, and returns the fetch's future) on the lane; the
        returned future resolves with that future's outcome (its tensor or its error), or with
        the error ``fetch_now`` raised."""
        outer: Future = Future()

        def forward(inner: Future) -> None:
            if inner.exception() is not None:
                outer.set_exception(inner.exception())
            else:
                outer.set_result(inner.result())

        def run() -> None:
            try:
                inner = fetch_now()
            except BaseException as e:  # noqa: BLE001 - delivered through the handle
                outer.set_exception(e)
                return
            inner.add_done_callback(forward)
        try:
            self._pool.submit(run)
        except RuntimeError:  # the lane is shut down (interpreter exit): wait here instead
            run()
        return outer

    def close(self) -> None:
        """Let the fetches already handed over get their room or their error, then stop."""
        self._pool.shutdown(wait=True)
