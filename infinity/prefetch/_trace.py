"""Recorded execution traces of units, kept per phase, and a follower that tolerates divergence.

A *trace* is the ordered list of unit executions of one step (forward then backward, including
activation-checkpoint recomputation), each with the unit's shard and gathered byte counts, its home
tier and its measured times. :mod:`._executor` plans fetches from it; the tiered store asks it
for next-use distances (Belady eviction).

Public API (all pure Python, no threads, no tensors):

- ``Level``: ``NVME < HOST < DEVICE < GATHERED``, the rungs a unit climbs before compute.
- ``TraceEntry(*, unit, shard_bytes, gathered_bytes, home, compute_s=0.0, gap_s=0.0)``
- ``as_level(value) -> Level`` accepts a Level, its name, or another enum with that value.
- ``Trace(entries, *, phase="train", step_end=None)``: ``len``, ``[i]``, ``entries``,
  ``step_end``, ``units()``, ``positions(unit)``, ``find(unit, start, stop=None)``,
  ``next_use(unit, cursor) -> int | None``, ``next_use_distance(unit, cursor) -> float``
  (positions, ``inf`` if never), ``next_use_s(unit, cursor) -> float``, ``time_between_s(i, j)``,
  ``start_s(i)``, ``similarity(other) -> float``, ``followed_by(other) -> Trace``.
- ``TraceRecorder(phase)``: ``on_pre(entry_template, *, start_s, pre_s)``, ``on_post(unit, *, now_s)``,
  ``finish(end_s=None) -> tuple[TraceEntry, ...]``.
- ``TraceStore(*, max_variants=4, similarity_threshold=0.75)``: ``commit(phase, entries) -> Trace``,
  ``latest(phase)``, ``variants(phase)``, ``phases()``, ``candidates(phase)``, ``predict(phase, unit,
  num_entries)``.
- ``TraceFollower(store, *, window_entries=64)``: ``begin(phase, *, then=None)``, ``advance(unit) ->
  Follow``, ``view() -> (Trace, cursor) | None``, ``horizon() -> Trace | None``, attributes ``trace``,
  ``cursor``, ``synced``.

[Note: divergence never raises] An executed unit that differs from the trace is never an error:
the follower first looks for the unit a little further along the trace (skipped units), then for
the last two executed units anywhere in the phase's traces (another variant, another phase), and
otherwise marks the step unpredictable until one of those succeeds. Meanwhile per-unit successor
statistics predict a short chain, or, for a unit never seen (a new MoE expert), the trace is read
on as if the unit had replaced the expected one. Nothing is predicted past a step's recorded end
(but see [Note: predicting past an evaluation step]). The step's recording replaces the most
similar stored trace at the step's end, so a changed control flow is predicted again from the next
step on.

[Note: predicting past an evaluation step] After a training step the optimizer rewrites every
parameter shard, so nothing past its end may be fetched early. An evaluation forward (no grad)
changes nothing: the next step reads the same bytes. Its follower is begun with ``then``, the phase
the next step most likely has, and ``view()`` / ``horizon()`` give the followed trace with that
phase's latest trace appended (``Trace.followed_by``; ``step_end`` marks the seam). The planner then
moves the next step's first shards up while the evaluation's last units compute, and the store's
Belady eviction keeps them instead of dropping them first as 'not used again this step'. Without
it an evaluation forward ends holding its own last units and the training step after it finds
its first units on NVMe with no compute left to hide the reads (``warm_next_step`` after the
forward starts them, but the training step follows at once). Past the seam the planner issues
shard hops only, never demand ones, never an all-gather: gathered units are released at every
step's end ([Note: stale gathered units] in infinity/zero/_prefetcher.py), and the next step starts
whenever the caller starts it.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import logging
import math
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace
from typing import Hashable, Iterable, Sequence

logger = logging.getLogger(__name__)


class Level(str, enum.Enum):
    """Where a unit's bytes are, ordered by closeness to compute.

    ``NVME``: the shard is only in its swap file. ``HOST``: a shard copy is in host memory.
    ``DEVICE``: a shard copy is on the compute device. ``GATHERED``: the full unit (all shards,
    ``gathered_bytes``) is on the device and ready for compute. A unit's *home* is where its shard
    lives when not in use (one of the first three).
    """

    NVME = "NVME"
    HOST = "HOST"
    DEVICE = "DEVICE"
    GATHERED = "GATHERED"

    @property
    def rank(self) -> int:
        return _LEVEL_RANK[self]

    def up(self) -> "Level":
        """The next rung towards compute (``GATHERED`` has none)."""
        try:
            return _LEVEL_UP[self]
        except KeyError:
            raise ValueError("Level.GATHERED is the top rung; nothing to fetch above it") from None


_LEVELS = (Level.NVME, Level.HOST, Level.DEVICE, Level.GATHERED)
_LEVEL_RANK = {lvl: i for i, lvl in enumerate(_LEVELS)}
_LEVEL_UP = dict(zip(_LEVELS, _LEVELS[1:]))


def as_level(value: object) -> Level:
    """Accept a ``Level``, a string, or another enum whose value is one of the level names."""
    if isinstance(value, Level):
        return value
    raw = getattr(value, "value", value)
    try:
        return Level(str(raw).upper())
    except ValueError:
        raise ValueError(f"unknown level {value!r}; expected one of "
                         f"{', '.join(lvl.value for lvl in _LEVELS)}") from None


@dataclass(frozen=True, kw_only=True)
class TraceEntry:
    """One execution of one unit in a step."""

    unit: Hashable
    """The caller's key of the unit (any hashable: a name, an int)."""
    shard_bytes: int
    """Bytes of this rank's shard (what NVME->HOST and HOST->DEVICE move)."""
    gathered_bytes: int
    """Bytes of the full unit after the all-gather (what the GATHERED level holds)."""
    home: Level = Level.NVME
    """Where the shard lives when not in use."""
    compute_s: float = 0.0
    """Seconds from the unit's pre-hook (after any stall) to its post-hook."""
    gap_s: float = 0.0
    """Seconds from the post-hook to the next unit's pre-hook (non-unit compute that also hides I/O)."""

    @property
    def duration_s(self) -> float:
        return self.compute_s + self.gap_s


