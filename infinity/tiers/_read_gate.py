"""The read gate: how a writer that owes the store newer bytes is asked for them before a read.

[Note: the read gate] A writer may hold back bytes it owes a shard (the offloaded optimizer's
deferred step, [Note: deferred optimizer step] in infinity/optim/_offloaded.py, computes a
parameter shard's update only when the shard is about to be read). The store asks it through one
gate, registered once (:meth:`TieredStore.set_read_gate`), not through a callback slot anyone may
overwrite. The contract: ``gate.apply_before_read(key)`` is called with the key, in the caller's
thread and without the store's lock, before every ``fetch`` or ``acquire`` that may read the
shard's bytes (not ``acquire(..., overwrite=True)``), reads issued ahead included ([Note: a read
ahead never waits for room on its caller] in infinity/tiers/store.py: the gate runs before the
fetch is handed to the room lane). It may use the store (fetch, acquire, mark_dirty,
write_back...); when it returns, the shard's newest bytes are in the store.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class ReadGate(Protocol):
    """What the store asks before it reads a shard ([Note: the read gate])."""

    def apply_before_read(self, key: str) -> None:
        """Write any bytes still owed to shard ``key`` into the store before it is read."""
