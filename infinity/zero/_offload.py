"""Offload for one model: what the store will hold (from the unit choice), the budgets resolved for
it before any state is built, and the store itself.

The arithmetic is :mod:`infinity.tiers._offload_budgets` (pure, on sizes); this module measures
the sizes from the units the parameter manager will build and resolves the request from the config
once, so the engine, ``infinity train`` and the benchmarks size offload the same way.
"""

from __future__ import annotations

import dataclasses
import os

import psutil
import torch
from torch import nn

from infinity._modeled_link import DuplexLink
from infinity.config import AUTO, DTYPE_BYTES, InfinityConfig, SwapperConfig
from infinity.io import Swapper
from infinity.ledger import (ACTIVATION_STAGING_BYTES, DEFAULT_PREFETCH_UNITS, flat_layout,
                             grad_staging_dtype, host_grad_dtype)
from infinity.tiers import (AUTO_HOST_RAM_FRACTION, SUB_GROUP_BYTES_PER_NUMEL, DeviceWorkingSet,
                            HostNeeds, NvmeBytes, NvmeDemand, OffloadBudgets, OffloadRequest,
                            StateSizes, StoreConfig, Tier, TieredStore, check_nvme_space,
                            extent_bytes, host_needs, least_host_bytes, nvme_bytes,
                            resolve_offload_budgets)
from infinity.zero._manager_config import DEFAULT_LIVE_UNITS, ParamReads, param_reads
from infinity.zero._unit_choice import UnitChoice, units_of


def state_sizes(choice: UnitChoice, *, stage: int, world_size: int,
                param_bytes: int) -> StateSizes:
    """The sizes of what the store holds for the units of ``choice`` (``param_bytes``: bytes per
    element of the compute dtype): one flat group per unit and ``requires_grad``, laid out and
    padded as :func:`~infinity.zero._flat_group.layout_group` does ([Note: 16-byte aligned
    slots] in infinity/ledger/_flat_layout.py)."""
    unit_bytes, param_shards, opt_parts, unit_extents = [], [], [], []
    for unit in choice.units:
        extents = 0
        for trainable in (True, False):
            numels = [p.numel() for _, p in unit.params if p.requires_grad == trainable]
            if not sum(numels):
                continue
            shard = flat_layout(numels, world_size, param_bytes).shard_numel
            unit_bytes.append(shard * world_size * param_bytes)
            if not unit.persistent and stage == 3:
                param_shards.append(shard * param_bytes)
                extents += extent_bytes(shard * param_bytes)
            if trainable:  # the optimizer's partition: the shard, or everything at stage 0
                opt_parts.append(shard if stage > 0 else shard * world_size)
        if extents:
            unit_extents.append(extents)
    return StateSizes(unit_bytes=tuple(unit_bytes), param_shard_bytes=tuple(param_shards),
                      optimizer_partition_numel=tuple(opt_parts),
                      unit_param_shard_extents=tuple(unit_extents))


