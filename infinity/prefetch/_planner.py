"""The pure prefetch planner: which hops to issue now, given a trace, where each unit is and budgets.

Plain data in, a list of actions out: no clock, no I/O, no tiers. The executor in
:mod:`._executor` builds a :class:`FetchQuery` at each hook, runs :func:`plan_fetches` and issues
the actions. Levels are the rungs ``Level.NVME -> HOST -> DEVICE -> GATHERED`` of
:class:`~infinity.prefetch._trace.Level`.

Public API
----------
``Bandwidths(initial: Mapping[tuple[Level, Level], float] | None = None, *, ema_weight=0.3)``
    Bytes/s per hop (``(NVME, HOST)``, ``(HOST, DEVICE)``, ``(DEVICE, GATHERED)``; the all-gather
    rate is counted in gathered bytes). ``get(src, dst)``, ``observe(src, dst, nbytes, seconds)``
    (EMA update), ``transfer_s(src, dst, nbytes)``, ``as_dict()``.

``FetchAction(*, unit, src, dst, nbytes, position, needed_in_s, demand=False)``
    One hop of one unit; ``position`` is the trace index of the use it serves.

``FetchQuery(*, trace, cursor, time_to_cursor_s, next_plan_in_s, levels, inflight, bandwidth,
link_busy_s={}, free_bytes={}, evictable={}, inflight_free_bytes={}, lookahead_bytes=None,
safety_factor=1.0, max_entries=4096, plans_at_post=True, gather_lead_entries=None)`` and
``plan_fetches(query) -> list[FetchAction]``
    The pure planner (see :func:`plan_fetches`).

``Hop`` (``tuple[Level, Level]``), ``HOPS`` (the three hops, bottom up) and
``hop_chain(entry, start, bandwidth, safety_factor) -> list[(hop, nbytes, seconds)]`` (the hops that
take ``entry`` from ``start`` to GATHERED; the executor prices a re-fetch with it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping, Sequence

from infinity.prefetch._trace import Level, Trace, TraceEntry, as_level

logger = logging.getLogger(__name__)

__all__ = ["Bandwidths", "FetchAction", "HOPS", "Hop", "FetchQuery", "hop_chain", "plan_fetches"]

Hop = tuple[Level, Level]
HOPS: tuple[Hop, ...] = ((Level.NVME, Level.HOST), (Level.HOST, Level.DEVICE),
                         (Level.DEVICE, Level.GATHERED))


class Bandwidths:
    """Measured bytes/s per hop, smoothed with an exponential moving average."""

    def __init__(self, initial: Mapping[Hop, float] | None = None, *, ema_weight: float = 0.3):
        if not 0.0 < ema_weight <= 1.0:
            raise ValueError(f"ema_weight: expected a number in (0, 1], got {ema_weight!r}")
        self.ema_weight = ema_weight  # weight of a new measurement: ~3 transfers to follow a change
        self._bps: dict[Hop, float] = {h: 1e9 for h in HOPS}
        for (src, dst), bps in (initial or {}).items():
            self._set((as_level(src), as_level(dst)), bps)

    def _set(self, hop: Hop, bps: float) -> None:
        if hop not in self._bps:
            raise ValueError(f"unknown hop {hop[0].value}->{hop[1].value}; expected one of "
                             + ", ".join(f"{a.value}->{b.value}" for a, b in HOPS))
        if not bps > 0:
            raise ValueError(f"bandwidth of {hop[0].value}->{hop[1].value}: expected > 0 bytes/s, got {bps!r}")
        self._bps[hop] = float(bps)

    def get(self, src: Level | str, dst: Level | str) -> float:
        bps = self._bps.get((src, dst))  # fast path: Level members (the planner's hot loop)
        return bps if bps is not None else self._bps[(as_level(src), as_level(dst))]

    def transfer_s(self, src: Level | str, dst: Level | str, nbytes: int) -> float:
        return nbytes / self.get(src, dst)

    def observe(self, src: Level | str, dst: Level | str, nbytes: int, seconds: float) -> None:
        """Fold one measured transfer in; too-small samples (timer noise) are ignored."""
        if nbytes <= 0 or seconds <= 1e-6:
            return
        hop = (as_level(src), as_level(dst))
        old = self._bps[hop]
        self._set(hop, (1.0 - self.ema_weight) * old + self.ema_weight * (nbytes / seconds))

    def as_dict(self) -> dict[str, float]:
        return {f"{a.value}->{b.value}": v for (a, b), v in self._bps.items()}


@dataclass(frozen=True, kw_only=True)
class FetchAction:
    """One hop of one unit, to be issued now."""

    unit: Hashable
    src: Level
    dst: Level
    nbytes: int
    """Bytes the hop adds at ``dst`` (shard bytes; gathered bytes for the all-gather)."""
    position: int
    """Trace index of the use this fetch serves."""
    needed_in_s: float
    """Predicted seconds from now until that use starts (0 or less: needed now)."""
    demand: bool = False
    """Needed now: planned first and regardless of budgets (the executor waits for room)."""


@dataclass(frozen=True, kw_only=True)
class FetchQuery:
    """Everything the planner looks at; plain data, so tests build it by hand."""

    trace: Trace
    """The followed trace; entries from its ``step_end`` on are the next step's (shard hops only)."""
    cursor: int
    """Position of the next entry to start."""
    time_to_cursor_s: float
    """Predicted seconds until that entry starts (the running unit's remaining time)."""
    next_plan_in_s: float
    """Seconds until the planner runs again: a fetch that can start then and still be on time waits."""
    levels: Mapping[Hashable, Level]
    """Nearest level where each unit is resident now (missing: the entry's home)."""
    inflight: Mapping[Hashable, Level]
    """Units with a hop in flight, and that hop's destination."""
    bandwidth: Bandwidths
    link_busy_s: Mapping[Hop, float] = field(default_factory=dict)
    """Seconds of transfers already queued on each hop."""
    free_bytes: Mapping[Level, int | None] = field(default_factory=dict)
    """Bytes new copies may still take per level (missing or None: no limit)."""
    evictable: Mapping[Level, Sequence[tuple[float, int]]] = field(default_factory=dict)
    """Per level with known ``free_bytes``: the copies the store may evict there, as (trace position
    of their next use, bytes). A prefetch for position ``j`` may also take the bytes of those used
    after ``j``, never of one used sooner ([Note: prefetch never displaces a sooner use])."""
    inflight_free_bytes: Mapping[Level, int | None] = field(default_factory=dict)
    """Room under each destination level's in-flight byte bound (missing or None: no bound)."""
    lookahead_bytes: int | None = None
    """Optional cap on the bytes of prefetches (non-demand hops) planned by this call."""
    safety_factor: float = 1.0
    """Transfer times are multiplied by this (> 1 absorbs jitter in measured times)."""
    max_entries: int = 4096
    """Scan at most this many entries past the cursor (bounds the cost of one call)."""
    plans_at_post: bool = True
    """Whether the planner also runs at post-hooks (else only at pre-hooks)."""
    gather_lead_entries: int | None = None
    """Set: all-gathers are not planned here (the executor issues them at fixed positions, see
    [Note: all-gathers at fixed positions] in infinity/prefetch/_executor.py); shard hops aim to land on the device by
    the start of entry ``j - gather_lead_entries``, when entry ``j``'s all-gather is issued."""