class Trace:
    """An immutable recorded step: entries in execution order plus indexes for fast look-ups."""

    def __init__(self, entries: Iterable[TraceEntry], *, phase: str = "train",
                 step_end: int | None = None):
        self.entries: tuple[TraceEntry, ...] = tuple(entries)
        self.phase = phase
        self.step_end = len(self.entries) if step_end is None else step_end
        """Position of the recorded step's end: entries from here on are the next step's, appended by
        :meth:`followed_by` ([Note: predicting past an evaluation step])."""
        # Start time of each entry relative to entry 0 (one extra slot: the end of the step).
        self._start_s = [0.0, *itertools.accumulate(e.duration_s for e in self.entries)]
        self._positions: dict[Hashable, list[int]] = {}
        for i, e in enumerate(self.entries):
            self._positions.setdefault(e.unit, []).append(i)
        # Post-hook time of each entry: with the start times, the planner's future planning points.
        self._post_s = [s + e.compute_s for s, e in zip(self._start_s, self.entries)]
        # Suffix maxima bound how far ahead the planner must scan (see prefetch.plan).
        n = len(self.entries)
        self._suffix_max = [(0, 0, 0.0)] * (n + 1)
        for i in range(n - 1, -1, -1):
            e, (sb, gb, d) = self.entries[i], self._suffix_max[i + 1]
            self._suffix_max[i] = (max(sb, e.shard_bytes), max(gb, e.gathered_bytes), max(d, e.duration_s))

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int) -> TraceEntry:
        return self.entries[i]

    def __repr__(self) -> str:
        return f"Trace(phase={self.phase!r}, entries={len(self.entries)}, units={len(self._positions)})"

    def units(self) -> list[Hashable]:
        return [e.unit for e in self.entries]

    def followed_by(self, following: "Trace") -> "Trace":
        """This step, then ``following`` as if it started when this one ends (the gap between steps
        is unknown: taking it as none plans the next step's fetches early rather than late)."""
        return Trace((*self.entries[:self.step_end], *following.entries[:following.step_end]),
                     phase=self.phase, step_end=self.step_end)

    def positions(self, unit: Hashable) -> Sequence[int]:
        return self._positions.get(unit, ())

    def find(self, unit: Hashable, start: int, stop: int | None = None) -> int | None:
        """First position ``p`` of ``unit`` with ``start <= p < stop``, or None."""
        pos = self._positions.get(unit)
        if not pos:
            return None
        k = bisect.bisect_left(pos, start)
        if k < len(pos) and (stop is None or pos[k] < stop):
            return pos[k]
        return None

    def next_use(self, unit: Hashable, cursor: int) -> int | None:
        """Position of the unit's next execution at or after ``cursor``, or None."""
        return self.find(unit, cursor)

    def next_use_distance(self, unit: Hashable, cursor: int) -> float:
        """Entries from ``cursor`` until the unit's next use (0: it is the next one); ``inf`` if never."""
        p = self.next_use(unit, cursor)
        return math.inf if p is None else float(p - cursor)

    def next_use_s(self, unit: Hashable, cursor: int) -> float:
        """Recorded seconds from the start of entry ``cursor`` to the unit's next use; ``inf`` if never."""
        p = self.next_use(unit, cursor)
        return math.inf if p is None else self.time_between_s(cursor, p)

    def time_between_s(self, i: int, j: int) -> float:
        """Recorded seconds from the start of entry ``i`` to the start of entry ``j``."""
        n = len(self.entries)
        return self._start_s[min(j, n)] - self._start_s[min(i, n)]

    @property
    def starts_s(self) -> Sequence[float]:
        """Recorded start of every entry relative to entry 0, plus the end of the last one."""
        return self._start_s

    def start_s(self, i: int) -> float:
        """Recorded start of entry ``i`` relative to entry 0 (``len``: the end of the last entry)."""
        return self._start_s[min(max(i, 0), len(self.entries))]

    def max_from(self, i: int) -> tuple[int, int, float]:
        """Largest shard_bytes, gathered_bytes and duration_s of any entry at or after ``i``."""
        return self._suffix_max[min(max(i, 0), len(self.entries))]

    def next_hook_s(self, t_s: float, lo: int, *, posts: bool) -> float | None:
        """Earliest recorded pre-hook (or post-hook when ``posts``) time >= ``t_s`` at entry >= ``lo``."""
        n = len(self.entries)
        best = None
        i = bisect.bisect_left(self._start_s, t_s, lo, n)
        if i < n:
            best = self._start_s[i]
        if posts:
            k = bisect.bisect_left(self._post_s, t_s, lo, n)
            if k < n and (best is None or self._post_s[k] < best):
                best = self._post_s[k]
        return best

    def similarity(self, other: "Trace | Sequence[Hashable]") -> float:
        """Shared (unit, next unit) pairs over the larger pair count: 1.0 same order, ~0 unrelated."""
        a = _bigrams(self.units())
        b = _bigrams(other.units() if isinstance(other, Trace) else list(other))
        if not a and not b:
            return 1.0
        shared = sum((a & b).values())
        return shared / max(sum(a.values()), sum(b.values()))


