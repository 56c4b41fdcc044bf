"""Which trainable parameters got a gradient in an accumulation window, on any rank.

[Note: parameters without a gradient]
torch's optimizers skip a parameter whose ``grad`` is None: no weight decay, no moment update,
and its own step count (bias correction) stays where it was. The engine keeps that rule
(a Linear used every third step otherwise ends 3.7% away from ``torch.optim.AdamW`` after 7
steps; MoE experts that receive no tokens are this case): at a step, the parameters with no
gradient in any micro-batch of the window, on any rank, are left out of the step's runs
([Note: runs of a flat partition] in infinity/optim/_runs.py). Across ranks "no gradient" means
no rank produced one, which is single-process torch on the global batch.

What it costs on the common path: at the end of each backward the manager's one all-reduce of
flags (which it runs anyway, [Note: every rank reduces every unit in one order] in
infinity/zero/_reduce_order.py) also says which units were partial on some rank: a unit some
trainable parameter of which got no gradient there. When no unit was partial in any micro-batch
of the window, every parameter has a gradient everywhere: nothing more is exchanged and the step
updates everything. Only the parameters of the partial units could be without one; their flags
(one int32 each, in unit order) are all-reduced once per step. The ranks agree on the partial
units, so they agree on whether that all-reduce runs.
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
        """Indices of the units partial on some rank in some micro-batch of this window (the
        same on every rank: see the note)."""

    def note(self, param: torch.Tensor) -> None:
        """``param``'s gradient arrived (a post-accumulate-grad hook)."""
        self._with_grad.add(id(param))

    def end_backward(self, partial: set[int]) -> None:
        """Called at the end of each backward with the units some trainable parameter of which
        got no gradient in it, on any rank (the manager's end-of-backward all-reduce)."""
        self._partial |= partial

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
