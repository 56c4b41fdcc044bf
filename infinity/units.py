"""Choosing units and laying out their flat buffers (pure logic on the module tree; no hooks).

A **unit** is a group of parameters fetched and released together. :func:`plan_units` picks them:

* **unit modules**: each module whose class name is in ``zero.unit_class_names`` (outermost wins),
  or, choosing by size, each module whose subtree holds at least ``zero.unit_min_numel`` elements
  not already claimed by a unit module below it (post-order, so blocks become units before the
  model that contains them). Containers without a ``forward`` (``ModuleList``) never become units:
  their hooks would never fire. The root module is always a unit module: it owns the leftovers.
* **ownership**: a parameter belongs to the unit of the first module (pre-order) that holds it.
  A parameter held by a second module in another unit (a tied LM head sharing the embedding's
  weight) makes that module a **borrower**: it gets hooks of its own that gather the owner's unit
  whenever it runs. So every parameter is in exactly one flat buffer, and is gathered whenever any
  module holding it runs.
* **persistent**: parameters with fewer elements than ``persistence_threshold_numel`` go into one
  persistent unit that stays gathered (norms and biases: gathering them costs more than keeping
  them). ``'auto'`` is :data:`AUTO_PERSISTENCE_THRESHOLD_NUMEL`.

:func:`layout_group` places parameters one after another in a flat buffer padded so its numel
divides the world size (the shard of rank r is the contiguous slice ``[r*S, (r+1)*S)``).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any, Iterable

import torch
from torch import nn

from infinity.config import DTYPE_BYTES
from infinity.estimate import host_grad_dtype

logger = logging.getLogger(__name__)

AUTO_PERSISTENCE_THRESHOLD_NUMEL = 2 ** 14
"""'auto' persistence threshold: 16384 elements (64 KiB in fp32). Covers biases and norm weights of
models up to hidden size 16384, which are small and used by every unit; matrices are far above it."""

PERSISTENT_UNIT_NAME = "<persistent>"
ROOT_UNIT_NAME = "<root>"


@dataclasses.dataclass
class UnitSpec:
    """One unit as planned: its name, the module it hangs on, and its parameters in order."""

    index: int
    name: str
    """Qualified name of the unit module ('<root>' for the root's leftovers, '<persistent>')."""
    params: list[tuple[str, nn.Parameter]]
    """(first qualified name, parameter), distinct parameters in module pre-order."""
    persistent: bool = False

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.params)


@dataclasses.dataclass
class UnitPlan:
    units: list[UnitSpec]
    hooked: list[tuple[nn.Module, str, list[int]]]
    """(module, qualified name, unit indices it needs gathered while it runs) for modules that get
    forward hooks: unit modules and borrowers. The persistent unit is never listed (always gathered)."""
    param_names: dict[int, list[str]]
    """id(parameter) -> every qualified name it has (tied parameters have several)."""


def resolve_persistence_threshold(value: int | str) -> int:
    return AUTO_PERSISTENCE_THRESHOLD_NUMEL if value == "auto" else int(value)


def _direct_params(module: nn.Module) -> Iterable[tuple[str, nn.Parameter]]:
    return ((n, p) for n, p in module._parameters.items() if p is not None)