def _hop_bytes(e: TraceEntry, src: Level) -> int:
    return e.gathered_bytes if src is Level.DEVICE else e.shard_bytes


def hop_chain(e: TraceEntry, start: Level, bw: Bandwidths, k: float) -> list[tuple[Hop, int, float]]:
    """The hops from ``start`` to GATHERED: (hop, bytes, seconds)."""
    out = []
    lvl = start
    while lvl is not Level.GATHERED:
        nxt = lvl.up()
        nbytes = _hop_bytes(e, lvl)
        out.append(((lvl, nxt), nbytes, k * bw.transfer_s(lvl, nxt, nbytes)))
        lvl = nxt
    return out


class _PlanPoints:
    """When (seconds from now) the planner runs again: the next point, then each later unit's pre-
    and post-hook as recorded. Answers by binary search, so a call costs no per-entry work."""

    def __init__(self, req: FetchQuery):
        self._t, self._lo, self._posts = req.trace, req.cursor, req.plans_at_post
        self._next_s = req.next_plan_in_s
        # Trace time minus this: seconds from now.
        self._offset_s = req.trace.start_s(req.cursor) - req.time_to_cursor_s

    def at_or_after(self, t_s: float) -> float:
        if t_s <= self._next_s:
            return self._next_s
        found = self._t.next_hook_s(t_s + self._offset_s, self._lo, posts=self._posts)
        return t_s if found is None else found - self._offset_s


