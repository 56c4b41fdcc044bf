"""Budgets and eviction of the tiered store: reserve bytes in a tier, evicting by policy.

:class:`TierBudgets` is owned by the :class:`~infinity.tiers.TieredStore`; it holds the byte
counts per tier and reads the records through the store's :class:`~._shard_table.ShardTable`, whose
lock guards both ([Note: store locking] in infinity/tiers/_shard_table.py). It never writes a shard
back itself: where a dirty victim must be written first, :meth:`TierBudgets.reserve` returns it
(:class:`DirtyVictim`) to the caller, who owns the write-backs
(:meth:`~._writeback.WriteBacks.reserve` writes it back and asks again).

[Note: eviction policy] A copy may be evicted only when it is RESIDENT, unpinned, not busy (no move
reads it), not the home copy, and its shard has no write-back in flight. Among those: furthest next
use first (Belady) where a distance is known -- the store's ``next_use`` callable first, else the
last distance given to fetch/acquire/set_next_use; an unknown distance counts as furthest -- and
least recently used first on ties and when nothing is known. A dirty victim is written back before
it is dropped, so the newest bytes of a shard are never lost.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from infinity._common import format_bytes
from infinity.errors import TierCapacityError
from infinity.io import advise_huge_pages, engine_buffers
from infinity.tiers._arena import HostArena
from infinity.tiers._records import Counters, _Shard
from infinity.tiers._shard_table import ShardTable
from infinity.tiers.residency import Residency, Tier

NextUse = Callable[[str], "float | None"]

logger = logging.getLogger(__name__)

_A, _I, _R, _W = Residency.ABSENT, Residency.INFLIGHT, Residency.RESIDENT, Residency.WRITING


def _empty_device(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every DEVICE allocation of the store goes through here (tests wrap it to count live bytes)."""
    with engine_buffers():  # [Note: freed buffers leave the process] in infinity/io
        tensor = torch.empty(numel, dtype=dtype, device=device)
    advise_huge_pages(tensor)  # a CPU engine's DEVICE tier: [Note: first touch of large host buffers]
    return tensor


class _Alloc:
    """Bytes reserved in a tier for one copy, not yet attached to it."""

    __slots__ = ("tier", "tensor", "extent", "charged_bytes")

    def __init__(self, tier, tensor, extent, charged_bytes):
        self.tier, self.tensor, self.extent, self.charged_bytes = tier, tensor, extent, charged_bytes


class DirtyVictim:
    """What :meth:`TierBudgets.reserve` returns where the next victim is dirty: write ``shard``
    back, then reserve again (nothing was allocated)."""

    __slots__ = ("shard",)

    def __init__(self, shard: _Shard):
        self.shard = shard