def _bigrams(units: Sequence[Hashable]) -> Counter:
    # A sentinel start pair makes one-entry traces comparable too.
    seq = [_START, *units]
    return Counter(zip(seq, seq[1:]))


_START = object()


class TraceRecorder:
    """Builds the entries of the step being executed from pre/post hook timestamps.

    The caller (the executor) supplies times from its clock, so tests can drive it with fake time.
    """

    def __init__(self, phase: str):
        self.phase = phase
        self._entries: list[TraceEntry] = []
        # Post-hook time of the last entry; None while it runs (its gap is unknown until the next pre).
        self._last_post_s: float | None = None
        self._open_start_s: float | None = None  # start of the running entry, None once posted

    def __len__(self) -> int:
        return len(self._entries)

    def on_pre(self, template: TraceEntry, *, start_s: float, pre_s: float) -> None:
        """A unit starts: ``pre_s`` is the pre-hook time (before any stall), ``start_s`` after it."""
        self._close_previous(pre_s)
        self._entries.append(template)
        self._open_start_s = start_s

    def on_post(self, unit: Hashable, *, now_s: float) -> None:
        if not self._entries or self._open_start_s is None or self._entries[-1].unit != unit:
            return  # a post without its pre (nested or foreign hook): no timing to record
        compute_s = max(0.0, now_s - self._open_start_s)
        self._entries[-1] = replace(self._entries[-1], compute_s=compute_s, gap_s=0.0)
        self._open_start_s = None
        self._last_post_s = now_s

    def _close_previous(self, pre_s: float) -> None:
        if not self._entries:
            return
        last = self._entries[-1]
        if self._open_start_s is not None:  # no post-hook came: all of it counts as compute
            self._entries[-1] = replace(last, compute_s=max(0.0, pre_s - self._open_start_s), gap_s=0.0)
        elif self._last_post_s is not None:
            self._entries[-1] = replace(last, gap_s=max(0.0, pre_s - self._last_post_s))
        self._open_start_s = None
        self._last_post_s = None

    def finish(self, end_s: float | None = None) -> tuple[TraceEntry, ...]:
        """The step's entries; the last gap runs to ``end_s`` when given (else it is left at 0)."""
        if end_s is not None and self._open_start_s is not None:
            self._close_previous(end_s)
        entries, self._entries = tuple(self._entries), []
        self._open_start_s = self._last_post_s = None
        return entries