def _finish_s(chain: list[tuple[Hop, int, float]], t0: float, link_free: Mapping[Hop, float],
              points: _PlanPoints) -> float:
    """When the chain completes if its first hop starts at ``t0``.

    Hops queue FIFO per link, and a later hop starts only at the first planning point after the
    previous one landed (the executor issues hops only when it runs).
    """
    t = t0
    for i, (hop, _, dur) in enumerate(chain):
        if i:
            t = points.at_or_after(t)
        t = max(t, link_free.get(hop, 0.0)) + dur
    return t


class _Room:
    """[Note: prefetch never displaces a sooner use] The store evicts by the trace's next use
    (Belady): a new copy displaces the resident copy used furthest ahead, even one used sooner than
    the new copy itself. A prefetch that displaces a sooner use turns one fetch into two (the
    displaced copy is fetched again, often on demand), which is how a host budget of part of the
    model made the forward read more than the whole model. So, per level, a prefetch for position
    ``j`` fits only in free bytes plus evictable copies whose next use is after ``j``; taking them
    uses the furthest first, as the store will. With budgets unknown (no ``free_bytes``) a level is
    unlimited, as before."""

    def __init__(self, req: FetchQuery):
        self.free = {lvl: v for lvl, v in req.free_bytes.items() if v is not None}
        # ascending next use: the furthest is popped first
        self.evictable = {lvl: sorted(req.evictable.get(lvl, ()), key=lambda c: c[0])
                          for lvl in self.free}

    def fits(self, lvl: Level, nbytes: int, position: int) -> bool:
        free = self.free.get(lvl)
        if free is None or free >= nbytes:
            return True
        for pos, b in reversed(self.evictable[lvl]):
            if pos <= position:
                break
            free += b
            if free >= nbytes:
                return True
        return False

    def take(self, lvl: Level, nbytes: int) -> None:
        if lvl not in self.free:
            return
        self.free[lvl] -= nbytes
        stack = self.evictable[lvl]
        while self.free[lvl] < 0 and stack:  # fits() checked the positions; demand takes any
            self.free[lvl] += stack.pop()[1]


def _fits(free: _Room, room: dict, chain: list[tuple[Hop, int, float]], position: int) -> bool:
    (_, dst), nbytes, _ = chain[0]
    return room.get(dst, nbytes) >= nbytes and all(free.fits(h[1], b, position) for h, b, _ in chain)


def _charge(free: _Room, room: dict, link_free: dict, chain: list[tuple[Hop, int, float]]) -> None:
    """Reserve what a planned unit will use: its bytes at every rung it climbs, its link time."""
    for hop, nbytes, _ in chain:
        free.take(hop[1], nbytes)
    (_, dst), nbytes, _ = chain[0]
    if dst in room:
        room[dst] -= nbytes
    t_done = 0.0
    for hop, _, dur in chain:
        t_done = max(t_done, link_free.get(hop, 0.0)) + dur
        link_free[hop] = t_done


_STOP = object()  # _Planner.consider: nothing later can be planned in this call


