"""The tiered store: keyed shards with one residency record per copy, budgets, eviction, write-back.

See the package docstring (:mod:`infinity.tiers`) for the public API and the rules it keeps.

[Note: store locking] One lock (``self._lock``, with the condition ``self._cond``) guards every record
and the budgets. Allocation happens only in the calling thread, under the lock, when a move is
issued; it may wait on ``self._cond`` (which releases the lock) for a write-back it started to free a
dirty victim, so every caller re-checks the world after ``budgets.reserve`` returns. Moves complete on the
store's copy threads, which never allocate and never block on another move of this store (chained
moves use ``add_done_callback``), so a completion can always make progress. A read issued ahead
waits for room on the store's room lane instead of its caller ([Note: a read ahead never waits for
room on its caller]); the lane allocates like any caller and is never waited for by a completion.
"""

from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from infinity._async_copy import blocking_event, record_on_current_stream
from infinity._modeled_link import DuplexLink
from infinity.io import Swapper, aligned_empty, pin_device_for
from infinity.tiers._arena import HostArena
from infinity.tiers._budgets import NextUse, TierBudgets
from infinity.tiers._copy_lane import CopyLane
from infinity.tiers._records import (Counters, StoreConfig, TierHandle, _Shard, done_future,
                                     host_copy)
from infinity.tiers.residency import Residency, Tier

logger = logging.getLogger(__name__)

_A, _I, _R, _W = Residency.ABSENT, Residency.INFLIGHT, Residency.RESIDENT, Residency.WRITING


# [Note: device copies complete on the stream] A copy into a DEVICE copy is RESIDENT as soon as it
# is issued on the store's copy stream: the fetch's future resolves then, with a blocking event
# recorded after the copy (``_Copy.ready_event``), and every reader makes its own stream wait on
# that event (``TierHandle.wait`` and ``get`` do it), so a demand fetch holds the training thread
# only for the issue, never until the GPU drains, and wait/stall figures no longer include GPU
# compute. The source copy stays busy (not evictable, not changed) until the copy has run, which a
# copy thread waits for on the blocking event, sleeping; the destination is recorded on the copy
# stream so that an early eviction cannot hand its memory to other work first. A HOST destination
# is read by the CPU (the optimizer, a swap-out), so its copy completes before the future does.


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
# lane's fetch has its room and its bytes. ``before_read`` runs in the caller first, as for every
# fetch. Errors (no room can be made at all: TierCapacityError) arrive through the handle: a caller
# that needs the bytes then fetches again itself, once its own pins are gone. Measured: the main job
# 0.459 -> 0.429 s a step, 5 rounds interleaved with the blocking version
# (benchmarks/results/main-ab-20261206c.json).


class _WouldWait(Exception):
    """Raised inside the lock where a fetch issued ahead would wait for room or for another move;
    nothing was allocated or pinned for it ([Note: a read ahead never waits for room on its
    caller])."""


SETUP_WRITES_IN_FLIGHT_BYTES = 512 * 1024 * 1024
"""Bytes of set-up writes (``register(..., keep_host_copy=False)``) in flight at once; a larger
registration goes alone. Enough for the disk's queue: one 16 MiB block per I/O thread many
times over."""