class SuccessorStats:
    """Per-unit counts of which unit ran next (decayed), for predicting when no trace matches."""

    def __init__(self, decay: float = 0.5):
        self._decay = decay  # weight of old counts at each commit: recent control flow dominates
        self._next: dict[Hashable, Counter] = {}
        self._last_entry: dict[Hashable, TraceEntry] = {}

    def update(self, entries: Sequence[TraceEntry]) -> None:
        for counts in self._next.values():
            for k in counts:
                counts[k] *= self._decay
        for a, b in zip(entries, entries[1:]):
            self._next.setdefault(a.unit, Counter())[b.unit] += 1.0
        for e in entries:
            self._last_entry[e.unit] = e

    def predict(self, unit: Hashable, num_entries: int) -> list[TraceEntry]:
        """The most likely chain after ``unit`` (stops at a unit already predicted or unknown)."""
        out: list[TraceEntry] = []
        seen = {unit}
        cur = unit
        while len(out) < num_entries:
            counts = self._next.get(cur)
            if not counts:
                break
            # Ties break by insertion order, so the prediction is deterministic.
            nxt = max(counts.items(), key=lambda kv: kv[1])[0]
            if nxt in seen:
                break
            seen.add(nxt)
            out.append(self._last_entry[nxt])
            cur = nxt
        return out

    def entry(self, unit: Hashable) -> TraceEntry | None:
        return self._last_entry.get(unit)


class TraceStore:
    """Traces kept side by side: per phase name, up to ``max_variants`` distinct shapes each.

    [Note: automatic phase detection] A committed recording replaces the stored variant of its phase
    that it resembles (``similarity >= similarity_threshold``), else it is added as a new variant
    (the least recently committed one goes when there are too many). A forward-only evaluation run
    under the 'train' phase name therefore lands beside the training trace instead of clobbering it,
    and the follower switches between variants when the executed units say so.
    """

    def __init__(self, *, max_variants: int = 4, similarity_threshold: float = 0.75):
        if max_variants < 1:
            raise ValueError(f"max_variants: expected an integer >= 1, got {max_variants!r}")
        if not 0.0 < similarity_threshold <= 1.0:
            raise ValueError(f"similarity_threshold: expected a number in (0, 1], got {similarity_threshold!r}")
        self.max_variants = max_variants
        self.similarity_threshold = similarity_threshold
        # phase -> variants, most recently committed last.
        self._phases: "OrderedDict[str, list[Trace]]" = OrderedDict()
        self._successors: dict[str, SuccessorStats] = {}
        self.num_commits = 0
        self.num_new_variants = 0

    def commit(self, phase: str, entries: Sequence[TraceEntry]) -> Trace | None:
        """Store a finished step's recording (see the class note); empty recordings are dropped."""
        if not entries:
            return None
        trace = Trace(entries, phase=phase)
        variants = self._phases.setdefault(phase, [])
        best_i, best_sim = None, -1.0
        for i, old in enumerate(variants):
            sim = trace.similarity(old)
            if sim > best_sim:
                best_i, best_sim = i, sim
        if best_i is not None and best_sim >= self.similarity_threshold:
            del variants[best_i]
        else:
            self.num_new_variants += int(bool(variants))
            if len(variants) >= self.max_variants:
                del variants[0]
        variants.append(trace)
        self._phases.move_to_end(phase)
        self._successors.setdefault(phase, SuccessorStats()).update(trace.entries)
        self.num_commits += 1
        return trace

    def latest(self, phase: str) -> Trace | None:
        variants = self._phases.get(phase)
        return variants[-1] if variants else None

    def variants(self, phase: str) -> tuple[Trace, ...]:
        """The phase's traces, most recently committed first."""
        return tuple(reversed(self._phases.get(phase, ())))

    def phases(self) -> tuple[str, ...]:
        return tuple(self._phases)

    def candidates(self, phase: str) -> list[Trace]:
        """Traces to resynchronise against: this phase's variants, then other phases' (recent first)."""
        out = list(self.variants(phase))
        for other in reversed(self._phases):
            if other != phase:
                out.extend(self.variants(other))
        return out

    def predict(self, phase: str, unit: Hashable, num_entries: int) -> list[TraceEntry]:
        stats = self._successors.get(phase)
        chain = stats.predict(unit, num_entries) if stats else []
        if not chain:  # an unknown phase (or unit) borrows what other phases learnt
            for other, st in self._successors.items():
                if other != phase:
                    chain = st.predict(unit, num_entries)
                    if chain:
                        break
        return chain

    def successor_entry(self, unit: Hashable) -> TraceEntry | None:
        for st in self._successors.values():
            e = st.entry(unit)
            if e is not None:
                return e
        return None