def _choose_unit_modules(root: nn.Module, *, unit_class_names: tuple[str, ...],
                         unit_min_numel: int, persistent_ids: set[int]) -> set[str]:
    """Qualified names of the unit modules (always including the root, named '')."""
    modules = dict(root.named_modules())
    chosen: set[str] = {""}
    if unit_class_names:
        wanted = set(unit_class_names)
        for name, module in modules.items():
            if name and type(module).__name__ in wanted and not any(
                    name.startswith(c + ".") for c in chosen if c):
                chosen.add(name)
        if len(chosen) == 1:
            logger.warning("zero.unit_class_names %s matched no module; the whole model is one unit",
                           sorted(wanted))
        return chosen
    claimed: set[int] = set(persistent_ids)

    def visit(name: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        if not name or type(module).forward is nn.Module.forward:
            return  # the root, and containers that never run (ModuleList): hooks would not fire
        fresh = {id(p): p for sub in module.modules() for _, p in _direct_params(sub)
                 if id(p) not in claimed}
        if sum(p.numel() for p in fresh.values()) >= unit_min_numel:
            chosen.add(name)
            claimed.update(fresh)

    visit("", root)
    return chosen


def plan_units(root: nn.Module, *, unit_class_names: tuple[str, ...] = (), unit_min_numel: int,
               persistence_threshold_numel: int) -> UnitPlan:
    """Choose units, owners and borrowers for ``root`` (see the module docstring)."""
    param_names: dict[int, list[str]] = {}
    all_params: dict[int, nn.Parameter] = {}
    for mod_name, module in root.named_modules(remove_duplicate=False):
        for p_name, p in _direct_params(module):
            param_names.setdefault(id(p), []).append(f"{mod_name}.{p_name}" if mod_name else p_name)
            all_params[id(p)] = p
    persistent_ids = {i for i, p in all_params.items() if p.numel() < persistence_threshold_numel}
    unit_modules = _choose_unit_modules(root, unit_class_names=unit_class_names,
                                        unit_min_numel=unit_min_numel,
                                        persistent_ids=persistent_ids)

    owner: dict[int, str] = {}  # id(param) -> unit module name
    members: dict[str, list[tuple[str, nn.Parameter]]] = {}
    borrows: dict[str, set[str]] = {}  # module name -> unit module names it borrows from
    module_objs: dict[str, nn.Module] = {}
    for mod_name, module in root.named_modules():
        module_objs[mod_name] = module
        scope = _scope_of(mod_name, unit_modules)
        for p_name, p in _direct_params(module):
            if id(p) in persistent_ids:
                continue
            if id(p) not in owner:
                owner[id(p)] = scope
                members.setdefault(scope, []).append(
                    (f"{mod_name}.{p_name}" if mod_name else p_name, p))
            elif owner[id(p)] != scope:
                borrows.setdefault(mod_name, set()).add(owner[id(p)])

    units: list[UnitSpec] = []
    index_of: dict[str, int] = {}
    persistent = [(param_names[i][0], all_params[i]) for i in all_params if i in persistent_ids]
    if persistent:
        units.append(UnitSpec(index=0, name=PERSISTENT_UNIT_NAME, params=persistent,
                              persistent=True))
    for mod_name in module_objs:  # pre-order: the order the forward usually runs them in
        if mod_name in members:
            index_of[mod_name] = len(units)
            units.append(UnitSpec(index=len(units), name=mod_name or ROOT_UNIT_NAME,
                                  params=members[mod_name]))

    hooked: list[tuple[nn.Module, str, list[int]]] = []
    for mod_name, module in module_objs.items():
        needed = []
        if mod_name in index_of:
            needed.append(index_of[mod_name])
        needed += sorted(index_of[o] for o in borrows.get(mod_name, ()) if o in index_of)
        if needed:
            hooked.append((module, mod_name, needed))
    return UnitPlan(units=units, hooked=hooked, param_names=param_names)


def _scope_of(mod_name: str, unit_modules: set[str]) -> str:
    """The nearest unit module at or above ``mod_name``."""
    parts = mod_name.split(".") if mod_name else []
    for cut in range(len(parts), 0, -1):
        candidate = ".".join(parts[:cut])
        if candidate in unit_modules:
            return candidate
    return ""


_MANAGED_MODULES: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_MANAGED_PARAMS: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
"""id -> parameter of every managed parameter (tensors compare elementwise, so no WeakSet)."""


def mark_managed(module: nn.Module, params: list[torch.Tensor]) -> None:
    _MANAGED_MODULES.add(module)
    for p in params:
        _MANAGED_PARAMS[id(p)] = p


def check_not_wrapped(module: nn.Module) -> None:
    """ValueError when ``module`` (or one of its parameters) is already managed by an engine or
    wrapped by DeepSpeed/FSDP/DDP: hooks and flat buffers would be installed twice."""
    if module in _MANAGED_MODULES:
        raise ValueError(f"{type(module).__name__} is already managed by an infinity engine; "
                         f"call infinity.initialize once per model (use the engine it returned)")
    for name, p in module.named_parameters():
        if _MANAGED_PARAMS.get(id(p)) is p:
            raise ValueError(f"parameter {name!r} is already managed by another infinity engine "
                             f"(a submodule was wrapped before); wrap the model only once")
        if hasattr(p, "ds_id") or hasattr(p, "ds_status"):
            raise ValueError(f"parameter {name!r} carries DeepSpeed ZeRO attributes (ds_id): the "
                             f"model is already wrapped by deepspeed.initialize or zero.Init; "
                             f"pass the plain model instead")
        if type(p.data).__name__ == "DTensor" or hasattr(p, "_local_tensor"):
            raise ValueError(f"parameter {name!r} is a DTensor (FSDP2/tensor parallel already "
                             f"applied); pass the plain model instead")
    if type(module).__name__ in ("FullyShardedDataParallel", "DistributedDataParallel",
                                 "DeepSpeedEngine"):
        raise ValueError(f"the model is already wrapped in {type(module).__name__}; pass the "
                         f"inner module (model.module) instead")


@dataclasses.dataclass
class ParamSlot:
    """Where one parameter lives in its flat buffer."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size


def layout_group(params: list[tuple[str, nn.Parameter]], world_size: int
                 ) -> tuple[list[ParamSlot], int, int]:
    """Slots for ``params`` in order; returns (slots, numel, padded numel divisible by world_size)."""
    slots, offset = [], 0
    for name, p in params:
        slots.append(ParamSlot(name=name, param=p, offset=offset, numel=p.numel(), shape=p.shape))
        offset += p.numel()
    padded = -(-offset // world_size) * world_size
    return slots, offset, max(padded, world_size)


# ----------------------------------------------------------------------------------------------
# Offload sizing: budgets resolved and checked before any state is built.

AUTO_SUB_GROUP_NUMEL = 2 ** 22
"""'auto' zero.sub_group_numel: 4 Mi elements, a 48 MiB [master | exp_avg | exp_avg_sq] shard:
large enough for full-speed NVMe requests, small enough that three (the read ahead, the one
being stepped, the one being written) fit a modest host budget."""
_EXTENT_ALIGN_BYTES = 4096
_AUTO_OVERLAP_FLOOR_NUMEL = 2 ** 16
"""The smallest 'auto' sub-group chosen to make room for overlap: 768 KiB NVMe requests. Smaller
ones would trade the pipeline's request size for a read ahead; the least budget decides then."""
_AUTO_LEAST_FLOOR_NUMEL = 2 ** 14
"""The smallest 'auto' sub-group at all (192 KiB requests), for budgets that fit nothing larger."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadPlan:
    """Resolved budgets of the tiered store for one model and configuration."""

    device_budget_bytes: int
    host_budget_bytes: int
    nvme_path: str | None
    sub_group_numel: int
    largest_unit_bytes: int
    """Full (gathered) bytes of the largest unit in the compute dtype."""
    overlap: bool
    """The host budget leaves room for reads ahead (prefetch) beyond the least that works."""
    optimizer_readahead_bytes: int = 0
    """Optimizer on NVMe: bytes of sub-groups the optimizer may hold pinned in HOST at once (read
    during backward, read ahead in the step, the one being stepped), counted in slots of the
    largest staging extent ([Note: optimizer read-ahead] in infinity/shard_optimizer.py); 0 when
    nothing of the optimizer is on NVMe."""
    optimizer_host_resident_bytes: int = 0
    """Optimizer on NVMe: host room beyond the read-ahead window in which the optimizer homes
    whole sub-groups on HOST instead ([Note: host-resident sub-groups]); 0 when the budget has
    no such surplus."""
    device_holds_params: bool = False
    """Parameters offloaded and the device budget holds every parameter shard at once: once
    fetched they stay on the device, so the host needs no parameter staging in the step, and
    with the optimizer on NVMe updated shards go home lazily (on eviction or flush)."""


def _extent(nbytes: int) -> int:
    return -(-nbytes // _EXTENT_ALIGN_BYTES) * _EXTENT_ALIGN_BYTES


def _host_needs(config: Any, opt_parts: list[int], param_shards: list[int],
                sub: int, world_size: int) -> tuple[int, int, int]:
    """(bytes of shards homed on the host, the least budget that works, a comfortable budget).

    The least: the host-homed shards, plus room for two optimizer sub-groups (the one stepped and
    the next one read) and one parameter shard staged between NVMe and the device, plus one spare
    extent. Every staging slot is counted at the size of the largest extent, so that arena holes
    left by copies of different sizes can never leave a pinned pipeline without a fitting hole.
    Comfortable: a third sub-group (the previous one being written) and a second parameter shard
    (a prefetch), so that reads and writes overlap compute."""
    opt_dev, param_dev = config.offload_optimizer.device, config.offload_param.device
    opt_shards = [12 * min(sub, part - lo) for part in opt_parts for lo in range(0, part, sub)]
    opt_nvme, param_nvme = opt_dev == "nvme", param_dev == "nvme"
    slot = max(_extent(max(opt_shards, default=0)) if opt_nvme else 0,
               _extent(max(param_shards, default=0)) if param_nvme else 0)
    homed = (sum(map(_extent, opt_shards)) if opt_dev == "cpu" else 0) + (
        sum(map(_extent, param_shards)) if param_dev == "cpu" else 0)
    if opt_dev != "none":  # the gradient accumulators ([Note: gradient placement], estimate.py)
        item = DTYPE_BYTES[host_grad_dtype(config, world_size)]
        homed += sum(_extent(item * part) for part in opt_parts)
    if not slot:
        return homed, homed, homed
    least = homed + slot * (2 * opt_nvme + param_nvme + 1)
    comfortable = homed + slot * (3 * opt_nvme + 2 * param_nvme + 1)
    return homed, least, comfortable


def _auto_candidates(floor: int) -> list[int]:
    """'auto' sub-group sizes, largest first: AUTO_SUB_GROUP_NUMEL halved down to ``floor``."""
    return [AUTO_SUB_GROUP_NUMEL >> k for k in range(AUTO_SUB_GROUP_NUMEL.bit_length())
            if AUTO_SUB_GROUP_NUMEL >> k >= floor]


def _resolve_host_budget(config: Any, opt_parts: list[int], param_shards: list[int],
                         world_size: int) -> tuple[int, int, bool]:
    """(host budget bytes, sub-group numel, room to overlap).

    An explicit ``zero.sub_group_numel`` is kept, and overlap is on when the budget holds its
    comfortable staging. 'auto' takes the largest size (down to _AUTO_OVERLAP_FLOOR_NUMEL) whose
    comfortable staging fits, and only when none does, the largest (down to
    _AUTO_LEAST_FLOOR_NUMEL) whose least staging fits, without overlap. Taking the largest size
    that merely fits would turn overlap off at budgets where a smaller sub-group leaves room for
    it, and back on at larger ones: overlap would not grow with the budget."""
    zero, host = config.zero, config.memory.host_budget_bytes
    if zero.sub_group_numel != "auto":
        overlap_sizes = least_sizes = [int(zero.sub_group_numel)]
    else:
        overlap_sizes = _auto_candidates(_AUTO_OVERLAP_FLOOR_NUMEL)
        least_sizes = _auto_candidates(_AUTO_LEAST_FLOOR_NUMEL)
    needs = {sub: _host_needs(config, opt_parts, param_shards, sub, world_size)
             for sub in {*overlap_sizes, *least_sizes}}
    if host == "auto":
        comfortable = needs[overlap_sizes[0]][2]
        return comfortable + comfortable // 10 + 2 ** 20, overlap_sizes[0], True
    for sub in overlap_sizes:
        if needs[sub][2] <= host:
            return host, sub, True
    for sub in least_sizes:
        if needs[sub][1] <= host:
            return host, sub, False
    sub = least_sizes[-1]
    homed, least, _comfortable = needs[sub]
    raise ValueError(
        f"memory.host_budget_bytes={host} cannot hold what must live in host memory: {least} "
        f"bytes ({homed} of shards homed on the host, {least - homed} of NVMe staging: two "
        f"optimizer sub-groups of {sub} elements, one parameter shard and a spare); raise it to "
        f"at least "
        f"{least}, lower zero.sub_group_numel, or home more state on 'nvme'")


def _offload_parts(module: nn.Module, config: Any, world_size: int
                   ) -> tuple[list[int], list[int], list[int]]:
    """(full bytes of each unit group, bytes of each offloadable parameter shard, elements of
    each optimizer partition) of ``module`` under ``config`` at ``world_size``."""
    zero, dtype_bytes = config.zero, config.precision.param_bytes
    plan = plan_units(module, unit_class_names=zero.unit_class_names,
                      unit_min_numel=zero.unit_min_numel,
                      persistence_threshold_numel=resolve_persistence_threshold(
                          zero.persistence_threshold_numel))
    unit_bytes, param_shards, opt_parts = [], [], []
    for spec in plan.units:
        for rg in (True, False):
            numel = sum(p.numel() for _, p in spec.params if p.requires_grad == rg)
            if not numel:
                continue
            shard = -(-numel // world_size)
            unit_bytes.append(shard * world_size * dtype_bytes)
            if not spec.persistent and zero.stage == 3:
                param_shards.append(shard * dtype_bytes)
            if rg:  # the optimizer's partition: the shard, or everything at stage 0
                opt_parts.append(shard if zero.stage > 0 else shard * world_size)
    return unit_bytes, param_shards, opt_parts


def least_host_budget_bytes(module: nn.Module, config: Any, *, world_size: int = 1) -> int:
    """The smallest ``memory.host_budget_bytes`` that :func:`plan_offload` accepts for
    ``module`` under ``config`` (its sub-group size, or the smallest 'auto' one): what must live
    in host memory plus the least NVMe staging. 0 when nothing is offloaded."""
    if config.offload_optimizer.device == "none" and config.offload_param.device == "none":
        return 0
    _units, param_shards, opt_parts = _offload_parts(module, config, world_size)
    sub = config.zero.sub_group_numel
    sizes = [int(sub)] if sub != "auto" else _auto_candidates(_AUTO_LEAST_FLOOR_NUMEL)
    return min(_host_needs(config, opt_parts, param_shards, s, world_size)[1] for s in sizes)


def plan_offload(module: nn.Module, config: Any, *, world_size: int,
                 device: torch.device) -> OffloadPlan | None:
    """Budgets for the store when anything is offloaded (None otherwise). Explicit budgets that
    cannot hold what must fit (the largest unit on the device, the HOST-homed shards, the NVMe
    pipeline's staging) are a ``ValueError`` naming the field and the bytes needed."""
    zero, opt_dev, param_dev = config.zero, config.offload_optimizer.device, \
        config.offload_param.device
    if opt_dev == "none" and param_dev == "none":
        return None
    unit_bytes, param_shards, opt_parts = _offload_parts(module, config, world_size)
    largest_unit = max(unit_bytes, default=0)
    host, sub, overlap = _resolve_host_budget(config, opt_parts, param_shards, world_size)
    device_budget = config.memory.device_budget_bytes
    device_needed = largest_unit + 2 * max(param_shards, default=0)
    if device_budget == "auto":
        device_budget = _auto_device_budget(device, device_needed)
    elif device_budget < device_needed:
        raise ValueError(
            f"memory.device_budget_bytes={device_budget} cannot hold the largest unit gathered "
            f"({largest_unit} bytes) and its shard in flight; raise it to at least "
            f"{device_needed}, or choose smaller units (zero.unit_class_names/unit_min_numel)")
    # Every shard fits at once: after the first fetch of each, nothing is evicted from the device.
    holds_params = bool(param_shards) and device_budget >= sum(param_shards)
    readahead, resident = _optimizer_host_room(config, opt_parts, param_shards, sub, host, overlap,
                                               world_size, device_holds_params=holds_params)
    paths = {s.nvme_path for s in (config.offload_param, config.offload_optimizer)
             if s.device == "nvme"}
    if len(paths) > 1:
        raise ValueError(f"offload_param.nvme_path and offload_optimizer.nvme_path differ "
                         f"({sorted(paths)}); one swap directory per process is supported: use "
                         f"the same path for both")
    return OffloadPlan(device_budget_bytes=int(device_budget), host_budget_bytes=int(host),
                       nvme_path=next(iter(paths), None), sub_group_numel=sub,
                       largest_unit_bytes=largest_unit, overlap=overlap,
                       optimizer_readahead_bytes=readahead,
                       optimizer_host_resident_bytes=resident, device_holds_params=holds_params)


OPTIMIZER_WINDOW_SLOTS = 3
"""Read-ahead slots the NVMe optimizer keeps before host room goes to host-resident sub-groups
([Note: host-resident sub-groups])."""


def _optimizer_host_room(config: Any, opt_parts: list[int], param_shards: list[int], sub: int,
                         host: int, overlap: bool, world_size: int, *,
                         device_holds_params: bool) -> tuple[int, int]:
    """(read-ahead window bytes, host-resident bytes) of the NVMe optimizer; (0, 0) otherwise.

    [Note: optimizer read-ahead] The host room the NVMe optimizer may pin: the budget less the
    host-homed shards, two parameter shards in flight (none when the device holds every
    parameter shard: nothing is staged through the host in the step) and one spare, in slots of
    the largest staging extent (as :func:`_host_needs` counts them, so that arena holes always
    fit). At least two sub-groups with overlap (the one stepped and the next one read), else
    one; the window is that many sub-groups' extents.

    [Note: host-resident sub-groups] A sub-group read ahead saves its read from the forward's
    disk traffic once; a sub-group homed on HOST saves its read and its write, every step. So
    beyond OPTIMIZER_WINDOW_SLOTS slots the room of an explicit budget homes sub-groups on HOST,
    unless parameters stream from NVMe every step (the device cannot hold them all), which need
    that room to cache their shards. The optimizer takes them in add order, which is unit order:
    the embedding first, whose update opens the forward with no compute to hide it. Three slots
    are the pipeline's own (the one stepped, the next one read, the last one written). Measured
    on the 2-core VM (135M GPT, bf16, host budget half the training state, the device holding
    every parameter shard; seconds over 3 deferred steps, deferred updates / waiting for reads):
    window 2: 0.60 / 0.27, 3: 0.68 / 0.30, 4: 0.70-0.72 / 0.17-0.29, 6: 1.13 / 0.69,
    8: 1.15 / 0.57, 9 (nothing resident): 1.33 / 0.53. Each slot more in the window is a
    sub-group less on HOST: ~100 MB more NVMe traffic per step.
    """
    if config.offload_optimizer.device != "nvme":
        return 0, 0
    homed, _least, _comfortable = _host_needs(config, opt_parts, param_shards, sub, world_size)
    opt_slot = _extent(12 * min(sub, max(opt_parts, default=0)))
    param_nvme = config.offload_param.device == "nvme"
    slot = max(opt_slot, _extent(max(param_shards, default=0)) if param_nvme else 0)
    # Whole slots: sub-groups and parameter shards of different sizes fragment the arena, and
    # counting finer let a parameter shard find no hole beside a full window.
    staged = 0 if device_holds_params else 2 * param_nvme
    slots = (host - homed) // slot - staged - 1 if slot else 0
    # An 'auto' budget is the pipeline's need plus a margin: nothing to spare. Parameters read
    # from NVMe every step need the spare room as their host cache (it saves their reads).
    spare = config.memory.host_budget_bytes != "auto" and not staged
    resident = 0
    if slots > OPTIMIZER_WINDOW_SLOTS and spare:
        resident, slots = (slots - OPTIMIZER_WINDOW_SLOTS) * slot, OPTIMIZER_WINDOW_SLOTS
    return max(slots, 2 if overlap else 1) * opt_slot, resident


def _auto_device_budget(device: torch.device, needed: int) -> int:
    """CUDA: 80 % of the free memory; CPU (the device tier is host RAM): what the shards in flight
    need plus 64 MiB, so that DEVICE copies never pile up in RAM."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return max(needed, int(free * 0.8))
    return needed + 64 * 2 ** 20
