"""The hand-off of a backward's gradients from autograd to the reducer: each parameter's gradient
staged as it arrives, a unit reduced once it is complete (in one order over the ranks), the LM
head's and the embeddings' taps, and the end of backward's flush, on which every rank agrees.

Split out of :class:`~infinity.zero._param_manager.ParameterManager` (#35), which owns the
training loop's state and the units' gathers: the hand-off asks it, through
:class:`BackwardCalls`, to note that a backward began and to let a unit go once its gradients
are all in. The reductions themselves are the units'
(:class:`~infinity.zero._unit_storage.UnitStorage`) and the reducer's
([Note: gradient ledger] in infinity/zero/_grad_reducer.py); this decides when.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
from torch import nn

from infinity.zero._collectives import Collectives, Phase
from infinity.zero._embedding_rows import EmbeddingRows, RowsPayload
from infinity.zero._flat_group import FlatGroup, ParamSlot, Unit
from infinity.zero._grad_presence import GradPresence
from infinity.zero._grad_reducer import GradientReducer
from infinity.zero._head_grad import (HeadPlan, HeadTaps, head_candidates, plan_head,
                                     weight_rows_grad)
from infinity.zero._manager_config import ManagerConfig
from infinity.zero._reduce_order import ReduceOrder, backward_order, spread_pieces
from infinity.zero._tensor_parallel import local_grad
from infinity.zero._unit_storage import UnitStorage

logger = logging.getLogger(__name__)

__all__ = ["BackwardCalls", "GradHandoff"]

SlotOf = dict[int, tuple[Unit, FlatGroup, ParamSlot]]
"""id(parameter) -> (its unit, its flat group, its slot)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackwardCalls:
    """What the hand-off asks of the parameter manager, which owns the training loop's state."""

    enter_backward: Callable[[], None]
    """A gradient hook fired: the backward has begun, if it had not ([Note: the end of
    backward] in infinity/zero/_param_manager.py)."""
    unit_done: Callable[[Unit], None]
    """A unit's gradients are in (or reduced): its backward hold may drop."""
    micro_step: Callable[[], int]
    """The backward's number, for agreement checks and errors."""
    in_backward: Callable[[], bool]
    """The manager is in BACKWARD (a head's pieces go early only then)."""