class Follow(str, enum.Enum):
    """How an executed unit related to the trace (counted by the executor)."""

    MATCH = "match"          # the unit the trace expected
    REPEAT = "repeat"        # a unit the trace just passed, run again (e.g. recomputation): cursor stays
    RESYNC = "resync"        # found further along, or in another trace: cursor jumps there
    DIVERGED = "diverged"    # not predicted; the step is unpredictable until a resync
    UNTRACED = "untraced"    # no trace and no resync candidate at all


class TraceFollower:
    """Keeps the cursor into the active trace as units execute (see [Note: divergence never raises]).

    ``cursor`` is the position of the next entry expected to start; ``trace[cursor - 1]`` is the
    running unit while ``synced``.
    """

    _HISTORY = 2  # executed units matched when resynchronising anywhere (1 would jump at every repeat)

    def __init__(self, store: TraceStore, *, window_entries: int = 64):
        self.store = store
        self.window_entries = window_entries
        self.phase = "train"
        self.trace: Trace | None = None
        self.cursor = 0
        self.synced = False
        self._history: list[Hashable] = []  # last executed units, for resynchronisation
        self._diverged_at = 0  # cursor when the trace last stopped matching (where resync looks from)
        self._guesses = 0  # consecutive unmatched units since then
        self._last = Follow.UNTRACED  # how the last unit related to the trace
        self.then: str | None = None  # phase of the next step, when this one leaves the bytes alone
        self._ahead: tuple[Trace, Trace, Trace] | None = None  # (followed, next, joined), cached

    def begin(self, phase: str, *, then: str | None = None) -> None:
        """Follow a step of ``phase``. ``then``: the step leaves the parameters as they are (an
        evaluation forward) and the next one most likely has phase ``then``; predictions go on into
        it ([Note: predicting past an evaluation step]). None: nothing past this step's end."""
        self.phase = phase
        self.then = then
        self.trace = self.store.latest(phase)
        self.cursor = 0
        self.synced = self.trace is not None
        self._history = []
        self._diverged_at, self._guesses, self._last = 0, 0, Follow.UNTRACED

    def advance(self, unit: Hashable) -> Follow:
        self._last = self._advance(unit)
        return self._last

    def _advance(self, unit: Hashable) -> Follow:
        self._history = [*self._history[-(self._HISTORY - 1):], unit]
        t, c = self.trace, self.cursor
        if self.synced and t is not None:
            if c < len(t) and t[c].unit == unit:
                self.cursor = c + 1
                return Follow.MATCH
            if c > 0 and t[c - 1].unit == unit:
                return Follow.REPEAT  # the unit just run, run again
        if t is not None:
            # Skipped units (or, after a divergence, an inserted one): look a little further along.
            lo = c if self.synced else self._diverged_at
            p = t.find(unit, lo, lo + self.window_entries)
            if p is not None:
                self.cursor, self.synced = p + 1, True
                return Follow.RESYNC
        if self._resync_anywhere(unit):
            return Follow.RESYNC
        if t is None:
            return Follow.UNTRACED
        if self.synced:
            self._diverged_at, self._guesses = c, 0
        # Guess a substitution (MoE routing: another expert ran in the expected one's place), so the
        # trace after it keeps predicting; after a few unmatched units stop trusting the trace.
        self.synced = False
        self._guesses += 1
        self.cursor = c + 1
        return Follow.DIVERGED

    def _resync_anywhere(self, unit: Hashable) -> bool:
        """Find the recent history in the current trace (forward of the cursor first) or another."""
        candidates = self.store.candidates(self.phase)
        if self.trace is not None and self.trace not in candidates:
            candidates.insert(0, self.trace)
        elif self.trace is not None:
            candidates.remove(self.trace)
            candidates.insert(0, self.trace)
        for t in candidates:
            start = self.cursor if t is self.trace else 0
            for lo in (start, 0):
                p = self._match_history(t, lo)
                if p is not None:
                    self.trace, self.cursor, self.synced = t, p + 1, True
                    return True
        return False

    def _match_history(self, t: Trace, lo: int) -> int | None:
        hist = self._history
        for p in t.positions(hist[-1]):
            if p < lo:
                continue
            if len(hist) == 1:
                # Only the step's first unit: accept a trace that starts with it.
                if p == 0:
                    return p
                continue
            if p >= 1 and t[p - 1].unit == hist[-2]:
                return p
        return None

    _MAX_GUESSES = 4  # unmatched units in a row after which the trace no longer predicts

    def horizon(self) -> Trace | None:
        """The followed trace while synced, with the next step's appended when ``then`` says the
        parameters stay as they are ([Note: predicting past an evaluation step]); else None."""
        t = self.trace
        if t is None or not self.synced:
            return None
        following = self.store.latest(self.then) if self.then is not None else None
        if following is None:
            return t
        if self._ahead is None or self._ahead[0] is not t or self._ahead[1] is not following:
            self._ahead = (t, following, t.followed_by(following))  # built once per pair of traces
        return self._ahead[2]

    def view(self, num_predicted: int = 8) -> tuple[Trace, int] | None:
        """(trace, cursor) to plan from; while unsynced a successor-statistics chain, else a guess."""
        t = self.trace
        if t is not None and self.synced:
            if self.cursor >= len(t) and self._history:
                # Ran off the end (e.g. a forward-only variant while backward follows): continue in
                # a trace that has the same recent history and more after it.
                self._resync_beyond_end()
            ahead = self.horizon()  # goes on into the next step when ``then`` allows
            ended = self._last is Follow.MATCH  # at the recorded end, not jumped past it
            if self.cursor < len(self.trace) or (ended and self.cursor < len(ahead)):
                return ahead, self.cursor
            if ended:
                # The step ended as recorded. Predicting on would fetch the next step's units
                # before the optimizer step has updated them.
                return None
            t = None  # jumped to the end: successor statistics may still know what comes next
        # Unsynced: what usually follows this unit, else the guessed position in the trace.
        if self._history:
            last = self._history[-1]
            chain = self.store.predict(self.phase, last, num_predicted)
            head = self.store.successor_entry(last)
            if chain and head is not None:
                return Trace([head, *chain], phase=self.phase), 1
        if t is not None and self._guesses <= self._MAX_GUESSES and self.cursor < len(t):
            return t, self.cursor
        return None

    def _resync_beyond_end(self) -> None:
        # Only a longer variant of the same phase: at a recorded step's true end, continuing into
        # another phase's trace would prefetch past the optimizer step.
        for t in self.store.variants(self.phase):
            if t is self.trace or self.trace is None or len(t) <= len(self.trace):
                continue
            p = self._match_history(t, 0)
            if p is not None and p + 1 < len(t):
                self.trace, self.cursor = t, p + 1
                return
