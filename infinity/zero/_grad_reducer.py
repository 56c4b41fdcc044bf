"""The gradient half of the parameter manager: staging, reduction across ranks, accumulation.

:class:`GradientReducer` is owned by :class:`~infinity.zero._param_manager.ParameterManager`, which
decides *when* a unit's gradients are complete (its hooks and the end of backward); this module owns
what happens to a gradient from ``param.grad`` to the optimizer's fp32 partition.

[Note: gradient ledger]
Autograd writes ``param.grad`` (compute dtype); the post-accumulate-grad hook adds it into the
unit's staging buffer (full padded size, alive only during backward; fp32, or the compute dtype
where nothing is summed in fp32: [Note: staging in the accumulator's dtype] in
infinity/ledger/_estimate.py) and drops
``param.grad``.
When every trainable parameter of the unit has its gradient, the staging buffer is averaged over
ranks (reduce-scatter for stages 2-3, all-reduce for 0-1, on the shard group; over a mesh the
partition is then summed across the replicas, and the average is over all R * S data-parallel
ranks: [Note: collectives over a mesh] in infinity/zero/_collectives.py) into the fp32
accumulator, which holds
the sum over micro-batches until the optimizer step. Where that accumulator lives (the device,
or host memory when the optimizer is offloaded) is [Note: gradient placement] in
infinity/ledger/_estimate.py. With several ranks every unit is reduced in every backward, in one
fixed order, with zeros where a rank has no gradient ([Note: every rank reduces every unit in one
order] in infinity/zero/_reduce_order.py); a unit's reduction is issued, and waited for (and
accumulated) while the next unit's backward runs ([Note: issue and wait] in
infinity/zero/_collectives.py).

[Note: gradients on NVMe]
Host accumulators hold 2-4 B per parameter for the whole model until the step: 6.6-13 GB at 3.3B
parameters, which alone breaks "host memory does not grow with the model". So when the optimizer
is on NVMe and the host budget cannot hold every accumulator beside the NVMe staging (an explicit
budget too small for them, or an 'auto' one that would pass AUTO_HOST_RAM_FRACTION of the RAM;
the offload budgets decide, :mod:`infinity.tiers._offload_budgets`), each accumulator is a
:class:`~infinity.optim.StoredGrad`: NVMe-homed slices of the store, one per optimizer sub-group.
The reduced gradient of a unit is written slice by slice into a HOST copy (the first micro-batch
overwrites it without reading, later ones read and add), marked dirty and written back at once,
so the store may evict it under the budget like any clean copy; the optimizer acquires each
slice with its sub-group and drops it once stepped. This is ZeRO-Infinity's choice (gradient
partitions go to NVMe) over fusing the update into backward, which cannot clip by the exact
global norm: that needs every gradient first. The norm needs no read-back either: each slice's
sum of squares is taken while it is in memory, after the last addition (``StoredGrad.sum_sq``).
The price is the gradient's bytes written once and read once per step (+2-4 B per parameter of
NVMe traffic against the optimizer's 24), paid only where the host cannot hold them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import torch

from infinity._async_copy import SideStream, StagingRing
from infinity._modeled_link import ModeledLink
from infinity.io import advise_huge_pages, engine_buffers, pinned_staging_ring
from infinity.optim import StoredGrad
from infinity.tiers import Tier, TieredStore, TierHandle
from infinity.zero._collectives import DONE, Collectives, Phase
from infinity.zero._flat_group import FlatGroup, ParamSlot
from infinity.zero._grad_landing import LinkLanding
from infinity.zero._grad_norm import sum_of_squares
from infinity.zero._quantize import QuantSpec
from infinity.zero._quantized_collectives import reduce_scatter_sum_quantized
from infinity.zero._reduction import Reduction, _GroupReduction, _PiecewiseReduction
from infinity.zero._rows_exchange import add_rows_into, gather_rows, route_rows, unpack_rows


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReducerConfig:
    """The settings of one :class:`GradientReducer` (resolved by the engine)."""

    stage: int
    device: torch.device
    reduce_dtype: torch.dtype
    """What gradients cross ranks in: fp32, or the compute dtype (``precision.reduce_dtype``)."""
    host_dtype: torch.dtype
    """Dtype of the host accumulators of an offloaded optimizer (``ledger.host_grad_dtype_of``)."""
    staging_dtype: torch.dtype = torch.float32
    """Dtype of a unit's gradient staging: ``host_dtype`` or fp32 ([Note: staging in the
    accumulator's dtype] in infinity/ledger/_estimate.py)."""
    stored_slice_numel: int | None = None
    """The optimizer's sub-group size when the accumulators are NVMe-homed slices of it
    ([Note: gradients on NVMe]); None: whole HOST-homed accumulators."""
    grad_quant: QuantSpec | None = None
    """qgZ: the reduce-scatter sends quantized slices, summed in fp32 ([Note: qgZ as one
    all-to-all] in infinity/zero/_quantized_collectives.py); None: ``reduce_dtype``."""