def offload_request(config: InfinityConfig, world_size: int) -> OffloadRequest:
    """Where state lives and the budgets asked for, resolved from ``config`` at ``world_size``."""
    grad_dtype = host_grad_dtype(config, world_size)
    cache = config.memory.host_param_cache_bytes
    nvme_paths = [s.nvme_path for s in (config.offload_param, config.offload_optimizer)
                  if s.device == "nvme"]
    return OffloadRequest(param_home=config.offload_param.home_tier,
                          optimizer_home=config.offload_optimizer.home_tier,
                          host_budget_bytes=config.memory.host_budget_bytes,
                          device_budget_bytes=config.memory.device_budget_bytes,
                          sub_group_numel=config.zero.sub_group_numel,
                          grad_accumulator_bytes=DTYPE_BYTES[grad_dtype],
                          nvme_path=nvme_paths[0] if nvme_paths else None,
                          host_ram_bytes=psutil.virtual_memory().total,
                          host_param_cache_bytes=(None if cache == "auto" else int(cache)),
                          activations=config.activation_checkpointing.offload_tier,
                          activation_staging_bytes=ACTIVATION_STAGING_BYTES)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadInputs:
    """What sizing an offload reads of a config, resolved once (:func:`offload_inputs`): the
    budgets (:func:`resolve_offload`), the device's working set (:func:`device_working_set`) and
    the NVMe space check (:func:`check_nvme_space_for`) take this, not the config."""

    request: OffloadRequest
    """Where state lives and the budgets asked for, at the data-parallel size."""
    stage: int
    """The ZeRO stage (stage 3 offloads parameter shards)."""
    world_size: int
    """The shard degree the sizes divide by."""
    param_bytes: int
    """Bytes per element of the compute dtype (the parameters' shards)."""
    grad_staging_bytes: int
    """Bytes per element a unit's gradient is staged in ([Note: staging in the accumulator's
    dtype] in infinity/ledger/_estimate.py)."""
    borrows_host_copies: bool
    """Gathered units live in the host arena ([Note: a gathered unit borrows its HOST copy] in
    infinity/zero/_unit_storage.py), as the budgets see it before they know whether the DEVICE
    tier holds every shard."""
    nvme_sections: tuple[str, ...]
    """The config sections that put state on NVMe (named by the space check's error)."""


def offload_inputs(config: InfinityConfig, *, world_size: int, device: torch.device,
                   data_parallel_size: int | None = None) -> OffloadInputs:
    """Resolve ``config`` for offload sizing at ``world_size`` (the shard degree) on ``device``;
    ``data_parallel_size``: the ranks the gradients are summed over, which decide the
    accumulators' dtype (None: ``world_size``; [Note: collectives over a mesh] in
    infinity/zero/_collectives.py). The one place this module reads a config."""
    data_parallel = data_parallel_size or world_size
    # [Note: staging in the accumulator's dtype] in infinity/ledger/_estimate.py
    staged = DTYPE_BYTES[grad_staging_dtype(config, data_parallel)]
    reads = param_reads_of(config, device, shard_world_size=world_size, device_holds_params=False)
    return OffloadInputs(
        request=offload_request(config, data_parallel), stage=config.zero.stage,
        world_size=world_size, param_bytes=config.precision.param_bytes,
        grad_staging_bytes=staged, borrows_host_copies=reads.borrow and reads.tier is Tier.HOST,
        nvme_sections=tuple(s.name for s in (config.offload_param, config.offload_optimizer)
                            if s.device == "nvme"))


def _sizes_of(module: nn.Module, config: InfinityConfig, world_size: int) -> StateSizes:
    return state_sizes(units_of(module, config.zero), stage=config.zero.stage,
                       world_size=world_size, param_bytes=config.precision.param_bytes)


def least_host_budget_bytes(module: nn.Module, config: InfinityConfig, *,
                            world_size: int = 1) -> int:
    """The smallest ``memory.host_budget_bytes`` that ``infinity.initialize(module, config)``
    accepts at ``world_size``: what must live in host memory plus the least NVMe staging (at the
    config's sub-group size, or the smallest 'auto' one); 0 when nothing is offloaded."""
    return least_host_bytes(_sizes_of(module, config, world_size),
                            offload_request(config, world_size))


def host_needs_of(module: nn.Module, config: InfinityConfig, sub_group_numel: int, *,
                  world_size: int = 1) -> HostNeeds:
    """Host bytes ``module`` needs under ``config`` at one sub-group size: the shards homed on
    the host (optimizer state and gradient accumulators included), the least budget, a
    comfortable one (:func:`infinity.tiers.host_needs`)."""
    return host_needs(_sizes_of(module, config, world_size), offload_request(config, world_size),
                      sub_group_numel)


