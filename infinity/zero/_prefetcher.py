"""The adapter between the trace-driven prefetch executor and the tiered store's parameter shards.

:mod:`infinity.prefetch` knows no tiers and :mod:`infinity.tiers` knows no units; the parameter
manager (:mod:`._param_manager`) knows both but should not carry the bookkeeping that joins them.
This module does: it turns the executor's hops into store fetches and the manager's gathers, tells
the executor where each unit is (``locate``), feeds the trace's next-use distances to the store's
Belady eviction, and reports the store's evictions back to the executor.

Public API
----------
``PrefetchUnit(*, unit, keys, shard_bytes, gathered_bytes, home)``: one unit whose parameter shards
the store holds (``keys``: their store keys; ``home``: ``Level.HOST`` or ``Level.NVME``).

``prefetch_config(*, host_budget_bytes, device_budget_bytes, largest_shard_bytes,
largest_gathered_bytes, world_size, lookahead_bytes=None, max_reuse_distance_bytes=None)
-> PrefetchConfig``: the executor's knobs derived from the store's budgets (see the function).

``ParamPrefetcher(store, units, *, gather, is_gathered, config, gathered_budget_bytes=None,
clock=time.perf_counter)``
    ``gather(unit)`` makes the unit gathered (the manager's all-gather, synchronous);
    ``is_gathered(unit) -> bool``. Per step: ``begin_step(phase, *, then=None)`` (``then``: see
    [Note: predicting past an evaluation step] in infinity/prefetch/_trace.py); per unit U:
    ``before_compute(U)`` (returns once U is gathered), after U's compute the manager asks
    ``should_keep(U)``, releases U unless kept and then calls ``on_release(U)``, then
    ``after_compute(U)``; ``end_step()`` after the step's last unit and before the optimizer step.
    ``warm_next_step()`` once the parameters are final between steps (see the method);
    ``has_trace(phase)``. Properties ``in_step``, ``phase``, ``unit_ids``;
    ``next_use_given(U)`` (the next-use position given the store for U's shards);
    ``stats() -> dict`` (see :meth:`ParamPrefetcher.stats`).

[Note: synchronous all-gathers] The executor's DEVICE -> GATHERED hop runs the manager's gather on
the calling (training) thread and completes before ``issue`` returns. A prefetched gather therefore
costs no overlap, only its memory, and it happens when the planner says the unit is due (in practice
at the previous unit's post-hook); the NVMe reads and host->device copies, the slow hops, are the
asynchronous ones. With several ranks the executor's ``gather_lead_entries`` puts every all-gather
at the same trace position on every rank.

[Note: stale gathered units] A unit gathered past a step's last use (kept, or prefetched for a use
that never came) would hold parameters the optimizer step is about to change. The manager releases
every gathered on-demand unit at the end of each step; ``end_step`` is called just before that.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable

from infinity._timing import timer_for
from infinity.errors import TierCapacityError
from infinity.prefetch import FetchAction, Level, PrefetchConfig, PrefetchExecutor, UnitSizes
from infinity.tiers import Residency, Tier

logger = logging.getLogger(__name__)

__all__ = ["ParamPrefetcher", "PrefetchUnit", "disabled_stats", "prefetch_config"]

_VALID = (Residency.RESIDENT, Residency.WRITING)


@dataclass(frozen=True, kw_only=True)
class PrefetchUnit:
    """One unit whose parameter shards live in the tiered store."""

    unit: Hashable
    keys: tuple[str, ...]
    """Store keys of the unit's shards (one per flat group)."""
    shard_bytes: int
    """Bytes of this rank's shards (what NVME->HOST and HOST->DEVICE move)."""
    gathered_bytes: int
    """Bytes of the unit's full buffers once gathered."""
    home: Level = Level.NVME

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError(f"PrefetchUnit {self.unit!r}: keys must name at least one store shard")
        if self.home not in (Level.HOST, Level.NVME):
            raise ValueError(f"PrefetchUnit {self.unit!r}: home must be Level.HOST or Level.NVME, "
                             f"got {self.home!r}")


