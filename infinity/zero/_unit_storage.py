"""The storage operations of units: gather (issue, then wait), release, and reduce a unit's
gradient (issue, then wait, a bounded number in flight). The parameter manager decides *when*
(its hooks and the order); this decides nothing about timing and moves a unit's state only
through its table (:data:`~infinity.zero._flat_group.UNIT_TRANSITIONS`), as FSDP2's
``FSDPParamGroup`` does for its all-gathers and reduce-scatters.

States: RELEASED -(issue_gather)-> GATHERING -(wait_gather)-> GATHERED -(release)-> RELEASED, and
GATHERED -(issue_gather, refresh)-> GATHERING after a step. Handles of a gather in flight, and
what to do once it landed, live on the unit (``Unit.pending``); reductions in flight live here,
oldest first.
"""

from __future__ import annotations

import collections
from typing import Callable

import torch

from infinity.io import advise_huge_pages, engine_buffers
from infinity.tiers import Tier, TieredStore
from infinity.zero._collectives import DONE, CommHandle, Collectives, Phase, check_env_enabled
from infinity.zero._flat_group import FlatGroup, Unit, UnitState
from infinity.zero._grad_reducer import GradientReducer, Reduction
from infinity.zero._hpz import SecondaryPartition
from infinity.zero._manager_config import ManagerConfig
from infinity.zero._quantized_collectives import all_gather_quantized


