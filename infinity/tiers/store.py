"""The tiered store: keyed shards with one residency record per copy, budgets, eviction, write-back.

See the package docstring (:mod:`infinity.tiers`) for the public API and the rules it keeps.
:class:`TieredStore` is the package's one face for them; it decides what happens to a shard (which
copy to fetch from, what to allocate, when a write-back is needed) and hands the work to the
components it owns: its :class:`~._shard_table.ShardTable` (the records and the one lock,
[Note: store locking] in infinity/tiers/_shard_table.py), :class:`~._budgets.TierBudgets` (bytes
per tier, eviction), :class:`~._mover.Mover` (copies and swap-ins, completed on its threads) and
:class:`~._writeback.WriteBacks` (dirty copies to their home, room made by writing victims back)
and :class:`~._room_lane.RoomLane` (reads ahead that must wait for room).
"""

from __future__ import annotations

import functools
import logging
from concurrent.futures import Future
from typing import Callable

import torch

from infinity._modeled_link import DuplexLink
from infinity.io import Swapper, aligned_empty, pin_device_for
from infinity.tiers._arena import HostArena
from infinity.tiers._budgets import NextUse, TierBudgets
from infinity.tiers._mover import Mover
from infinity.tiers._read_gate import ReadGate
from infinity.tiers._read_out import ReadOuts
from infinity.tiers._room_lane import RoomLane
from infinity.tiers._records import CopyInfo, Counters, StoreConfig, TierHandle, _Shard, done_future
from infinity.tiers._shard_table import ShardTable
from infinity.tiers._writeback import WriteBacks
from infinity.tiers.residency import Residency, Tier

logger = logging.getLogger(__name__)

_A, _I, _R, _W, _Z = (Residency.ABSENT, Residency.INFLIGHT, Residency.RESIDENT, Residency.WRITING,
                      Residency.ZEROS)


# [Note: a read ahead never waits for room on its caller]
# A read issued ahead of its use (the offloaded optimizer's sub-group reads, [Note: optimizer
# read-ahead]) is issued by the training thread, which has work to do until the read is needed. When
# the HOST budget is full of copies just written by that same work, making room means waiting for a
# dirty victim's write-back (or for a move that will leave a copy evictable), and a blocking
# ``acquire`` waited for it on the training thread: in the README's main job (25M GPT, all on NVMe, a
# host budget of 0.4 of the state) 55-65 ms a step in ``TierBudgets.reserve``, the training thread
# idle while the disk wrote, the step CPU-bound all the same. ``acquire(..., ahead=True)`` tries
# without waiting; where it would wait it hands the fetch to the room lane (one thread, so reads
# ahead take room in the order they were issued) and returns at once; the handle completes when the
# lane's fetch has its room and its bytes. The read gate runs in the caller first, as for every
# fetch ([Note: the read gate] in infinity/tiers/_read_gate.py). Errors (no room can be made at
# all: TierCapacityError) arrive through the handle: a caller that needs the bytes then fetches
# again itself, once its own pins are gone. Measured: the main job 0.459 -> 0.429 s a step, 5
# rounds interleaved with the blocking version
# (benchmarks/results/main-ab-20261206c.json).


class _WouldWait(Exception):
    """Raised inside the lock where a fetch issued ahead would wait for room or for another move;
    nothing was allocated or pinned for it ([Note: a read ahead never waits for room on its
    caller])."""




# [Note: set-up copies are dropped once written] A model's set-up registers every shard once, in
# order, and writes it to NVMe (``register(..., keep_host_copy=False)``). Kept as a cache, those
# copies fill the whole arena before the first step, and the arena's pages are faulted in during
# set-up: on huge pages ([Note: direct I/O wants huge pages] in infinity/io/_huge_pages.py) that
# costs ~5 s per GB on a VM that reports free pages to its hypervisor (a 1B GPT at a 4 GiB budget:
# set-up 42.7 s against 22.3 s). Dropped once written, the copies reuse the extents at the bottom of
# the arena (best fit from the bottom, [Note: long-lived extents from the top] in _arena.py), so
# set-up touches what is in flight; the rest is made ready for the steps when set-up ends ([Note:
# huge pages where the disk moves the arena] in _arena.py). The set-up of a model larger than the
# arena evicted those copies before the first step anyway. Set-up draws values faster than the disk
# writes them, so such registrations also wait while SETUP_WRITES_IN_FLIGHT_BYTES (in
# _writeback.py) of them are being written: the copies waiting for the disk would otherwise spread
# up the arena all the same.