def device_working_set(choice: UnitChoice, inputs: OffloadInputs) -> DeviceWorkingSet:
    """What the engine allocates on the device beside the store's shard copies, at its peak, for
    the units of ``choice`` ([Note: the 'auto' device budget] in infinity/tiers/_offload_budgets.py).
    The same terms as the ledger's device working buffers (``prefetch_units`` gathered beyond the
    current unit, a unit's full gradient), counted on the real, padded groups."""
    stage, item, world_size = inputs.stage, inputs.param_bytes, inputs.world_size
    fp32 = DTYPE_BYTES["fp32"]
    gathered, resident, grad_staging, device_state = [], 0, [0], 0
    opt_on_device = inputs.request.optimizer_home is Tier.DEVICE
    for unit in choice.units:
        for trainable in (True, False):
            numels = [p.numel() for _, p in unit.params if p.requires_grad == trainable]
            if not sum(numels):
                continue
            lay = flat_layout(numels, world_size, item)
            full = lay.padded_numel * item
            if unit.persistent or stage < 3:
                resident += full
            else:
                gathered.append(full)
            if not trainable:
                continue
            # [Note: gradient ledger]: staging of the whole unit, and its reduced shard.
            grad_staging.append((lay.padded_numel + lay.shard_numel) * inputs.grad_staging_bytes)
            if opt_on_device:  # accumulator, master and moments of the partition (fp32)
                part = lay.shard_numel if stage > 0 else lay.padded_numel
                device_state += part * (fp32 + SUB_GROUP_BYTES_PER_NUMEL)
    largest = sorted(gathered, reverse=True)[:1 + DEFAULT_PREFETCH_UNITS]
    return DeviceWorkingSet(gathered_bytes=sum(largest), resident_bytes=resident,
                            grad_bytes=max(grad_staging), optimizer_bytes=device_state)


def resolve_offload(choice: UnitChoice, inputs: OffloadInputs, *, device: torch.device
                    ) -> OffloadBudgets | None:
    """The store's budgets for the units of ``choice`` (None when nothing is offloaded); raises
    ``ValueError`` before any state exists when an explicit budget is too small."""
    sizes = state_sizes(choice, stage=inputs.stage, world_size=inputs.world_size,
                        param_bytes=inputs.param_bytes)
    request = inputs.request
    if inputs.borrows_host_copies:
        request = dataclasses.replace(request, gathered_units_on_host=DEFAULT_LIVE_UNITS)
    return resolve_offload_budgets(sizes, request, device=device,
                                   device_working=device_working_set(choice, inputs))


def param_reads_of(config: InfinityConfig, device: torch.device, *, shard_world_size: int,
                   device_holds_params: bool) -> ParamReads:
    """:func:`~infinity.zero._manager_config.param_reads` for ``config``'s offload, device budget
    and ZeRO++ settings ([Note: a CPU engine reads parameter shards from HOST])."""
    zero = config.zero
    return param_reads(device, params_offloaded=config.offload_param.device != "none",
                       device_budget_auto=config.memory.device_budget_bytes == AUTO,
                       device_holds_params=device_holds_params,
                       shard_world_size=shard_world_size,
                       exact_gathers=(not zero.quantized_weights and not zero.quantized_frozen_weights
                                      and zero.hpz_partition_size <= 1))


def build_store(device: torch.device, budgets: OffloadBudgets, *, swapper_config: SwapperConfig,
                rank: int, nvme_path: str | None = None, copy_link: DuplexLink | None = None
                ) -> tuple[TieredStore, Swapper | None]:
    """The tiered store (and its swapper when some home is NVME) the engine's offload uses;
    ``nvme_path``: a swap directory for other shards (activations) when no state is on NVMe;
    ``copy_link``: a modeled link under its host<->device copies ([Note: the modeled link] in
    infinity/_modeled_link.py)."""
    path = budgets.nvme_path or nvme_path
    swapper = Swapper(path, swapper_config, rank=rank) if path else None
    store = TieredStore(device, StoreConfig(device_budget_bytes=budgets.device_budget_bytes,
                                            host_budget_bytes=budgets.host_budget_bytes),
                        swapper=swapper, copy_link=copy_link)
    return store, swapper


