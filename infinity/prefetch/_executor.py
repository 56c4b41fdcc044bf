"""Trace-driven prefetch: a small executor with in-flight byte bounds around a pure planner.

This module knows no tiers: it plans over the rungs ``Level.NVME -> HOST -> DEVICE -> GATHERED``
(see :class:`~infinity.prefetch._trace.Level`) with the pure planner of :mod:`._planner`, and
issues fetches through callbacks the parameter manager's prefetcher
(:mod:`infinity.zero._prefetcher`) supplies; the tiered store does the moves and owns the memory.

Public API (exported by :mod:`infinity.prefetch`)
-------------------------------------------------
``Level``, ``Trace``, ``TraceEntry``, ``TraceStore`` come from :mod:`._trace`; ``Bandwidths``,
``FetchAction``, ``FetchQuery`` and ``plan_fetches(query) -> list[FetchAction]`` (the pure
planner) from :mod:`._planner`.

``PrefetchConfig(*, host_inflight_budget_bytes=None, device_inflight_budget_bytes=None,
gathered_inflight_budget_bytes=None, lookahead_bytes=None, nvme_to_host_bytes_per_s=2e9,
host_to_device_bytes_per_s=8e9, all_gather_bytes_per_s=8e9, bandwidth_ema_weight=0.3,
transfer_time_safety_factor=1.25, resync_window_entries=64, max_trace_variants=4,
max_reuse_distance_bytes=0, max_plan_entries=4096, gather_lead_entries=None)`` (see the class for
each field; set ``gather_lead_entries`` when the world size is above 1)

``UnitSizes(*, unit, shard_bytes, gathered_bytes, home)``

``PrefetchExecutor(*, issue, config=PrefetchConfig(), locate=None, free_bytes=None,
evictable=None, clock=time.perf_counter, store=None)``
    ``issue(action) -> handle`` (``wait()``, ``done()``; ``settle()`` where the handle has one:
    completes the hop without what ``wait()`` adds for a reader, such as a CUDA stream wait;
    optional float ``elapsed_s`` once done feeds the bandwidth EMA); ``locate(unit) -> level``
    the nearest level where the store holds the unit now (else the executor's own bookkeeping,
    fed by completions and ``on_evicted``, is used);
    ``free_bytes(level) -> int | None`` bytes a new copy may take at that level without evicting
    anything needed sooner (a Belady store: free bytes plus copies whose next use is later than the
    fetch's; None: no limit known). ``evictable(level) -> [(next_use_position, nbytes), ...]`` the
    copies the store may evict at a level whose ``free_bytes`` is known, positions in the followed
    trace: a prefetch may take those used after it, never one used sooner ([Note: prefetch never
    displaces a sooner use] in infinity/prefetch/_planner.py). The executor bounds bytes in flight per destination itself.
    Methods: ``register_unit(spec)``, ``begin_step(phase="train", *, then=None)``,
    ``pre_hook(unit) -> handle``, ``post_hook(unit)``, ``end_step() -> Trace | None``,
    ``need(unit) -> handle``, ``poll()``, ``on_evicted(unit, nbytes, level=None)``,
    ``next_use_distance(unit, cursor=None) -> float | None``, ``next_use_s(unit, cursor=None) ->
    float | None``, ``keep_gathered(unit, *, free_bytes=None, cursor=None) -> bool``, property
    ``cursor``, ``observe_transfer(src, dst, nbytes, seconds)``, ``drain()``, ``stats() -> dict``.

``stats()`` keys: ``needs`` (need() calls), ``prefetch_hits`` (gathered by a prefetch not yet used),
``resident_hits`` (already gathered otherwise, e.g. kept gathered), ``prefetch_late`` (prefetched,
not gathered yet at need(): a hop in flight, waited, or landed with the all-gather left to need();
[Note: a need is classified before the reap]), ``demand_misses`` (nothing prefetched: demand
fetch), ``hit_rate``
((prefetch_hits + resident_hits) / needs), ``prefetches_issued``, ``prefetch_bytes_issued``,
``demand_bytes_issued``, ``prefetch_refused`` (issue raised ``TierCapacityError``),
``prefetched_evicted_unused_bytes``, ``stall_s`` (dict: seconds waited in need() on hops out of
``NVME`` (swap-in), ``HOST`` (host->device) and ``DEVICE`` (all-gather)), ``stall_s_total``,
``max_inflight_bytes`` (dict per destination level: high-water mark), ``trace_divergences``
(synced -> unpredictable), ``trace_resyncs``, ``trace_repeats``, ``units_unpredicted``,
``trace_commits``, ``trace_variants_added``, ``steps``, ``bandwidth_bytes_per_s`` (dict).

Wiring (the parameter manager), per unit U: ``pre_hook(U)`` returns once U is gathered; after U's compute
``keep = keep_gathered(U)``; if not keep, release U in the store and call ``on_evicted(U, bytes,
Level.GATHERED)``; then ``post_hook(U)`` (it plans with U's release already known). Every eviction
the store makes is reported with ``on_evicted``. ``begin_step(phase)`` before a step's first unit,
``end_step()`` after its last and before the optimizer step (nothing past a step's recorded end is
prefetched: the optimizer is about to change those bytes). With several ranks, all-gathers are
issued at fixed positions when ``gather_lead_entries`` is set ([Note: all-gathers at fixed
positions]; without it they are only kept in trace order, which is not enough when ranks time
differently and units are skipped); the store must release gathered units only as the parameter manager
decides, and keep_gathered must decide alike on all ranks, so keep ``max_reuse_distance_bytes``
byte-based (the default; None is time-based) and give it rank-symmetric ``free_bytes``.

Threading: every method is called from the training thread; handles may complete on I/O threads
(the executor only calls their ``done()``/``wait()``). ``stats()`` may be called from any thread.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Protocol

from infinity._common import warn_once
from infinity._timing import EventTimer, WallTimer, apply_unit_times, fill_unknown_times
from infinity.errors import TierCapacityError
from infinity.prefetch._config import PrefetchConfig, UnitSizes
from infinity.prefetch._planner import (Bandwidths, FetchAction, FetchQuery, Hop, hop_chain,
                                        plan_fetches)
from infinity.prefetch._trace import (Follow, Level, Trace, TraceEntry, TraceFollower,
                                      TraceRecorder, TraceStore, as_level)

logger = logging.getLogger(__name__)

__all__ = ["PrefetchConfig", "PrefetchExecutor", "UnitSizes"]


class Handle(Protocol):
    def wait(self) -> Any: ...
    def done(self) -> bool: ...


class _Ready:
    """The handle need() returns for a unit that was already gathered."""

    def wait(self) -> None:
        return None

    def done(self) -> bool:
        return True


_READY = _Ready()


@dataclass
class _Flight:
    action: FetchAction
    handle: Handle
    issued_s: float
    prefetch: bool


class _LevelView(Mapping):
    """The executor's view of each unit's level, handed to the planner without copying."""

    def __init__(self, ex: "PrefetchExecutor"):
        self._ex = ex

    def __getitem__(self, unit: Hashable) -> Level:
        return self._ex._level(unit)

    def get(self, unit: Hashable, default: Any = None) -> Any:
        return self._ex._level(unit, default)

    def __iter__(self):
        return iter(self._ex._specs)

    def __len__(self) -> int:
        return len(self._ex._specs)


_FAST = (Level.HOST, Level.DEVICE, Level.GATHERED)


class PrefetchExecutor:
    """Follows the trace at each hook, issues planned hops, and serves need() (see the module doc)."""

    def __init__(self, *, issue: Callable[[FetchAction], Handle], config: PrefetchConfig | None = None,
                 locate: Callable[[Hashable], Level | str] | None = None,
                 free_bytes: Callable[[Level], int | None] | None = None,
                 evictable: Callable[[Level], list[tuple[float, int]]] | None = None,
                 clock: Callable[[], float] = time.perf_counter, store: TraceStore | None = None,
                 unit_timer: WallTimer | EventTimer | None = None):
        cfg = config or PrefetchConfig()
        self._unit_timer = unit_timer
        """GPU: event pairs around each unit's compute, whose times replace the clock's in the
        recorded trace ([Note: timing asynchronous GPU work] in infinity/_timing.py); None: the
        clock's times stand (CPU: the work is synchronous)."""
        self.config = cfg
        self._issue_fn = issue
        self._locate = locate  # the store's truth about residency, when it offers one
        self._free_fn = free_bytes
        self._evictable_fn = evictable
        self._clock = clock
        self.bandwidth = Bandwidths({
            (Level.NVME, Level.HOST): cfg.nvme_to_host_bytes_per_s,
            (Level.HOST, Level.DEVICE): cfg.host_to_device_bytes_per_s,
            (Level.DEVICE, Level.GATHERED): cfg.all_gather_bytes_per_s}, ema_weight=cfg.bandwidth_ema_weight)
        self.store = store or TraceStore(max_variants=cfg.max_trace_variants)
        self._follower = TraceFollower(self.store, window_entries=cfg.resync_window_entries)
        self._recorder: TraceRecorder | None = None  # the open step's recording; None between steps
        self._specs: dict[Hashable, UnitSizes] = {}
        self._present: dict[Hashable, set[Level]] = {}  # levels fetched and not reported evicted
        self._inflight: dict[Hashable, _Flight] = {}  # at most one hop per unit (hops are dependent)
        self._inflight_bytes = {lvl: 0 for lvl in _FAST}
        self._budget = {Level.HOST: cfg.host_inflight_budget_bytes,
                        Level.DEVICE: cfg.device_inflight_budget_bytes,
                        Level.GATHERED: cfg.gathered_inflight_budget_bytes}
        self._unused: dict[Hashable, set[Level]] = {}  # levels a prefetch filled that no need() used yet
        self._current: TraceEntry | None = None  # expected times of the running unit
        self._expect_post = True  # False once pre-hooks arrive without post-hooks: plan at pres only
        self._open_unit: Hashable | None = None
        self._lock = threading.Lock()  # counters are read by stats() from any thread
        self._c: dict[str, float] = dict.fromkeys(
            ("needs", "prefetch_hits", "resident_hits", "prefetch_late", "demand_misses",
             "prefetches_issued", "prefetch_bytes_issued", "demand_bytes_issued", "prefetch_refused",
             "prefetched_evicted_unused_bytes", "trace_divergences", "trace_resyncs", "trace_repeats",
             "units_unpredicted", "steps"), 0)
        self._stall_s = {lvl: 0.0 for lvl in (Level.NVME, Level.HOST, Level.DEVICE)}
        self._max_inflight = {lvl: 0 for lvl in _FAST}

    # ---- units and residency -------------------------------------------------------------------
    def register_unit(self, spec: UnitSizes) -> None:
        self._specs[spec.unit] = spec

    def _spec(self, unit: Hashable) -> UnitSizes:
        try:
            return self._specs[unit]
        except KeyError:
            raise ValueError(f"unit {unit!r} was never registered; call register_unit(UnitSizes(...)) "
                             f"for every unit before its first hook") from None

    def _level(self, unit: Hashable, default: Any = None) -> Any:
        spec = self._specs.get(unit)
        if spec is None:
            return default
        if self._locate is not None:
            lvl = self._locate(unit)
            return lvl if isinstance(lvl, Level) else as_level(lvl)
        return max({spec.home, *self._present.get(unit, ())}, key=lambda lvl: lvl.rank)

    def on_evicted(self, unit: Hashable, nbytes: int, level: Level | str | None = None) -> None:
        """The store dropped the unit's copy at ``level`` (None: every cached copy; GATHERED: released)."""
        self._reap()  # a landed prefetch may not be booked yet
        levels = set(self._present.get(unit, ())) if level is None else {as_level(level)}
        present = self._present.get(unit, set())
        present -= levels
        unused = self._unused.get(unit, set())
        if unused & levels:
            unused -= levels
            self._count("prefetched_evicted_unused_bytes", nbytes)

    # ---- issuing and completing hops -----------------------------------------------------------
    def _count(self, key: str, amount: float = 1) -> None:
        with self._lock:
            self._c[key] += amount

    def _start(self, action: FetchAction, *, prefetch: bool) -> _Flight:
        handle = self._issue_fn(action)
        fl = _Flight(action, handle, self._clock(), prefetch)
        self._inflight[action.unit] = fl
        self._inflight_bytes[action.dst] += action.nbytes
        with self._lock:
            self._max_inflight[action.dst] = max(self._max_inflight[action.dst],
                                                 self._inflight_bytes[action.dst])
            kind = "prefetch" if prefetch else "demand"
            self._c[f"{kind}_bytes_issued"] += action.nbytes
            self._c["prefetches_issued"] += int(prefetch)
        return fl

    def _complete(self, fl: _Flight) -> None:
        a = fl.action
        if self._inflight.get(a.unit) is not fl:
            return  # already completed by a nested call (the store reported an eviction inside wait())
        # Forget the flight before wait(): an I/O error raised there must not leave it counted.
        del self._inflight[a.unit]
        self._inflight_bytes[a.dst] -= a.nbytes
        # Settled, not waited for: a reader's stream waits for a device copy where it reads the
        # shard, not here at whichever hook reaps the hop (at best one unit of overlap).
        settle = getattr(fl.handle, "settle", None)
        (settle or fl.handle.wait)()
        self._present.setdefault(a.unit, set()).add(a.dst)
        unused = self._unused.setdefault(a.unit, set())
        unused.discard(a.src)  # the hop consumed the copy below: evicting it later wastes nothing
        if fl.prefetch:
            unused.add(a.dst)
        elapsed_s = getattr(fl.handle, "elapsed_s", None)
        if isinstance(elapsed_s, (int, float)):
            self.bandwidth.observe(a.src, a.dst, a.nbytes, float(elapsed_s))

    def _wait(self, fl: _Flight) -> None:
        t0 = self._clock()
        self._complete(fl)
        with self._lock:
            self._stall_s[fl.action.src] += max(0.0, self._clock() - t0)

    def _reap(self) -> None:
        for fl in [f for f in self._inflight.values() if f.handle.done()]:
            self._complete(fl)

    def _make_room(self, dst: Level, nbytes: int) -> None:
        """Demand first: wait for the oldest hops into ``dst`` until ``nbytes`` fit its bound."""
        budget = self._budget[dst]
        while budget is not None and self._inflight_bytes[dst] + nbytes > budget:
            oldest = next((f for f in self._inflight.values() if f.action.dst is dst), None)
            if oldest is None:
                warn_once(f"prefetch.inflight_budget.{dst.value}",
                          f"a {nbytes}-byte fetch into {dst.value} exceeds its in-flight bound of {budget} "
                          f"bytes; issuing it alone. Raise prefetch.{dst.value.lower()}_inflight_budget_bytes.")
                return
            self._wait(oldest)

    def observe_transfer(self, src: Level | str, dst: Level | str, nbytes: int, seconds: float) -> None:
        """Feed a transfer time measured by the caller into the bandwidth EMA."""
        self.bandwidth.observe(src, dst, nbytes, seconds)

    # ---- need ----------------------------------------------------------------------------------
    def need(self, unit: Hashable) -> Handle:
        """Make ``unit`` gathered; returns a completed handle. Counts hit, late or miss.

        [Note: a need is classified before the reap] Whether a prefetch was issued for this use is
        read before ``_reap`` books what landed: a hop that completed on an I/O thread after the
        last planning point (so its all-gather was left to this call) is late, like one still in
        flight, never a demand miss. Reaping first made the count depend on which thread won the
        race, and counted the better outcome (the bytes had landed) as the worse one.
        """
        self._spec(unit)
        prefetched = unit in self._inflight or bool(self._unused.get(unit))
        self._reap()
        fl = self._inflight.get(unit)
        level = self._level(unit)
        if fl is not None:
            outcome = "prefetch_late"
        elif level is Level.GATHERED:
            outcome = "prefetch_hits" if Level.GATHERED in self._unused.get(unit, ()) else "resident_hits"
        elif prefetched:
            outcome = "prefetch_late"  # its hops landed, the all-gather is still to do
        else:
            outcome = "demand_misses"
        handle = self._bring_up(unit, Level.GATHERED)
        self._unused.pop(unit, None)
        with self._lock:
            self._c["needs"] += 1
            self._c[outcome] += 1
        return handle

    def _bring_up(self, unit: Hashable, target: Level, *, last_hop_prefetch: bool = False) -> Handle:
        """Wait for the unit's hop in flight, then issue and wait for hops until it reaches ``target``.

        Demand hops take their destination's in-flight room first (waiting for older hops); the last
        hop is left in flight instead when ``last_hop_prefetch`` (the fixed-position all-gathers).
        """
        spec, handle = self._specs[unit], None
        fl = self._inflight.get(unit)
        if fl is not None:
            handle = fl.handle
            self._wait(fl)
        level = self._level(unit)
        while level.rank < target.rank:
            dst = level.up()
            nbytes = spec.gathered_bytes if level is Level.DEVICE else spec.shard_bytes
            last = dst is target and last_hop_prefetch
            action = FetchAction(unit=unit, src=level, dst=dst, nbytes=nbytes,
                                 position=max(0, self._follower.cursor - 1), needed_in_s=0.0, demand=not last)
            if not last:
                self._make_room(dst, nbytes)
            fl = self._start(action, prefetch=last)
            handle = fl.handle
            if last:
                break
            self._wait(fl)
            level = dst  # the hop completed; trust it even if locate() lags
        return handle if handle is not None else _READY

    def _issue_fixed_gathers(self, trace: Trace, cursor: int) -> None:
        """[Note: all-gathers at fixed positions] An all-gather is a collective: every rank must issue
        the same ones in the same order, or ranks hang or pair the wrong buffers. Timing differs per
        rank, so with ``gather_lead_entries = k`` the all-gathers of the next k entries are issued at
        each hook, whatever has landed: a shard not yet on the device is waited for (a stall, counted).
        Which entries those are depends only on the executed units and the trace's units, which are
        the same on every rank, and so do releases when keep_gathered is byte-based.
        """
        seen: set[Hashable] = set()
        for j in range(cursor, min(trace.step_end, cursor + (self.config.gather_lead_entries or 0))):
            u = trace[j].unit
            if u in seen or u not in self._specs:
                continue
            seen.add(u)
            fl = self._inflight.get(u)
            if fl is not None and fl.action.dst is Level.GATHERED:
                continue
            if fl is None and self._level(u) is Level.GATHERED:
                continue
            self._bring_up(u, Level.GATHERED, last_hop_prefetch=True)

    # ---- planning ------------------------------------------------------------------------------
    def _link_busy_s(self, now_s: float) -> dict[Hop, float]:
        end: dict[Hop, float] = {}
        for fl in self._inflight.values():  # insertion order = issue order: FIFO per link
            a = fl.action
            hop = (a.src, a.dst)
            dur = self.config.transfer_time_safety_factor * self.bandwidth.transfer_s(a.src, a.dst, a.nbytes)
            end[hop] = max(end.get(hop, -math.inf), fl.issued_s) + dur
        return {hop: max(0.0, e - now_s) for hop, e in end.items()}

    def _prefetch(self, *, time_to_cursor_s: float, next_plan_in_s: float) -> None:
        view = self._follower.view()
        if view is None:
            return
        trace, cursor = view
        cfg = self.config
        lookahead = None
        if cfg.lookahead_bytes is not None:
            used = sum(f.action.nbytes for f in self._inflight.values() if f.prefetch)
            lookahead = max(0, cfg.lookahead_bytes - used)
        room = {lvl: (None if b is None else b - self._inflight_bytes[lvl]) for lvl, b in self._budget.items()}
        free = {lvl: self._free_fn(lvl) for lvl in _FAST} if self._free_fn is not None else {}
        evictable = ({lvl: self._evictable_fn(lvl) for lvl, f in free.items() if f is not None}
                     if self._evictable_fn is not None else {})
        req = FetchQuery(trace=trace, cursor=cursor, time_to_cursor_s=time_to_cursor_s,
                          next_plan_in_s=next_plan_in_s, levels=_LevelView(self),
                          inflight={u: f.action.dst for u, f in self._inflight.items()},
                          bandwidth=self.bandwidth, link_busy_s=self._link_busy_s(self._clock()),
                          free_bytes=free, evictable=evictable, inflight_free_bytes=room,
                          lookahead_bytes=lookahead,
                          safety_factor=cfg.transfer_time_safety_factor, max_entries=cfg.max_plan_entries,
                          plans_at_post=self._expect_post, gather_lead_entries=cfg.gather_lead_entries)
        for action in plan_fetches(req):
            if action.unit not in self._specs or action.unit in self._inflight:
                continue
            budget = self._budget[action.dst]
            if action.demand:
                self._make_room(action.dst, action.nbytes)  # needed now: wait for room, as need() would
            elif budget is not None and self._inflight_bytes[action.dst] + action.nbytes > budget:
                continue  # a prefetch that does not fit waits for a later planning point
            try:
                self._start(action, prefetch=True)
            except TierCapacityError as exc:  # the store is full of nearer units: not an error
                self._count("prefetch_refused")
                logger.debug("prefetch of %r refused: %s", action.unit, exc)
        if cfg.gather_lead_entries is not None:
            self._issue_fixed_gathers(trace, cursor)

    def poll(self) -> None:
        """Reap completed hops and issue what is due; cheap enough to call between hooks."""
        self._reap()
        cur = self._current
        if cur is not None:
            self._prefetch(time_to_cursor_s=cur.gap_s, next_plan_in_s=cur.gap_s)

    # ---- hooks and steps -----------------------------------------------------------------------
    @property
    def in_step(self) -> bool:
        """A step is open: :meth:`begin_step` ran (or a hook opened one) and :meth:`end_step` did
        not yet. The step's recording is the one owner of "inside a step"; the prefetcher above
        asks here."""
        return self._recorder is not None

    @property
    def phase(self) -> str | None:
        """The open step's phase; None between steps."""
        return None if self._recorder is None else self._recorder.phase

    @property
    def then(self) -> str | None:
        """The open step's guess of the next step's phase, where it leaves the parameters as they
        are ([Note: predicting past an evaluation step] in infinity/prefetch/_trace.py); None
        between steps or when it changes them."""
        return None if self._recorder is None else self._follower.then

    def begin_step(self, phase: str = "train", *, then: str | None = None) -> None:
        """Start following and recording a step of ``phase`` (an open step is ended first).
        ``then``: the step leaves the parameters as they are and the next one most likely has phase
        ``then``: plan into its first units ([Note: predicting past an evaluation step] in
        infinity/prefetch/_trace.py)."""
        if self._recorder is not None:
            self.end_step()
        self._follower.begin(phase, then=then)
        self._recorder = TraceRecorder(phase)
        self._current, self._open_unit = None, None
        self._reap()
        self._prefetch(time_to_cursor_s=0.0, next_plan_in_s=0.0)

    def pre_hook(self, unit: Hashable) -> Handle:
        """Unit ``unit`` is about to run: follow the trace, need() it, plan ahead. Returns need()'s handle."""
        pre_s = self._clock()
        if self._recorder is None:
            self.begin_step(self._follower.phase)
        if self._open_unit is not None:
            self._expect_post = False  # the previous unit got no post-hook: plan at pre-hooks only
        was_synced = self._follower.synced
        follow = self._follower.advance(unit)
        self._count_follow(follow, was_synced)
        handle = self.need(unit)
        spec = self._specs[unit]
        template = TraceEntry(unit=unit, shard_bytes=spec.shard_bytes, gathered_bytes=spec.gathered_bytes,
                              home=spec.home)
        start_s = self._clock()
        if self._unit_timer is not None:
            self._unit_timer.start()
        self._recorder.on_pre(template, start_s=start_s, pre_s=pre_s)
        self._open_unit = unit
        self._current = self._expected_entry(unit) or template
        cur = self._current
        self._prefetch(time_to_cursor_s=cur.duration_s,
                       next_plan_in_s=cur.compute_s if self._expect_post else cur.duration_s)
        return handle

    def _count_follow(self, follow: Follow, was_synced: bool) -> None:
        with self._lock:
            if follow is Follow.REPEAT:
                self._c["trace_repeats"] += 1
            elif follow is Follow.RESYNC:
                self._c["trace_resyncs"] += 1
                self._c["trace_divergences"] += int(was_synced)
            elif follow in (Follow.DIVERGED, Follow.UNTRACED):
                self._c["units_unpredicted"] += 1
                self._c["trace_divergences"] += int(was_synced)

    def _expected_entry(self, unit: Hashable) -> TraceEntry | None:
        f = self._follower
        t = f.trace if f.synced else None
        if t is not None and 0 < f.cursor <= len(t) and t[f.cursor - 1].unit == unit:
            return t[f.cursor - 1]
        return self.store.successor_entry(unit)

    def post_hook(self, unit: Hashable) -> None:
        """Unit ``unit`` finished its compute: record its time and plan ahead."""
        if self._recorder is not None:
            self._recorder.on_post(unit, now_s=self._clock())
            if self._unit_timer is not None:
                self._unit_timer.stop(unit)
        if self._open_unit == unit:
            self._open_unit = None
            self._expect_post = True
        self.poll()

    def end_step(self) -> Trace | None:
        """Commit the step's recording (it replaces the most similar trace of its phase)."""
        if self._recorder is None:
            return None
        rec, self._recorder = self._recorder, None
        entries = rec.finish()
        if self._unit_timer is not None:  # GPU times of the units whose work has completed
            timer = self._unit_timer
            # The backward's units are still running on the GPU: their times come from the
            # previous step's, carried over and read now, rather than from the launch clock.
            measured = fill_unknown_times(timer.take(), timer.take_carried())
            entries = apply_unit_times(entries, measured)
        trace = self.store.commit(rec.phase, entries)
        self._current, self._open_unit = None, None
        self._count("steps")
        return trace

    def drain(self) -> None:
        """Wait for every hop in flight (not counted as stall)."""
        for fl in list(self._inflight.values()):
            self._complete(fl)

    # ---- eviction advice -----------------------------------------------------------------------
    def _synced_trace(self) -> Trace | None:
        f = self._follower
        return f.trace if f.synced else None

    @property
    def cursor(self) -> int:
        """Position in the followed trace of the next unit expected to start."""
        return self._follower.cursor

    def next_use_distance(self, unit: Hashable, cursor: int | None = None) -> float | None:
        """Trace entries from ``cursor`` (default: now) until ``unit`` is used again (``inf``: not
        this step, nor the next one when the step was begun with ``then``); None while no trace
        predicts the step: the store falls back to LRU."""
        t = self._follower.horizon()
        return None if t is None else t.next_use_distance(unit, self.cursor if cursor is None else cursor)

    def next_use_s(self, unit: Hashable, cursor: int | None = None) -> float | None:
        """Recorded seconds from ``cursor`` (default: now) until ``unit`` is used again; None: no trace."""
        t = self._follower.horizon()
        return None if t is None else t.next_use_s(unit, self.cursor if cursor is None else cursor)

    def keep_gathered(self, unit: Hashable, *, free_bytes: int | None = None,
                      cursor: int | None = None) -> bool:
        """Whether to keep ``unit`` gathered after its compute instead of releasing it.

        Yes when the trace says it comes back soon (within ``max_reuse_distance_bytes`` of other
        units' gathered bytes, or, when that is None, sooner than re-fetching it from home would
        take) and the budget allows: with it kept, the largest unit that must be gathered before it
        comes back still fits ``free_bytes`` (the GATHERED level's free bytes as the store counts them
        now, this unit included; default: the ``free_bytes`` callback; None: no limit).
        """
        t, spec = self._synced_trace(), self._specs.get(unit)
        if t is None or spec is None:
            return False
        cursor = self.cursor if cursor is None else cursor
        p = t.next_use(unit, cursor)
        if p is None:
            return False
        limit = self.config.max_reuse_distance_bytes
        if limit is None:
            entry = TraceEntry(unit=unit, shard_bytes=spec.shard_bytes, gathered_bytes=spec.gathered_bytes,
                               home=spec.home)
            refetch_s = sum(d for _, _, d in hop_chain(entry, spec.home, self.bandwidth, 1.0))
            if t.time_between_s(cursor, p) >= refetch_s:
                return False
        between: dict[Hashable, int] = {}  # other units that run before it comes back
        for i in range(cursor, p):
            e = t[i]
            if e.unit != unit and e.unit not in between:
                between[e.unit] = e.gathered_bytes
                if limit is not None and sum(between.values()) > limit:
                    return False
        if free_bytes is None and self._free_fn is not None:
            free_bytes = self._free_fn(Level.GATHERED)
        if free_bytes is None:
            return True
        to_gather = [b for u, b in between.items()
                     if self._level(u, Level.NVME) is not Level.GATHERED
                     and not (u in self._inflight and self._inflight[u].action.dst is Level.GATHERED)]
        return max(to_gather, default=0) <= free_bytes

    # ---- counters ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters (keys documented in the module docstring); a copy, safe from any thread."""
        with self._lock:
            out: dict[str, Any] = {k: int(v) for k, v in self._c.items()}
            out["stall_s"] = {lvl.value: s for lvl, s in self._stall_s.items()}
            out["max_inflight_bytes"] = {lvl.value: b for lvl, b in self._max_inflight.items()}
        out["stall_s_total"] = sum(out["stall_s"].values())
        hits = out["prefetch_hits"] + out["resident_hits"]
        out["hit_rate"] = hits / out["needs"] if out["needs"] else 0.0
        out["trace_commits"] = self.store.num_commits
        out["trace_variants_added"] = self.store.num_new_variants
        out["bandwidth_bytes_per_s"] = self.bandwidth.as_dict()
        return out
