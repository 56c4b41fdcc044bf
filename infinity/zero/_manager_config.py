"""The parameter manager's settings, resolved by the engine from the config once."""

from __future__ import annotations

import dataclasses

import torch

from infinity.tiers import Tier
from infinity.zero._quantize import QuantPolicy


DEFAULT_LIVE_UNITS = 3
"""Without ``zero.max_live_bytes``, when gathers read shards from HOST ([Note: a CPU engine
reads parameter shards from HOST]): gathered units the prefetcher may hold at once, in units of
the largest (the running one, the next one, one kept for its reuse).
Gathers are synchronous ([Note: synchronous all-gathers] in infinity/zero/_prefetcher.py): one
gathered ahead buys nothing but memory. With the DEVICE level in the HOST tier nothing else
bounds them, and the trace planner gathered far ahead whenever reads ran late (the 2-core VM, a
3.3B GPT at width 2560, parameters on NVMe: 24 units of 157 MB gathered at once, 3.8 GB, against
11 at 1B: host memory grew with the model; with the bound, 1B's gathered peak went from 1.75
to 0.96 GB at the same step time). With a DEVICE tier in the path its budget bounds them. Where
gathered units borrow their HOST copies an 'auto' host budget has room for this many more
parameter shards ([Note: a gathered unit borrows its HOST copy] in
infinity/zero/_unit_storage.py)."""


CAN_BORROW_STORAGE = (hasattr(torch.UntypedStorage, "_swap_data_ptr_")
                      and hasattr(torch._C, "_construct_storage_from_data_pointer"))
"""The torch calls a borrowed gather needs ([Note: a gathered unit borrows its HOST copy] in
infinity/zero/_unit_storage.py): private, present in the pinned torch; without them every gather
copies, as before."""


@dataclasses.dataclass(frozen=True)
class ParamReads:
    """Where stage 3's gathers read offloaded parameter shards, decided once by
    :func:`param_reads` for the offload budgets, the manager, its prefetcher and its storage."""

    tier: Tier = Tier.DEVICE
    """HOST: gathers read the HOST copy and prefetches stop there ([Note: a CPU engine reads
    parameter shards from HOST]); DEVICE: through a DEVICE copy."""
    borrow: bool = False
    """A gathered unit points into the pinned copy it reads instead of copying it ([Note: a
    gathered unit borrows its HOST copy] in infinity/zero/_unit_storage.py)."""


def param_reads(device: torch.device, *, params_offloaded: bool, device_budget_auto: bool,
                device_holds_params: bool, shard_world_size: int, exact_gathers: bool
                ) -> ParamReads:
    """[Note: a CPU engine reads parameter shards from HOST]
    On a CPU device the DEVICE tier is host RAM too, so a gather that reads an offloaded shard
    through a DEVICE copy pays a copy HOST -> DEVICE (a fresh buffer, faulted in) before the
    copy into the gathered unit, for nothing: both are the same memory. At 7B (LoRA, the frozen
    bf16 base read from NVMe twice a step, 24.6 GB) that was ~25 GB of extra copies per step on
    two cores, and the DEVICE tier's budget of RAM on top of the HOST one. So with an 'auto'
    device budget a CPU engine's gathers read the HOST copy, prefetches stop there (the
    prefetcher's DEVICE level is the HOST tier) and writes (the optimizer's updated shards,
    checkpoint loads) go to the HOST copy too: the DEVICE tier holds nothing. An explicit
    ``memory.device_budget_bytes`` keeps the DEVICE tier in the read path: that is how the tests
    and benchmarks stand a small GPU in with CPU memory. So does a device budget that holds every
    parameter shard (``device_holds_params``): there the updated shards stay on the DEVICE tier
    between steps and nothing is copied per gather anyway.

    A CPU gather whose shard is the whole unit (``shard_world_size`` 1) and is exact
    (``exact_gathers``: no qwZ, no hpZ) borrows the copy it reads, HOST or, where the DEVICE tier
    holds every shard, DEVICE. The offload budgets ask before they know ``device_holds_params``
    (False: the room an 'auto' host budget keeps for borrowed HOST copies); the engine asks once
    with the budgets' answer and hands the result down (``ManagerConfig.reads``)."""
    cpu = device.type == "cpu"
    on_host = cpu and device_budget_auto and params_offloaded and not device_holds_params
    borrow = (CAN_BORROW_STORAGE and cpu and shard_world_size == 1 and exact_gathers
              and (on_host or device_holds_params))
    return ParamReads(tier=Tier.HOST if on_host else Tier.DEVICE, borrow=borrow)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ManagerConfig:
    """The settings of one :class:`ParameterManager`, resolved by the engine (no 'auto' left)."""

    stage: int
    device: torch.device
    compute_dtype: torch.dtype
    param_home: Tier = Tier.DEVICE
    """Home of the shards of units gathered on demand (stage 3): DEVICE keeps them on the device;
    HOST or NVME puts them in the tiered store (parameter offload)."""
    optimizer_offloaded: bool = False
    """The optimizer lives off the device: masters are built in host memory for it, and gradient
    accumulators live in the store's host arena ([Note: gradient placement])."""
    reads: ParamReads = dataclasses.field(default_factory=lambda: ParamReads())
    """Where gathers read offloaded shards, and whether they borrow them (:func:`param_reads`)."""
    device_holds_params: bool = False
    """Every offloaded parameter shard stays on the DEVICE tier once read
    (``OffloadBudgets.device_holds_params``)."""
    prefetch: bool = True
    """Read the next units' offloaded shards ahead of use (the host budget has room for it)."""
    prefetch_lookahead_bytes: int | None = None
    """Bytes of prefetches in flight ahead of compute at most; None: from bandwidth and trace."""
    max_live_bytes: int | None = None
    """Gathered unit bytes resident at once at most; None: only the device budget's limit."""
    max_reuse_distance_bytes: int | None = None
    """Keep a unit gathered when the trace reuses it within this many bytes of other units;
    None: the largest unit's gathered bytes."""
    reduce_dtype: torch.dtype = torch.float32
    """What gradients cross ranks in (``precision.reduce_dtype``)."""
    grad_host_dtype: torch.dtype = torch.float32
    """Dtype of an offloaded optimizer's host gradient accumulators (``ledger.host_grad_dtype_of``)."""
    grad_staging_dtype: torch.dtype = torch.float32
    """Dtype of a unit's gradient staging ([Note: staging in the accumulator's dtype] in
    infinity/ledger/_estimate.py)."""
    stored_grad_slice_numel: int | None = None
    """The optimizer's sub-group size when the gradient accumulators are NVMe-homed slices
    ([Note: gradients on NVMe] in infinity/zero/_grad_reducer.py); None: in host memory."""
    quant: QuantPolicy = dataclasses.field(default_factory=lambda: QuantPolicy())
    """ZeRO++'s quantized gathers (qwZ) and reductions (qgZ); the default quantizes nothing."""
    overlap_param_gather: bool = False
    """Stages 1-2: the after-step all-gather overlaps the next forward (``zero.
    overlap_param_gather``; [Note: the after-step gather overlaps the next forward] in
    infinity/zero/_step_gathers.py)."""
    hpz_partition_size: int = 1
    """ZeRO++ hpZ secondary group size (``zero.hpz_partition_size``); 1: off ([Note: hpZ
    secondary shards] in infinity/zero/_hpz.py)."""