class _Planner:
    """The running state of one planning call: budgets left, link queues, blocked levels."""

    def __init__(self, req: FetchQuery):
        self.req, t, bw, k = req, req.trace, req.bandwidth, req.safety_factor
        self.link_free = dict(req.link_busy_s)  # seconds until each hop's queue drains
        self.busiest_s = max(self.link_free.values(), default=0.0)
        self.free = _Room(req)
        self.room = {lvl: v for lvl, v in req.inflight_free_bytes.items() if v is not None}
        self.look = req.lookahead_bytes  # prefetch bytes still allowed by the cap
        self.blocked: set[Level] = set()  # levels no later prefetch may go to (order is kept)
        self.points = _PlanPoints(req)
        max_shard, max_gathered, max_duration_s = t.max_from(req.cursor)
        # Bound on any unit's chain: its transfers plus a wait for a plan point before each later hop.
        self.worst_s = k * (max_shard / bw.get(Level.NVME, Level.HOST)
                            + max_shard / bw.get(Level.HOST, Level.DEVICE)
                            + max_gathered / bw.get(Level.DEVICE, Level.GATHERED)) + 2 * max_duration_s

    def run(self) -> list[FetchAction]:
        req, t = self.req, self.req.trace
        starts_s, entries = t.starts_s, t.entries  # locals: this loop runs at every hook
        base_s = req.time_to_cursor_s - t.start_s(req.cursor)
        seen: set[Hashable] = set()
        actions: list[FetchAction] = []
        lead = req.gather_lead_entries
        for j in range(req.cursor, min(len(t), req.cursor + req.max_entries)):
            e = entries[j]
            if e.unit in seen:
                continue
            seen.add(e.unit)
            if lead is None:
                deadline = base_s + starts_s[j]
            else:  # the shard is due when the all-gather is issued, at entry j - lead
                anchor = j - lead
                deadline = 0.0 if anchor < req.cursor else base_s + starts_s[anchor]
            if deadline - req.next_plan_in_s > self.busiest_s + self.worst_s or len(self.blocked) == 3:
                break  # nothing from here on needs to (or can) start before the next planning point
            got = self.consider(j, e, deadline)
            if got is _STOP:
                break
            if got is not None:
                actions.append(got)
        return actions

    def consider(self, j: int, e: TraceEntry, deadline: float) -> Any:
        """The action for the unit at position ``j``, None to skip it, or _STOP."""
        req, blocked = self.req, self.blocked
        inflight_to = req.inflight.get(e.unit)
        if inflight_to is not None:
            if inflight_to is not Level.GATHERED:
                blocked.add(Level.GATHERED)  # its all-gather is still to come: later ones wait
            return None
        level = req.levels.get(e.unit, e.home)
        if not isinstance(level, Level):
            level = as_level(level)
        if level is Level.GATHERED:
            return None
        # [Note: predicting past an evaluation step] in infinity/prefetch/_trace.py: the next step's
        # units get shard hops only, and none is needed now (the next step starts when it starts).
        next_step = j >= req.trace.step_end
        demand = deadline <= 0.0 and not next_step
        if not demand and level.up() in blocked:
            blocked.add(Level.GATHERED)  # cheap skip: nothing more goes into that level this call
            return None
        chain = hop_chain(e, level, req.bandwidth, req.safety_factor)
        if req.gather_lead_entries is not None or next_step:
            chain = chain[:-1]  # the all-gather is the executor's, at a fixed position, or next step's
            if not chain:
                return None
        (src, dst), nbytes, _ = chain[0]
        if not demand:
            if _finish_s(chain, req.next_plan_in_s, self.link_free, self.points) <= deadline:
                blocked.add(Level.GATHERED)  # it can wait; its all-gather comes later, so later ones wait
                return None
            if dst in blocked or not _fits(self.free, self.room, chain, j):
                blocked.update((dst, Level.GATHERED))
                return None
            if self.look is not None:
                if self.look < nbytes:
                    return _STOP  # the lookahead cap is global: everything later is farther ahead
                self.look -= nbytes
        _charge(self.free, self.room, self.link_free, chain)
        self.busiest_s = max(self.link_free.values())
        if dst is not Level.GATHERED:
            blocked.add(Level.GATHERED)  # this unit's all-gather comes later
        return FetchAction(unit=e.unit, src=src, dst=dst, nbytes=nbytes, position=j,
                           needed_in_s=deadline, demand=demand)


def plan_fetches(req: FetchQuery) -> list[FetchAction]:
    """Which hops to issue now, ordered by need (demand first). Pure and deterministic.

    For each distinct unit at or after the cursor, in execution order, the planner simulates its
    remaining hops on FIFO links (``link_busy_s`` plus what this call already planned; a later hop
    waits for the next planning point) and issues the next hop now only if starting it at the next
    planning point (``next_plan_in_s``) would finish after the use starts. So a fetch is issued at
    the last planning point that still hides its transfer: far enough ahead, not more. The scan stops
    once even the largest remaining unit, behind all queued transfers, could wait.

    Entries from ``trace.step_end`` on belong to the next step ([Note: predicting past an evaluation
    step] in infinity/prefetch/_trace.py): their shards are moved up, never on demand and never
    all-gathered.

    Budgets: a prefetch must fit the free bytes of every rung it climbs (counting evictable copies
    used after it, [Note: prefetch never displaces a sooner use]), its destination's in-flight
    room and ``lookahead_bytes``; the first that does not fit blocks later prefetches into that level
    (need order is kept). A demand hop (needed now) is always planned, first, and charged first.
    [Note: all-gathers in trace order] All-gathers are collectives: every rank must issue them in the
    same order, whatever its local timing. So an all-gather is planned only when every earlier unit's
    all-gather has been issued (or is planned before it).
    """
    return _Planner(req).run()
