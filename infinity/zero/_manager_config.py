"""The parameter manager's settings, resolved by the engine from the config once."""

from __future__ import annotations

import dataclasses

import torch

from infinity.tiers import Tier
from infinity.zero._quantize import QuantSpec


DEFAULT_LIVE_UNITS = 3
"""Without ``zero.max_live_bytes``, when gathers read shards from HOST ([Note: a CPU engine reads
parameter shards from HOST] in infinity/zero/_engine.py): gathered units the prefetcher may hold
at once, in units of the largest (the running one, the next one, one kept for its reuse).
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
    params_read_on_host: bool = False
    """[Note: a CPU engine reads parameter shards from HOST] Gathers read offloaded shards from
    their HOST copy instead of a DEVICE copy, and prefetches stop at HOST."""
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
    stored_grad_slice_numel: int | None = None
    """The optimizer's sub-group size when the gradient accumulators are NVMe-homed slices
    ([Note: gradients on NVMe] in infinity/zero/_grad_reducer.py); None: in host memory."""
    weight_quant: QuantSpec | None = None
    """qwZ: how stage 3's forward and backward all-gathers quantize parameters (``zero.
    quantized_weights``); None: exact ([Note: qwZ dequantizes every slice])."""
    weight_quant_frozen_only: bool = False
    """Apply ``weight_quant`` to frozen flat groups only (``zero.quantized_frozen_weights``)."""
    grad_quant: QuantSpec | None = None
    """qgZ: how the gradient reduce-scatter quantizes (``zero.quantized_gradients``); None: exact."""
    overlap_param_gather: bool = False
    """Stages 1-2: the after-step all-gather overlaps the next forward (``zero.
    overlap_param_gather``; [Note: the after-step gather overlaps the next forward] in
    infinity/zero/_step_gathers.py)."""
    hpz_partition_size: int = 1
    """ZeRO++ hpZ secondary group size (``zero.hpz_partition_size``); 1: off ([Note: hpZ
    secondary shards] in infinity/zero/_hpz.py)."""