class TieredStore:
    """Keyed shards over DEVICE / HOST / NVME with byte budgets. Thread-safe. See :mod:`infinity.tiers`."""

    def __init__(self, device: torch.device | str, config: StoreConfig, *,
                 swapper: Swapper | None = None, next_use: NextUse | None = None):
        self.device = torch.device(device)
        self.config = config
        self.swapper = swapper
        """Owned by the caller (closing the store does not close it); needed for NVME shards."""
        self._cuda = self.device.type == "cuda"
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
        self._shards: dict[str, _Shard] = {}
        self._lock = threading.Lock()  # [Note: store locking]
        self._cond = threading.Condition(self._lock)
        self._clock = 0  # LRU clock, bumped by every touch
        self._setup_writes_bytes = 0
        """Bytes of ``keep_host_copy=False`` registrations being written ([Note: set-up copies
        are dropped once written])."""
        self.counters = Counters()
        self.budgets = TierBudgets(device=self.device, device_budget_bytes=config.device_budget_bytes,
                                   arena=self.arena, shards=self._shards, cond=self._cond,
                                   counters=self.counters, next_use=next_use,
                                   wait_writeback=self._wait_writeback)
        """Bytes per tier and eviction ([Note: eviction policy] in ``_budgets.py``)."""
        self._pool = ThreadPoolExecutor(config.num_copy_threads, thread_name_prefix="infinity-tiers")
        self._copy_stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        self._lane = CopyLane()
        """Completes host<->device copies in issue order ([Note: device copies complete on the
        copy lane] in ``_copy_lane.py``)."""
        self._room_lane = ThreadPoolExecutor(1, thread_name_prefix="infinity-tiers-room")
        """Fetches issued ahead that must wait for room ([Note: a read ahead never waits for room
        on its caller]), in issue order."""
        self.copy_link: DuplexLink | None = None
        """A modeled link under the host<->device copies of a CPU engine ([Note: the modeled
        link] in infinity/_modeled_link.py): moves and write-backs between HOST and DEVICE;
        None: copies take the time they take."""
        self._modeled_lanes = {Tier.DEVICE: CopyLane("infinity-link-to-device"),
                               Tier.HOST: CopyLane("infinity-link-to-host")}
        """Land the modeled copies, one lane per direction: a copy into HOST that the link
        finished first must not wait behind one into DEVICE still on the wire (and the shared
        copy lane above keeps its own order for real device copies)."""
        self._closed = False
        self.before_read: Callable[[str], None] | None = None
        """Called with the key, in the caller's thread and without the lock, before every fetch
        or acquire that may read the shard's bytes (not ``overwrite``): a writer that owes the
        shard newer bytes (a deferred optimizer step) writes them first. It may use the store."""

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
        staying as a cache ([Note: set-up copies are dropped once written]).

        [Note: set-up copies are dropped once written] A model's set-up registers every shard once,
        in order, and writes it to NVMe. Kept as a cache, those copies fill the whole arena before
        the first step, and the arena's pages are faulted in during set-up: on huge pages ([Note:
        direct I/O wants huge pages] in infinity/io/_huge_pages.py) that costs ~5 s per GB on a
        VM that reports free pages to its hypervisor (a 1B GPT at a 4 GiB budget: set-up 42.7 s
        against 22.3 s). Dropped once written, the copies reuse the extents at the bottom of the
        arena (best fit from the bottom, [Note: long-lived extents from the top] in _arena.py),
        so set-up touches what is in flight; the rest is made ready for the steps when set-up
        ends ([Note: huge pages where the disk moves the arena] in _arena.py). The set-up of a
        model larger than the arena evicted those copies before the first step anyway. Set-up
        draws values faster than the disk writes them, so such registrations also wait while
        SETUP_WRITES_IN_FLIGHT_BYTES of them are being written: the copies waiting for the disk
        would otherwise spread up the arena all the same."""
        self._check_new(key, numel, dtype, home, initial)
        if fill is not None and initial is not None:
            raise ValueError(f"register({key!r}): pass initial or fill, not both")
        with self._lock:
            self._check_open()
            if key in self._shards:
                raise ValueError(f"register({key!r}): key is already registered; unregister it first")
            shard = _Shard(key, numel, dtype, home)
            if home is Tier.NVME and initial is None and fill is None:
                shard.set_state(Tier.NVME, _R)
                shard.nvme_zeros = True
                self._shards[key] = shard
                return
            tier = Tier.HOST if home is Tier.NVME else home
            dropped = home is Tier.NVME and not keep_host_copy
            while dropped and self._setup_writes_bytes and \
                    self._setup_writes_bytes + shard.nbytes > SETUP_WRITES_IN_FLIGHT_BYTES:
                self._cond.wait()  # [Note: set-up copies are dropped once written]
            alloc = self.budgets.reserve(tier, shard, for_key=key)
            if key in self._shards:  # registered by another thread while we waited for memory
                self.budgets.free(alloc)
                raise ValueError(f"register({key!r}): key is already registered; unregister it first")
            self.budgets.attach(shard, alloc)
            copy = shard.copies[tier]
            if fill is not None:
                fill(copy.tensor)
            elif initial is None:
                copy.tensor.zero_()
            else:
                copy.tensor.copy_(initial.reshape(-1))
            shard.set_state(tier, _R)
            copy.last_use = self._tick()
            self._shards[key] = shard
            if home is Tier.NVME:
                shard.dirty = Tier.HOST
                shard.drop_host_when_written = dropped
                self._setup_writes_bytes += shard.nbytes if dropped else 0
                self._start_writeback(shard)

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
        with self._lock:
            shard = self._wait_settled(self._shard(key))
            pinned = [t.name for t, c in shard.copies.items() if c.pins]
            if pinned:
                raise ValueError(f"unregister({key!r}): copies on {pinned} are acquired; release "
                                 "them first")
            for tier in (Tier.DEVICE, Tier.HOST):
                if shard.copies[tier].state is _R:
                    self.budgets.drop(shard, tier)
            had_file = shard.has_swap_file
            if shard.copies[Tier.NVME].state is _R:
                shard.set_state(Tier.NVME, _A)
            del self._shards[key]
            self._cond.notify_all()
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
        with self._lock:
            copy = self._shard(key).copies[tier]
            if copy.pins == 0:
                raise ValueError(f"release({key!r}, {tier.name}): the copy is not acquired")
            copy.pins -= 1
            if copy.pins == 0:
                self._cond.notify_all()

    def get(self, key: str, tier: Tier) -> torch.Tensor:
        """The tensor of a resident copy (1-D, ``numel`` elements). Not resident: ValueError."""
        with self._lock:
            shard = self._shard(key)
            copy = shard.copies[tier]
            if tier is Tier.NVME or copy.state not in (_R, _W):
                raise ValueError(f"get({key!r}, {tier.name}): the copy is {copy.state.name}, not "
                                 f"resident; fetch({key!r}, Tier.{tier.name}) and wait first")
            if shard.dirty is not None and tier is shard.home:
                raise ValueError(f"get({key!r}, {tier.name}): the home copy is stale (the "
                                 f"{shard.dirty.name} copy is dirty); write_back({key!r}) first")
            copy.last_use = self._tick()
            reader = self._device_reader(shard, tier)
        if reader is not None:
            reader()
        return copy.tensor

    def _fetch(self, key: str, tier: Tier, *, next_use: float | None, pin: bool,
               overwrite: bool = False, prefetch: bool = False, ahead: bool = False) -> TierHandle:
        if tier not in (Tier.DEVICE, Tier.HOST):
            raise ValueError(f"fetch({key!r}, {tier!r}): fetch to DEVICE or HOST; write_back "
                             "moves data to the home tier")
        if self.before_read is not None and not overwrite:
            self.before_read(key)
        try:
            future, shard = self._fetch_now(key, tier, next_use=next_use, pin=pin,
                                            overwrite=overwrite, prefetch=prefetch, may_wait=not ahead)
        except _WouldWait:
            future, shard = self._fetch_on_room_lane(key, tier, next_use=next_use, pin=pin), None
        return TierHandle(future, key, tier, self.counters.add_wait,
                          before_use=None if shard is None else self._device_reader(shard, tier))

    def _fetch_now(self, key: str, tier: Tier, *, next_use: float | None, pin: bool,
                   overwrite: bool, prefetch: bool, may_wait: bool) -> tuple[Future, _Shard]:
        with self._lock:
            self._check_open()
            shard = self._shard(key)
            if next_use is not None:
                shard.next_use = next_use
            future, outcome = self._fetch_locked(shard, tier, pin, overwrite, prefetch,
                                                 may_wait=may_wait)
            self.counters.fetch[outcome] += 1
        return future, shard

    def _fetch_on_room_lane(self, key: str, tier: Tier, *, next_use: float | None,
                            pin: bool) -> Future:
        """[Note: a read ahead never waits for room on its caller]: the fetch, run where it may
        wait; the returned future resolves with the fetch's own (its tensor or its error)."""
        outer: Future = Future()

        def forward(inner: Future) -> None:
            if inner.exception() is not None:
                outer.set_exception(inner.exception())
            else:
                outer.set_result(inner.result())

        def run() -> None:
            try:
                inner, _ = self._fetch_now(key, tier, next_use=next_use, pin=pin, overwrite=False,
                                           prefetch=False, may_wait=True)
            except BaseException as e:  # noqa: BLE001 - delivered through the handle
                outer.set_exception(e)
                return
            inner.add_done_callback(forward)
        try:
            self._room_lane.submit(run)
        except RuntimeError:  # the lane is shut down (interpreter exit): wait here instead
            run()
        return outer

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
                self._wait_writeback(shard)  # the home copy is stale: make it current first
                continue
            if copy.state is _I and copy.future is None:  # staging copy of a write-back
                if not may_wait:
                    raise _WouldWait
                self._cond.wait()
                continue
            if copy.state in (_R, _W, _I):
                copy.last_use = self._tick()
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
            alloc = self.budgets.reserve(tier, shard, for_key=shard.key,
                                         displace_sooner=not prefetch, may_wait=may_wait)
            if alloc is None:
                raise _WouldWait
            if self._shards.get(shard.key) is not shard:
                self.budgets.free(alloc)
                raise KeyError(f"fetch({shard.key!r}): unregistered while waiting for memory")
            if copy.state is not _A or self._source(shard, tier) != source:
                self.budgets.free(alloc)  # someone else moved things while we waited: look again
                continue
            self.budgets.attach(shard, alloc)
            shard.set_state(tier, _I)
            copy.future = started = Future()
            self._start_move(shard, source, tier)
            missed = True  # the loop's next pass pins the copy and returns its future

    def _allocate_for_overwrite(self, shard: _Shard, tier: Tier, pin: bool) -> Future | None:
        """An absent copy made resident with undefined bytes for an overwrite acquire; None when
        the copy changed while waiting for memory (the caller looks again). Other copies stay as
        they are: until :meth:`mark_dirty` the shard's valid bytes are its home's."""
        copy = shard.copies[tier]
        alloc = self.budgets.reserve(tier, shard, for_key=shard.key)
        if self._shards.get(shard.key) is not shard:
            self.budgets.free(alloc)
            raise KeyError(f"acquire({shard.key!r}): unregistered while waiting for memory")
        if copy.state is not _A:
            self.budgets.free(alloc)  # fetched by someone else while we waited for memory
            return None
        self.budgets.attach(shard, alloc)
        shard.set_state(tier, _R)
        copy.last_use = self._tick()
        copy.pins += int(pin)
        return done_future(copy.tensor)

    def _source(self, shard: _Shard, tier: Tier) -> Tier | None:
        """Where a fetch into ``tier`` reads from; None: DEVICE must wait for a HOST copy first."""
        other = Tier.HOST if tier is Tier.DEVICE else Tier.DEVICE
        stale = shard.dirty is not None and other is shard.home
        if shard.copies[other].state is not _A and not stale:
            return other
        if tier is Tier.HOST and shard.copies[Tier.NVME].state is _R:
            return Tier.NVME
        if tier is Tier.DEVICE and shard.home is Tier.NVME:
            return None
        raise RuntimeError(f"internal error: no valid copy of shard {shard.key!r} to fetch from "
                           f"({ {t.name: c.state.name for t, c in shard.copies.items()} }, "
                           f"dirty={shard.dirty})")

    # -- moves ------------------------------------------------------------------------------------

    def _start_move(self, shard: _Shard, src: Tier, dst: Tier) -> None:
        """Issue the move of ``shard`` from ``src`` into ``dst`` (its copy is INFLIGHT, allocated)."""
        dst_copy = shard.copies[dst]
        if src is Tier.NVME:
            if shard.nvme_zeros:
                dst_copy.tensor.zero_()
                self._finish_move(shard, src, dst, None, lock=False)
                return
            try:
                handle = self.swapper.swap_in(shard.key, self.arena.raw(dst_copy.extent))
            except BaseException as e:  # noqa: BLE001 - refused at issue: fail through the handle
                self._finish_move_locked(shard, src, dst, e)
                return
            handle.future.add_done_callback(
                lambda f: self._submit(self._finish_move, shard, src, dst, f.exception()))
            return
        src_copy = shard.copies[src]
        src_copy.busy += 1
        ready = self._stream_event()
        if src_copy.state is _I:  # chain after the move into the source
            src_copy.future.add_done_callback(
                lambda f: self._submit(self._copy_then_finish, shard, src, dst, ready,
                                            f.exception()))
        else:
            self._submit(self._copy_then_finish, shard, src, dst, ready, None)

    def _copy_then_finish(self, shard, src: Tier, dst: Tier, ready, error) -> None:
        if error is None and self._modeled(src, dst):
            try:
                self._modeled_copy(shard, src, dst)
                return
            except BaseException as e:  # noqa: BLE001 - delivered through the handle
                error = e
        done = None
        if error is None:
            try:
                done = self._issue_copy(shard.copies[dst].tensor, shard.copies[src].tensor, ready)
            except BaseException as e:  # noqa: BLE001 - delivered through the handle
                error = e
        # [Note: device copies complete on the copy lane]: a blocking event, waited there
        if done is not None and dst is Tier.DEVICE:
            # [Note: device copies complete on the stream]
            self._finish_move(shard, src, dst, None, ready_event=done, release_source=False)
            self._lane.submit(done.synchronize, lambda: self._release_source(shard, src))
            return
        if done is not None:  # HOST destination: the CPU reads it once the copy has landed
            self._lane.submit(done.synchronize, lambda: self._finish_move(shard, src, dst, None))
            return
        self._finish_move(shard, src, dst, error)

    def _modeled_copy(self, shard, src: Tier, dst: Tier) -> None:
        """A CPU engine's copy under ``copy_link``: queued on the link, its bytes land at its
        modeled end on the copy lane (NaN until then where the link asks for it)."""
        dst_t, src_t = shard.copies[dst].tensor, shard.copies[src].tensor
        link, done_at = self._reserve_on_link(shard, src, dst)
        if link.model.poison_until_wait and dst_t.is_floating_point():
            dst_t.fill_(float("nan"))

        def land() -> None:
            error = None
            try:
                host_copy(dst_t, src_t)
            except BaseException as e:  # noqa: BLE001 - delivered through the handle
                error = e
            self._finish_move(shard, src, dst, error)
        self._modeled_lanes[dst].submit(lambda: link.wait_until(done_at), land)

    def _modeled(self, src: Tier, dst: Tier) -> bool:
        """A copy between HOST and DEVICE that ``copy_link`` times (a CPU engine's)."""
        return (self.copy_link is not None and not self._cuda
                and {src, dst} == {Tier.HOST, Tier.DEVICE})

    def _reserve_on_link(self, shard: _Shard, src: Tier, dst: Tier):
        """Queue ``shard``'s copy on ``copy_link``'s direction: (that direction, its end)."""
        link = self.copy_link.toward(device=dst is Tier.DEVICE)
        return link, link.reserve(shard.nbytes, f"{src.name}->{dst.name}", shard.key)

    def _writeback_copy(self, shard: _Shard, src: Tier, dst: Tier, ready) -> None:
        """A write-back's copy, complete on return. Under ``copy_link`` this copy thread waits for
        the copy's modeled end, as it waits for a real one's event (:meth:`_copy`); the
        destination is INFLIGHT meanwhile, so nobody reads it early."""
        dst_t, src_t = shard.copies[dst].tensor, shard.copies[src].tensor
        if self._modeled(src, dst):
            link, done_at = self._reserve_on_link(shard, src, dst)
            link.wait_until(done_at)
            host_copy(dst_t, src_t)
        else:
            self._copy(dst_t, src_t, ready)

    def _release_source(self, shard: _Shard, src: Tier) -> None:
        """The copy out of ``src`` has run: the source copy may be evicted or changed again."""
        with self._lock:
            shard.copies[src].busy -= 1
            self._cond.notify_all()

    def _finish_move(self, shard: _Shard, src: Tier, dst: Tier, error, lock: bool = True, *,
                     ready_event=None, release_source: bool = True) -> None:
        if lock:
            with self._lock:
                self._finish_move_locked(shard, src, dst, error, ready_event=ready_event,
                                         release_source=release_source)
        else:
            self._finish_move_locked(shard, src, dst, error)

    def _finish_move_locked(self, shard: _Shard, src: Tier, dst: Tier, error, *,
                            ready_event=None, release_source: bool = True) -> None:
        copy = shard.copies[dst]
        future, copy.future = copy.future, None
        if src is not Tier.NVME and release_source:
            shard.copies[src].busy -= 1
        copy.ready_event = ready_event
        if error is None:
            shard.set_state(dst, _R)
            if not (src is Tier.NVME and shard.nvme_zeros):
                self.counters.add_moved(src, dst, shard.nbytes, shard.key)
            future.set_result(copy.tensor)
        else:
            shard.set_state(dst, _A)
            copy.pins = 0  # the acquires that pinned it fail with this error
            self.budgets.release_bytes(shard, dst)
            logger.warning("fetch of %r into %s failed: %s", shard.key, dst.name, error)
            future.set_exception(error)
        self._cond.notify_all()

    def _submit(self, fn, *args) -> None:
        """Run ``fn`` on a copy thread. Completions must never fail silently (a waiter would hang),
        so an exception escaping one is logged loudly; the functions themselves deliver I/O errors
        through the copy's future."""
        def run() -> None:
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - a bug in the store; make it visible
                logger.exception("internal error in a tiered-store completion (%s)", fn.__name__)
                raise
        try:
            self._pool.submit(run)
        except RuntimeError:
            # [Note: completions after pool shutdown] concurrent.futures stops every pool at
            # interpreter exit, before atexit handlers and finalizers (where owners close the
            # store); a swap still in flight then has nowhere to complete and close() would wait
            # for it forever. Run it on a one-off thread instead -- not inline: a done-callback
            # may fire in a thread that holds the store's lock -- and inline only as the last
            # resort, when the interpreter refuses new threads too (finalizing).
            logger.debug("copy pool is shut down: running %s on its own thread", fn.__name__)
            try:
                threading.Thread(target=run, name="infinity-tiers-late", daemon=True).start()
            except RuntimeError:
                run()

    def _stream_event(self):
        """CUDA: a blocking event on the caller's stream, so the copy stream waits (on the GPU,
        not the host) for the work issued so far: it wrote the source, or last used the memory
        the destination was allocated in (the caching allocator orders reuse by stream)."""
        if not self._cuda:
            return None
        return record_on_current_stream(self.device)

    def _issue_copy(self, dst: torch.Tensor, src: torch.Tensor, ready):
        """Copy between HOST and DEVICE. CPU: done on return (None). CUDA: issued on the store's
        copy stream after ``ready``; returns the blocking event recorded after it."""
        if not self._cuda:
            host_copy(dst, src)
            return None
        with torch.cuda.device(self.device), torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(ready)
            dst.copy_(src, non_blocking=True)
            for t in (dst, src):
                if t.is_cuda:  # freed early (an eviction): not reused before the copy has run
                    t.record_stream(self._copy_stream)
            done = blocking_event()
            done.record(self._copy_stream)
        return done

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, ready) -> None:
        """:meth:`_issue_copy`, complete on return (the copy thread sleeps on a blocking event)."""
        done = self._issue_copy(dst, src, ready)
        if done is not None:
            done.synchronize()

    def _device_reader(self, shard: _Shard, tier: Tier) -> Callable[[], None] | None:
        """[Note: device copies complete on the stream]: what a reader of ``shard``'s copy on
        ``tier`` runs before using it: on CUDA, its current stream waits for the copy that filled
        it (the GPU waits, the host does not). None: nothing to wait for."""
        if not self._cuda or tier is not Tier.DEVICE:
            return None
        copy = shard.copies[tier]
        device = self.device

        def wait_on_current_stream() -> None:
            event = copy.ready_event
            if event is not None:
                torch.cuda.current_stream(device).wait_event(event)
        return wait_on_current_stream

    # -- dirty data and write-back ---------------------------------------------------------------

    def mark_dirty(self, key: str, tier: Tier) -> None:
        """Say the copy on ``tier`` was modified. Other non-home copies are dropped (stale); when
        ``tier`` is not home, the home copy is stale until :meth:`write_back` (or an eviction)."""
        with self._lock:
            shard = self._wait_settled(self._shard(key))
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
            shard.writeback_error = None

    def write_back(self, key: str) -> TierHandle:
        """Copy the dirty copy's bytes to the home tier (async; ``wait()`` returns None)."""
        with self._lock:
            self._check_open()
            shard = self._shard(key)
            future = self._start_writeback(shard)
        return TierHandle(future, key, None, self.counters.add_wait)

    def flush(self) -> None:
        """Write back every dirty shard and wait (before a checkpoint reads the home tiers)."""
        futures = []
        with self._lock:
            for shard in list(self._shards.values()):
                # _start_writeback may wait (lock released): skip shards unregistered meanwhile.
                if self._shards.get(shard.key) is shard and shard.dirty is not None:
                    futures.append(self._start_writeback(shard))
        for future in futures:
            future.result()

    def _start_writeback(self, shard: _Shard) -> Future:
        """Issue the write-back of ``shard.dirty`` to its home (lock held; may wait for memory)."""
        while True:
            if shard.writeback is not None:
                return shard.writeback
            src = shard.dirty
            if src is None:
                return done_future(None)
            if not shard.settled():
                self._wait_settled(shard)
                continue
            staged = src is Tier.DEVICE and shard.home is Tier.NVME
            if staged and shard.copies[Tier.HOST].state is _A:
                alloc = self.budgets.reserve(Tier.HOST, shard, for_key=shard.key)
                if self._shards.get(shard.key) is not shard or shard.dirty is not src or \
                        shard.copies[Tier.HOST].state is not _A or shard.writeback is not None:
                    self.budgets.free(alloc)
                    continue
                self.budgets.attach(shard, alloc)
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
        self._submit(self._writeback_job, shard, src, staged, self._stream_event())
        return shard.writeback

    def _writeback_job(self, shard: _Shard, src: Tier, staged: bool, ready) -> None:
        error = None
        home = shard.home
        try:
            if staged:  # DEVICE -> HOST extent -> NVME
                self._writeback_copy(shard, Tier.DEVICE, Tier.HOST, ready)
                self.counters.add_moved(Tier.DEVICE, Tier.HOST, shard.nbytes)
                with self._lock:
                    shard.set_state(Tier.HOST, _R)
                    shard.set_state(Tier.HOST, _W)
                    shard.copies[Tier.HOST].busy -= 1
            if home is Tier.NVME:
                # [Note: a write-back holds no copy thread]
                extent = shard.copies[Tier.HOST].extent
                shard.has_swap_file = True
                handle = self.swapper.swap_out(shard.key, self.arena.raw(extent))
                handle.future.add_done_callback(
                    lambda f: self._submit(self._swapped_out, shard, src, staged, f.exception()))
                return
            self._writeback_copy(shard, src, home, ready)
            self.counters.add_moved(src, home, shard.nbytes)
        except BaseException as e:  # noqa: BLE001 - delivered through the handle
            error = e
        self._finish_writeback(shard, src, staged, error)

    def _swapped_out(self, shard: _Shard, src: Tier, staged: bool, error) -> None:
        """[Note: a write-back holds no copy thread] A write-back's swap-out is issued and left
        to the swapper's threads; its completion comes back here, as a read's does
        (:meth:`_start_move`). The copy threads used to wait for each swap-out: two write-backs
        held both, so no more than two were ever in flight, and every read's completion queued
        behind them. On the 1B GPU proxy's optimizer step (sub-groups of 48 MB, a window of 31
        reads ahead) the disk then ran reads alone or writes alone, both at once 0.1 s of 4.9 s,
        the training thread waiting 4 s for reads the disk had already made."""
        if error is None:
            self.counters.add_moved(Tier.HOST, Tier.NVME, shard.nbytes, shard.key)
        self._finish_writeback(shard, src, staged, error)

    def _finish_writeback(self, shard: _Shard, src: Tier, staged: bool, error) -> None:
        with self._lock:
            home = shard.home
            # Only the copies this write-back moved change state: a fetch may be under way into
            # another copy meanwhile (a WRITING copy is a valid source).
            if staged:
                host = shard.copies[Tier.HOST]
                if host.state is _I:  # the DEVICE -> HOST copy failed: drop the staging extent
                    shard.set_state(Tier.HOST, _A)
                    host.busy = 0
                    self.budgets.release_bytes(shard, Tier.HOST)
                else:
                    shard.set_state(Tier.HOST, _R)
            shard.set_state(src, _R)
            future, shard.writeback = shard.writeback, None
            if error is None:
                shard.set_state(home, _R)
                shard.dirty = None
                if home is Tier.NVME:
                    shard.nvme_zeros = False
                self._end_setup_write(shard, written=True)
                future.set_result(None)
            else:
                # The dirty copy is kept; an NVMe home that failed mid-write has no valid file.
                shard.set_state(home, _A if home is Tier.NVME else _R)
                shard.writeback_error = error
                self._end_setup_write(shard, written=False)
                logger.warning("write-back of %r to %s failed: %s", shard.key, home.name, error)
                future.set_exception(error)
            self._cond.notify_all()

    def _end_setup_write(self, shard: _Shard, *, written: bool) -> None:
        """[Note: set-up copies are dropped once written] (lock held). A failed write keeps the
        copy: it is the only one with the bytes."""
        if not shard.drop_host_when_written:
            return
        shard.drop_host_when_written = False
        self._setup_writes_bytes -= shard.nbytes
        host = shard.copies[Tier.HOST]
        if written and host.state is _R and not host.pins and not host.busy:  # else in use: keep
            self.budgets.drop(shard, Tier.HOST)
            self.counters.evictions[Tier.HOST] += 1

    def _wait_writeback(self, shard: _Shard) -> None:
        """Write ``shard`` back and wait (lock held; released while waiting). Re-raises its error."""
        future = self._start_writeback(shard)
        while not future.done():
            self._cond.wait()
        if future.exception() is not None:
            raise future.exception()

    # -- eviction -----------------------------------------------------------------------------------

    def evict(self, key: str, tier: Tier) -> None:
        """Drop the copy on ``tier`` (writing it back first when dirty). Absent: no-op.
        The home copy and pinned copies cannot be evicted (ValueError)."""
        with self._lock:
            shard = self._shard(key)
            if tier is shard.home or tier is Tier.NVME:
                raise ValueError(f"evict({key!r}, {tier.name}): that is the home copy; unregister "
                                 "the shard to drop it")
            while True:
                shard = self._wait_settled(shard)
                copy = shard.copies[tier]
                if copy.state is _A:
                    return
                if copy.pins:
                    raise ValueError(f"evict({key!r}, {tier.name}): the copy is acquired "
                                     f"{copy.pins} time(s); release it first")
                if shard.dirty is tier:
                    self._wait_writeback(shard)
                    continue
                self.budgets.drop(shard, tier)
                self.counters.evictions[tier] += 1
                return

    def _wait_settled(self, shard: _Shard) -> _Shard:
        while not shard.settled():
            self._cond.wait()
        if self._shards.get(shard.key) is not shard:
            raise KeyError(f"shard {shard.key!r} was unregistered meanwhile")
        return shard

    def _shard(self, key: str) -> _Shard:
        shard = self._shards.get(key)
        if shard is None:
            raise KeyError(f"shard {key!r} is not registered (register it first)")
        return shard

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the TieredStore is closed")

    # -- introspection and shutdown ------------------------------------------------------------------

    def state(self, key: str, tier: Tier) -> Residency:
        with self._lock:
            return self._shard(key).copies[tier].state

    def home(self, key: str) -> Tier:
        """The tier ``key`` was registered with as its home."""
        with self._lock:
            return self._shard(key).home

    def is_dirty(self, key: str) -> Tier | None:
        with self._lock:
            return self._shard(key).dirty

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._shards)

    def set_next_use(self, key: str, distance: float | None) -> None:
        with self._lock:
            self._shard(key).next_use = distance

    def reclaimable_bytes(self, tier: Tier) -> int:
        """Bytes of ``tier``'s budget a new copy could take now: free, or held by copies the
        store may evict (unpinned, not busy, not a home copy, no write-back under way)."""
        with self._lock:
            return self.budgets.reclaimable(tier)

    def budget_bytes(self, tier: Tier) -> int:
        """The bytes ``tier`` (DEVICE or HOST) may hold: its budget in the store's config."""
        return int(self.config.device_budget_bytes if tier is Tier.DEVICE
                   else self.config.host_budget_bytes)

    def used_bytes(self, tier: Tier) -> int:
        """The bytes charged to ``tier`` (DEVICE or HOST) now: one counter, no walk over the
        shards (which :meth:`stats` makes), for planners that ask on every decision."""
        with self._lock:
            return int(self.budgets.used[tier])

    def moved_bytes(self, src: Tier, dst: Tier) -> int:
        """Bytes moved from ``src`` to ``dst`` so far (``stats()``'s ``bytes_<src>_to_<dst>``)."""
        return int(self.counters.moved[(src.label, dst.label)])

    def stats(self) -> dict[str, float]:
        """Counters; keys in :data:`infinity.tiers.STATS_KEYS`, documented in the package docstring."""
        out = self.counters.snapshot()
        with self._lock:
            for tier in (Tier.DEVICE, Tier.HOST):
                out[f"{tier.label}_used_bytes"] = self.budgets.used[tier]
                out[f"{tier.label}_peak_bytes"] = self.budgets.peak[tier]
                out[f"{tier.label}_budget_bytes"] = self.budgets.budget[tier]
            out["num_shards"] = len(self._shards)
            out["host_homed_bytes"] = sum(s.copies[Tier.HOST].charged_bytes
                                          for s in self._shards.values() if s.home is Tier.HOST)
        out["host_largest_free_bytes"] = self.arena.largest_free_bytes()
        return out

    def nvme_bytes_by_kind(self) -> dict[str, dict[str, int]]:
        """NVMe bytes read and written so far per kind of shard (a key's first path component:
        'param', 'opt', 'grad'): which state moves more than once a step."""
        return self.counters.nvme_bytes_by_kind()

    def reset_peaks(self) -> None:
        with self._lock:
            self.budgets.peak = dict(self.budgets.used)

    def close(self) -> None:
        """Wait for moves in flight, drop every copy (no write-back: call flush() first to keep
        dirty data), stop the copy threads. The swapper stays open (the caller owns it)."""
        # Reads ahead still waiting for room get it or their error first (each waits only for
        # moves, which complete on their own).
        self._room_lane.shutdown(wait=True)
        with self._lock:
            if self._closed:
                return
            for shard in list(self._shards.values()):
                while not shard.settled():
                    self._cond.wait()
            self._closed = True
            keys = [k for k, s in self._shards.items() if s.has_swap_file]
            self._shards.clear()
            self.budgets.used = {Tier.DEVICE: 0, Tier.HOST: 0}
        self._pool.shutdown(wait=True)
        self._lane.close()
        for lane in self._modeled_lanes.values():
            lane.close()
        for key in keys:
            try:
                self.swapper.remove(key)
            except (KeyError, OSError, RuntimeError):
                pass

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