class GradHandoff:
    """A backward's gradients, from the hooks to the reducer (see the module doc)."""

    def __init__(self, module: nn.Module, units: list[Unit], slot_of: SlotOf,
                 config: ManagerConfig, *, collectives: Collectives, reducer: GradientReducer,
                 storage: UnitStorage, calls: BackwardCalls):
        self.module = module
        self.units = units
        self.stage = config.stage
        self.device = config.device
        self.coll = collectives
        self.reducer = reducer
        self.storage = storage
        self.calls = calls
        self._slot_of = slot_of
        self.presence = GradPresence(units, collectives, config.device)
        """Which parameters got a gradient in this window ([Note: parameters without a
        gradient] in infinity/zero/_grad_presence.py)."""
        trainable = {id(s.param) for u in units for g in u.groups if g.requires_grad
                     for s in g.slots}
        self._rows: EmbeddingRows | None = None
        """[Note: embedding rows cross ranks as rows] in infinity/zero/_embedding_rows.py; None
        at one rank, where nothing crosses ranks."""
        self._row_slots: dict[int, tuple[int, ParamSlot]] = {}
        """id(weight) of a tapped embedding -> (its group's number in ``_row_groups``, slot)."""
        self._row_groups: list[FlatGroup] = []
        """The groups holding a tapped weight, in one fixed order (the rows' group numbers)."""
        self._row_entries: list[tuple[int, ParamSlot, torch.Tensor, torch.Tensor]] = []
        """This backward's rows: (group number, slot, unique ids, rows)."""
        if collectives.data_parallel_size > 1:
            self._tap_rows(trainable)
        heads = (head_candidates(module, trainable,
                                 self._rows.tapped_modules if self._rows is not None else set())
                 if collectives.data_parallel_size > 1 and config.stage >= 2
                 and config.quant.gradients is None else [])
        self._heads: HeadTaps | None = HeadTaps(heads, self._on_head) if heads else None
        """[Note: the head's gradient reduced as it is made] in infinity/zero/_head_grad.py;
        None: no head is tapped (kept by :meth:`order_reductions` only where its unit is
        reduced in pieces that it alone fills)."""
        self._head_plans: dict[int, HeadPlan] = {}
        """id(tapped head) -> the pieces its backward issues."""
        self._reduce_order: ReduceOrder | None = None
        """[Note: every rank reduces every unit in one order]; None at one rank."""
        self._pieces: dict[int, int] = {}
        """Units whose reductions go in pieces, and how many ([Note: a large reduction spread
        over the backward] in infinity/zero/_grad_reducer.py)."""
        if collectives.data_parallel_size > 1:
            self.order_reductions()

    def _tap_rows(self, trainable: set[int]) -> None:
        """Tap the embeddings whose gradients cross ranks as rows, and number their groups."""
        rows = EmbeddingRows(self.module, trainable, self._on_rows,
                             unit_of=lambda p: self._slot_of[id(p)][0].index)
        if not rows.modules:
            return
        self._rows = rows
        for m in rows.modules:
            unit, group, slot = self._slot_of[id(m.weight)]
            if group not in self._row_groups:
                self._row_groups.append(group)
            self._row_slots[id(m.weight)] = (self._row_groups.index(group), slot)
            if id(m.weight) in rows.rows_only:
                unit.rows_only = unit.rows_only | {id(m.weight)}

    # ------------------------------------------------------------------ taps

    @property
    def rows_tapped(self) -> bool:
        """Some embedding's gradient crosses ranks as rows (until a backward finds the rows no
        fewer bytes than their tables)."""
        return self._rows is not None

    @property
    def heads_tapped(self) -> bool:
        """Some LM head's gradient is reduced as its backward makes it."""
        return self._heads is not None

    def install(self) -> None:
        """The embeddings' and heads' taps (the manager installs its hooks after)."""
        if self._rows is not None:
            self._rows.install()
        if self._heads is not None:
            self._heads.install()

    def remove(self) -> None:
        if self._rows is not None:
            self._rows.remove()
        if self._heads is not None:
            self._heads.remove()

    # ------------------------------------------------------------------ gradients as they arrive

    def on_grad(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: stage the gradient ([Note: gradient ledger]); reduce the
        unit once every trainable parameter of it has one."""
        unit, group, slot = self._slot_of[id(param)]
        if param.grad is None:
            return
        self.calls.enter_backward()
        self.reducer.stage(group, slot, local_grad(param, param.grad))
        param.grad = None
        if self._heads is None or not self._heads.first_part(param):
            self._grad_staged(unit, param)

    def _grad_staged(self, unit: Unit, param: torch.Tensor) -> None:
        """``param``'s gradient of this backward is staged: reduce its unit if that completed
        it (in the reduction order over several ranks)."""
        self.presence.note(param)
        complete, late = unit.grad_arrived(id(param))  # complete until the backward ends
        if complete:
            order = self._reduce_order
            if order is None:  # one rank: at once (a late gradient too: nothing to agree on)
                self.reduce(unit, Phase.REDUCE_GRAD)
            elif not late:  # several: in the order ([Note: every rank reduces every unit ...])
                for index in order.complete(unit.index):
                    self.reduce(self.units[index], Phase.REDUCE_GRAD)
            # else a late one stays staged: the end of backward reduces it on every rank
            self.calls.unit_done(unit)

    def _on_head(self, module: nn.Linear, x: torch.Tensor, grad_out: torch.Tensor
                 ) -> torch.Tensor:
        """A tapped head's backward ([Note: the head's gradient reduced as it is made] in
        infinity/zero/_head_grad.py): its weight's gradient staged, the pieces of the unit's
        reduction it alone fills issued as their rows are made; returns the input's gradient."""
        weight = module.weight
        unit, group, slot = self._slot_of[id(weight)]
        self.calls.enter_backward()
        rows, width = weight.shape
        # In the output gradient's dtype: under autocast the forward ran in another dtype than
        # the saved input's and the weight's (autograd's own linear has the casts in its graph).
        grads = grad_out.reshape(-1, rows)
        inputs = x.reshape(-1, width).to(grads.dtype)
        plan = self._head_plans.get(id(module))
        reduction = None
        if (plan is not None and self._heads is not None
                and self._heads.calls.get(id(module)) == 1
                and self.calls.in_backward()
                and self._reduce_order is not None and self._reduce_order.pending(unit.index)
                and not (group.grad_staging is not None and id(slot) in group.grad_staged)):
            reduction = self.reducer.begin_pieces(
                group, plan.pieces, f"{Phase.REDUCE_GRAD.value} of unit {unit.index} "
                                    f"{unit.name!r} (micro-step {self.calls.micro_step()})")
        if reduction is None:  # called again, or reduced already: staged whole, as autograd's
            self.reducer.stage(group, slot, grads.t() @ inputs)
        else:
            self._head_pieces(unit, group, slot, plan, reduction, grads, inputs, (rows, width))
        # Before the unit may be released:
        grad_x = (grads @ weight.to(grads.dtype)).view(x.shape).to(x.dtype)
        # (untapped since its forward, by a backward that ran in between: staged whole above)
        if self._heads is None or not self._heads.first_part(weight):
            self._grad_staged(unit, weight)  # its unit's turn may be now
        return grad_x

    @staticmethod
    def _head_pieces(unit: Unit, group: FlatGroup, slot: ParamSlot, plan: HeadPlan,
                     reduction: Any, grads: torch.Tensor, inputs: torch.Tensor,
                     shape: tuple[int, int]) -> None:
        """The head's weight gradient (``shape``: rows, width) made into the staging buffer
        row range by row range, each piece it alone fills issued as soon as its rows are there."""
        rows, width = shape
        staging = group.grad_staging
        table = staging[slot.offset:slot.offset + slot.numel].view(rows, width)
        with torch.profiler.record_function(f"infinity::head pieces ({unit.name})"):
            for number, row_ranges, zeros in plan.early:
                for lo, hi in row_ranges:
                    table[lo:hi].copy_(weight_rows_grad(grads, inputs, lo, hi))
                for lo, hi in zeros:  # rows' and padding elements: zeros, as at its turn
                    staging[lo:hi].zero_()
                reduction.issue_piece(number)
            for lo, hi in plan.rest:
                table[lo:hi].copy_(weight_rows_grad(grads, inputs, lo, hi))
        group.grad_staged.add(id(slot))

    def _on_rows(self, param: nn.Parameter, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """A tapped embedding's backward: this rank's rows of ``param``'s gradient, reduced at
        the end of backward ([Note: embedding rows cross ranks as rows])."""
        unit = self._slot_of[id(param)][0]
        self.calls.enter_backward()
        number, slot = self._row_slots[id(param)]
        self._row_entries.append((number, slot, ids, rows))
        self.presence.note(param)
        unit.rows_arrived.add(id(param))

    # ------------------------------------------------------------------ order and pieces

    def order_reductions(self) -> None:
        """The order of the units' reductions, the units reduced in pieces, and the tapped
        heads' plans, from the units and the taps (several data-parallel ranks). A head whose
        unit is not reduced in pieces, or in none that the head alone fills, is untapped."""
        heads = self._heads.modules if self._heads is not None else []
        # A tapped head's weight counts as autograd's: its gradient completes its unit, at the
        # head's backward (the manager is handed it there).
        order = backward_order(
            self.module, self.units,
            skip_modules=self._rows.tapped_modules if self._rows is not None else set())
        self._reduce_order = ReduceOrder(order)
        numel = {u.index: sum(g.padded_numel for g in u.groups if g.requires_grad)
                 for u in self.units}
        self._pieces = spread_pieces(order, numel) if self.stage >= 2 else {}
        self._head_plans, untap = {}, []
        world = self.coll.world_size
        for m in heads:
            unit, group, slot = self._slot_of[id(m.weight)]
            pieces = self._pieces.get(unit.index, 1)
            late = [(s.offset, s.offset + s.numel) for s in group.slots
                    if s.numel and s is not slot and id(s.param) not in unit.rows_only]
            plan = plan_head(world=world, shard_numel=group.shard_numel,
                             pieces=pieces, offset=slot.offset, rows=m.weight.shape[0],
                             width=m.weight.shape[1], late=late) \
                if pieces > 1 and world > 1 else None
            if plan is not None and plan.early:
                self._head_plans[id(m)] = plan
            else:
                untap.append(m)
        if untap:
            self._untap_heads(untap)
            self.order_reductions()

    def _untap_heads(self, heads: list[nn.Linear]) -> None:
        """Their gradients go through autograd from now on."""
        self._heads.remove(heads)
        for m in heads:
            self._head_plans.pop(id(m), None)
        if not self._heads.modules:
            self._heads = None

    def reduce(self, unit: Unit, phase: Phase) -> None:
        pieces = self._pieces.get(unit.index, 1) if phase is Phase.REDUCE_GRAD else 1
        self.storage.issue_reduce(unit, phase, self.calls.micro_step(), pieces=pieces)

    # ------------------------------------------------------------------ the end of backward

    def finish(self) -> None:
        """End of one backward's gradients: with several ranks, reduce the units not reduced yet
        in the fixed order ([Note: every rank reduces every unit in one order]); wait for every
        reduction; reduce again, on every rank, the units some rank staged gradients for after
        their reduction (at one rank: the incomplete units); then the rows and the heads."""
        if self._reduce_order is not None:
            for index in self._reduce_order.rest():  # incomplete here: zeros where no gradient
                self.reduce(self.units[index], Phase.REDUCE_GRAD)
        self.storage.wait_reductions()
        n = len(self.units)
        flags, entries, payload, sizes = self._agreed_flags()
        for unit, flag in zip(self.units, flags[:n]):
            if flag:
                self.reduce(unit, Phase.FLUSH)
        self.storage.wait_reductions()
        if payload is not None:
            self._reduce_rows(entries, payload, sizes, flags[2 * n])
        self.presence.end_backward({u.index for u, f in zip(self.units, flags[n:2 * n]) if f})
        if self._heads is not None:
            again = self._heads.end_backward()
            if again:  # [Note: the head's gradient reduced as it is made]: called twice
                logger.info("LM head %s was called more than once between backwards: its "
                            "weight's gradient goes through autograd from now on",
                            ", ".join(type(m).__name__ for m in again))
                self._untap_heads(again)
                self.order_reductions()

    def _agreed_flags(self) -> tuple[list[int], list, torch.Tensor | None, list[int] | None]:
        """(flags, this backward's rows, their payload, its sizes per rank): per unit, staged
        again after its reduction; per unit, partial; then the rows' bytes. Gradients staged
        again after their unit's reduction (one rank: units never complete), and units some
        parameter of which got no gradient here ([Note: parameters without a gradient]): one
        all-reduce, so that every rank reduces the same units again."""
        flags = [int(any(g.grad_staging is not None for g in u.groups)) for u in self.units]
        flags += [int(u.num_trainable > 0 and not u.every_grad_arrived) for u in self.units]
        entries, payload, sizes = [], None, None
        if self._rows is not None:  # [Note: embedding rows cross ranks as rows]
            entries, self._row_entries = self._row_entries, []
            scale = 1.0 / self.coll.data_parallel_size
            packed = [(number, slot.offset, ids, rows) for number, slot, ids, rows in entries]
            if self.reducer.routes_rows:  # the bytes this rank sends
                payload, sizes = RowsPayload.pack(
                    packed, scale, self.device, world=self.coll.world_size,
                    shard_numel=[g.shard_numel for g in self._row_groups])
                flags.append(payload.numel() - sizes[self.coll.rank])
            else:  # every rank's, padded to the largest rank's
                payload, _ = RowsPayload.pack(
                    packed, scale, self.device, world=1,
                    shard_numel=[g.padded_numel for g in self._row_groups])
                flags.append(payload.numel())
        if self.coll.data_parallel_size > 1:  # replicas must agree too: they reduce together
            pending = torch.tensor(flags, dtype=torch.int64, device=self.device)
            self.coll.all_reduce_max(
                pending, context=f"end of backward (micro-step {self.calls.micro_step()})")
            flags = pending.tolist()
        return flags, entries, payload, sizes

    def _reduce_rows(self, entries: list[tuple[int, ParamSlot, torch.Tensor, torch.Tensor]],
                     payload: torch.Tensor, sizes: list[int] | None, max_bytes: int) -> None:
        """The end of backward's rows, on every rank: sent as rows (to the rank holding each,
        ``sizes`` per rank, or to every rank) while that moves fewer bytes than reducing their
        groups densely, else added into the staging buffers and reduced with their units (every
        rank takes the same branch: ``max_bytes``, what the largest rank sends or pads to, is
        the same everywhere)."""
        ranks = self.coll.data_parallel_size
        dense_bytes = sum(g.padded_numel for g in self._row_groups) * 4
        names = ", ".join(f"unit {u.index} {u.name!r}" for u in self.units
                          if any(g in self._row_groups for g in u.groups))
        context = (f"reduce of the embedding rows of {names} "
                   f"(micro-step {self.calls.micro_step()})")
        if sizes is not None:  # a reduce-scatter sends (W - 1) / W of the buffer
            if max_bytes < dense_bytes * (ranks - 1) / ranks:
                self.reducer.route_rows(payload, sizes, self._row_groups, context=context)
                return
        elif max_bytes <= RowsPayload.HEADER * 8:
            return  # no rank has rows
        # Dense where accumulators hold a rank's own sum: [Note: one all-reduce per window at
        # stages 0-1] in _grad_reducer.py.
        elif ranks * max_bytes < dense_bytes and not self.reducer.holds_local_sums:
            self.reducer.gather_rows(payload, max_bytes, self._row_groups, context=context)
            return
        for number, slot, ids, rows in entries:
            group = self._row_groups[number]
            grad = torch.zeros(slot.numel, dtype=torch.float32, device=self.device)
            grad.view(-1, rows.shape[1]).index_add_(0, ids.to(self.device), rows.to(self.device))
            self.reducer.stage(group, slot, grad)
        for unit in self.units:  # in index order on every rank
            if any(g in self._row_groups for g in unit.groups):
                self.reduce(unit, Phase.FLUSH)
        self.storage.wait_reductions()
        self._rows_go_dense(max_bytes)

    def _rows_go_dense(self, max_bytes: int) -> None:
        """That reduced the rows' units twice in this backward (their dense part in the hooks):
        from now on their embeddings' gradients go through autograd, as without rows."""
        self._rows.remove()
        self._rows, self._row_groups, self._row_slots = None, [], {}
        if self._heads is not None:  # a tied head's weight is the table's: dense too
            self._untap_heads(list(self._heads.modules))
        for unit in self.units:
            unit.rows_only = frozenset()
        self.order_reductions()
        logger.info("embedding gradients: the rows of a backward (%d B on the largest rank) "
                    "were not fewer bytes than their tables; reduced densely from now on",
                    max_bytes)

    def abort(self) -> None:
        """The backward raised: reductions begun early dropped, the heads' calls counted anew.
        Staged gradients stay: the next :meth:`finish` reduces them."""
        self.reducer.drop_early()
        if self._heads is not None:
            self._heads.end_backward()