class TieredStore:
    """Keyed shards over DEVICE / HOST / NVME with byte budgets. Thread-safe. See :mod:`infinity.tiers`."""

    def __init__(self, device: torch.device | str, config: StoreConfig, *,
                 swapper: Swapper | None = None, next_use: NextUse | None = None,
                 copy_link: DuplexLink | None = None):
        self.device = torch.device(device)
        self.config = config
        self.swapper = swapper
        """Owned by the caller (closing the store does not close it); needed for NVME shards."""
        alignment = max(4096, getattr(swapper, "alignment_bytes", 4096))
        # Pinned for a CUDA device only, on that device ([Note: pin only what a GPU copy
        # touches] in infinity/io/_aligned.py): host <-> device copies read and write the arena.
        # With a swapper the disk reads into its transient extents and writes from them: huge
        # pages there ([Note: huge pages where the disk moves the arena] in _arena.py).
        # A pinned arena is faulted in whole when it is registered: advised up front instead.
        pin = pin_device_for(self.device)
        self.arena = HostArena(config.host_budget_bytes, alignment_bytes=alignment,
                               allocate_fn=functools.partial(
                                   aligned_empty, pin_device=pin,
                                   direct_io=swapper is not None and pin is not None),
                               direct_io=swapper is not None and pin is None)
        self._table = ShardTable()
        """The records and the one lock ([Note: store locking] in infinity/tiers/_shard_table.py)."""
        self.counters = Counters()
        self.budgets = TierBudgets(device=self.device, device_budget_bytes=config.device_budget_bytes,
                                   arena=self.arena, table=self._table, counters=self.counters,
                                   next_use=next_use)
        """Bytes per tier and eviction ([Note: eviction policy] in ``_budgets.py``)."""
        self._mover = Mover(device=self.device, num_copy_threads=config.num_copy_threads,
                            table=self._table, budgets=self.budgets, counters=self.counters,
                            arena=self.arena, swapper=swapper, copy_link=copy_link)
        """Issues and completes the moves between tiers."""
        self._writebacks = WriteBacks(table=self._table, budgets=self.budgets, mover=self._mover,
                                      counters=self.counters, arena=self.arena, swapper=swapper)
        """Write-backs, and the room every allocation reserves through them."""
        self._read_outs = ReadOuts(table=self._table, mover=self._mover, counters=self.counters,
                                   arena=self.arena, swapper=swapper)
        """Reads into callers' buffers, outside the budgets:
        [Note: a read into the caller's buffer takes no room] in infinity/tiers/_read_out.py."""
        self._room_lane = RoomLane()
        """Fetches issued ahead that must wait for room ([Note: a read ahead never waits for room
        on its caller]), in issue order."""
        self._closed = False
        self._read_gate: ReadGate | None = None
        """[Note: the read gate] in infinity/tiers/_read_gate.py: set once by :meth:`set_read_gate`."""

    @property
    def copy_link(self) -> DuplexLink | None:
        """A modeled link under the host<->device copies of a CPU engine ([Note: the modeled
        link] in infinity/_modeled_link.py): moves and write-backs between HOST and DEVICE;
        None: copies take the time they take. Given at construction."""
        return self._mover.copy_link

    def begin_setup(self) -> None:
        """An engine's set-up begins: its writes go through a small window at the arena's bottom,
        not on huge pages ([Note: huge pages where the disk moves the arena] in _arena.py)."""
        self.arena.pause_direct_io_advice()

    def end_setup(self) -> None:
        """Set-up is over: the arena's holes are made ready for the steps' reads (see
        :meth:`begin_setup`)."""
        self.arena.resume_direct_io_advice()

    def set_read_gate(self, gate: ReadGate) -> None:
        """Register the store's one read gate ([Note: the read gate] in
        infinity/tiers/_read_gate.py): from now on ``gate.apply_before_read(key)`` runs before
        every fetch or acquire that may read the shard's bytes. A second, different gate:
        ValueError (one writer may owe the store bytes)."""
        if not isinstance(gate, ReadGate):
            raise ValueError(f"set_read_gate: {gate!r} has no apply_before_read(key) method")
        if self._read_gate is not None and self._read_gate is not gate:
            raise ValueError(f"set_read_gate({gate!r}): the store already has a read gate "
                             f"({self._read_gate!r}); a store has one")
        self._read_gate = gate

    # -- registration ----------------------------------------------------------------------------

    def register(self, key: str, numel: int, dtype: torch.dtype, home: Tier,
                 initial: torch.Tensor | None = None, *,
                 fill: Callable[[torch.Tensor], None] | None = None,
                 keep_host_copy: bool = True) -> None:
        """Add a shard. Its home copy is allocated now (DEVICE/HOST) and filled from ``initial``
        (zeros when None). NVME home: ``initial`` is copied into a HOST extent and written back
        asynchronously (the HOST copy stays as a cache); None means zeros, read as zeros, no file.
        ``fill`` instead of ``initial``: called with that copy (``numel`` elements of ``dtype``,
        its bytes undefined) to write every element in place, so that a caller assembling the
        values from parts needs no buffer of its own (set-up: an optimizer sub-group's master
        beside its zero moments, [Note: set-up writes in place] in infinity/optim/_offloaded.py).
        ``keep_host_copy=False`` (NVME home): that HOST copy is dropped once written instead of
        staying as a cache ([Note: set-up copies are dropped once written])."""
        self._check_new(key, numel, dtype, home, initial)
        if fill is not None and initial is not None:
            raise ValueError(f"register({key!r}): pass initial or fill, not both")
        with self._table:
            self._check_open()
            self._check_unregistered(key)
            shard = _Shard(key, numel, dtype, home)
            if home is Tier.NVME and initial is None and fill is None:
                shard.set_state(Tier.NVME, _Z)  # read as zeros, no file until written
                self._table.add(shard)
                return
            tier = Tier.HOST if home is Tier.NVME else home
            dropped = home is Tier.NVME and not keep_host_copy
            if dropped:  # [Note: set-up copies are dropped once written]
                self._writebacks.wait_for_setup_room(shard.nbytes)
            alloc = self._writebacks.reserve(tier, shard, for_key=key)
            if key in self._table:  # registered by another thread while we waited for memory
                self.budgets.free(alloc)
                self._check_unregistered(key)
            self.budgets.attach(shard, alloc)
            self._fill_home(shard, tier, initial, fill)
            self._table.add(shard)
            if home is Tier.NVME:
                self._writebacks.start_setup_write(shard, drop_host_when_written=dropped)

    def _check_unregistered(self, key: str) -> None:
        if key in self._table:
            raise ValueError(f"register({key!r}): key is already registered; unregister it first")

    def _fill_home(self, shard: _Shard, tier: Tier, initial: torch.Tensor | None,
                   fill: Callable[[torch.Tensor], None] | None) -> None:
        """Write a new shard's first copy (on ``tier``, attached) and make it RESIDENT."""
        copy = shard.copies[tier]
        if fill is not None:
            fill(copy.tensor)
        elif initial is None:
            copy.tensor.zero_()
        else:
            copy.tensor.copy_(initial.reshape(-1))
        shard.set_state(tier, _R)
        copy.last_use = self._table.tick()

    def _check_new(self, key, numel, dtype, home, initial) -> None:
        if not isinstance(key, str) or not key:
            raise ValueError(f"register: key must be a non-empty string, got {key!r}")
        if isinstance(numel, bool) or not isinstance(numel, int) or numel <= 0:
            raise ValueError(f"register({key!r}): numel must be an integer > 0, got {numel!r}")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"register({key!r}): dtype must be a torch.dtype, got {dtype!r}")
        if not isinstance(home, Tier):
            raise ValueError(f"register({key!r}): home must be a Tier, got {home!r}")
        if home is Tier.NVME and self.swapper is None:
            raise ValueError(f"register({key!r}, home=NVME): this store has no swapper; pass "
                             "swapper=Swapper(nvme_path) to TieredStore")
        if home is Tier.NVME:
            self.swapper.path_of(key)  # ValueError now for a key that cannot name a swap file
        if initial is not None and (initial.numel() != numel or initial.dtype != dtype):
            raise ValueError(f"register({key!r}): initial is {initial.dtype} with {initial.numel()} "
                             f"elements, expected {dtype} with {numel}")

    def unregister(self, key: str) -> None:
        """Drop every copy (the home copy too) and delete the swap file. Pinned copies: ValueError."""
        with self._table:
            shard = self._table.wait_settled(self._table.get(key))
            pinned = [t.name for t, c in shard.copies.items() if c.pins]
            if pinned:
                raise ValueError(f"unregister({key!r}): copies on {pinned} are acquired; release "
                                 "them first")
            for tier in (Tier.DEVICE, Tier.HOST):
                if shard.copies[tier].state is _R:
                    self.budgets.drop(shard, tier)
            had_file = shard.has_swap_file
            if shard.copies[Tier.NVME].state in (_R, _Z):
                shard.set_state(Tier.NVME, _A)
            self._table.remove(key)
            self._table.notify()
        if had_file:
            try:
                self.swapper.remove(key)
            except KeyError:  # never written successfully: nothing on disk
                pass

    # -- fetch, get, pin -------------------------------------------------------------------------

    def fetch(self, key: str, tier: Tier, *, next_use: float | None = None,
              prefetch: bool = False) -> TierHandle:
        """Bring a copy of ``key`` to ``tier`` (DEVICE or HOST); ``wait()`` returns its tensor.

        NVME -> DEVICE goes through a HOST copy, which stays cached. Without a pin the copy may be
        evicted by later allocations: use :meth:`acquire` when compute reads it. ``prefetch``:
        the fetch may wait, so it raises TierCapacityError rather than evict a copy used sooner
        than this one ([Note: a prefetch never evicts a sooner use] in infinity/tiers/_budgets.py)."""
        return self._fetch(key, tier, next_use=next_use, pin=False, prefetch=prefetch)

    def acquire(self, key: str, tier: Tier, *, next_use: float | None = None,
                overwrite: bool = False, ahead: bool = False) -> TierHandle:
        """:meth:`fetch` and pin: the copy is not evicted until a matching :meth:`release`.
        If ``wait()`` raises, the pin is gone too (do not release).

        ``overwrite``: the caller writes every element before anything reads the copy (the
        optimizer writing a whole updated parameter shard). An absent copy is then allocated
        without reading the shard from another tier (no NVMe read for bytes about to be
        replaced): its contents are undefined until written. The caller must
        :meth:`mark_dirty` it after writing, or :meth:`evict` it if the write fails, and nothing
        else may read the shard meanwhile.

        ``ahead`` (HOST, not with ``overwrite``): a read issued before its use; where making room
        would wait, the store's room lane waits instead of the caller, and ``wait()`` returns once
        it has ([Note: a read ahead never waits for room on its caller])."""
        if ahead and (tier is not Tier.HOST or overwrite):
            raise ValueError(f"acquire({key!r}, {tier.name}, ahead=True): reads ahead go to HOST "
                             "and read the shard's bytes (not overwrite)")
        return self._fetch(key, tier, next_use=next_use, pin=True, overwrite=overwrite,
                           ahead=ahead)

    def release(self, key: str, tier: Tier) -> None:
        """Undo one :meth:`acquire` of the copy on ``tier``."""
        with self._table:
            copy = self._table.get(key).copies[tier]
            if copy.pins == 0:
                raise ValueError(f"release({key!r}, {tier.name}): the copy is not acquired")
            copy.pins -= 1
            if copy.pins == 0:
                self._table.notify()

    def read_into(self, key: str, out: torch.Tensor) -> TierHandle:
        """Copy the shard's current bytes into ``out`` (a contiguous CPU tensor of the shard's
        ``numel`` and dtype, any shape) without taking room in any tier: from a HOST copy that
        holds them, else a DEVICE copy, else the NVMe file; see
        [Note: a read into the caller's buffer takes no room] in infinity/tiers/_read_out.py.
        ``wait()`` returns ``out``; a copy from memory is done when this returns, a file read
        completes through the handle."""
        if self._read_gate is not None:  # [Note: the read gate]
            self._read_gate.apply_before_read(key)
        with self._table:
            self._check_open()
            shard = self._table.get(key)
            read = self._read_outs.start(shard, out)
        return TierHandle(read(), key, Tier.HOST, self.counters.add_wait)

    def get(self, key: str, tier: Tier) -> torch.Tensor:
        """The tensor of a resident copy (1-D, ``numel`` elements). Not resident: ValueError."""
        with self._table:
            shard = self._table.get(key)
            copy = shard.copies[tier]
            if tier is Tier.NVME or copy.state not in (_R, _W):
                raise ValueError(f"get({key!r}, {tier.name}): the copy is {copy.state.name}, not "
                                 f"resident; fetch({key!r}, Tier.{tier.name}) and wait first")
            if shard.dirty is not None and tier is shard.home:
                raise ValueError(f"get({key!r}, {tier.name}): the home copy is stale (the "
                                 f"{shard.dirty.name} copy is dirty); write_back({key!r}) first")
            copy.last_use = self._table.tick()
            reader = self._mover.device_reader(shard, tier)
        if reader is not None:
            reader()
        return copy.tensor

    def _fetch(self, key: str, tier: Tier, *, next_use: float | None, pin: bool,
               overwrite: bool = False, prefetch: bool = False, ahead: bool = False) -> TierHandle:
        if tier not in (Tier.DEVICE, Tier.HOST):
            raise ValueError(f"fetch({key!r}, {tier!r}): fetch to DEVICE or HOST; write_back "
                             "moves data to the home tier")
        if self._read_gate is not None and not overwrite:  # [Note: the read gate]
            self._read_gate.apply_before_read(key)
        try:
            future, shard = self._fetch_now(key, tier, next_use=next_use, pin=pin,
                                            overwrite=overwrite, prefetch=prefetch, may_wait=not ahead)
        except _WouldWait:  # [Note: a read ahead never waits for room on its caller]
            future, shard = self._room_lane.fetch(lambda: self._fetch_now(
                key, tier, next_use=next_use, pin=pin, overwrite=False, prefetch=False,
                may_wait=True)[0]), None
        return TierHandle(future, key, tier, self.counters.add_wait,
                          before_use=None if shard is None else self._mover.device_reader(shard, tier))

    def _fetch_now(self, key: str, tier: Tier, *, next_use: float | None, pin: bool,
                   overwrite: bool, prefetch: bool, may_wait: bool) -> tuple[Future, _Shard]:
        with self._table:
            self._check_open()
            shard = self._table.get(key)
            if next_use is not None:
                shard.next_use = next_use
            future, outcome = self._fetch_locked(shard, tier, pin, overwrite, prefetch,
                                                 may_wait=may_wait)
            self.counters.fetch[outcome] += 1
        return future, shard

    def _fetch_locked(self, shard: _Shard, tier: Tier, pin: bool, overwrite: bool = False,
                      prefetch: bool = False, may_wait: bool = True) -> tuple[Future, str]:
        """``may_wait`` False: raise _WouldWait (nothing allocated, nothing pinned) where the
        fetch would wait for a write-back, another move or room."""
        missed = False
        started: Future | None = None  # the move this call issued (or its HOST staging fetch)
        while True:
            if started is not None and started.done() and started.exception() is not None:
                return started, "miss"  # it failed: so does this fetch (never retry in a loop)
            copy = shard.copies[tier]
            if tier is shard.home and shard.dirty is not None:
                if not may_wait:
                    raise _WouldWait
                self._writebacks.wait(shard)  # the home copy is stale: make it current first
                continue
            if copy.state is _I and copy.future is None:  # staging copy of a write-back
                if not may_wait:
                    raise _WouldWait
                self._table.wait()
                continue
            if copy.state in (_R, _W, _I):
                copy.last_use = self._table.tick()
                copy.pins += int(pin)
                if copy.state is _I:
                    return copy.future, "miss" if missed else "late"
                return (done_future(copy.tensor), "miss" if missed else "hit")
            if overwrite:
                future = self._allocate_for_overwrite(shard, tier, pin)
                if future is None:
                    continue
                return future, "overwrite"
            source = self._source(shard, tier)
            if source is None:  # DEVICE from NVME: stage in HOST first, then come back
                started = self._fetch_locked(shard, Tier.HOST, False, prefetch=prefetch,
                                             may_wait=may_wait)[0]
                continue
            alloc = self._writebacks.reserve(tier, shard, for_key=shard.key,
                                         displace_sooner=not prefetch, may_wait=may_wait)
            if alloc is None:
                raise _WouldWait
            if not self._table.holds(shard):
                self.budgets.free(alloc)
                raise KeyError(f"fetch({shard.key!r}): unregistered while waiting for memory")
            if copy.state is not _A or self._source(shard, tier) != source:
                self.budgets.free(alloc)  # someone else moved things while we waited: look again
                continue
            self.budgets.attach(shard, alloc)
            shard.set_state(tier, _I)
            copy.future = started = Future()
            self._mover.start_move(shard, source, tier)
            missed = True  # the loop's next pass pins the copy and returns its future

    def _allocate_for_overwrite(self, shard: _Shard, tier: Tier, pin: bool) -> Future | None:
        """An absent copy made resident with undefined bytes for an overwrite acquire; None when
        the copy changed while waiting for memory (the caller looks again). Other copies stay as
        they are: until :meth:`mark_dirty` the shard's valid bytes are its home's."""
        copy = shard.copies[tier]
        alloc = self._writebacks.reserve(tier, shard, for_key=shard.key)
        if not self._table.holds(shard):
            self.budgets.free(alloc)
            raise KeyError(f"acquire({shard.key!r}): unregistered while waiting for memory")
        if copy.state is not _A:
            self.budgets.free(alloc)  # fetched by someone else while we waited for memory
            return None
        self.budgets.attach(shard, alloc)
        shard.set_state(tier, _R)
        copy.last_use = self._table.tick()
        copy.pins += int(pin)
        return done_future(copy.tensor)

    def _source(self, shard: _Shard, tier: Tier) -> Tier | None:
        """Where a fetch into ``tier`` reads from; None: DEVICE must wait for a HOST copy first."""
        other = Tier.HOST if tier is Tier.DEVICE else Tier.DEVICE
        stale = shard.dirty is not None and other is shard.home
        if shard.copies[other].state is not _A and not stale:
            return other
        if tier is Tier.HOST and shard.copies[Tier.NVME].state in (_R, _Z):
            return Tier.NVME
        if tier is Tier.DEVICE and shard.home is Tier.NVME:
            return None
        raise RuntimeError(f"internal error: no valid copy of shard {shard.key!r} to fetch from "
                           f"({ {t.name: c.state.name for t, c in shard.copies.items()} }, "
                           f"dirty={shard.dirty})")

    # -- dirty data and write-back ---------------------------------------------------------------

    def mark_dirty(self, key: str, tier: Tier) -> None:
        """Say the copy on ``tier`` was modified. Other non-home copies are dropped (stale); when
        ``tier`` is not home, the home copy is stale until :meth:`write_back` (or an eviction)."""
        with self._table:
            shard = self._table.wait_settled(self._table.get(key))
            copy = shard.copies[tier]
            if tier is Tier.NVME or copy.state is not _R:
                raise ValueError(f"mark_dirty({key!r}, {tier.name}): the copy is "
                                 f"{copy.state.name}; only a resident DEVICE or HOST copy can be "
                                 "modified")
            others = [t for t in (Tier.DEVICE, Tier.HOST)
                      if t not in (tier, shard.home) and shard.copies[t].state is _R]
            pinned = [t.name for t in others if shard.copies[t].pins]
            if pinned:
                raise ValueError(f"mark_dirty({key!r}, {tier.name}): the copy on {pinned} is "
                                 "acquired and would go stale while in use; release it first")
            for t in others:
                self.budgets.drop(shard, t)
            shard.dirty = None if tier is shard.home else tier

    def write_back(self, key: str) -> TierHandle:
        """Copy the dirty copy's bytes to the home tier (async; ``wait()`` returns None)."""
        with self._table:
            self._check_open()
            shard = self._table.get(key)
            future = self._writebacks.start(shard)
        return TierHandle(future, key, None, self.counters.add_wait)

    def flush(self) -> None:
        """Write back every dirty shard and wait (before a checkpoint reads the home tiers)."""
        futures = []
        with self._table:
            for shard in list(self._table):
                # start() may wait (lock released): skip shards unregistered meanwhile.
                if self._table.holds(shard) and shard.dirty is not None:
                    futures.append(self._writebacks.start(shard))
        for future in futures:
            future.result()

    # -- eviction -----------------------------------------------------------------------------------

    def evict(self, key: str, tier: Tier) -> None:
        """Drop the copy on ``tier`` (writing it back first when dirty). Absent: no-op.
        The home copy and pinned copies cannot be evicted (ValueError)."""
        with self._table:
            shard = self._table.get(key)
            if tier is shard.home or tier is Tier.NVME:
                raise ValueError(f"evict({key!r}, {tier.name}): that is the home copy; unregister "
                                 "the shard to drop it")
            while True:
                shard = self._table.wait_settled(shard)
                copy = shard.copies[tier]
                if copy.state is _A:
                    return
                if copy.pins:
                    raise ValueError(f"evict({key!r}, {tier.name}): the copy is acquired "
                                     f"{copy.pins} time(s); release it first")
                if shard.dirty is tier:
                    self._writebacks.wait(shard)
                    continue
                self.budgets.drop(shard, tier)
                self.counters.evictions[tier] += 1
                return

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the TieredStore is closed")

    # -- introspection and shutdown ------------------------------------------------------------------

    def state(self, key: str, tier: Tier) -> Residency:
        with self._table:
            return self._table.get(key).copies[tier].state

    def copy_info(self, key: str, tier: Tier) -> CopyInfo:
        """A read-only snapshot of the copy of ``key`` on ``tier`` (its residency, pins, moves
        reading it, its tensor): for tests and tools that check what the store holds."""
        with self._table:
            return CopyInfo.of(self._table.get(key), tier)

    def home(self, key: str) -> Tier:
        """The tier ``key`` was registered with as its home."""
        with self._table:
            return self._table.get(key).home

    def is_dirty(self, key: str) -> Tier | None:
        with self._table:
            return self._table.get(key).dirty

    def keys(self) -> list[str]:
        with self._table:
            return self._table.keys()

    def set_next_use(self, key: str, distance: float | None) -> None:
        with self._table:
            self._table.get(key).next_use = distance

    def reclaimable_bytes(self, tier: Tier) -> int:
        """Bytes of ``tier``'s budget a new copy could take now: free, or held by copies the
        store may evict (unpinned, not busy, not a home copy, no write-back under way)."""
        with self._table:
            return self.budgets.reclaimable(tier)

    def budget_bytes(self, tier: Tier) -> int:
        """The bytes ``tier`` (DEVICE or HOST) may hold: its budget in the store's config."""
        return int(self.config.device_budget_bytes if tier is Tier.DEVICE
                   else self.config.host_budget_bytes)

    def used_bytes(self, tier: Tier) -> int:
        """The bytes charged to ``tier`` (DEVICE or HOST) now: one counter, no walk over the
        shards (which :meth:`stats` makes), for planners that ask on every decision."""
        with self._table:
            return int(self.budgets.used[tier])

    def moved_bytes(self, src: Tier, dst: Tier) -> int:
        """Bytes moved from ``src`` to ``dst`` so far (``stats()``'s ``bytes_<src>_to_<dst>``)."""
        return int(self.counters.moved[(src.label, dst.label)])

    def stats(self) -> dict[str, float]:
        """Counters; keys in :data:`infinity.tiers.STATS_KEYS`, documented in the package docstring."""
        out = self.counters.snapshot()
        with self._table:
            for tier in (Tier.DEVICE, Tier.HOST):
                out[f"{tier.label}_used_bytes"] = self.budgets.used[tier]
                out[f"{tier.label}_peak_bytes"] = self.budgets.peak[tier]
                out[f"{tier.label}_budget_bytes"] = self.budgets.budget[tier]
            out["num_shards"] = len(self._table)
            out["host_homed_bytes"] = sum(s.copies[Tier.HOST].charged_bytes
                                          for s in self._table if s.home is Tier.HOST)
        out["host_largest_free_bytes"] = self.arena.largest_free_bytes()
        return out

    def nvme_bytes_by_kind(self) -> dict[str, dict[str, int]]:
        """NVMe bytes read and written so far per kind of shard (a key's first path component:
        'param', 'opt', 'grad'): which state moves more than once a step."""
        return self.counters.nvme_bytes_by_kind()

    def reset_peaks(self) -> None:
        with self._table:
            self.budgets.peak = dict(self.budgets.used)

    def close(self) -> None:
        """Wait for moves in flight, drop every copy (no write-back: call flush() first to keep
        dirty data), stop the copy threads. The swapper stays open (the caller owns it)."""
        # Reads ahead still waiting for room get it or their error first (each waits only for
        # moves, which complete on their own).
        self._room_lane.close()
        with self._table:
            if self._closed:
                return
            for shard in list(self._table):
                while not shard.settled():
                    self._table.wait()
            self._closed = True
            keys = [s.key for s in self._table if s.has_swap_file]
            self._table.clear()
            self.budgets.used = {Tier.DEVICE: 0, Tier.HOST: 0}
        self._mover.close()
        for key in keys:
            try:
                self.swapper.remove(key)
            except (KeyError, OSError, RuntimeError):
                pass

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
