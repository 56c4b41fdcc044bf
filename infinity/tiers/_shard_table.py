"""The shard table: the store's records by key, the one lock that guards them, the LRU clock.

[Note: store locking] One lock (the table's, with its condition: ``with table:``,
``table.wait()``, ``table.notify()``) guards every record and the budgets. The table is their one
owner: the store, its budgets (:class:`~._budgets.TierBudgets`), its moves
(:class:`~._mover.Mover`) and its write-backs (:class:`~._writeback.WriteBacks`) all take it
through these methods, none holds a lock or a record map of its own for them. Allocation happens
only in the calling thread, under the lock, when a move is issued; it may wait on the condition
(which releases the lock) for a write-back it started to free a dirty victim, so every caller
re-checks the world after ``reserve`` returns. Moves complete on the store's copy threads, which
never allocate and never block on another move of this store (chained moves use
``add_done_callback``), so a completion can always make progress. A read issued ahead waits for
room on the store's room lane instead of its caller ([Note: a read ahead never waits for room on
its caller] in infinity/tiers/store.py); the lane allocates like any caller and is never waited
for by a completion.
"""

from __future__ import annotations

import threading
from typing import Iterator

from infinity.tiers._records import _Shard


class ShardTable:
    """Registered shards by key, guarded by one lock ([Note: store locking]). Every method but
    :meth:`__enter__` expects the lock held."""

    def __init__(self) -> None:
        self._shards: dict[str, _Shard] = {}
        """Key -> record of every registered shard."""
        self._lock = threading.Lock()  # [Note: store locking]
        self._cond = threading.Condition(self._lock)
        """Signalled whenever a record or a budget changes in a way a waiter may be waiting for."""
        self._clock = 0
        """LRU clock, bumped by every touch."""

    def __enter__(self) -> "ShardTable":
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def wait(self) -> None:
        """Release the lock until :meth:`notify`, then hold it again: re-check what you waited for."""
        self._cond.wait()

    def notify(self) -> None:
        self._cond.notify_all()

    def get(self, key: str) -> _Shard:
        shard = self._shards.get(key)
        if shard is None:
            raise KeyError(f"shard {key!r} is not registered (register it first)")
        return shard

    def holds(self, shard: _Shard) -> bool:
        """``shard`` is still the record registered under its key (not unregistered meanwhile)."""
        return self._shards.get(shard.key) is shard

    def __contains__(self, key: str) -> bool:
        return key in self._shards

    def add(self, shard: _Shard) -> None:
        self._shards[shard.key] = shard

    def remove(self, key: str) -> None:
        del self._shards[key]

    def clear(self) -> None:
        self._shards.clear()

    def __iter__(self) -> Iterator[_Shard]:
        return iter(self._shards.values())

    def __len__(self) -> int:
        return len(self._shards)

    def keys(self) -> list[str]:
        return list(self._shards)

    def tick(self) -> int:
        """The next LRU clock value."""
        self._clock += 1
        return self._clock

    def wait_settled(self, shard: _Shard) -> _Shard:
        """Wait until no move runs in or out of ``shard``; KeyError if it was unregistered meanwhile."""
        while not shard.settled():
            self._cond.wait()
        if not self.holds(shard):
            raise KeyError(f"shard {shard.key!r} was unregistered meanwhile")
        return shard
