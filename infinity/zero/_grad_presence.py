"""Which trainable parameters got a gradient in an accumulation window, on any rank.

[Note: parameters without a gradient]
torch's optimizers skip a parameter whose ``grad`` is None: no weight decay, no moment update,
and its own step count (bias correction) stays where it was. The engine keeps that rule
(a Linear used every third step otherwise ends 3.7% away from ``torch.optim.AdamW`` after 7
steps; MoE experts that receive no tokens are this case): at a step, the parameters with no
gradient in any micro-batch of the window, on any rank, are left out of the step's runs
([Note: runs of a flat partition] in infinity/optim/_runs.py). Across ranks "no gradient" means
no rank produced one, which is single-process torch on the global batch.

What it costs on the common path: a unit whose every trainable parameter got its gradient is
reduced in the backward's hooks (:meth:`ParameterManager._on_grad`); the ranks already agree on
which units those are (they issue that unit's collective then, every rank, or the collectives
would not match). So when every unit was reduced in hooks in every micro-batch of the window,
every parameter has a gradient everywhere: nothing is exchanged and the step updates everything.
Only the parameters of the other units (reduced at the end of backward, or not at all) could be
without one; their flags (one int32 each, in unit order) are all-reduced once per step.

What the ranks must agree on (as before this rule): in each backward, which units are complete
(their collective runs in the hooks, in the same order on every rank). A unit complete on one
rank and not on another issues its collective at different points (caught by the agreement check
at the first micro-step, ``INFINITY_CHECK_COLLECTIVES=1`` later). Rank-dependent use is fine
inside a unit that is incomplete on every rank: experts routed per rank belong in one unit (their
MoE layer), which then is reduced at the end of backward everywhere, with zeros where unused.
"""

from __future__ import annotations

import torch

from infinity.zero._collectives import Collectives
from infinity.zero._flat_group import Unit


class GradPresence:
    """The record behind [Note: parameters without a gradient], kept by the parameter manager."""

    def __init__(self, units: list[Unit], collectives: Collectives, device: torch.device):
        self.units = units
        self.coll = collectives
        self.device = device
        self._with_grad: set[int] = set()
        """id() of the trainable parameters whose gradient arrived in this window (this rank)."""
        self._partial: set[int] = set()
        """Indices of the units not reduced in the backward's hooks in some micro-batch of this
        window (the same on every rank: see the note)."""

    def note(self, param: torch.Tensor) -> None:
        """``param``'s gradient arrived (a post-accumulate-grad hook)."""
        self._with_grad.add(id(param))

    def end_backward(self) -> None:
        """Called at the end of each backward, before the units' per-backward records reset: a
        unit is complete when every trainable parameter of it arrived in this backward."""
        for u in self.units:
            if u.num_trainable and len(u.grads_seen) != u.num_trainable:
                self._partial.add(u.index)

    def clear(self) -> None:
        """The window's gradients were consumed (a step) or dropped (an fp16 overflow)."""
        self._with_grad.clear()
        self._partial.clear()

    def params_with_grad(self) -> set[int] | None:
        """id() of the trainable parameters with a gradient in this window on any rank; None
        when that is every one (nothing exchanged). A collective when some unit was partial:
        call on every rank at the step."""
        if not self._partial:
            return None
        candidates = [s.param for u in self.units if u.index in self._partial
                      for g in u.groups if g.requires_grad for s in g.slots]
        flags = [id(p) in self._with_grad for p in candidates]
        if self.coll.data_parallel_size > 1:
            t = torch.tensor(flags, dtype=torch.int32, device=self.device)
            self.coll.all_reduce_max(t, context="parameters with a gradient (optimizer step)")
            flags = [bool(f) for f in t.tolist()]
        used = {id(s.param) for u in self.units if u.index not in self._partial
                for g in u.groups if g.requires_grad for s in g.slots}
        used.update(id(p) for p, f in zip(candidates, flags) if f)
        return used
