"""An LM head's weight gradient reduced while the head's backward makes it.

[Note: the head's gradient reduced as it is made]
The backward starts with the LM head: on the 135M GPT at 2 ranks its backward (the vocabulary's
logits) is 0.76 s of a 3.3 s backward in which no gradient is ready yet, so at stage 2 the link
has nothing to do for that long, and at stage 3 only the next blocks' gathers, which the
gathered-bytes bound stops after 0.6 s. Then the head's weight, the largest gradient of the
step (the tied vocabulary table: 29 % of the parameters), is complete, and its reduce-scatter
(in pieces: [Note: a large reduction spread over the backward] in
infinity/zero/_grad_reducer.py) queues behind and beside the blocks' reductions for the rest
of the backward. Measured at L = T0 over the modeled link: stage 2 with the after-step gather
overlapped stepped at 1.47 x max(T0, L), the link idle for the whole head window.

Yet the head's weight gradient is a sum over tokens of ``grad_logits[t, v] * h[t, :]``: any
rows of it can be computed alone, and a piece of the reduce-scatter needs only the rows its
slices hold. So with several data-parallel ranks at stages 2-3 a plain bias-free
``nn.Linear`` with a vocabulary's rows (at least ``MIN_VOCABULARY_ROWS``), held only by
itself and tapped embeddings ([Note: embedding rows cross ranks as rows] in
infinity/zero/_embedding_rows.py: the tied table), whose unit is reduced in pieces, runs
through :class:`_HeadFunction`: the weight goes in detached (autograd accumulates nothing into
it; a zero-size anchor makes autograd run the backward) and its backward hands the manager the
head's input and output gradient. The manager begins the unit's reduction there: for each
piece whose slices hold only the head's weight, rows that come as rows (zeros in the staging)
and padding, it computes those rows of the gradient into the staging buffer, zeroes the rest
of the slices and issues the piece; then the remaining rows; then it returns the input's
gradient. The pieces that hold a parameter autograd accumulates (a final norm beside the
table) wait for the unit's turn as before. The bytes are the same, in the same pieces, on the
same ranks in the same order; they are issued a backward-head earlier.

Only one call of the head per backward goes this way (a checkpoint's recomputation redoes it): a
second call in the forward runs the plain ``nn.Linear`` and its gradient comes through autograd; the
tapped call's backward then stages its gradient whole (added to the others, reduced with the
unit or, arriving after it, at the end of backward: [Note: parameters without a gradient] in
infinity/zero/_grad_presence.py), and the tap is removed at the end of that backward for good.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from infinity.zero._embedding_rows import MIN_VOCABULARY_ROWS, ForwardTaps, holders_of
from infinity.zero._reduction import piece_bounds
from infinity.zero._tensor_parallel import is_dtensor

HeadSink = Callable[[nn.Linear, torch.Tensor, torch.Tensor], torch.Tensor]
"""(head, its input, its output's gradient) -> the input's gradient."""


def head_candidates(model: nn.Module, managed: set[int], tapped: set[int]) -> list[nn.Linear]:
    """The plain bias-free ``nn.Linear`` modules with a trainable managed weight of at least
    ``MIN_VOCABULARY_ROWS`` rows held by no module but itself and the tapped modules
    (``tapped``: id() of the tapped embeddings)."""
    holders = holders_of(model)
    found = []
    for m in model.modules():
        weight = getattr(m, "weight", None)
        if (isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward and m.bias is None
                and isinstance(weight, nn.Parameter) and weight.requires_grad
                and id(weight) in managed and not is_dtensor(weight)
                and weight.shape[0] >= MIN_VOCABULARY_ROWS
                and all(h is m or id(h) in tapped for h in holders[id(weight)])):
            found.append(m)
    return found


@dataclasses.dataclass(frozen=True)
class HeadPlan:
    """Which pieces of its unit's reduction a head's backward issues, and how."""

    pieces: int
    early: tuple[tuple[int, tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]], ...]
    """(piece number, the weight's row ranges [lo, hi) its slices hold, the flat ranges of its
    slices outside the weight: zeroed before it is issued), in piece order."""
    rest: tuple[tuple[int, int], ...]
    """Row ranges no early piece holds (computed after the early pieces)."""


def plan_head(*, world: int, shard_numel: int, pieces: int, offset: int, rows: int, width: int,
              late: list[tuple[int, int]]) -> HeadPlan:
    """The plan of a head whose weight (``rows`` x ``width``) starts at flat element ``offset``
    of a group sharded over ``world`` ranks (``shard_numel`` each) and reduced in ``pieces``
    (:func:`~infinity.zero._reduction.piece_bounds`); ``late``: the flat ranges of the
    group's parameters whose gradient autograd accumulates (a piece holding any of them waits
    for the unit's turn)."""
    start, end = offset, offset + rows * width
    early, covered = [], []
    for number, (lo, hi) in enumerate(piece_bounds(shard_numel, pieces)):
        slices = [(r * shard_numel + lo, r * shard_numel + hi) for r in range(world)]
        if any(a < y and x < b for a, b in slices for x, y in late):
            continue
        row_ranges, zeros = [], []
        for a, b in slices:
            x, y = max(a, start), min(b, end)
            if x < y:
                row_ranges.append(((x - start) // width, -(-(y - start) // width)))
            zeros += [(a, min(b, start)), (max(a, end), b)]
        early.append((number, tuple(row_ranges), tuple((x, y) for x, y in zeros if x < y)))
        covered += row_ranges
    rest, at = [], 0
    for lo, hi in sorted(covered):
        if lo > at:
            rest.append((at, lo))
        at = max(at, hi)
    if at < rows:
        rest.append((at, rows))
    return HeadPlan(pieces=pieces, early=tuple(early), rest=tuple(rest))


def weight_rows_grad(grad_out: torch.Tensor, inputs: torch.Tensor, lo: int, hi: int
                     ) -> torch.Tensor:
    """Rows [lo, hi) of ``F.linear``'s weight gradient (``grad_out``: tokens x out features,
    ``inputs``: tokens x in features)."""
    return grad_out[:, lo:hi].t() @ inputs


class _HeadFunction(torch.autograd.Function):
    """``F.linear(x, weight)`` whose backward the sink computes (the weight's gradient staged
    and reduced by the manager, not accumulated by autograd)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, anchor: torch.Tensor,
                module: nn.Linear, sink: HeadSink) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.module, ctx.sink = module, sink
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        # The weight is read in the sink, from the module: gathered again for the backward at
        # stage 3 (the pre-backward hook ran before this), where a saved view would be stale.
        return ctx.sink(ctx.module, x, grad_out), None, None, None, None


class HeadTaps(ForwardTaps):
    """The tapped LM heads of one model ([Note: the head's gradient reduced as it is made])."""

    def __init__(self, modules: list[nn.Linear], sink: HeadSink):
        super().__init__(modules)
        self.calls: dict[int, int] = {id(m): 0 for m in self.modules}
        """id(head) -> calls with grad since the last backward ended: the first is tapped."""
        self.of_weight: dict[int, nn.Linear] = {id(m.weight): m for m in self.modules}
        self.parts: dict[int, int] = {id(m): 0 for m in self.modules}
        """id(head) -> parts of its weight's gradient staged in this backward, where it was
        called again (the tapped call's, autograd's for the others): :meth:`first_part`."""
        self._sink = sink

    def remove(self, modules: list[nn.Linear] | None = None) -> None:
        super().remove(modules)
        self.of_weight = {id(m.weight): m for m in self.modules}

    def first_part(self, weight: torch.Tensor) -> bool:
        """``weight`` is a tapped head's, called again since the last backward, and this is the
        first of the two parts of its gradient (the tapped call's backward, and autograd's
        accumulation of the other calls', in either order): its unit is not complete yet, nor
        may it be released (the other part's backward reads the weight)."""
        m = self.of_weight.get(id(weight))
        if m is None or self.calls[id(m)] < 2:
            return False
        self.parts[id(m)] += 1
        return self.parts[id(m)] == 1

    def end_backward(self) -> list[nn.Linear]:
        """The heads called more than once since the last backward ended (their counts reset)."""
        again = [m for m in self.modules if self.calls[id(m)] > 1]
        self.calls = {id(m): 0 for m in self.modules}
        self.parts = {id(m): 0 for m in self.modules}
        return again

    def _forward(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        weight = module.weight
        if not (torch.is_grad_enabled() and weight.requires_grad):
            return nn.Linear.forward(module, x)
        if torch._C._current_graph_task_id() == -1:  # not a checkpoint's recomputation,
            self.calls[id(module)] += 1              # which must redo what the forward did
            if self.calls[id(module)] > 1:
                return nn.Linear.forward(module, x)
        return _HeadFunction.apply(x, weight.detach(), self._anchor(weight.device), module,
                                   self._sink)
