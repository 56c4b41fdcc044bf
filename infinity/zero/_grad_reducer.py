"""The gradient half of the parameter manager: staging, reduction across ranks, accumulation.

:class:`GradientReducer` is owned by :class:`~infinity.zero._param_manager.ParameterManager`, which
decides *when* a unit's gradients are complete (its hooks and the end of backward); this module owns
what happens to a gradient from ``param.grad`` to the optimizer's fp32 partition.

[Note: gradient ledger]
Autograd writes ``param.grad`` (compute dtype); the post-accumulate-grad hook adds it into the
unit's fp32 staging buffer (full padded size, alive only during backward) and drops ``param.grad``.
When every trainable parameter of the unit has its gradient, the staging buffer is averaged over
ranks (reduce-scatter for stages 2-3, all-reduce for 0-1) into the fp32 accumulator, which holds
the sum over micro-batches until the optimizer step. Where that accumulator lives (the device,
or host memory when the optimizer is offloaded) is [Note: gradient placement] in
infinity/ledger/_estimate.py. Units with parameters unused in this backward are reduced at the end
of backward, in unit order, after the ranks agree (one small all-reduce) on which units still hold
gradients.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import torch

from infinity.tiers import Tier, TieredStore
from infinity.zero._collectives import Collectives
from infinity.zero._flat_group import FlatGroup, ParamSlot


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReducerConfig:
    """The settings of one :class:`GradientReducer` (resolved by the engine)."""

    stage: int
    device: torch.device
    reduce_dtype: torch.dtype
    """What gradients cross ranks in: fp32, or the compute dtype (``precision.reduce_dtype``)."""
    host_dtype: torch.dtype
    """Dtype of the host accumulators of an offloaded optimizer (``ledger.host_grad_dtype_of``)."""


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
        self.rank = collectives.rank
        self.host_store = host_store
        """Holds the host accumulators of an offloaded optimizer; None: on the device."""
        self.on_ready = on_ready

    @property
    def offloaded(self) -> bool:
        return self.host_store is not None

    def register_accumulators(self, groups: Iterable[FlatGroup]) -> None:
        """[Note: gradient placement]: one accumulator per trainable group over the optimizer's
        partition (fp32, or the compute dtype where nothing is summed in fp32: ``host_dtype``),
        homed in the store's host arena (so ``memory.host_budget_bytes`` covers it), allocated
        once and never evicted (a HOST home copy stays put)."""
        for g in groups:
            key = f"grad/{g.key}"
            numel = g.padded_numel if self.config.stage == 0 else g.shard_numel
            self.host_store.register(key, numel, self.config.host_dtype, Tier.HOST)
            g.grad_host = self.host_store.get(key, Tier.HOST)

    def stage(self, group: FlatGroup, slot: ParamSlot, grad: torch.Tensor) -> None:
        """Add one parameter's ``grad`` into its group's staging buffer (created on first use)."""
        if group.grad_staging is None:
            group.grad_staging = self._new_staging(group)
        group.grad_staging[slot.offset:slot.offset + slot.numel].add_(grad.reshape(-1))

    def _stages_in_host(self, g: FlatGroup) -> bool:
        """One rank, an empty host accumulator on the compute device (CPU): the staging buffer is
        the accumulator itself, so the reduce and the host copy are no-ops (two full fp32 copies
        of the gradients a step saved)."""
        return (self.world_size == 1 and g.grad_host is not None and g.grad_acc is None
                and g.grad_host.device == self.config.device
                and g.grad_host.numel() == g.padded_numel)

    def _new_staging(self, g: FlatGroup) -> torch.Tensor:
        if self._stages_in_host(g):
            return g.grad_host.zero_()
        return torch.zeros(g.padded_numel, dtype=torch.float32, device=self.config.device)

    def reduce(self, groups: Iterable[FlatGroup], *, context: str) -> None:
        """Average each trainable group's staging buffer over the ranks into its accumulator
        (``context`` names the collective in errors); a group without staging contributes zeros
        (the ranks that have some still need this rank's part of the collective)."""
        stage, device = self.config.stage, self.config.device
        for g in groups:
            if not g.requires_grad:
                continue
            staging = g.grad_staging
            if staging is None:
                staging = self._new_staging(g)
            g.grad_staging = None
            if self.world_size > 1:
                staging.div_(self.world_size)
            # precision.reduce_dtype 'compute': the wire carries the compute dtype (half the
            # bytes with bf16/fp16); the sum lands back in fp32 for the accumulator.
            wire = staging if self.world_size == 1 or self.config.reduce_dtype == torch.float32 \
                else staging.to(self.config.reduce_dtype)
            if stage >= 2 and self.world_size == 1:
                part = staging  # the shard is the whole buffer: no reduce, no copy
            elif stage >= 2:
                part = torch.empty(g.shard_numel, dtype=wire.dtype, device=device)
                self.coll.reduce_scatter_sum(part, wire, context=context)
                part = part.float()  # no copy when the wire is fp32
            else:
                self.coll.all_reduce_sum(wire, context=context)
                if wire is not staging:
                    staging.copy_(wire)
                part = staging
                if stage == 1 and self.offloaded:  # only its shard leaves
                    part = staging[self.rank * g.shard_numel:(self.rank + 1) * g.shard_numel]
            self._accumulate(g, part)
            if self.on_ready is not None:
                self.on_ready(g.key)

    def _accumulate(self, g: FlatGroup, part: torch.Tensor) -> None:
        """Add one micro-batch's reduced gradient into the accumulator: on the device, or, with an
        offloaded optimizer, into the host buffer, dropping the device copy
        ([Note: gradient placement] in infinity/ledger/_estimate.py)."""
        if g.grad_host is None:
            if g.grad_acc is None:
                g.grad_acc = part
            else:
                g.grad_acc.add_(part)
            return
        if g.grad_acc is None and part.data_ptr() == g.grad_host.data_ptr():
            g.grad_acc = g.grad_host  # staged in place (_stages_in_host)
            return
        if g.grad_acc is None:
            # Pinned: the copy runs on the current stream; partitions() waits for it.
            g.grad_host.copy_(part, non_blocking=g.grad_host.is_pinned())
            g.grad_acc = g.grad_host
        else:  # a blocking copy: it also waits for the earlier copies on the stream
            g.grad_acc.add_(part.to(g.grad_host.device))

    def partitions(self, groups: Iterable[FlatGroup]) -> dict[str, torch.Tensor]:
        """Gradient per trainable group over the optimizer's partition (fp32, or the host
        accumulators' ``host_dtype``); absent when zero."""
        device = self.config.device
        if self.offloaded and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # host copies have landed
        out = {}
        for g in groups:
            if g.grad_acc is None:
                continue
            if self.config.stage == 1 and g.grad_acc is not g.grad_host:
                lo = self.rank * g.shard_numel
                out[g.key] = g.grad_acc[lo:lo + g.shard_numel]
            else:
                out[g.key] = g.grad_acc
        return out

    @staticmethod
    def zero(groups: Iterable[FlatGroup]) -> None:
        """Forget the accumulated gradients (the host buffers stay allocated, to be overwritten)."""
        for g in groups:
            g.grad_acc = None
