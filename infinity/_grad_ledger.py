"""The gradient half of the parameter manager: staging, reduction across ranks, accumulation.

:class:`GradientLedger` is a mixin of :class:`infinity.stage3.ParameterManager` (same object,
same attributes: ``_slot_of``, ``coll``, ``stage``, ``world_size``, ``rank``, ``device``,
``reduce_dtype``, ``optimizer_offloaded``, ``grad_store``, ``on_grad_ready``, ...), kept apart so
that each module reads as one job: stage3 owns units, hooks, gather and release; this module owns
what happens to a gradient from ``param.grad`` to the optimizer's fp32 partition.

[Note: gradient ledger]
Autograd writes ``param.grad`` (compute dtype); the post-accumulate-grad hook adds it into the
unit's fp32 staging buffer (full padded size, alive only during backward) and drops ``param.grad``.
When every trainable parameter of the unit has its gradient, the staging buffer is averaged over
ranks (reduce-scatter for stages 2-3, all-reduce for 0-1) into the fp32 accumulator, which holds
the sum over micro-batches until the optimizer step. Where that accumulator lives (the device,
or host memory when the optimizer is offloaded) is [Note: gradient placement] in
infinity/estimate.py. Units with parameters unused in this backward are reduced at the end of
backward, in unit order, after the ranks agree (one small all-reduce) on which units still hold
gradients.
"""

from __future__ import annotations

from typing import Any

import torch


class GradientLedger:
    """Gradient staging, reduction and accumulation for :class:`~infinity.stage3.ParameterManager`."""

    def _on_grad(self, param: torch.Tensor) -> None:
        unit, group, slot = self._slot_of[id(param)]
        if param.grad is None:
            return
        if group.grad_staging is None:
            group.grad_staging = self._new_staging(group)
        group.grad_staging[slot.offset:slot.offset + slot.numel].add_(param.grad.reshape(-1))
        param.grad = None
        unit.grads_seen.add(id(param))
        if len(unit.grads_seen) == unit.num_trainable:
            self._reduce_unit(unit, "reduce-grad")
            unit.grads_seen = {id(s.param) for g in unit.groups if g.requires_grad
                               for s in g.slots}  # stays "complete" until the backward ends
            self._maybe_drop_hold(unit)

    def _stages_in_host(self, g: Any) -> bool:
        """One rank, an empty host accumulator on the compute device (CPU): the staging buffer is
        the accumulator itself, so the reduce and the host copy are no-ops (two full fp32 copies
        of the gradients a step saved)."""
        return (self.world_size == 1 and g.grad_host is not None and g.grad_acc is None
                and g.grad_host.device == self.device and g.grad_host.numel() == g.padded_numel)

    def _new_staging(self, g: Any) -> torch.Tensor:
        if self._stages_in_host(g):
            return g.grad_host.zero_()
        return torch.zeros(g.padded_numel, dtype=torch.float32, device=self.device)

    def _reduce_unit(self, unit: Any, phase: str) -> None:
        if self._check_now():
            self.coll.check_agreement(step=self.micro_step, phase=phase, unit_index=unit.index,
                                      unit_name=unit.name, device=self.device)
        context = f"{phase} of unit {unit.index} {unit.name!r} (micro-step {self.micro_step})"
        with torch.profiler.record_function(f"infinity::reduce ({unit.name})"):
            for g in unit.groups:
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
                wire = staging if self.world_size == 1 or self.reduce_dtype == torch.float32 \
                    else staging.to(self.reduce_dtype)
                if self.stage >= 2 and self.world_size == 1:
                    part = staging  # the shard is the whole buffer: no reduce, no copy
                elif self.stage >= 2:
                    part = torch.empty(g.shard_numel, dtype=wire.dtype, device=self.device)
                    self.coll.reduce_scatter_sum(part, wire, context=context)
                    part = part.float()  # no copy when the wire is fp32
                else:
                    self.coll.all_reduce_sum(wire, context=context)
                    if wire is not staging:
                        staging.copy_(wire)
                    part = staging
                    if self.stage == 1 and self.optimizer_offloaded:  # only its shard leaves
                        part = staging[self.rank * g.shard_numel:(self.rank + 1) * g.shard_numel]
                self._accumulate_grad(g, part)
                if self.on_grad_ready is not None:
                    self.on_grad_ready(g.key)
        self._note_peak()

    def _register_grad_accumulators(self) -> None:
        """[Note: gradient placement]: one accumulator per trainable group over the optimizer's
        partition (fp32, or the compute dtype where nothing is summed in fp32:
        ``grad_host_dtype``), homed in the store's host arena (so ``memory.host_budget_bytes``
        covers it), allocated once and never evicted (a HOST home copy stays put)."""
        from infinity.tiers import Tier

        for g in self.trainable_groups():
            key = f"grad/{g.key}"
            numel = g.padded_numel if self.stage == 0 else g.shard_numel
            self.grad_store.register(key, numel, self.grad_host_dtype, Tier.HOST)
            g.grad_host = self.grad_store.get(key, Tier.HOST)

    def _accumulate_grad(self, g: Any, part: torch.Tensor) -> None:
        """Add one micro-batch's reduced gradient into the accumulator: on the device, or, with an
        offloaded optimizer, into the host buffer, dropping the device copy
        ([Note: gradient placement] in infinity/estimate.py)."""
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
            # Pinned: the copy runs on the current stream; grad_partitions() waits for it.
            g.grad_host.copy_(part, non_blocking=g.grad_host.is_pinned())
            g.grad_acc = g.grad_host
        else:  # a blocking copy: it also waits for the earlier copies on the stream
            g.grad_acc.add_(part.to(g.grad_host.device))

    def grad_partitions(self) -> dict[str, torch.Tensor]:
        """Gradient per trainable group over the optimizer's partition (fp32, or the host
        accumulators' ``grad_host_dtype``); absent when zero."""
        if self.optimizer_offloaded and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # host copies have landed
        out = {}
        for g in self.trainable_groups():
            if g.grad_acc is None:
                continue
            if self.stage == 1 and g.grad_acc is not g.grad_host:
                lo = self.rank * g.shard_numel
                out[g.key] = g.grad_acc[lo:lo + g.shard_numel]
            else:
                out[g.key] = g.grad_acc
        return out

    def zero_grads(self) -> None:
        for g in self.trainable_groups():
            g.grad_acc = None
