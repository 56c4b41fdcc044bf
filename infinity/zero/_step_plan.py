"""The step plan: at each optimizer step, which slices of every flat partition are updated, with
which hyperparameters and step numbers ([Note: runs of a flat partition] in
infinity/optim/_runs.py), read from ``engine.optimizer``'s parameter groups and per-parameter step
counts; and, once the step ran, the step counts of the parameters it updated."""

from __future__ import annotations

import dataclasses
from typing import Collection

from torch import nn

from infinity.optim import AdamRun, EngineOptimizer, merge_runs


@dataclasses.dataclass(frozen=True)
class _Segment:
    """One parameter's slice ``[a, b)`` of a key's partition."""

    a: int
    b: int
    param: nn.Parameter
    group: int


class StepPlan:
    """The runs of one engine's trainable keys, step by step (see the module docstring)."""

    def __init__(self, manager, optimizer: EngineOptimizer):
        self.optimizer = optimizer
        self._keys: dict[str, tuple[int, tuple[_Segment, ...]]] = {}
        """Key -> (its partition's numel, the segments of its parameters in order)."""
        self._params: list[nn.Parameter] = []
        """Every trainable managed parameter once (step counts are kept for each on every
        rank, also where this rank's partition holds none of it: checkpoints write rank 0's)."""
        seen: set[int] = set()
        for g in manager.trainable_groups():
            base, n = manager.partition_of(g)
            segments = []
            for s in g.slots:
                a, b = max(s.offset, base), min(s.offset + s.numel, base + n)
                index = optimizer.group_index(s.param)
                if index is None:  # resolve_param_groups checked every trainable one is in one
                    raise ValueError(f"parameter {s.name!r} is trainable but in no parameter "
                                     f"group of engine.optimizer")
                if a < b:
                    segments.append(_Segment(a - base, b - base, s.param, index))
                if id(s.param) not in seen:
                    seen.add(id(s.param))
                    self._params.append(s.param)
            self._keys[g.key] = (n, tuple(segments))

    def runs(self, updated: Collection[int] | None = None) -> dict[str, tuple[AdamRun, ...]]:
        """Per key, the runs of this step. ``updated``: ids of the parameters updated (those with
        a gradient); None: every one. Keys with nothing to update are left out."""
        opt = self.optimizer
        hypers = [opt.hyperparameters(i) for i in range(len(opt.param_groups))]
        out: dict[str, tuple[AdamRun, ...]] = {}
        for key, (numel, segments) in self._keys.items():
            pieces = [AdamRun(s.a, s.b, opt.step_of(s.param) + 1, hypers[s.group])
                      for s in segments if updated is None or id(s.param) in updated]
            runs = merge_runs(pieces)
            if not runs:
                continue
            # The padding after the last parameter joins its run ([Note: runs of a flat
            # partition]).
            if runs[-1].hi == segments[-1].b and runs[-1].hi < numel:
                runs = runs[:-1] + (dataclasses.replace(runs[-1], hi=numel),)
            out[key] = runs
        return out

    def commit(self, updated: Collection[int] | None = None) -> None:
        """The step ran: every parameter it updated has one more step."""
        opt = self.optimizer
        for p in self._params:
            if updated is None or id(p) in updated:
                opt.set_step(p, opt.step_of(p) + 1)