ACTIVATION_AUTO_HOST_BYTES = 2 * 1024 ** 3
"""The arena of a store that holds only activations, with an 'auto' host budget: at most this,
and at most AUTO_HOST_RAM_FRACTION of the RAM."""


def activation_nvme_path(config: InfinityConfig) -> str | None:
    """The swap directory of activations offloaded 'nvme' or 'auto' (None: not on NVMe): the
    offload sections' (one per process) or ``activation_checkpointing.nvme_path``."""
    acts = config.activation_checkpointing
    if acts.offload_tier not in ("nvme", "auto"):
        return None
    paths = [s.nvme_path for s in (config.offload_param, config.offload_optimizer)
             if s.device == "nvme"]
    return paths[0] if paths else acts.nvme_path


def activations_need_store(config: InfinityConfig) -> bool:
    """Whether the saved activations need a store when no state is offloaded: offload 'nvme' or
    'auto', or 'host' with an explicit host budget (an 'auto' one keeps them in torch's host
    memory, counted: [Note: activations on the host] in infinity/zero/_activations.py)."""
    tier = config.activation_checkpointing.offload_tier
    return tier in ("nvme", "auto") or (
        tier == "host" and config.memory.host_budget_bytes != "auto")


def build_activation_store(device: torch.device, config: InfinityConfig, *, rank: int
                           ) -> tuple[TieredStore, Swapper | None]:
    """A store for activations alone ([Note: saved activations are shards of the store] in
    infinity/zero/_stored_activations.py): the host budget as given, or ACTIVATION_AUTO_HOST_BYTES
    within AUTO_HOST_RAM_FRACTION of the RAM; a swapper where they may go to NVMe."""
    host = config.memory.host_budget_bytes
    if host == "auto":
        host = min(ACTIVATION_AUTO_HOST_BYTES,
                   int(psutil.virtual_memory().total * AUTO_HOST_RAM_FRACTION))
    path = activation_nvme_path(config)
    swapper = Swapper(path, config.swapper, rank=rank) if path else None
    device_budget = config.memory.device_budget_bytes
    store = TieredStore(device, StoreConfig(
        device_budget_bytes=0 if device_budget == "auto" else int(device_budget),
        host_budget_bytes=int(host)), swapper=swapper)
    return store, swapper


def check_nvme_space_for(choice: UnitChoice, inputs: OffloadInputs, budgets: OffloadBudgets, *,
                         store: TieredStore) -> NvmeBytes:
    """[Note: NVMe space check] in infinity/tiers/_nvme_space.py: raise ``DiskSpaceError`` when
    the file system of ``budgets.nvme_path`` cannot take what the store built from ``budgets``
    (``store``, not yet holding anything) will write for the units of ``choice``, times the ranks
    on this machine (``LOCAL_WORLD_SIZE``, set by torchrun). Returns the bytes checked."""
    sizes = state_sizes(choice, stage=inputs.stage, world_size=inputs.world_size,
                        param_bytes=inputs.param_bytes)
    need = nvme_bytes(sizes, inputs.request, budgets, extent_bytes=store.arena.extent_bytes,
                      header_bytes=store.swapper.header_bytes)
    fix = (f" ({' and '.join(inputs.nvme_sections)}), or keep more state in host memory: a "
           f"device 'cpu' there"
           + (", or a memory.host_budget_bytes that holds the gradients" if need.gradient_bytes
              else ""))
    check_nvme_space([NvmeDemand(budgets.nvme_path, need.file_bytes, need.describe())],
                     local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), fix=fix)
    return need


__all__ = ["OffloadInputs", "activation_nvme_path", "activations_need_store",
           "build_activation_store", "build_store", "check_nvme_space_for", "device_working_set",
           "host_needs_of", "least_host_budget_bytes", "offload_inputs", "offload_request",
           "resolve_offload", "state_sizes"]