class TierBudgets:
    """Byte budgets of the DEVICE and HOST tiers and the eviction that keeps allocations in them.

    Reads the store's shard table (``table``, whose lock guards the records and these counts:
    every method runs with it held, [Note: store locking] in infinity/tiers/_shard_table.py), and
    shares the store's ``counters`` and arena."""

    def __init__(self, *, device: torch.device, device_budget_bytes: int, arena: HostArena,
                 table: ShardTable, counters: Counters, next_use: NextUse | None):
        self.device = device
        self.arena = arena
        self.budget = {Tier.DEVICE: device_budget_bytes, Tier.HOST: arena.capacity_bytes}
        """Bytes each tier may hold (HOST: the arena's capacity)."""
        self.used = {Tier.DEVICE: 0, Tier.HOST: 0}
        """Bytes charged now per tier."""
        self.peak = {Tier.DEVICE: 0, Tier.HOST: 0}
        """High-water mark of ``used`` per tier since start or the last reset."""
        self._table = table
        self._counters = counters
        self._next_use_fn = next_use

    def _distance(self, shard: _Shard) -> float | None:
        """The shard's next use as the store knows it (None: unknown)."""
        dist = self._next_use_fn(shard.key) if self._next_use_fn else None
        return shard.next_use if dist is None else dist

    def _victims(self, tier: Tier) -> list[_Shard]:
        """Evictable copies on ``tier``, first to evict first: furthest next use (Belady) when a
        distance is known, unknown distances count as furthest; LRU breaks ties and decides alone
        when nothing is known."""
        def rank(shard: _Shard) -> tuple[float, int]:
            dist = self._distance(shard)
            return (-(math.inf if dist is None else dist), shard.copies[tier].last_use)

        return sorted(self._evictable(tier), key=rank)

    def _evictable(self, tier: Tier) -> list[_Shard]:
        return [s for s in self._table
                if s.home is not tier and s.copies[tier].state is _R and not s.copies[tier].pins
                and not s.copies[tier].busy and s.writeback is None]

    def reclaimable(self, tier: Tier) -> int:
        """Free bytes plus those of the copies :meth:`reserve` may evict (lock held)."""
        evictable = sum(s.copies[tier].charged_bytes for s in self._evictable(tier))
        return self.budget[tier] - self.used[tier] + evictable

    def reserve(self, tier: Tier, shard: _Shard, *, for_key: str,
                displace_sooner: bool = True, may_wait: bool = True
                ) -> "_Alloc | DirtyVictim | None":
        """Allocate bytes for ``shard`` in ``tier``, evicting by policy; TierCapacityError when
        nothing (more) can go. Lock held; released while waiting for moves under way. Where the
        next victim is dirty: a :class:`DirtyVictim` (write it back, then call again).

        ``displace_sooner`` False (a prefetch): [Note: a prefetch never evicts a sooner use].
        ``may_wait`` False: None where room needs a write-back or a move to finish first (clean
        victims already dropped stay dropped; nothing is allocated) ([Note: a read ahead never
        waits for room on its caller] in store.py)."""
        nbytes = shard.nbytes
        charge = self.arena.extent_bytes(nbytes) if tier is Tier.HOST else nbytes
        if charge > self.budget[tier]:
            self.capacity_error(tier, for_key, charge, "larger than the whole budget")
        while True:
            alloc = self._try_alloc(tier, shard, charge)
            if alloc is not None:
                return alloc
            victims = self._victims(tier)
            if not victims:
                if self._moves_pending(tier):
                    if not may_wait:
                        return None
                    self._table.wait()
                    continue
                self.capacity_error(tier, for_key, charge, self._why_full(tier, charge))
            victim = victims[0]
            if not displace_sooner:
                self._check_not_sooner(tier, shard, victim, for_key, charge)
            if victim.dirty is tier:
                if not may_wait:
                    return None
                return DirtyVictim(victim)
            self.drop(victim, tier)
            self._counters.evictions[tier] += 1
            logger.debug("evicted %r from %s for %r", victim.key, tier.name, for_key)

    def _check_not_sooner(self, tier: Tier, shard: _Shard, victim: _Shard, for_key: str,
                          charge: int) -> None:
        """[Note: a prefetch never evicts a sooner use]
        The prefetch planner admits a prefetch only where free bytes and copies used after it
        cover its size ([Note: prefetch never displaces a sooner use] in
        infinity/prefetch/_planner.py), but it counts bytes, and the HOST arena needs one hole:
        when the free bytes lie in two holes, making a hole can take a copy used sooner than the
        prefetched one, even the one about to run. Traced on 8 of 7B's layers (LoRA, the frozen
        base streamed through a 2 GiB host budget): 10 of 151 evictions in 5 steps took a copy
        used sooner than the one fetched, 2 of them a prefetched copy not yet used. So a fetch
        that may wait (a prefetch) is refused here instead; it is planned again at the next
        hook, when the copies before it have run and are evictable in the right order. A demand
        fetch takes any victim: it is needed now."""
        mine, theirs = self._distance(shard), self._distance(victim)
        if mine is not None and theirs is not None and theirs < mine:
            self.capacity_error(tier, for_key, charge,
                                f"making room would evict {victim.key!r}, used sooner (a prefetch "
                                f"waits for the next planning point)")

    def _try_alloc(self, tier: Tier, shard: _Shard, charge: int) -> "_Alloc | None":
        if self.used[tier] + charge > self.budget[tier]:
            return None
        if tier is Tier.HOST:
            extent = self.arena.allocate(shard.nbytes, long_lived=shard.home is tier)
            if extent is None:
                return None  # fragmented: evict to make a hole
            tensor = self.arena.view(extent, shard.numel, shard.dtype)
        else:
            extent, tensor = None, _empty_device(shard.numel, shard.dtype, self.device)
        self.used[tier] += charge
        self.peak[tier] = max(self.peak[tier], self.used[tier])
        return _Alloc(tier, tensor, extent, charge)

    def _moves_pending(self, tier: Tier) -> bool:
        """[Note: wait, do not refuse] Unpinned non-home copies on ``tier`` that a move under way
        will leave evictable: a write-back's source or HOST staging copy (RESIDENT, WRITING or, while
        the DEVICE -> HOST part runs, INFLIGHT), a fetch landing in the copy, a copy a move reads
        (busy). Each such move already holds its memory and completes on the store's / swapper's
        threads, which never allocate, so waiting for it cannot deadlock -- and the caller's own move
        is never among them: it is issued only after ``reserve`` returns. Refusing instead made
        write-backs under a tight HOST budget raise while staging copies were about to be freed."""
        for s in self._table:
            copy = s.copies[tier]
            if s.home is tier or copy.pins:
                continue
            if s.writeback is not None and copy.state in (_I, _W, _R):
                return True
            if (copy.state is _I and copy.future is not None) or (copy.state is _R and copy.busy):
                return True
        return False

    def _why_full(self, tier: Tier, charge: int) -> str:
        if tier is Tier.HOST and self.budget[tier] - self.used[tier] >= charge:
            return (f"fragmented: {format_bytes(self.arena.free_bytes())} free but the largest hole "
                    f"is {format_bytes(self.arena.largest_free_bytes())} and no unpinned copy is "
                    "left to evict")
        return "every other copy there is pinned, in flight or a home copy"

    def capacity_error(self, tier: Tier, key: str, charge: int, why: str) -> None:
        raise TierCapacityError(
            f"{tier.name} tier cannot hold {format_bytes(charge)} for shard {key!r}: {why}; raise "
            f"memory.{tier.label}_budget_bytes, release acquired shards, or fetch fewer at once",
            tier=tier.name, requested_bytes=charge, used_bytes=self.used[tier],
            budget_bytes=self.budget[tier])

    # -- bookkeeping -----------------------------------------------------------------------

    def attach(self, shard: _Shard, alloc: "_Alloc") -> None:
        copy = shard.copies[alloc.tier]
        copy.tensor, copy.extent, copy.charged_bytes = alloc.tensor, alloc.extent, alloc.charged_bytes
        alloc.tensor = alloc.extent = None  # the copy owns the bytes now; a stale frame must not

    def free(self, alloc: "_Alloc") -> None:
        if alloc.extent is not None:
            self.arena.free(alloc.extent)
        self.used[alloc.tier] -= alloc.charged_bytes
        alloc.tensor = alloc.extent = None  # really free it now, not when the caller's frame ends
        alloc.charged_bytes = 0
        self._table.notify()

    def release_bytes(self, shard: _Shard, tier: Tier) -> None:
        copy = shard.copies[tier]
        self.free(_Alloc(tier, None, copy.extent, copy.charged_bytes))
        copy.tensor, copy.extent, copy.charged_bytes, copy.future = None, None, 0, None

    def drop(self, shard: _Shard, tier: Tier) -> None:
        """Free a RESIDENT copy (the caller checked it is not pinned, busy or the only newest one)."""
        shard.set_state(tier, _A)
        self.release_bytes(shard, tier)