class UnitStorage:
    """Gathers, releases and reduces units for one parameter manager."""

    def __init__(self, config: ManagerConfig, *, collectives: Collectives,
                 store: TieredStore | None, reducer: GradientReducer,
                 hpz: SecondaryPartition | None, read_tier: Tier, borrow_copies: bool,
                 reduce_inflight: int, on_bytes_changed: Callable[[], None]):
        """``read_tier``: where gathers read stored shards. ``borrow_copies``: gathers of stored
        groups borrow the copy they read ([Note: a gathered unit borrows its HOST copy]).
        ``reduce_inflight``: reductions left in flight beside the next unit's staging (0: each
        waited at once). ``on_bytes_changed``: called after a gather or a reduction is issued
        (the manager's peak of device bytes)."""
        self.config = config
        self.coll = collectives
        self.store = store
        self.reducer = reducer
        self.hpz = hpz
        self.read_tier = read_tier
        self.borrow_copies = borrow_copies
        self.reduce_inflight = reduce_inflight
        self._on_bytes_changed = on_bytes_changed
        self.num_gathers = 0
        """Unit gathers issued (forward, backward and after-step), for stats()."""
        self.num_borrowed_gathers = 0
        """Group gathers that borrowed the copy they read instead of copying it, for stats()."""
        self.busy = 0
        """Nonzero while a gather copies into unit buffers (the outside-use detector ignores
        those reads)."""
        self.borrowed: dict[int, tuple[FlatGroup, torch.UntypedStorage, torch.Tensor]] = {}
        """id(group) -> (group, the storage that holds the group's own empty data pointer while
        ``group.full`` points at the borrowed copy, that copy: its reference keeps the arena's
        memory alive should the store close first)."""
        self.stale_borrowed: set[str] = set()
        """Keys of borrowed copies an optimizer write left partly written: evicted when the unit
        gives them back (while borrowed they are pinned)."""
        self.reductions: collections.deque[Reduction] = collections.deque()
        """Gradient reductions issued and not yet waited, oldest first."""
        self.spread: collections.deque[Reduction] = collections.deque()
        """Reductions issued in pieces, waited at the end of backward ([Note: a large reduction
        spread over the backward] in infinity/zero/_grad_reducer.py)."""

    # ------------------------------------------------------------------ gather

    def _check(self, unit: Unit, phase: Phase, step: int) -> None:
        if self.coll.data_parallel_size > 1 and (step == 0 or check_env_enabled()):
            self.coll.check_agreement(step=step, phase=phase, unit_index=unit.index,
                                      unit_name=unit.name, device=self.config.device)

    def gather(self, unit: Unit, phase: Phase, step: int) -> None:
        """Gather ``unit`` now (or refresh a gathered one): issue, then wait."""
        self.issue_gather(unit, phase, step, refresh=True)
        self.wait_gather(unit)

    def issue_gather(self, unit: Unit, phase: Phase, step: int, *, refresh: bool = False
                     ) -> None:
        """Allocate ``unit``'s full buffers and issue their all-gathers ([Note: issue and wait]
        in infinity/zero/_collectives.py); :meth:`wait_gather` completes them. A unit in flight
        already is left as it is; a gathered one too, unless ``refresh`` (after a step)."""
        if unit.state is UnitState.GATHERING or (unit.state is UnitState.GATHERED
                                                 and not refresh):
            return
        hpz = self.hpz
        if hpz is not None and phase is Phase.BACKWARD_GATHER and hpz.holds(unit.groups):
            # Inside the node: [Note: hpZ secondary shards] in infinity/zero/_hpz.py
            phase = Phase.SECONDARY_GATHER
        keep = (hpz is not None and phase is Phase.FORWARD_GATHER and not unit.always_gathered
                and torch.is_grad_enabled())
        self._check(unit, phase, step)
        self.busy += 1  # our own copies must not look like outside uses to the detector
        try:
            with torch.profiler.record_function(f"infinity::gather ({unit.name})"):
                for g in unit.groups:
                    # (no hpZ secondary gathers here: borrow_copies excludes hpZ)
                    if self.borrow_copies and not unit.always_gathered \
                            and g.store_key is not None and self._borrow(g):
                        continue
                    with engine_buffers():  # [Note: freed buffers leave the process] (io)
                        g.full.untyped_storage().resize_(g.padded_numel * g.full.element_size())
                    advise_huge_pages(g.full)  # [Note: first touch of large host buffers] (io)
                    context = (f"{phase.value} of unit {unit.index} {unit.name!r} "
                               f"(micro-step {step})")
                    if phase is Phase.SECONDARY_GATHER:
                        unit.pending.append(hpz.gather(g, context=context))
                    elif g.store_key is None:
                        unit.pending.append(
                            self._all_gather(unit, g, g.shard, context=context, phase=phase))
                    else:  # the store's copy stays acquired until the gather has read it
                        key, tier = g.store_key, self.read_tier
                        shard = self.store.acquire(key, tier).wait()
                        unit.pending.append(lambda key=key, tier=tier:
                                            self.store.release(key, tier))
                        unit.pending.append(
                            self._all_gather(unit, g, shard, context=context, phase=phase))
                    if keep:
                        unit.pending.append(lambda g=g: hpz.keep(g))
        finally:
            self.busy -= 1
        unit.transition(UnitState.GATHERING)
        self.num_gathers += 1
        self._on_bytes_changed()

    def wait_gather(self, unit: Unit) -> None:
        """Complete ``unit``'s issued gathers (a no-op unless it is GATHERING)."""
        if unit.state is not UnitState.GATHERING:
            return
        pending, unit.pending = unit.pending, []
        # The collectives first: a store copy is given back once its gather has read it.
        for item in pending:
            if isinstance(item, CommHandle):
                item.wait()
        for item in pending:
            if not isinstance(item, CommHandle):
                item()
        unit.transition(UnitState.GATHERED)

    def _all_gather(self, unit: Unit, g: FlatGroup, shard: torch.Tensor, *, context: str,
                    phase: Phase) -> CommHandle:
        """One group's all-gather, issued: quantized (qwZ, synchronous: it decodes what it
        receives) for the gathers around compute of units gathered on demand, when configured;
        exact for the always-gathered units, after-step and state-dict gathers (they are kept
        or saved, not recomputed each step)."""
        spec = self.config.quant.quantizes_gather(g.requires_grad)
        if (spec is not None and phase in (Phase.FORWARD_GATHER, Phase.BACKWARD_GATHER)
                and not unit.always_gathered):
            all_gather_quantized(self.coll, g.full, shard, spec=spec, context=context, phase=phase)
            return DONE
        return self.coll.all_gather_async(g.full, shard, context=context, phase=phase)

    def release(self, unit: Unit) -> None:
        # [Note: release keeps parameter identity] in infinity/zero/_param_manager.py
        self.wait_gather(unit)  # a gather in flight still writes into the buffers
        for g in unit.groups:
            if not self.give_back(g):
                g.full.untyped_storage().resize_(0)
        unit.transition(UnitState.RELEASED)

    # ------------------------------------------------------------------ borrowed copies

    def _borrow(self, g: FlatGroup) -> bool:
        """[Note: a gathered unit borrows its HOST copy]
        With one data-parallel rank the gathered unit is the shard itself, and on a CPU engine
        that reads shards from HOST ([Note: a CPU engine reads parameter shards from HOST] in
        infinity/zero/_manager_config.py) the shard is already in host memory, page-aligned in the arena,
        where the prefetcher's NVMe read put it. Copying it into the unit's own buffer cost a
        fresh buffer (faulted in) and a copy per gather: on 8 of 7B's layers (LoRA, the frozen
        base on NVMe, 405 MB per layer, read twice a step) 31 copies a step and 6.6 s of the
        step's 13.5 s on two cores, against 3.5 s for plain PyTorch's whole step. So the gather
        pins the HOST copy and points the unit's storage at it (``_swap_data_ptr_``: the
        parameters stay views of the same storage object, as [Note: release keeps parameter
        identity] needs, and so do tensors autograd saved); the release swaps back and unpins.
        The unit then lives inside the HOST budget, not beside it, so a borrow must leave room in
        the arena for two more shards of this size (a prefetch and a demand read): else this
        gather copies, as before. The optimizer writing the shard writes the same bytes the unit
        shows, which is what it would read after the step anyway.

        A CPU engine whose DEVICE tier holds every parameter shard (``device_holds_params``: the
        tests' and benchmarks' stand-in for a GPU with room for them all) reads them from that
        tier, and borrows that copy the same way; it needs no room check, since those copies are
        never evicted. Measured on the 2-core VM (135M GPT, bf16, parameters and optimizer on
        NVMe, budget half the state): the copies into the units' own buffers and the freeing of
        those buffers were 0.13 s of a 2.0 s step. A GPU's device-to-device copy costs next to
        nothing, and borrowing there is untried: it still copies."""
        key, tier = g.store_key, self.read_tier
        nbytes = g.padded_numel * g.full.element_size()
        tensor = self.store.acquire(key, tier).wait()
        if (tensor.numel() != g.padded_numel or tensor.dtype != g.full.dtype
                or (tier is Tier.HOST and self.store.reclaimable_bytes(tier) < 2 * nbytes)):
            self.store.release(key, tier)
            return False
        own = torch._C._construct_storage_from_data_pointer(tensor.data_ptr(), tensor.device,
                                                              nbytes)
        g.full.untyped_storage()._swap_data_ptr_(own)  # g.full shows the HOST copy; own is empty
        self.borrowed[id(g)] = (g, own, tensor)
        self.num_borrowed_gathers += 1
        return True

    def give_back(self, g: FlatGroup) -> bool:
        """Undo :meth:`_borrow`; False when ``g`` holds its own buffer."""
        entry = self.borrowed.pop(id(g), None)
        if entry is None:
            return False
        g.full.untyped_storage()._swap_data_ptr_(entry[1])  # empty again, its own allocator
        self.store.release(g.store_key, self.read_tier)
        if g.store_key in self.stale_borrowed:  # a failed write left it partly written
            self.stale_borrowed.discard(g.store_key)
            self.store.evict(g.store_key, self.read_tier)
        return True

    def own_buffers(self, unit: Unit) -> None:
        """Give back the borrowed copies of a unit that is to stay gathered (it would pin them
        for good): its own buffers instead, with the same values."""
        for g in unit.groups:
            if id(g) in self.borrowed:
                values = g.full.clone()
                self.give_back(g)
                with engine_buffers():
                    g.full.untyped_storage().resize_(g.padded_numel * g.full.element_size())
                g.full.copy_(values)

    # ------------------------------------------------------------------ reduce

    def issue_reduce(self, unit: Unit, phase: Phase, step: int, *, pieces: int = 1) -> None:
        """Issue the reduction of ``unit``'s staged gradients. The oldest reductions land first
        (FSDP2 waits for the last reduce-scatter at the next one), so at most
        ``reduce_inflight`` are in flight beside this unit's staging. ``pieces`` > 1: its
        reduce-scatter goes in that many pieces, one more with each later reduction
        ([Note: a large reduction spread over the backward] in infinity/zero/_grad_reducer.py);
        such a reduction is not counted in ``reduce_inflight`` (the unit's staging is what the
        bound would have freed, and it lives until the last piece is copied out either way)."""
        self._check(unit, phase, step)
        context = f"{phase.value} of unit {unit.index} {unit.name!r} (micro-step {step})"
        while self.reduce_inflight and len(self.reductions) >= self.reduce_inflight:
            self.reductions.popleft().wait()
        for spread in self.spread:
            spread.issue_piece()
        with torch.profiler.record_function(f"infinity::reduce ({unit.name})"):
            reduction = self.reducer.issue(unit.groups, context=context, pieces=pieces)
        (self.spread if pieces > 1 else self.reductions).append(reduction)
        self._on_bytes_changed()
        if not self.reduce_inflight:
            self.wait_reductions()

    def wait_reductions(self) -> None:
        """Wait for every reduction issued; the pieces not issued yet go first, in order."""
        for spread in self.spread:
            while spread.issue_piece():
                pass
        while self.reductions:
            self.reductions.popleft().wait()
        while self.spread:
            self.spread.popleft().wait()

    def tensors_in_flight(self) -> list[torch.Tensor]:
        """The buffers of reductions issued and not yet waited."""
        return [t for r in (*self.reductions, *self.spread) for t in r.tensors()]