class GradientReducer:
    """Gradient staging, reduction and accumulation for the flat groups of one parameter manager.

    ``host_store``: the optimizer lives off the device, so each group's reduced gradient moves
    right after its reduction into an accumulator homed in this store's host arena; None keeps
    the accumulators on the device. ``on_ready(key)``: called once a trainable group's gradient of
    this backward is reduced and accumulated (the engine starts reading that group's NVMe
    optimizer state then; [Note: optimizer read-ahead] in infinity/optim/_offloaded.py)."""

    def __init__(self, config: ReducerConfig, *, collectives: Collectives,
                 host_store: TieredStore | None = None,
                 on_ready: Callable[[str], None] | None = None):
        self.config = config
        self.coll = collectives
        self.world_size = collectives.world_size
        """The shard degree (S): what the reduce-scatter splits over."""
        self.rank = collectives.rank
        self.data_parallel_size = collectives.data_parallel_size
        """What the gradients are averaged over: every data-parallel rank (R * S)."""
        self.host_store = host_store
        """Holds the host accumulators of an offloaded optimizer; None: on the device."""
        self.on_ready = on_ready
        self._ring: StagingRing | None = None
        """Pinned staging of gradients copied down to host accumulators from a GPU (None until
        used; [Note: event-guarded staging] in infinity/_async_copy.py)."""
        self._down = SideStream(config.device)
        """Where the copies down to host accumulators run ([Note: copies on a side stream] in
        infinity/_async_copy.py); :meth:`partitions` waits for them."""
        self._writebacks: list[TierHandle] = []
        """Write-backs of stored gradient slices issued in this accumulation window (their
        errors are raised by :meth:`partitions`)."""
        self._landing: LinkLanding | None = None
        """[Note: gradients down a modeled link]; None: copies take the time they take."""
        self._early: dict[int, _PiecewiseReduction] = {}
        """id(group) -> its reduction begun before its unit's turn (:meth:`begin_pieces`)."""
        self._replicas_at_step = collectives.replicate is not None and host_store is None
        """[Note: replicas summed once per step]: the accumulators are on the compute device,
        so the replicas sum them at the step instead of each micro-batch's gradient."""
        self._replicas_owed = False
        """A reduction of this window left the replicas' sum to the step."""
        self.sums_locally = False
        """[Note: one all-reduce per window at stages 0-1]: this backward's gradients stay in
        this rank's accumulators (set by the engine before each backward)."""
        self._local: set[int] = set()
        """id(group): accumulators that hold this rank's own sum, not yet all-reduced."""

    def attach_down_link(self, link: ModeledLink, on_wait: Callable[[float], None]) -> None:
        """[Note: gradients down a modeled link]: the copies down to host accumulators go on
        ``link`` (a CPU engine's device->host direction); ``on_wait`` gets the seconds the
        training thread waited for them."""
        self._landing = LinkLanding(link, on_wait)

    @property
    def offloaded(self) -> bool:
        return self.host_store is not None

    def register_accumulators(self, groups: Iterable[FlatGroup]) -> None:
        """[Note: gradient placement]: one accumulator per trainable group over the optimizer's
        partition (fp32, or the compute dtype where nothing is summed in fp32: ``host_dtype``),
        homed in the store's host arena (so ``memory.host_budget_bytes`` covers it), allocated
        once and never evicted (a HOST home copy stays put); or, with ``stored_slice_numel``,
        NVMe-homed slices of it ([Note: gradients on NVMe])."""
        sub = self.config.stored_slice_numel
        for g in groups:
            key = f"grad/{g.key}"
            numel = self.accumulator_numel(g)
            if sub is None:
                self.host_store.register(key, numel, self.config.host_dtype, Tier.HOST)
                g.grad_host = self.host_store.get(key, Tier.HOST)
                continue
            bounds = tuple((lo, min(numel, lo + sub)) for lo in range(0, numel, sub))
            keys = tuple(f"{key}/{i}" for i in range(len(bounds)))
            for (lo, hi), k in zip(bounds, keys):  # zeros, no file until first written
                self.host_store.register(k, hi - lo, self.config.host_dtype, Tier.NVME)
            g.grad_stored = StoredGrad(store_keys=keys, bounds=bounds)

    def accumulator_numel(self, g: FlatGroup) -> int:
        """Elements of ``g``'s accumulator of an offloaded optimizer: the optimizer's partition
        (the whole padded buffer at stage 0, this rank's shard from stage 1 on)."""
        return g.padded_numel if self.config.stage == 0 else g.shard_numel

    def accumulator_bytes(self, groups: Iterable[FlatGroup]) -> int:
        """Bytes of the accumulators of ``groups`` (host buffers or stored slices alike)."""
        return sum(self.accumulator_numel(g) for g in groups) * self.config.host_dtype.itemsize

    def stage(self, group: FlatGroup, slot: ParamSlot, grad: torch.Tensor) -> None:
        """Put one parameter's ``grad`` into its group's staging buffer (created on first use):
        [Note: staging writes each gradient once]."""
        if group.grad_staging is None:
            group.grad_staging = self._new_staging(group)
            group.grad_staged = set()
        view = group.grad_staging[slot.offset:slot.offset + slot.numel]
        if id(slot) in group.grad_staged:
            view.add_(grad.reshape(-1))  # a parameter used again in this backward (tied weights)
        else:
            view.copy_(grad.reshape(-1))
            group.grad_staged.add(id(slot))  # not the offset: a zero-size slot shares the next's

    def _completed_staging(self, g: FlatGroup) -> torch.Tensor:
        """[Note: staging writes each gradient once]
        The staging buffer is not zeroed when it is made: each parameter's first gradient of the
        backward is copied into its slot, later ones (a parameter used twice) are added, and only
        what no gradient wrote (the padding, the gaps of 16-byte aligned slots, parameters
        without a gradient in this backward) is zeroed here, before the buffer is reduced.
        Zeroing the whole buffer and adding every gradient into it cost two more passes over it
        per backward: on the 135M GPT (bf16, 2-core VM) 0.16 s of a 1.8 s step with fp32
        staging, against plain PyTorch, whose gradient is autograd's own tensor. The values are
        the same: 0 + g is g (bar the sign of a zero, which no sum, square or Adam moment keeps)."""
        staging = g.grad_staging
        staged = g.grad_staged
        if staging is None:
            staging, staged = self._new_staging(g), set()
        pos = 0
        for s in g.slots:  # in offset order (layout_group places them one after another)
            if id(s) in staged:
                if s.offset > pos:
                    staging[pos:s.offset].zero_()
                pos = s.offset + s.numel
        if pos < staging.numel():
            staging[pos:].zero_()
        return staging

    def _stages_in_host(self, g: FlatGroup) -> bool:
        """One rank, an empty host accumulator on the compute device (CPU): the staging buffer is
        the accumulator itself, so the reduce and the host copy are no-ops (two full fp32 copies
        of the gradients a step saved)."""
        return (self.data_parallel_size == 1 and g.grad_host is not None and g.grad_acc is None
                and self._landing is None  # modeled: staged "on the device", then copied
                and g.grad_host.device == self.config.device
                and g.grad_host.numel() == g.padded_numel)

    @property
    def staging_dtype(self) -> torch.dtype:
        """The dtype a unit's gradient is staged in: the resolved ``ReducerConfig.staging_dtype``
        ([Note: staging in the accumulator's dtype] in infinity/ledger/_estimate.py)."""
        return self.config.staging_dtype

    def _new_staging(self, g: FlatGroup) -> torch.Tensor:
        """An unzeroed staging buffer ([Note: staging writes each gradient once])."""
        if self._stages_in_host(g):
            return g.grad_host
        with engine_buffers():  # [Note: freed buffers leave the process] in infinity/io
            staging = torch.empty(g.padded_numel, dtype=self.staging_dtype,
                                  device=self.config.device)
        advise_huge_pages(staging)  # [Note: first touch of large host buffers] in infinity/io
        return staging

    def issue(self, groups: Iterable[FlatGroup], *, context: str, pieces: int = 1
              ) -> "Reduction":
        """Average each trainable group's staging buffer over the ranks into its accumulator
        (``context`` names the collective in errors); a group without staging contributes zeros
        (the ranks that have some still need this rank's part of the collective). The
        collectives are issued here; the accumulation runs at the returned reduction's wait
        ([Note: issue and wait] in infinity/zero/_collectives.py). ``pieces`` > 1: a stage 2-3
        reduce-scatter is cut into that many, the first issued here, the others by
        :meth:`Reduction.issue_piece` ([Note: a large reduction spread over the backward])."""
        return Reduction([self._issue_group(g, context, pieces) for g in groups
                          if g.requires_grad])

    def _issue_group(self, g: FlatGroup, context: str, pieces: int = 1
                     ) -> "_GroupReduction | _PiecewiseReduction":
        early = self._early.pop(id(g), None)
        if early is not None:  # begun in the head's backward: its turn issues one more piece
            if early.staging is not None:  # pieces left: what no gradient wrote is zeroed
                self._completed_staging(g)
            g.grad_staging = None
            early.issue_next()
            return early
        staging = self._completed_staging(g)
        g.grad_staging = None  # the next stage() makes a buffer and its staged set anew
        if self._in_pieces(g, pieces):
            part = torch.empty(g.shard_numel, dtype=self._wire_dtype(staging),
                               device=self.config.device)
            return _PiecewiseReduction(self, g, staging, part, pieces, context)
        if self.data_parallel_size > 1:
            staging.div_(self.data_parallel_size)
        if self.config.stage < 2 and self.sums_locally:
            # [Note: one all-reduce per window at stages 0-1]: added into this rank's own sum
            self._local.add(id(g))
            return _GroupReduction(self, g, DONE, lambda: staging, (staging,))
        if id(g) in self._local:  # the window's last backward: the sum so far goes with it
            staging.add_(g.grad_acc)
            g.grad_acc = None
            self._local.discard(id(g))
        # precision.reduce_dtype 'compute': the wire carries the compute dtype (half the
        # bytes with bf16/fp16); the sum lands back in the staging's dtype (fp32 unless
        # [Note: staging in the accumulator's dtype]) for the accumulator.
        wire = staging if self._wire_dtype(staging) == staging.dtype \
            else staging.to(self.config.reduce_dtype)
        if self.config.stage == 0:
            return self._issue_all_reduce(g, staging, wire, context)
        if self.config.stage == 1:
            return self._issue_shard_of_sum(g, staging, wire, context)
        if self.world_size == 1:
            return self._issue_one_shard(g, staging, wire, context)
        if self.config.grad_quant is not None:
            return self._issue_quantized(g, staging, context)
        return self._issue_reduce_scatter(g, staging, wire, context)

    def _issue_one_shard(self, g: FlatGroup, staging: torch.Tensor, wire: torch.Tensor,
                         context: str) -> _GroupReduction:
        """Stages 2-3 with one shard rank: the shard is the whole buffer, so no reduce-scatter
        and no copy; only the replicas (if any) sum it."""
        part = wire
        self._sum_replicas(part, context=context)
        if part is not staging:  # the replicas' wire dtype: back to the staging's
            part = part.to(staging.dtype)
        # else the staging's dtype already, or the host accumulator itself
        # (_stages_in_host: in place; converting it to fp32 and back cost 0.14 s of the
        # 135M GPT's bf16 step)
        return _GroupReduction(self, g, DONE, lambda: part, (staging, wire))

    def _issue_quantized(self, g: FlatGroup, staging: torch.Tensor, context: str
                         ) -> _GroupReduction:
        """qgZ inside the shard group; the replicas then sum the fp32 shard exactly.
        Synchronous: the quantizer's all-to-all and its sum are one call."""
        part = torch.empty(g.shard_numel, dtype=torch.float32, device=self.config.device)
        reduce_scatter_sum_quantized(self.coll, part, staging, spec=self.config.grad_quant,
                                     context=context, phase=Phase.REDUCE_GRAD)
        self._sum_replicas(part, context=context)
        return _GroupReduction(self, g, DONE, lambda: part, (staging, part))

    def _issue_reduce_scatter(self, g: FlatGroup, staging: torch.Tensor, wire: torch.Tensor,
                              context: str) -> _GroupReduction:
        """Stages 2-3: this rank's shard of the sum, the replicas summed at the wait."""
        part = torch.empty(g.shard_numel, dtype=wire.dtype, device=self.config.device)
        handle = self.coll.reduce_scatter_sum_async(part, wire, context=context,
                                                    phase=Phase.REDUCE_GRAD)

        def scattered() -> torch.Tensor:
            self._sum_replicas(part, context=context)
            return part.to(staging.dtype)  # no copy when the wire is that already
        return _GroupReduction(self, g, handle, scattered, (staging, wire, part))

    def _issue_all_reduce(self, g: FlatGroup, staging: torch.Tensor, wire: torch.Tensor,
                          context: str) -> _GroupReduction:
        """Stage 0: the whole sum on every rank."""
        handle = self.coll.all_reduce_sum_async(wire, context=context, phase=Phase.REDUCE_GRAD)

        def reduced() -> torch.Tensor:
            self._sum_replicas(wire, context=context)
            if wire is not staging:
                staging.copy_(wire)
            return staging
        return _GroupReduction(self, g, handle, reduced, (staging, wire))

    def _issue_shard_of_sum(self, g: FlatGroup, staging: torch.Tensor, wire: torch.Tensor,
                            context: str) -> _GroupReduction:
        """[Note: stage 1 reduce-scatters]
        Stage 1's optimizer steps this rank's shard of each group and reads nothing else of the
        summed gradient (:meth:`partitions` hands it the shard; the replicas sum only it), so the
        sum crosses as a reduce-scatter: (W-1)/W of the buffer per rank, half an all-reduce's
        2 (W-1)/W, which is what the planner prices for stage 1 (``_reduce_once`` in
        infinity/ledger/_pricing.py) and what DeepSpeed's stage 1 sends. The accumulator on the
        device stays the whole buffer, as the ledger counts it: the reduced shard lands in its
        slice of the staging, which becomes (or is added into) the accumulator; the rest of it
        holds this rank's own gradients, which nothing reads. An offloaded optimizer's host
        accumulator is the shard alone."""
        lo, hi = self.rank * g.shard_numel, (self.rank + 1) * g.shard_numel
        part = torch.empty(g.shard_numel, dtype=wire.dtype, device=self.config.device)
        handle = self.coll.reduce_scatter_sum_async(part, wire, context=context,
                                                    phase=Phase.REDUCE_GRAD)

        def scattered() -> torch.Tensor:
            self._sum_replicas(part, context=context)
            if self.offloaded:  # only its shard leaves
                return part.to(staging.dtype)
            staging[lo:hi].copy_(part)
            return staging
        return _GroupReduction(self, g, handle, scattered, (staging, wire, part))

    def _wire_dtype(self, staging: torch.Tensor) -> torch.dtype:
        """What a reduction of ``staging`` carries: ``precision.reduce_dtype`` over several
        ranks (qgZ quantizes the staging's own dtype), else the staging's."""
        if (self.data_parallel_size == 1 or self.config.reduce_dtype == torch.float32
                or self.config.grad_quant is not None):
            return staging.dtype
        return self.config.reduce_dtype

    @property
    def may_sum_locally(self) -> bool:
        """[Note: one all-reduce per window at stages 0-1]
        At stages 0-1 with the optimizer on the device each rank's accumulator is the whole
        gradient (the ledger's 2 + 2 + K/N: [Note: gradient placement] in
        infinity/ledger/_estimate.py), and every rank adds each micro-batch's all-reduced
        gradient into it. Addition commutes: each rank may as well add its own gradients into
        it over the window and all-reduce the sum once, in the window's last backward, which is
        what DeepSpeed does at stages 0-1 (its all-reduce at the accumulation boundary) and
        DDP's ``no_sync``: 1/GA of the bytes, at the same memory. The engine says before each
        backward whether the next ``step()`` ends the window (:attr:`sums_locally`): if not,
        each unit's staged gradient, divided by the ranks as before, is added into this rank's
        accumulator without a collective; in the last backward each unit's staging and its
        accumulator's sum so far cross together, overlapped with the backward as every
        reduction is. A window a caller ends early (``step(boundary=True)``) all-reduces what is
        still this rank's own at the step, exposed but exact. Embedding rows
        ([Note: embedding rows cross ranks as rows] in infinity/zero/_embedding_rows.py) take
        the dense path in such windows, so that they too are summed in the accumulators and
        cross once. Stages 2-3 reduce-scatter each micro-batch as before (their accumulator
        is a shard: a local sum would need the whole gradient kept), and so does an offloaded
        optimizer's host accumulator (NCCL reduces device memory only)."""
        return self.config.stage < 2 and self.data_parallel_size > 1 and self.host_store is None

    @property
    def holds_local_sums(self) -> bool:
        """This backward sums locally, or some accumulator still holds a rank's own sum: the
        embedding rows take the dense path, which folds them in as any gradient
        ([Note: one all-reduce per window at stages 0-1])."""
        return self.sums_locally or bool(self._local)

    def _all_reduce_local_at_step(self, groups: list[FlatGroup]) -> None:
        """[Note: one all-reduce per window at stages 0-1]: a window ended before the backward
        the engine expected to be its last; what each rank summed alone is all-reduced now, in
        the groups' order on every rank (each rank summed every group alike: [Note: every rank
        reduces every unit in one order] in infinity/zero/_reduce_order.py)."""
        local = [g for g in groups if id(g) in self._local]
        self._local.clear()
        self._sum_in_place(self.coll, [(g.grad_acc, f"the window's gradient of {g.key}")
                                       for g in local], Phase.REDUCE_GRAD)
        # The replicas' share: as each micro-batch's all-reduce would have left it owed.
        if self._replicas_at_step and local:
            self._replicas_owed = True

    def _sum_in_place(self, coll: Collectives, accs: list[tuple[torch.Tensor, str]],
                      phase: Phase) -> None:
        """All-reduce each accumulator (with its context for errors) over ``coll``, all issued
        before the first wait, the wire in ``precision.reduce_dtype`` as a micro-batch's."""
        pending = []
        for acc, context in accs:
            wire = acc if self._wire_dtype(acc) == acc.dtype else acc.to(self._wire_dtype(acc))
            pending.append((coll.all_reduce_sum_async(wire, context=context, phase=phase),
                            acc, wire))
        for handle, acc, wire in pending:
            handle.wait()
            if wire is not acc:
                acc.copy_(wire)

    def _sum_replicas(self, part: torch.Tensor, *, context: str) -> None:
        """Sum one reduction's ``part`` across the replicas now, or leave it to the step
        ([Note: replicas summed once per step])."""
        if self._replicas_at_step:
            self._replicas_owed = True
            return
        self.coll.all_reduce_replicas(part, context=context)

    def _sum_replicas_at_step(self, groups: Iterable[FlatGroup]) -> None:
        """[Note: replicas summed once per step]
        Without replicas (R = 1) a micro-batch's gradient is reduced over the shard group and
        added into this rank's accumulator. With replicas it was also summed across them right
        there, once per micro-batch: GA times the bytes on the link between replicas, the
        slowest of the mesh (between nodes), where the planner ([Note: mesh time model] in
        infinity/ledger/_mesh_plan.py) prices it once per step, as MiCS does (Zhang et al.
        2022: the inter-group all-reduce at the accumulation boundary) and as DDP's
        ``no_sync`` does for plain data parallelism. Addition commutes, so each replica's
        accumulator may hold its own sum over the window and the replicas sum the accumulators
        once, at the step, before anything reads them (the norm, the clip, the optimizer); the
        average is the same (each micro-batch's gradient is already divided by R * S). It is
        done so where the accumulators are on the compute device (the optimizer there): an
        offloaded optimizer's accumulators are host memory (or NVMe slices), which NCCL does
        not reduce, so there each micro-batch's shard still crosses the replicas on the
        device, as before. The wire carries ``precision.reduce_dtype`` as each micro-batch's
        did. Every trainable group is summed, in one order on every rank: every rank reduced
        every group in each backward ([Note: every rank reduces every unit in one order] in
        infinity/zero/_reduce_order.py), so each holds an accumulator (zeros where no rank
        had a gradient, as a micro-batch's reduction gives); one that does not is summed as
        zeros all the same, so that the collectives match."""
        accs = []
        for g in groups:
            if g.grad_acc is None:
                g.grad_acc = torch.zeros(g.padded_numel if self.config.stage < 2 else g.shard_numel,
                                         dtype=self.staging_dtype, device=self.config.device)
            acc = g.grad_acc
            if self.config.stage == 1:  # only this rank's shard of the all-reduced buffer
                acc = acc[self.rank * g.shard_numel:(self.rank + 1) * g.shard_numel]
            accs.append((acc, f"the replicas' sum of {g.key}'s gradient"))
        self._sum_in_place(self.coll.replicate, accs, Phase.REPLICATE_REDUCE)

    def _in_pieces(self, g: FlatGroup, pieces: int) -> bool:
        """``g``'s reduction is a reduce-scatter cut into ``pieces``: stages 2-3 over several
        shards, not qgZ (whose quantizer reduces a whole buffer), a shard of at least that many
        elements (:class:`~infinity.zero._reduction._PiecewiseReduction` issues it).

        [Note: a large reduction spread over the backward]
        A collective runs over the link whole, and the link serves its transfers in the order they
        were issued (one NCCL communicator; the modeled link): so a unit reduced in the hooks much
        larger than the others holds every transfer issued after it. When a tied or untied LM head
        completes the root early in the backward ([Note: embedding rows cross ranks as rows] in
        infinity/zero/_embedding_rows.py), that is a 50k-vocabulary table's reduce-scatter (0.69 s
        of link on the 135M GPT at L = T0, 5x a block's) ahead of the next blocks' backward
        gathers: the blocks then wait for their parameters. So such a unit's reduce-scatter is cut
        into pieces along its shard (piece i: every rank's slice [lo_i, hi_i) of its shard, copied
        out contiguously and divided by the ranks, reduce-scattered into this rank's
        ``part[lo_i:hi_i]``), the first issued at its turn and one more with each later unit's
        reduction (the same sequence on every rank: the reduction order is), the rest at the end
        of backward: the table's bytes ride in the slack each block leaves on the link; a tapped
        LM head issues most of them before the unit's turn, as its backward makes them
        ([Note: the head's gradient reduced as it is made] in infinity/zero/_head_grad.py). Each
        piece's copy is the only extra memory (the staging is dropped once the last piece is
        copied out); the manager chooses the pieces (``ParameterManager._pieces``); the sum is the
        same sum."""
        return (self.config.stage >= 2 and self.world_size > 1 and pieces > 1
                and g.shard_numel >= pieces and self.config.grad_quant is None)

    def begin_pieces(self, g: FlatGroup, pieces: int, context: str
                     ) -> "_PiecewiseReduction | None":
        """[Note: the head's gradient reduced as it is made] in infinity/zero/_head_grad.py:
        ``g``'s reduce-scatter in ``pieces``, none issued yet, over its staging buffer (made
        now when there is none): the caller fills pieces and issues them
        (:meth:`_PiecewiseReduction.issue_piece`) before the unit's turn; at its turn
        (:meth:`issue`) the reduction goes on as one spread over the backward. None where a
        reduction of ``g`` began already in this backward, or where it is not a reduce-scatter
        in pieces (stages 0-1, one shard, qgZ, a shard smaller than ``pieces``)."""
        if not self._in_pieces(g, pieces) or id(g) in self._early:
            return None
        if g.grad_staging is None:
            g.grad_staging = self._new_staging(g)
            g.grad_staged = set()
        part = torch.empty(g.shard_numel, dtype=self._wire_dtype(g.grad_staging),
                           device=self.config.device)
        reduction = _PiecewiseReduction(self, g, g.grad_staging, part, pieces, context,
                                        issue_first=False)
        self._early[id(g)] = reduction
        return reduction

    def drop_early(self) -> None:
        """A backward that raised: forget the reductions begun in it (their pieces in flight
        landed first). The staging buffers keep every value, so the next backward's end reduces
        them whole ([Note: staging writes each gradient once])."""
        early, self._early = self._early, {}
        for reduction in early.values():
            reduction.drop()

    @property
    def routes_rows(self) -> bool:
        """Rows go to the rank whose shard holds them (:meth:`route_rows`): every partition is a
        shard (stages 2-3) and no replica needs them too (none, or the replicas sum the
        accumulators at the step: [Note: replicas summed once per step]); else every rank gets
        every rank's rows (:meth:`gather_rows`)."""
        return self.config.stage >= 2 and (self.coll.replicate is None or self._replicas_at_step)

    def gather_rows(self, payload: torch.Tensor, max_bytes: int, groups: list[FlatGroup], *,
                    context: str) -> None:
        """[Note: embedding rows cross ranks as rows] in infinity/zero/_embedding_rows.py:
        all-gather every data-parallel rank's packed rows (``payload``, this rank's; padded to
        ``max_bytes``, the largest rank's, a multiple of 8) and add those in this rank's
        partition of each of ``groups`` (numbered as packed) into its accumulator (of the
        shard group's ranks only where the replicas sum the accumulators at the step: [Note:
        replicas summed once per step]). Synchronous:
        it runs at the end of backward, where nothing is left to overlap."""
        # Over the shard group only where the replicas sum the accumulators at the step.
        group = self.coll if self._replicas_at_step else self.coll.world
        self._add_rows(gather_rows(group, payload, max_bytes, context=context), groups)

    def route_rows(self, payload: torch.Tensor, sizes: list[int], groups: list[FlatGroup], *,
                   context: str) -> None:
        """:meth:`gather_rows` for :attr:`routes_rows`: ``payload`` holds one chunk per shard
        rank (``sizes`` bytes each, :meth:`RowsPayload.pack`); an all-to-all of the sizes,
        then one of the chunks, so each rank receives only the rows of its shard: the bytes of
        one rank's rows, whatever the number of ranks."""
        self._add_rows(route_rows(self.coll, payload, sizes, context=context), groups)

    def _add_rows(self, chunks: list[torch.Tensor], groups: list[FlatGroup]) -> None:
        """Add the rows of packed ``chunks`` that fall in this rank's partition of each group."""
        number, index, values = unpack_rows(chunks)
        for i, g in enumerate(groups):
            mask = number == i
            if not bool(mask.any()):
                continue  # no rank has rows of it: its accumulator stays as it is
            lo, hi = self._partition_range(g)
            at, vals = index[mask], values[mask]
            inside = (at >= lo) & (at < hi)
            at, vals = at[inside] - lo, vals[inside]
            acc = g.grad_acc
            if (acc is not None and g.grad_stored is None and self._landing is None
                    and acc.device == at.device and acc.numel() == hi - lo):
                add_rows_into(acc, at, vals)  # where it is a tensor here: as the dense part
                if self.on_ready is not None:
                    self.on_ready(g.key)
                continue
            part = torch.zeros(hi - lo, dtype=torch.float32, device=self.config.device)
            part.index_add_(0, at.to(part.device), vals.to(part.device))
            self._finish(g, part if self.staging_dtype == torch.float32
                         else part.to(self.staging_dtype))

    def _partition_range(self, g: FlatGroup) -> tuple[int, int]:
        """The flat range of ``g`` this rank's accumulator holds: the whole buffer at stage 0 and
        for stage 1's device accumulators, this rank's shard otherwise."""
        stage = self.config.stage
        if stage == 0 or (stage == 1 and not self.offloaded):
            return 0, g.padded_numel
        return self.rank * g.shard_numel, (self.rank + 1) * g.shard_numel

    def _finish(self, g: FlatGroup, part: torch.Tensor) -> None:
        """One group's reduced gradient is in ``part``: accumulate it, tell the optimizer."""
        self._accumulate(g, part)
        if self.on_ready is not None:
            self.on_ready(g.key)

    def _accumulate(self, g: FlatGroup, part: torch.Tensor) -> None:
        """Add one micro-batch's reduced gradient into the accumulator: on the device, or, with an
        offloaded optimizer, into the host buffer, dropping the device copy
        ([Note: gradient placement] in infinity/ledger/_estimate.py), or into its stored slices."""
        if self._landing is not None and (g.grad_stored is not None or g.grad_host is not None):
            self._accumulate_over_link(g, part)
            return
        if g.grad_stored is not None:
            self._accumulate_stored(g.grad_stored, part)
            return
        if g.grad_host is None:
            if g.grad_acc is None:
                g.grad_acc = part
            else:
                g.grad_acc.add_(part)
            return
        if g.grad_acc is None and part.data_ptr() == g.grad_host.data_ptr():
            g.grad_acc = g.grad_host  # staged in place (_stages_in_host)
            return
        if part.device.type == "cpu":
            if g.grad_acc is None:
                g.grad_host.copy_(part)
                g.grad_acc = g.grad_host
            else:
                g.grad_acc.add_(part)
            return
        with self._down.issue(part):  # beside the backward's kernels; partitions() waits
            if g.grad_acc is None:
                g.grad_host.copy_(part, non_blocking=g.grad_host.is_pinned())
                g.grad_acc = g.grad_host
            else:
                self._add_from_device(g.grad_acc, part)

    def _accumulate_over_link(self, g: FlatGroup, part: torch.Tensor) -> None:
        """[Note: gradients down a modeled link]
        A CPU engine under a modeled host<->device link (``initialize(copy_link=...)``) copies
        each reduced gradient to its host accumulator as a GPU would: ``part`` is the device's
        buffer (never the accumulator itself: :meth:`_stages_in_host` is off), queued on the
        link's device->host direction, and its bytes land in the accumulator at the copy's
        modeled end, on a lane thread of its own; :meth:`partitions` waits for the landings
        before the optimizer reads them (the wait a GPU does on the side stream), and counts
        that wait as exposed. With ``poison_until_wait`` an accumulator a copy overwrites holds
        NaN from the issue until the landing, so a read that skips the wait is a wrong number.
        ``part`` is a fresh buffer per reduction, kept alive by the landing until it has run."""
        done_at = self._landing.reserve(part, g.key)
        if g.grad_stored is not None:
            stored = g.grad_stored
            land: Callable[[], None] = lambda: self._accumulate_stored(stored, part)
        elif g.grad_acc is None:
            host = g.grad_acc = g.grad_host
            if self._landing.link.model.poison_until_wait and host.is_floating_point():
                host.fill_(float("nan"))
            land = lambda: host.copy_(part)
        else:
            acc = g.grad_acc
            land = lambda: acc.add_(part)
        self._landing.submit(done_at, land)

    def _wait_landings(self) -> None:
        """The modeled copies down have landed; raises the first that failed."""
        if self._landing is not None:
            self._landing.wait()

    def close(self) -> None:
        """Stop the landing thread of a modeled link (after its last landing)."""
        if self._landing is not None:
            self._landing.close()

    def _add_from_device(self, acc: torch.Tensor, part: torch.Tensor) -> None:
        """``acc += part`` for a host accumulator and a GPU ``part`` without stalling backward:
        the copy down is non-blocking into pinned staging (on the caller's stream: the side
        stream of :meth:`_accumulate`), and the addition runs once it has landed, when its
        staging slot comes round again or at :meth:`partitions` ([Note: event-guarded staging]
        in infinity/_async_copy.py). The event also covers the earlier non-blocking copies into
        ``acc``: they were issued before it on the same stream."""
        ring = self._ring_for(part.device)
        slot, staging = ring.take(part.numel(), part.dtype)
        staging.copy_(part.reshape(-1), non_blocking=True)
        ring.done(slot, lambda: acc.add_(staging.view_as(acc)))

    def _ring_for(self, device: torch.device) -> StagingRing:
        if self._ring is None:
            self._ring = pinned_staging_ring(device)
        return self._ring

    def _accumulate_stored(self, stored: StoredGrad, part: torch.Tensor) -> None:
        """[Note: gradients on NVMe]: add ``part`` into the stored slices (the first micro-batch
        of a window overwrites them unread), each written back at once; the sum of squares is
        taken while each slice is in memory."""
        store, total = self.host_store, 0.0
        for (lo, hi), key in zip(stored.bounds, stored.store_keys):
            buf = store.acquire(key, Tier.HOST, overwrite=not stored.live).wait()
            try:
                if stored.live:
                    buf.add_(part[lo:hi].to(buf.device))
                else:  # a blocking copy: the write-back's thread reads the bytes next
                    buf.copy_(part[lo:hi])
                total += float(sum_of_squares(buf))
                store.mark_dirty(key, Tier.HOST)
            except BaseException:
                # The copy's bytes may be half written: drop it (overwrite's contract too), so
                # the home keeps the last sum that was marked dirty.
                store.release(key, Tier.HOST)
                store.evict(key, Tier.HOST)
                raise
            store.release(key, Tier.HOST)
            self._writebacks.append(store.write_back(key))
        stored.live, stored.sum_sq = True, total

    def partitions(self, groups: Iterable[FlatGroup]) -> dict[str, torch.Tensor | StoredGrad]:
        """Gradient per trainable group over the optimizer's partition (fp32, or the host
        accumulators' ``host_dtype``; a :class:`StoredGrad` where they are stored slices);
        absent when zero. Raises the error of any stored slice's write-back."""
        device = self.config.device
        if self.offloaded and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
            self._down.synchronize()  # the copies down have landed
        self._wait_landings()
        self._drain_ring()
        writebacks, self._writebacks = self._writebacks, []
        for handle in writebacks:
            handle.wait()
        groups = list(groups)
        if self._local:
            self._all_reduce_local_at_step(groups)
        if self._replicas_owed:
            self._sum_replicas_at_step(groups)
            self._replicas_owed = False
        out = {}
        for g in groups:
            if g.grad_stored is not None:
                if g.grad_stored.live:
                    out[g.key] = g.grad_stored
                continue
            if g.grad_acc is None:
                continue
            if self.config.stage == 1 and g.grad_acc is not g.grad_host:
                lo = self.rank * g.shard_numel
                out[g.key] = g.grad_acc[lo:lo + g.shard_numel]
            else:
                out[g.key] = g.grad_acc
        return out

    def _drain_ring(self) -> None:
        """Finish the additions still waiting for their copies (before anything reads or
        overwrites a host accumulator)."""
        if self._ring is not None:
            self._ring.drain()

    def zero(self, groups: Iterable[FlatGroup]) -> None:
        """Forget the accumulated gradients (the host buffers stay allocated, to be overwritten;
        stored slices are overwritten unread by the next micro-batch)."""
        self._wait_landings()  # a late addition must not land in the next window's sums
        self._drain_ring()
        self._replicas_owed = False  # a discarded window's sums go with it
        self._local.clear()
        for g in groups:
            g.grad_acc = None
            if g.grad_stored is not None:
                g.grad_stored.live = False