def prefetch_config(*, host_budget_bytes: int, device_budget_bytes: int, largest_shard_bytes: int,
                    largest_gathered_bytes: int, world_size: int, lookahead_bytes: int | None = None,
                    max_reuse_distance_bytes: int | None = None) -> PrefetchConfig:
    """The executor's knobs from the store's budgets.

    In-flight bounds: half of each tier's budget (at least one shard), so fetches in flight, which
    the store cannot evict, always leave the other half for demand fetches and pinned copies.
    Keep-gathered: by default a unit stays gathered when at most the largest unit's gathered bytes
    of other units run before it comes back (the forward/backward turnaround, a recomputation, a
    unit called twice around a small one); byte-based, so every rank decides alike.
    """
    return PrefetchConfig(
        host_inflight_budget_bytes=max(largest_shard_bytes, host_budget_bytes // 2),
        device_inflight_budget_bytes=max(largest_shard_bytes, device_budget_bytes // 2),
        lookahead_bytes=lookahead_bytes,
        max_reuse_distance_bytes=(largest_gathered_bytes if max_reuse_distance_bytes is None
                                  else max_reuse_distance_bytes),
        # [Note: all-gathers at fixed positions] in infinity/prefetch/_executor.py: ranks time differently.
        gather_lead_entries=1 if world_size > 1 else None)


class _Done:
    """Handle of a hop that completed inside ``issue`` (the synchronous all-gather)."""

    def __init__(self, elapsed_s: float):
        self.elapsed_s = elapsed_s

    def wait(self) -> None:
        return None

    def done(self) -> bool:
        return True


class _Fetch:
    """Handle of one hop over a unit's shards: the store's handles, joined.

    ``elapsed_s`` is set only when ``wait()`` found the hop unfinished, so it measures the transfer
    (issue to completion) and never the compute that ran while a finished hop went unnoticed: the
    bandwidth estimate can only err towards 'too fast', which makes the next fetch late, which is
    measured, which corrects it.
    """

    def __init__(self, handles: list[Any], issued_s: float, clock: Callable[[], float],
                 on_complete: Callable[[], None]):
        self._handles = handles
        self._issued_s = issued_s
        self._clock = clock
        self._on_complete = on_complete
        self.elapsed_s: float | None = None

    def done(self) -> bool:
        return all(h.done() for h in self._handles)

    def wait(self) -> None:
        blocked = not self.done()
        for h in self._handles:
            h.wait()  # re-raises the move's error (SwapIOError...)
        if blocked:
            self.elapsed_s = self._clock() - self._issued_s
        self._on_complete()


class ParamPrefetcher:
    """Drives a :class:`PrefetchExecutor` over the store's parameter shards (see the module doc)."""

    def __init__(self, store: Any, units: Iterable[PrefetchUnit], *, gather: Callable[[Hashable], None],
                 is_gathered: Callable[[Hashable], bool], config: PrefetchConfig,
                 gathered_budget_bytes: int | None = None, clock: Callable[[], float] = time.perf_counter,
                 device_tier: Tier = Tier.DEVICE):
        self.store = store
        self._tier_of = {Level.HOST: Tier.HOST, Level.DEVICE: device_tier}
        """The store tier behind each executor level: the DEVICE level is the HOST tier when
        gathers read shards from HOST ([Note: a CPU engine reads parameter shards from HOST] in
        infinity/zero/_manager_config.py); the executor then finds a shard at DEVICE once it is in HOST."""
        self._units = {u.unit: u for u in units}
        self._gather = gather
        self._is_gathered = is_gathered
        self._gathered_budget = gathered_budget_bytes  # None: only the device's own limit
        self._clock = clock
        # [Note: timing asynchronous GPU work]: on a GPU the hooks' clock sees launches only.
        device = getattr(store, "device", None)
        unit_timer = timer_for(device) if getattr(device, "type", None) == "cuda" else None
        self.executor = PrefetchExecutor(issue=self._issue, config=config, locate=self._locate,
                                         free_bytes=self._free_bytes, evictable=self._evictable,
                                         clock=clock, unit_timer=unit_timer)
        for u in self._units.values():
            self.executor.register_unit(UnitSizes(unit=u.unit, shard_bytes=u.shard_bytes,
                                                 gathered_bytes=u.gathered_bytes, home=u.home))
        self._cached: dict[Hashable, set[Level]] = {}
        """Levels our fetches filled and no eviction was reported for yet (checked at each hook)."""
        self._last_cursor = -1  # cursor at the last next-use refresh: a jump means a full refresh
        self._last_synced = False
        self._last_phase: str | None = None  # the next step's likely phase: the last ended step's
        # ``then``, else its own
        self._warm_bytes = 0  # shard bytes warm_next_step() fetched
        self._warm_handles: list[Any] = []  # its fetches, until seen complete (drain waits for them)
        self._next_pos: dict[Hashable, float | None] = {}  # next use we gave the store, per unit
        self._keys = {k for u in self._units.values() for k in u.keys}
        self._sole_cache: set[Level] = set()  # levels where our shards are the only evictable copies
        _drain_before_pools_stop(self)

    # ---- steps -----------------------------------------------------------------------------------
    @property
    def in_step(self) -> bool:
        """A step is open (the executor's recording owns that fact)."""
        return self.executor.in_step

    @property
    def phase(self) -> str | None:
        """The open step's phase; None between steps."""
        return self.executor.phase

    def begin_step(self, phase: str, *, then: str | None = None) -> None:
        """A step of ``phase`` starts ('train', 'eval', ...: each phase has its own traces).
        ``then``: the step leaves the parameters as they are (an evaluation forward) and the next
        one most likely has phase ``then``: its first shards are moved up during this step's last
        units ([Note: predicting past an evaluation step] in infinity/prefetch/_trace.py)."""
        self._report_evictions()
        self._sole_cache = self._levels_only_we_cache()
        self.executor.begin_step(phase, then=then)
        # After the executor follows the new step: before, the ended step's follower put every
        # unit at 'not used again' and undid end_step()'s positions, so the store's first
        # evictions of a step could take the very units it starts with.
        self._refresh_next_use(full=True)

    def end_step(self) -> None:
        """The step's last unit ran: commit its trace; until the next step the store keeps first
        what the next step (of phase ``then``, else of the same phase) needs first."""
        if not self.executor.in_step:
            return
        self._last_phase = self.executor.then or self.executor.phase
        self.executor.end_step()  # commits the step's trace: the latest of its phase
        self._last_cursor = -1
        following = self.executor.store.latest(self._last_phase)
        if following is None:
            return
        for u in self._units.values():  # positions in the next step (cursor 0)
            self._set_next_use(u, following.next_use_distance(u.unit, 0))

    def warm_next_step(self, phase: str | None = None) -> None:
        """The parameters are final (after the optimizer step, after an evaluation forward): start
        moving the shards the next step of ``phase`` (default: the last step's ``then``, else its
        phase) uses first towards the device, within the device's in-flight bound, so its first
        units are ready when it starts.

        [Note: warm-up across the step boundary] The executor prefetches nothing past a training
        step's end (the optimizer is about to change those bytes), and between steps no hook gives
        it a planning point, so without this the first unit of every step is a demand fetch. After
        an evaluation forward this only completes what the executor began during its last units
        ([Note: predicting past an evaluation step] in infinity/prefetch/_trace.py): the next step
        follows at once, with no compute left to hide reads started here. Only shard copies are
        fetched here, never gathered: the store keeps them coherent if anything writes the shards
        before the next step (a checkpoint load), a gathered unit it would not.
        """
        self._warm_handles = [h for h in self._warm_handles if not h.done()]
        phase = phase or self._last_phase
        trace = self.executor.store.latest(phase) if phase else None
        if trace is None:
            return
        room = self.executor.config.device_inflight_budget_bytes
        seen: set[Hashable] = set()
        for entry in trace.entries:
            u = self._units.get(entry.unit)
            if u is None or u.unit in seen:
                continue
            seen.add(u.unit)
            if room is not None and u.shard_bytes > room:
                break
            if self._locate(u.unit) in (Level.DEVICE, Level.GATHERED):
                continue
            try:
                for key in u.keys:
                    self._warm_handles.append(self.store.fetch(key, self._tier_of[Level.DEVICE],
                                                               prefetch=True))
            except TierCapacityError:
                break  # the device is full of copies needed sooner
            self._warm_bytes += u.shard_bytes
            if room is not None:
                room -= u.shard_bytes

    @property
    def unit_ids(self) -> tuple[Hashable, ...]:
        """The units whose shards this prefetcher moves (those in ``units`` at construction)."""
        return tuple(self._units)

    def next_use_given(self, unit: Hashable) -> float | None:
        """The next-use position this prefetcher last gave the store for ``unit``'s shards (the
        store's Belady order: a position in the followed trace, ``math.inf`` for 'not used again',
        None while nothing predicts the step). Read-only; for tests and diagnostics."""
        return self._next_pos.get(unit)

    def has_trace(self, phase: str) -> bool:
        """A step of ``phase`` was recorded."""
        return self.executor.store.latest(phase) is not None

    def drain(self) -> None:
        """Wait for every fetch this prefetcher issued (errors are the next use's to raise)."""
        self.executor.drain()
        for h in self._warm_handles:
            try:
                h.wait()
            except Exception as exc:  # noqa: BLE001 - a failed warm-up fetch fails again on use
                logger.debug("warm-up fetch %r failed: %s", h, exc)
        self._warm_handles = []

    # ---- per unit --------------------------------------------------------------------------------
    def before_compute(self, unit: Hashable) -> None:
        """Follow the trace, make ``unit`` gathered (prefetched or on demand), plan ahead."""
        if not self.executor.in_step:
            self.begin_step("train")
        self._report_evictions()
        self.executor.pre_hook(unit).wait()
        self._refresh_next_use(full=False, unit=unit)

    def should_keep(self, unit: Hashable) -> bool:
        """Keep ``unit`` gathered after its compute: the trace says it comes back within the reuse
        distance and the gathered budget still fits what runs in between."""
        if not self.executor.in_step:
            return False  # between steps nothing is kept ([Note: stale gathered units])
        return self.executor.keep_gathered(unit)

    def on_release(self, unit: Hashable) -> None:
        """The manager released ``unit``'s gathered buffers."""
        spec = self._units.get(unit)
        if spec is not None:
            self.executor.on_evicted(unit, spec.gathered_bytes, Level.GATHERED)

    def after_compute(self, unit: Hashable) -> None:
        """``unit``'s compute finished (after the release decision): record its time, plan ahead."""
        if not self.executor.in_step:
            return
        self._report_evictions()
        self.executor.post_hook(unit)

    # ---- executor callbacks ------------------------------------------------------------------------
    def _issue(self, action: FetchAction) -> Any:
        u = self._units[action.unit]
        t0 = self._clock()
        if action.dst is Level.GATHERED:  # [Note: synchronous all-gathers]
            self._gather(action.unit)
            return _Done(self._clock() - t0)
        tier, dst = self._tier_of[action.dst], action.dst
        handles = [self.store.fetch(key, tier, prefetch=not action.demand) for key in u.keys]
        return _Fetch(handles, t0, self._clock,
                      lambda: self._cached.setdefault(u.unit, set()).add(dst))

    def _locate(self, unit: Hashable) -> Level:
        if self._is_gathered(unit):
            return Level.GATHERED
        u = self._units[unit]
        level = Level.DEVICE
        for key in u.keys:
            if self.store.state(key, self._tier_of[Level.DEVICE]) in _VALID:
                continue
            if u.home is Level.HOST or self.store.state(key, Tier.HOST) in _VALID:
                level = Level.HOST
            else:
                return Level.NVME
        return level

    def _free_bytes(self, level: Level) -> int | None:
        if level is Level.GATHERED:
            if self._gathered_budget is None:
                return None
            held = sum(u.gathered_bytes for u in self._units.values() if self._is_gathered(u.unit))
            return self._gathered_budget - held
        if level not in self._sole_cache:
            return None  # other copies the store may evict are there: their next use is unknown
        # [Note: prefetch never displaces a sooner use] in infinity/prefetch/_planner.py: the free bytes here,
        # our evictable copies in _evictable; the planner takes only those used after the fetch.
        tier = self._tier_of[level]
        return self.store.budget_bytes(tier) - self.store.used_bytes(tier)


    def _evictable(self, level: Level) -> list[tuple[float, int]]:
        """Our shards' copies at ``level`` the store may evict, with the next use we gave it.
        Gathered units are released by the manager alone (after their compute, or at the step's
        end), never to make room for a prefetch: none at GATHERED."""
        if level is Level.GATHERED:
            return []
        tier, out = self._tier_of[level], []
        for u in self._units.values():
            home = Tier.HOST if u.home is Level.HOST else Tier.NVME
            if home is tier or not all(self.store.state(k, tier) is Residency.RESIDENT for k in u.keys):
                continue
            pos = self._next_pos.get(u.unit)
            out.append((math.inf if pos is None else pos, u.shard_bytes))
        return out

    def _levels_only_we_cache(self) -> set[Level]:
        """HOST/DEVICE levels where no other shard of the store has a copy the store could evict
        (a copy above a valid lower one): there our copies and the free bytes are the whole room."""
        levels = {Level.HOST, Level.DEVICE}
        lower = {Tier.DEVICE: (Tier.HOST, Tier.NVME), Tier.HOST: (Tier.NVME,)}
        for key in self.store.keys():
            if key in self._keys or not levels:
                continue
            for level in list(levels):
                tier = self._tier_of[level]
                if self.store.state(key, tier) is not Residency.ABSENT and any(
                        self.store.state(key, t) is not Residency.ABSENT for t in lower[tier]):
                    levels.discard(level)
        return levels

    # ---- eviction feedback ---------------------------------------------------------------------------
    def _report_evictions(self) -> None:
        """The store evicts on its own (budgets, stale copies after an optimizer write): tell the
        executor, which counts prefetched bytes evicted before use."""
        for unit, levels in list(self._cached.items()):
            u = self._units[unit]
            for level in list(levels):
                tier = self._tier_of[level]
                if all(self.store.state(k, tier) in _VALID for k in u.keys):
                    continue
                levels.discard(level)
                self.executor.on_evicted(unit, u.shard_bytes, level)
            if not levels:
                del self._cached[unit]

    def _set_next_use(self, u: PrefetchUnit, position: float | None) -> None:
        self._next_pos[u.unit] = position
        for key in u.keys:
            self.store.set_next_use(key, position)

    def _refresh_next_use(self, *, full: bool, unit: Hashable = None) -> None:
        """Give the store each unit's next use as a position in the followed trace (Belady); None
        while nothing predicts the step (the store falls back to LRU). Positions stay comparable
        while the cursor moves one entry at a time, so then only the running unit changes."""
        ex = self.executor
        cursor = ex.cursor
        d = ex.next_use_distance(unit) if unit is not None else None
        synced = d is not None
        if full or cursor != self._last_cursor + 1 or synced != self._last_synced:
            targets = list(self._units.values())
        else:
            targets = [self._units[unit]]
        for u in targets:
            dist = ex.next_use_distance(u.unit, cursor)
            self._set_next_use(u, None if dist is None else (math.inf if math.isinf(dist) else cursor + dist))
        self._last_cursor, self._last_synced = cursor, synced

    # ---- counters ------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The executor's counters (see :mod:`infinity.prefetch`) plus the short names the engine
        reports: ``hits`` (gathered when needed: prefetched or kept), ``late`` (prefetched, not
        gathered yet: a hop in flight, or landed with the all-gather left to the use), ``misses``
        (nothing prefetched: demand fetches), ``evicted_unused_bytes`` (prefetched, then
        evicted or released before use), ``hit_rate`` = hits / needs, ``stall_s`` per hop source
        (``NVME``: swap-in, ``HOST``: host->device, ``DEVICE``: all-gather)."""
        s = self.executor.stats()
        s["hits"] = s["prefetch_hits"] + s["resident_hits"]
        s["late"] = s["prefetch_late"]
        s["misses"] = s["demand_misses"]
        s["evicted_unused_bytes"] = s["prefetched_evicted_unused_bytes"]
        s["warm_bytes_issued"] = self._warm_bytes
        s["enabled"] = True
        return s


def _drain_before_pools_stop(fetcher: ParamPrefetcher) -> None:
    """[Note: drain before the pools stop] A prefetch may still be in flight when the interpreter
    exits. Its completion runs on the store's thread pool, which ``concurrent.futures`` shuts down
    at interpreter exit before ordinary ``atexit`` handlers (and the engine's finalizer) run: the
    move would never complete and closing the store would wait for it forever. Threading's own
    exit hooks run in reverse order of registration, before that shutdown, so one registered here
    (after the store imported ``concurrent.futures``) drains our fetches first."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return
    ref = weakref.ref(fetcher)

    def drain() -> None:
        f = ref()
        if f is not None:
            try:
                f.drain()
            except Exception as exc:  # noqa: BLE001 - exiting: never turn this into a hang or a crash
                logger.warning("draining parameter prefetches at exit failed: %s", exc)

    try:
        register(drain)
    except RuntimeError:  # the interpreter is already shutting down
        pass


def disabled_stats() -> dict[str, Any]:
    """The keys of :meth:`ParamPrefetcher.stats` when no prefetcher runs (nothing offloaded)."""
    return {"enabled": False, "needs": 0, "hits": 0, "prefetch_hits": 0, "resident_hits": 0, "late": 0,
            "misses": 0, "hit_rate": None, "evicted_unused_bytes": 0,
            "stall_s": {"NVME": 0.0, "HOST": 0.0, "DEVICE": 0.0}, "stall_s_total": 0.0}
