"""The store's write-backs: the dirty copy's bytes to the home tier, and room made by them.

:class:`WriteBacks` is owned by the :class:`~infinity.tiers.TieredStore`. It issues a shard's
write-back ([Note: dirty copy] in infinity/tiers/_records.py: DEVICE -> HOST -> NVME for an NVME
home, through a budgeted HOST extent), completes it on the store's copy threads (a swap-out on
the swapper's, [Note: a write-back holds no copy thread]), and is where every allocation of the
store reserves its room (:meth:`WriteBacks.reserve`): the budgets name a dirty victim, the
write-backs write it back and ask again. It counts the set-up writes in flight ([Note: set-up
copies are dropped once written] in infinity/tiers/store.py). Every method runs with the table's
lock held ([Note: store locking] in infinity/tiers/_shard_table.py), except the completions, which
take it.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

from infinity.io import Swapper
from infinity.tiers._arena import HostArena
from infinity.tiers._budgets import DirtyVictim, TierBudgets, _Alloc
from infinity.tiers._mover import Mover
from infinity.tiers._records import Counters, _Shard, done_future
from infinity.tiers._shard_table import ShardTable
from infinity.tiers.residency import Residency, Tier

logger = logging.getLogger(__name__)

_A, _I, _R, _W = Residency.ABSENT, Residency.INFLIGHT, Residency.RESIDENT, Residency.WRITING

SETUP_WRITES_IN_FLIGHT_BYTES = 512 * 1024 * 1024
"""Bytes of set-up writes (``register(..., keep_host_copy=False)``) in flight at once; a larger
registration goes alone. Enough for the disk's queue: one 16 MiB block per I/O thread many
times over."""


class WriteBacks:
    """Write-backs of the store's dirty shards (one at a time per shard), and room reserved by
    writing dirty victims back first."""

    def __init__(self, *, table: ShardTable, budgets: TierBudgets, mover: Mover,
                 counters: Counters, arena: HostArena, swapper: Swapper | None):
        self._table = table
        self._budgets = budgets
        self._mover = mover
        self.counters = counters
        self.arena = arena
        self.swapper = swapper
        self._setup_writes_bytes = 0
        """Bytes of ``keep_host_copy=False`` registrations being written ([Note: set-up copies
        are dropped once written] in infinity/tiers/store.py)."""
        self._drop_host_when_written: set[_Shard] = set()
        """Those registrations: the HOST copy their first write-back writes from is dropped once
        that write completes. A property of that write-back, so the write-backs hold it, not the
        shard record."""

    def reserve(self, tier: Tier, shard: _Shard, **options) -> "_Alloc | None":
        """:meth:`TierBudgets.reserve` (same ``options``), writing back and waiting for each dirty
        victim it names (the lock released meanwhile; re-raises a failed write-back's error).
        None: ``may_wait=False`` and room needs a wait."""
        while True:
            room = self._budgets.reserve(tier, shard, **options)
            if not isinstance(room, DirtyVictim):
                return room
            self.wait(room.shard)

    def wait_for_setup_room(self, nbytes: int) -> None:
        """[Note: set-up copies are dropped once written] in infinity/tiers/store.py: wait while
        set-up writes in flight would pass SETUP_WRITES_IN_FLIGHT_BYTES with ``nbytes`` more."""
        while self._setup_writes_bytes and \
                self._setup_writes_bytes + nbytes > SETUP_WRITES_IN_FLIGHT_BYTES:
            self._table.wait()

    def start_setup_write(self, shard: _Shard, *, drop_host_when_written: bool) -> None:
        """Write a just-registered NVME shard's HOST copy to its file; dropped once written
        where asked ([Note: set-up copies are dropped once written] in infinity/tiers/store.py)."""
        shard.dirty = Tier.HOST
        if drop_host_when_written:
            self._drop_host_when_written.add(shard)
            self._setup_writes_bytes += shard.nbytes
        self.start(shard)

    def start(self, shard: _Shard) -> Future:
        """Issue the write-back of ``shard.dirty`` to its home (lock held; may wait for memory)."""
        while True:
            if shard.writeback is not None:
                return shard.writeback
            src = shard.dirty
            if src is None:
                return done_future(None)
            if not shard.settled():
                self._table.wait_settled(shard)
                continue
            staged = src is Tier.DEVICE and shard.home is Tier.NVME
            if staged and shard.copies[Tier.HOST].state is _A:
                alloc = self.reserve(Tier.HOST, shard, for_key=shard.key)
                if not self._table.holds(shard) or shard.dirty is not src or \
                        shard.copies[Tier.HOST].state is not _A or shard.writeback is not None:
                    self._budgets.free(alloc)
                    continue
                self._budgets.attach(shard, alloc)
                shard.set_state(Tier.HOST, _I)
            elif staged:  # an existing HOST copy already holds the dirty bytes ([Note: dirty copy])
                staged, src = False, Tier.HOST
            break
        shard.writeback = Future()
        shard.set_state(src, _W)
        if staged:
            shard.copies[Tier.HOST].busy += 1  # written by us, then read by the swap-out
        home = shard.home
        shard.set_state(home, _I)
        self.counters.writebacks += 1
        self._mover.submit(self._job, shard, src, staged, self._mover.stream_event())
        return shard.writeback

    def _job(self, shard: _Shard, src: Tier, staged: bool, ready) -> None:
        error = None
        home = shard.home
        try:
            if staged:  # DEVICE -> HOST extent -> NVME
                self._mover.writeback_copy(shard, Tier.DEVICE, Tier.HOST, ready)
                self.counters.add_moved(Tier.DEVICE, Tier.HOST, shard.nbytes)
                with self._table:
                    shard.set_state(Tier.HOST, _R)
                    shard.set_state(Tier.HOST, _W)
                    shard.copies[Tier.HOST].busy -= 1
            if home is Tier.NVME:
                # [Note: a write-back holds no copy thread]
                extent = shard.copies[Tier.HOST].extent
                shard.has_swap_file = True
                handle = self.swapper.swap_out(shard.key, self.arena.raw(extent))
                handle.future.add_done_callback(
                    lambda f: self._mover.submit(self._swapped_out, shard, src, staged,
                                                 f.exception()))
                return
            self._mover.writeback_copy(shard, src, home, ready)
            self.counters.add_moved(src, home, shard.nbytes)
        except BaseException as e:  # noqa: BLE001 - delivered through the handle
            error = e
        self._finish(shard, src, staged, error)

    def _swapped_out(self, shard: _Shard, src: Tier, staged: bool, error) -> None:
        """[Note: a write-back holds no copy thread] A write-back's swap-out is issued and left
        to the swapper's threads; its completion comes back here, as a read's does
        (:meth:`~._mover.Mover.start_move`). The copy threads used to wait for each swap-out: two
        write-backs held both, so no more than two were ever in flight, and every read's completion queued
        behind them. On the 1B GPU proxy's optimizer step (sub-groups of 48 MB, a window of 31
        reads ahead) the disk then ran reads alone or writes alone, both at once 0.1 s of 4.9 s,
        the training thread waiting 4 s for reads the disk had already made."""
        if error is None:
            self.counters.add_moved(Tier.HOST, Tier.NVME, shard.nbytes, shard.key)
        self._finish(shard, src, staged, error)

    def _finish(self, shard: _Shard, src: Tier, staged: bool, error) -> None:
        with self._table:
            home = shard.home
            # Only the copies this write-back moved change state: a fetch may be under way into
            # another copy meanwhile (a WRITING copy is a valid source).
            if staged:
                host = shard.copies[Tier.HOST]
                if host.state is _I:  # the DEVICE -> HOST copy failed: drop the staging extent
                    shard.set_state(Tier.HOST, _A)
                    host.busy = 0
                    self._budgets.release_bytes(shard, Tier.HOST)
                else:
                    shard.set_state(Tier.HOST, _R)
            shard.set_state(src, _R)
            future, shard.writeback = shard.writeback, None
            if error is None:
                shard.set_state(home, _R)
                shard.dirty = None
                self._end_setup_write(shard, written=True)
                future.set_result(None)
            else:
                # The dirty copy is kept; an NVMe home that failed mid-write has no valid file.
                shard.set_state(home, _A if home is Tier.NVME else _R)
                self._end_setup_write(shard, written=False)
                logger.warning("write-back of %r to %s failed: %s", shard.key, home.name, error)
                future.set_exception(error)
            self._table.notify()

    def _end_setup_write(self, shard: _Shard, *, written: bool) -> None:
        """[Note: set-up copies are dropped once written] in infinity/tiers/store.py (lock held).
        A failed write keeps the copy: it is the only one with the bytes."""
        if shard not in self._drop_host_when_written:
            return
        self._drop_host_when_written.discard(shard)
        self._setup_writes_bytes -= shard.nbytes
        host = shard.copies[Tier.HOST]
        if written and host.state is _R and not host.pins and not host.busy:  # else in use: keep
            self._budgets.drop(shard, Tier.HOST)
            self.counters.evictions[Tier.HOST] += 1

    def wait(self, shard: _Shard) -> None:
        """Write ``shard`` back and wait (lock held; released while waiting). Re-raises its error."""
        future = self.start(shard)
        while not future.done():
            self._table.wait()
        if future.exception() is not None:
            raise future.exception()
