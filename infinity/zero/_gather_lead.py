"""Which units are gathered before their use and which are kept after it: the trace-driven
prefetcher over offloaded parameter shards (:mod:`._prefetcher`), or the gather-ahead order over
shards on the device ([Note: gathers issued ahead] in infinity/zero/_gather_ahead.py); at most
one of them leads. Neither: every gather on demand, every unit released after its use.

Split out of :class:`~infinity.zero._param_manager.ParameterManager` (#35): the manager asks
this at each use and each release and does what it says; the gathers themselves are the units'
(:class:`~infinity.zero._unit_storage.UnitStorage`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from infinity.zero._collectives import Phase
from infinity.zero._flat_group import Unit, UnitState
from infinity.zero._gather_ahead import GatherAhead
from infinity.zero._prefetcher import ParamPrefetcher, disabled_stats

logger = logging.getLogger(__name__)

__all__ = ["GatherLead"]


class GatherLead:
    """Gathers ahead of use and keeps after it, for the units of one manager (see the module
    doc)."""

    def __init__(self, units: list[Unit], *, fetcher: ParamPrefetcher | None,
                 gather_ahead: GatherAhead | None,
                 issue_gather: Callable[[Unit, Phase], None]):
        """``issue_gather(unit, phase)``: the manager's gather, issued and not waited."""
        assert fetcher is None or gather_ahead is None, "one of them leads the gathers"
        self.units = units
        self.fetcher = fetcher
        """Trace-driven prefetch of offloaded parameter shards; None: demand fetches only."""
        self._ahead = gather_ahead
        """[Note: gathers issued ahead] for units on the device; None: the prefetcher leads the
        gathers (offloaded shards), or they are local copies (one rank)."""
        self._issue_gather = issue_gather
        self._ahead_on = False
        """A training step is being recorded and predicted by ``_ahead``."""

    @property
    def gathers_ahead(self) -> bool:
        """Units on the device are gathered ahead of their use (stage 3, several ranks)."""
        return self._ahead is not None

    def begin_forward(self, grad: bool, training: bool) -> None:
        """A forward starts (``grad``: with grad enabled; ``training``: the module's mode)."""
        if self.fetcher is not None:
            # Separate traces per phase: an evaluation forward must not replace the training
            # trace.
            phase = ("train" if training else "eval-grad") if grad else "eval"
            # A forward without grad leaves the parameters as they are, and most likely runs
            # between training steps: the prefetcher moves the training step's first shards
            # up during its last units ([Note: predicting past an evaluation step] in
            # infinity/prefetch/_trace.py).
            then = None if grad else ("train" if self.fetcher.has_trace("train") else phase)
            self.fetcher.begin_step(phase, then=then)
        self._ahead_on = grad and self._ahead is not None
        if self._ahead_on:  # a training step: predict its gathers from the last one's
            self._ahead.begin_step()
            first = self._ahead.first()
            if first is not None:
                self._issue_gather(self.units[first], Phase.FORWARD_GATHER)

    def stop(self) -> None:
        """The step ended (or raised): nothing more is predicted or kept by the order."""
        self._ahead_on = False

    def before_gather(self, unit: Unit) -> None:
        """``unit`` is about to compute: the prefetcher makes it gathered if it leads it."""
        if self.fetcher is not None and not unit.always_gathered:
            self.fetcher.before_compute(unit.index)

    def after_gather(self, unit: Unit, backward: bool) -> None:
        """``unit`` is gathered for its compute: issue the gathers the order predicts next."""
        ahead = self._ahead
        if ahead is not None and self._ahead_on and not unit.always_gathered:
            ahead.use(unit.index, backward)  # [Note: gathers issued ahead]
            for index, later in ahead.ahead(unit.index, backward, self._in_use()):
                if self.units[index].state is UnitState.RELEASED:
                    self._issue_gather(self.units[index], Phase.BACKWARD_GATHER if later
                                       else Phase.FORWARD_GATHER)

    def after_compute(self, unit: Unit) -> None:
        if self.fetcher is not None and not unit.always_gathered:
            self.fetcher.after_compute(unit.index)

    def keeps(self, unit: Unit) -> bool:
        """``unit`` stays gathered after its compute: it is used again soon."""
        if self.fetcher is not None and self.fetcher.should_keep(unit.index):
            return True  # the trace says it is used again soon (released at the step's end at last)
        # used again next: [Note: gathers issued ahead]
        return self._ahead_on and self._ahead.used_next(unit.index, self._in_use())

    def on_release(self, unit: Unit) -> None:
        if self.fetcher is not None:
            self.fetcher.on_release(unit.index)

    def end_step(self) -> bool:
        """The prefetcher's step ends (its trace committed); False: no step was open."""
        if self.fetcher is None or not self.fetcher.in_step:
            return False
        self.fetcher.end_step()
        return True

    def warm_next_step(self) -> None:
        """The parameters are final: the next step's first shards start up."""
        if self.fetcher is not None:
            self.fetcher.warm_next_step()

    def stats(self) -> dict[str, Any]:
        """Counters of the trace-driven prefetcher (keys in ParamPrefetcher.stats)."""
        return self.fetcher.stats() if self.fetcher is not None else disabled_stats()

    def _in_use(self) -> set[int]:
        """The units computing now (forward, or held for their backward)."""
        return {u.index for u in self.units if u.in_use}
