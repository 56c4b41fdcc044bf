"""Which unit to gather next, from the order the last training step used them: the all-gathers
of parameters that live on the device, issued one unit ahead of their use.

[Note: gathers issued ahead]
A gather waited where it is issued puts the whole all-gather on the training thread: at stage 3
over several ranks a step then costs compute plus every collective's time. FSDP2 issues unit
k+1's all-gather before unit k computes and waits for it at unit k+1's pre-forward; this is the
same for units whose shards are on the device (the trace-driven prefetcher leads the gathers of
offloaded shards itself: [Note: all-gathers at fixed positions] in infinity/prefetch/_executor.py).

The order is the sequence of units the last training step needed for compute (forward pre-hooks,
pre-backward hooks, recomputation under activation checkpointing), one list per step. At each
use the cursor follows that list; the units named after it are gathered ahead, as many as fill
``LOOKAHEAD_UNITS`` times the largest unit's bytes (issued, not waited: the link's queue absorbs
a unit that computes faster than its successor's gather), and a unit whose next entry is itself
is kept instead of released: the
root, whose forward ends the forward and whose pre-backward starts the backward (FSDP2 does not
reshard its root after forward either), and a module called twice in a row. Gathers ahead stay
inside the phase (forward or backward) they are predicted in: a gather's phase decides its group
under hpZ and its count in ``collective_bytes_sent``, so the backward's first unit is gathered at
its pre-backward hook, except at the forward's end ([Note: the backward's gathers start in the
forward's tail]). A use the list does not predict moves the cursor to that unit's next
place within a small window, or stops the predictions for the step; nothing raises.

Memory: the unit computing, the units gathered ahead and a kept root (and the forward's last
unit, kept into its backward right after the root's: one block more than the reservation on the
135M GPT, which the root's nesting around the whole forward had made tight already): the ledger's
``gathered_units`` counts 1 + ``DEFAULT_PREFETCH_UNITS`` units of the largest size, which this
fills (by bytes: on the 135M GPT the root is five blocks, so ten blocks go ahead, and the LM
head's backward, the longest compute of the backward and one that gathers nothing, has their
gathers beside it: 0.5 s of a 4.8 s step at 2 ranks over the modeled link).

[Note: the backward's gathers start in the forward's tail]
The forward's last units (the last block, then the LM head's logits, 0.35 s of the 135M GPT's
1.4 s forward) gather nothing more: their gathers were issued ahead. Kept inside the forward,
the predictions left the link idle there, and the backward's first gathers then shared the
head's backward with the root's reduction ([Note: the head's gradient reduced as it is made] in
infinity/zero/_head_grad.py), more link work than that window holds. So the forward's
predictions run on into the backward's units (issued as backward gathers: their phase decides
the group under hpZ and the count in ``collective_bytes_sent``), within the same bytes; the
backward's never run into the next forward (the optimizer step comes between). Units computing
now (the root, whose forward spans the whole forward) are not gathered ahead nor counted.

Every rank must issue the same collectives in the same order. The uses that drive this are the
stage-3 hooks, whose gathers already have to match across ranks, so the recorded lists, the
cursors and the predictions are the same on every rank.
"""

from __future__ import annotations

RESYNC_WINDOW = 8
"""Entries of the last step's list searched for a use it did not predict at the cursor."""
LOOKAHEAD_UNITS = 2
"""Units gathered ahead of the one computing (the ledger's DEFAULT_PREFETCH_UNITS): without
their sizes, this many units; with them, this many of the largest unit's bytes."""


class GatherAhead:
    """The last training step's units in the order of use, and a cursor into it.

    ``gathered_bytes``: each unit's gathered bytes. Given, the units ahead fill
    ``LOOKAHEAD_UNITS`` times the largest unit's bytes (at least one unit), not that many units:
    the ledger's ``gathered_units`` reserves that much whatever the units' sizes, and where the
    largest unit is a 50k-vocabulary root five times a block, two blocks ahead left four fifths
    of it unused while the link had nothing to do (the LM head's backward, the longest compute of
    the backward, gathers nothing itself)."""

    def __init__(self, gathered_bytes: dict[int, int] | None = None) -> None:
        self._bytes = gathered_bytes
        self._budget = (LOOKAHEAD_UNITS * max(gathered_bytes.values(), default=0)
                        if gathered_bytes else 0)
        self._last: list[tuple[int, bool]] = []
        """(unit, in backward) in the order the last complete training step used them."""
        self._now: list[tuple[int, bool]] = []
        """This step's uses so far."""
        self._cursor: int | None = 0
        """Index into ``_last`` of the entry after the current use; None: lost for this step."""

    def begin_step(self) -> None:
        """A training forward starts a step (after the last one's backward, or the first)."""
        if self._now:
            self._last, self._now = self._now, []
        self._cursor = 0

    def first(self) -> int | None:
        """The unit the step's forward starts with, if a step was recorded."""
        return self._last[0][0] if self._last and not self._last[0][1] else None

    def use(self, unit: int, backward: bool) -> None:
        """``unit`` is needed for compute now (in the backward or not): record it and move the
        cursor."""
        entry = (unit, backward)
        self._now.append(entry)
        cur = self._cursor
        if cur is None:
            return
        window = self._last[cur:cur + RESYNC_WINDOW]
        self._cursor = cur + window.index(entry) + 1 if entry in window else None

    def ahead(self, unit: int, backward: bool, busy: frozenset[int] | set[int] = frozenset()
              ) -> list[tuple[int, bool]]:
        """The uses after the current one, as (unit, in backward), other than ``unit`` and the
        units in ``busy`` (computing now), up to ``LOOKAHEAD_UNITS`` of them or of the largest
        unit's bytes: from the forward on into the backward, from the backward not into the next
        forward ([Note: the backward's gathers start in the forward's tail]); [] when
        unknown."""
        if self._cursor is None:
            return []
        out: list[tuple[int, bool]] = []
        seen: set[int] = set()
        total = 0
        window = RESYNC_WINDOW if self._bytes is None else len(self._last)
        for u, b in self._last[self._cursor:self._cursor + window]:
            if backward and not b:
                break
            if self._bytes is None and len(out) == LOOKAHEAD_UNITS:
                break
            if u != unit and u not in seen and u not in busy:
                size = self._bytes.get(u, 0) if self._bytes is not None else 0
                if out and total + size > self._budget:
                    break
                out.append((u, b))
                seen.add(u)
                total += size
        return out

    def used_next(self, unit: int, busy: frozenset[int] | set[int] = frozenset()) -> bool:
        """The next use of a unit not in ``busy`` (computing now, and staying so: the root) is
        ``unit`` again, in either phase (keep it): a module called twice in a row, the root, the
        forward's last unit, whose backward comes right after the root's."""
        cur = self._cursor
        if cur is None:
            return False
        for u, _ in self._last[cur:cur + RESYNC_WINDOW]:
            if u not in busy or u == unit:
                return u == unit
        return False
