"""The offload budgets: the store's byte budgets and the NVMe pipeline's sizes, resolved and
checked for one model before any state is built (pure arithmetic on sizes, no tensors).

The parameter manager measures what the store will hold (:class:`StateSizes`: each unit group's
full bytes, each parameter shard's bytes, each optimizer partition's elements); the engine says
where state lives and what budgets were asked for (:class:`OffloadRequest`, resolved once from
the config). :func:`resolve_offload_budgets` turns both into :class:`OffloadBudgets`, or a
``ValueError`` naming the field and the bytes needed when an explicit budget cannot hold what must
fit (the largest unit on the device, the HOST-homed shards, the NVMe pipeline's staging).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import torch

from infinity._common import warn_once
from infinity._tier import Tier
from infinity.config import AUTO_SUB_GROUP_NUMEL

SUB_GROUP_BYTES_PER_NUMEL = 12
"""Bytes per element of one optimizer sub-group shard ``[master | exp_avg | exp_avg_sq]`` (fp32)."""
EXTENT_ALIGN_BYTES = 4096
"""The arena extent the budgets count in (the arena's own alignment when the file system says
nothing larger; the optimizer takes host-resident room in the arena's real extents)."""
_AUTO_OVERLAP_FLOOR_NUMEL = 2 ** 16
"""The smallest 'auto' sub-group chosen to make room for overlap: 768 KiB NVMe requests. Smaller
ones would trade the pipeline's request size for a read ahead; the least budget decides then."""
_AUTO_LEAST_FLOOR_NUMEL = 2 ** 14
"""The smallest 'auto' sub-group at all (192 KiB requests), for budgets that fit nothing larger."""
OPTIMIZER_WINDOW_SLOTS = 3
"""Read-ahead slots the NVMe optimizer keeps before host room goes to host-resident sub-groups
([Note: host-resident sub-groups])."""
AUTO_HOST_RAM_FRACTION = 0.125
"""An 'auto' host budget keeps an NVMe optimizer's gradients in host memory only while the whole
budget stays within this fraction of the machine's RAM ([Note: gradients on NVMe] in
infinity/zero/_grad_reducer.py)."""
_CPU_DEVICE_MARGIN_BYTES = 64 * 2 ** 20
CUDA_FREE_FRACTION = 0.8
"""[Note: the 'auto' device budget] The share of the GPU's free memory (at initialize) the engine
plans for; the rest is for activations, the caching allocator's fragmentation and the CUDA / NCCL
workspaces, which no size known at initialize bounds."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceWorkingSet:
    """Device bytes the engine allocates outside the store's shard copies, at their peak
    ([Note: the 'auto' device budget]): the store's budget counts shard copies only, so an
    'auto' budget subtracts these first."""

    gathered_bytes: int = 0
    """Units gathered at once from offloaded shards: the largest, plus those prefetched."""
    resident_bytes: int = 0
    """Units that stay gathered (persistent units; every unit below stage 3)."""
    grad_bytes: int = 0
    """Gradient working buffers: the fp32 staging of the largest trainable unit and its
    reduce-scatter output; with the optimizer on the device, its accumulators too."""
    optimizer_bytes: int = 0
    """Optimizer state kept on the device (the optimizer not offloaded): master and moments."""

    @property
    def total_bytes(self) -> int:
        return self.gathered_bytes + self.resident_bytes + self.grad_bytes + self.optimizer_bytes


def auto_device_budget_bytes(*, free_bytes: int, working: DeviceWorkingSet, needed_bytes: int
                             ) -> int:
    """[Note: the 'auto' device budget] The store's 'auto' device budget on a GPU with
    ``free_bytes`` free: CUDA_FREE_FRACTION of it, less what the engine itself allocates there
    (``working``), and never less than the store's own least need (``needed_bytes``: a unit's
    shards in flight), which is then all it gets: warned once, since the card is likely too small
    for what else it must hold."""
    usable = int(free_bytes * CUDA_FREE_FRACTION) - working.total_bytes
    if usable < needed_bytes:
        warn_once(f"auto-device-budget:{free_bytes}:{needed_bytes}",
                  f"memory.device_budget_bytes 'auto': {free_bytes} bytes free on the device, of "
                  f"which {working.total_bytes} go to gathered units, gradients and device state "
                  f"({working}), leave less than the {needed_bytes} bytes the offloaded shards "
                  "need in flight; expect an out-of-memory error. Offload more (offload_param, "
                  "offload_optimizer), choose smaller units, or free device memory first")
    return max(needed_bytes, usable)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StateSizes:
    """What the store holds for one model at one world size (from the parameter manager's units)."""

    unit_bytes: tuple[int, ...]
    """Full (gathered) bytes of each unit flat group, in the compute dtype."""
    param_shard_bytes: tuple[int, ...]
    """Bytes of each parameter shard the store may hold (stage 3, units not always gathered)."""
    optimizer_partition_numel: tuple[int, ...]
    """Elements of each optimizer partition (a trainable group's shard; all of it at stage 0)."""
    unit_param_shard_extents: tuple[int, ...] = ()
    """Per unit, the arena extents of its parameter shards together (a unit may have a trainable
    and a frozen group); () when unknown: each unit is then priced at the largest shard."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadRequest:
    """Where state lives and the budgets asked for, resolved from the config (no 'auto' left
    but the budgets' and the sub-group's own)."""

    param_home: Tier
    """Home of the parameter shards: DEVICE (not offloaded), HOST ('cpu') or NVME."""
    optimizer_home: Tier
    """Home of the fp32 masters and moments: DEVICE (not offloaded), HOST or NVME."""
    host_budget_bytes: int | Literal["auto"]
    device_budget_bytes: int | Literal["auto"]
    sub_group_numel: int | Literal["auto"]
    grad_accumulator_bytes: int
    """Bytes per element of the host gradient accumulators an offloaded optimizer reads
    ([Note: gradient placement] in infinity/ledger/_estimate.py)."""
    nvme_path: str | None = None
    host_ram_bytes: int | None = None
    """The machine's RAM: an 'auto' host budget holds an NVMe optimizer's gradients only while
    it stays within AUTO_HOST_RAM_FRACTION of it; None: no such bound (they go to NVMe under
    'auto' wherever that is the smaller budget)."""
    host_param_cache_bytes: int | None = None
    """Parameters on NVMe and an 'auto' host budget: the host room for their shards (staging and
    cache), on top of the rest of what the host holds ([Note: the parameter share]); None: the
    comfortable staging alone."""
    gathered_units_on_host: int = 0
    """Gathered units that live in the host arena ([Note: a gathered unit borrows its HOST copy]
    in infinity/zero/_unit_storage.py): an 'auto' host budget adds as many parameter slots,
    the room those units took beside the arena before they borrowed its copies."""
    activations: str = "none"
    """Where checkpointed activations go ('none', 'host', 'nvme', 'auto'): [Note: the
    activations' room]."""
    activation_staging_bytes: int = 0
    """Arena room activations bound for NVMe want to stage through ([Note: the activations'
    room])."""

    @property
    def offloaded(self) -> bool:
        return self.param_home is not Tier.DEVICE or self.optimizer_home is not Tier.DEVICE


class HostNeeds(NamedTuple):
    """Host bytes one sub-group size needs (see :func:`host_needs`)."""

    homed_bytes: int
    least_bytes: int
    comfortable_bytes: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadBudgets:
    """Resolved budgets of the tiered store for one model and configuration."""

    device_budget_bytes: int
    host_budget_bytes: int
    nvme_path: str | None
    sub_group_numel: int
    largest_unit_bytes: int
    """Full (gathered) bytes of the largest unit in the compute dtype."""
    overlap: bool
    """The host budget leaves room for reads ahead (prefetch) beyond the least that works."""
    optimizer_window_sub_groups: int = 2
    """Optimizer on NVMe: sub-groups it may hold pinned in HOST at once (read during backward,
    read ahead in the step, the one being stepped; [Note: optimizer read-ahead]); at least two."""
    optimizer_host_resident_bytes: int = 0
    """Optimizer on NVMe: host room beyond the read-ahead window in which the optimizer homes
    whole sub-groups on HOST instead ([Note: host-resident sub-groups]); 0 when the budget has
    no such surplus."""
    device_holds_params: bool = False
    """Parameters offloaded and the device budget holds every parameter shard at once: once
    fetched they stay on the device, so the host needs no parameter staging in the step, and
    with the optimizer on NVMe updated shards go home lazily (on eviction or flush)."""
    grads_on_nvme: bool = False
    """Optimizer on NVMe and the host budget cannot hold every gradient accumulator beside the
    NVMe staging: the accumulators are NVMe-homed slices of ``sub_group_numel`` elements
    ([Note: gradients on NVMe] in infinity/zero/_grad_reducer.py)."""
    host_param_cache_bytes: int = 0
    """The host room for NVMe parameter shards sized by ``memory.host_param_cache_bytes``
    ([Note: the parameter share]); 0 when it is 'auto'."""
    states_host_room_bytes: int = 0
    """Arena room the states want for overlap beyond their homed shards (the comfortable need
    less the homed bytes, :func:`host_needs`): what activations offloaded 'auto' leave them
    ([Note: the activations' room])."""


def extent_bytes(nbytes: int) -> int:
    """``nbytes`` rounded up to whole arena extents, as the budgets count them."""
    return -(-nbytes // EXTENT_ALIGN_BYTES) * EXTENT_ALIGN_BYTES


def _sub_group_shards(sizes: StateSizes, sub: int) -> list[int]:
    """Bytes of every optimizer sub-group shard at sub-group size ``sub``."""
    return [SUB_GROUP_BYTES_PER_NUMEL * min(sub, part - lo)
            for part in sizes.optimizer_partition_numel for lo in range(0, part, sub)]


def _slot_bytes(sizes: StateSizes, request: OffloadRequest, sub: int) -> int:
    """One staging slot: the largest extent staged through the host (an NVMe optimizer's
    sub-group, an NVMe parameter shard); 0 when nothing is staged."""
    opt_numel = min(sub, max(sizes.optimizer_partition_numel, default=0))
    opt = (extent_bytes(SUB_GROUP_BYTES_PER_NUMEL * opt_numel)
           if request.optimizer_home is Tier.NVME else 0)
    param = (extent_bytes(max(sizes.param_shard_bytes, default=0))
             if request.param_home is Tier.NVME else 0)
    return max(opt, param)


def host_needs(sizes: StateSizes, request: OffloadRequest, sub: int, *,
               grads_on_nvme: bool = False) -> HostNeeds:
    """(bytes of shards homed on the host, the least budget that works, a comfortable budget).

    The least: the host-homed shards, plus room for two optimizer sub-groups (the one stepped and
    the next one read) and one parameter shard staged between NVMe and the device, plus one spare
    extent. Every staging slot is counted at the size of the largest extent, so that arena holes
    left by copies of different sizes can never leave a pinned pipeline without a fitting hole.
    Comfortable: a third sub-group (the previous one being written) and a second parameter shard
    (a prefetch), so that reads and writes overlap compute. ``grads_on_nvme`` (optimizer on
    NVMe): the gradient accumulators are not homed on the host; each optimizer sub-group in
    flight takes a second slot for its gradient slice (a slot, not the slice's own smaller
    extent, for the same reason: extents of mixed sizes once left a parameter shard no hole),
    and one more slot takes the slice being accumulated in backward ([Note: gradients on NVMe]
    in infinity/zero/_grad_reducer.py)."""
    opt_home, param_home = request.optimizer_home, request.param_home
    opt_nvme, param_nvme = opt_home is Tier.NVME, param_home is Tier.NVME
    if grads_on_nvme and not opt_nvme:
        raise ValueError("host_needs: gradients go to NVMe only with the optimizer there")
    opt_shards = _sub_group_shards(sizes, sub)
    slot = _slot_bytes(sizes, request, sub)
    homed = (sum(map(extent_bytes, opt_shards)) if opt_home is Tier.HOST else 0) + (
        sum(map(extent_bytes, sizes.param_shard_bytes)) if param_home is Tier.HOST else 0)
    if opt_home is not Tier.DEVICE and not grads_on_nvme:  # [Note: gradient placement]
        homed += sum(extent_bytes(request.grad_accumulator_bytes * part)
                     for part in sizes.optimizer_partition_numel)
    if not slot:
        return HostNeeds(homed, homed, homed)
    per_sub_group = opt_nvme * (1 + grads_on_nvme)
    least = homed + slot * (2 * per_sub_group + param_nvme + 1 + grads_on_nvme)
    comfortable = homed + slot * (3 * per_sub_group + 2 * param_nvme + 1 + grads_on_nvme)
    return HostNeeds(homed, least, comfortable)


def _auto_candidates(floor: int) -> list[int]:
    """'auto' sub-group sizes, largest first: AUTO_SUB_GROUP_NUMEL halved down to ``floor``."""
    return [AUTO_SUB_GROUP_NUMEL >> k for k in range(AUTO_SUB_GROUP_NUMEL.bit_length())
            if AUTO_SUB_GROUP_NUMEL >> k >= floor]


def _grad_choices(request: OffloadRequest) -> tuple[bool, ...]:
    """Where the gradient accumulators may go, preferred first: host memory (no NVMe traffic for
    them), then NVMe when the optimizer is there ([Note: gradients on NVMe] in
    infinity/zero/_grad_reducer.py)."""
    return (False, True) if request.optimizer_home is Tier.NVME else (False,)


def least_host_bytes(sizes: StateSizes, request: OffloadRequest) -> int:
    """The smallest ``memory.host_budget_bytes`` that :func:`resolve_offload_budgets` accepts (at
    the request's sub-group size, or the smallest 'auto' one): what must live in host memory
    plus the least NVMe staging (gradients on NVMe where the optimizer is). 0 when nothing is
    offloaded."""
    if not request.offloaded:
        return 0
    sub = request.sub_group_numel
    subs = [int(sub)] if sub != "auto" else _auto_candidates(_AUTO_LEAST_FLOOR_NUMEL)
    return min(host_needs(sizes, request, s, grads_on_nvme=grads).least_bytes
               for s in subs for grads in _grad_choices(request))


class _HostChoice(NamedTuple):
    host_budget_bytes: int
    sub_group_numel: int
    overlap: bool
    grads_on_nvme: bool
    param_share_bytes: int = 0
    """[Note: the parameter share]: the host room for NVMe parameter shards; 0 when unset."""


def _with_margin(nbytes: int) -> int:
    """An 'auto' host budget: the comfortable staging plus 10 % and 1 MiB."""
    return nbytes + nbytes // 10 + 2 ** 20


def _gathered_room(sizes: StateSizes, request: OffloadRequest) -> int:
    """The 'auto' host budget's room for gathered units that borrow their HOST copies: that
    many of the largest parameter shard's extents (0 for an explicit budget: there a borrow
    that finds no room copies instead)."""
    if (request.host_budget_bytes != "auto" or request.param_home is not Tier.NVME
            or not sizes.param_shard_bytes):
        return 0
    live = request.gathered_units_on_host
    if not sizes.unit_param_shard_extents:
        return live * extent_bytes(max(sizes.param_shard_bytes))
    # The live units are distinct units: at most the largest few together, not the largest one
    # that many times (a GPT's embedding + head unit is twice a block: 1 GB against 0.65 GB at
    # 3.3B, 0.35 GB of RSS that no borrow could use).
    return sum(sorted(sizes.unit_param_shard_extents, reverse=True)[:live])


def _resolve_host_budget(sizes: StateSizes, request: OffloadRequest) -> _HostChoice:
    """The host budget, sub-group size, room to overlap, and where the gradients go.

    An explicit ``zero.sub_group_numel`` is kept, and overlap is on when the budget holds its
    comfortable staging. 'auto' takes the largest size (down to _AUTO_OVERLAP_FLOOR_NUMEL) whose
    comfortable staging fits, and only when none does, the largest (down to
    _AUTO_LEAST_FLOOR_NUMEL) whose least staging fits, without overlap. Taking the largest size
    that merely fits would turn overlap off at budgets where a smaller sub-group leaves room for
    it, and back on at larger ones: overlap would not grow with the budget. The gradients stay
    in host memory whenever an explicit budget holds them (so every budget that holds them runs
    as it did before gradients could move), and go to NVMe (optimizer there) only when it does
    not ([Note: gradients on NVMe] in infinity/zero/_grad_reducer.py): their 2-4 B per
    parameter written and read back each step are the price of a model larger than the host.

    An 'auto' budget is the comfortable one plus a margin, with the gradients in host memory
    while that stays within AUTO_HOST_RAM_FRACTION of the RAM, on NVMe beyond (where that
    budget is the smaller one: a small model's gradients take less than the slices' staging),
    so that host memory does not grow with the model."""
    host = request.host_budget_bytes
    if request.sub_group_numel != "auto":
        overlap_sizes = least_sizes = [int(request.sub_group_numel)]
    else:
        overlap_sizes = _auto_candidates(_AUTO_OVERLAP_FLOOR_NUMEL)
        least_sizes = _auto_candidates(_AUTO_LEAST_FLOOR_NUMEL)
    choices = _grad_choices(request)
    needs = {(sub, grads): host_needs(sizes, request, sub, grads_on_nvme=grads)
             for sub in {*overlap_sizes, *least_sizes} for grads in choices}
    if host == "auto":
        sub = overlap_sizes[0]
        share = _param_share(sizes, request, sub)
        if share:  # the staging's margin would be more room for parameters: exact sizes only
            budgets = {grads: needs[sub, grads].comfortable_bytes
                       - _PARAM_STAGING_SLOTS * _slot_bytes(sizes, request, sub) + share
                       for grads in choices}
        else:
            budgets = {grads: _with_margin(needs[sub, grads].comfortable_bytes)
                       for grads in choices}
        gathered = _gathered_room(sizes, request)
        budgets = {grads: budget + gathered for grads, budget in budgets.items()}
        ram = request.host_ram_bytes
        grads = (len(choices) > 1 and budgets[True] < budgets[False]
                 and (ram is None or budgets[False] > AUTO_HOST_RAM_FRACTION * ram))
        return _HostChoice(budgets[grads], sub, True, grads, share)
    for grads in choices:
        for sub in overlap_sizes:
            if needs[sub, grads].comfortable_bytes <= host:
                return _HostChoice(host, sub, True, grads)
        for sub in least_sizes:
            if needs[sub, grads].least_bytes <= host:
                return _HostChoice(host, sub, False, grads)
    sub = least_sizes[-1]
    grads = min(choices, key=lambda g: needs[sub, g].least_bytes)
    homed, least, _comfortable = needs[sub, grads]
    where = "gradient slices" if grads else "one parameter shard"
    raise ValueError(
        f"memory.host_budget_bytes={host} cannot hold what must live in host memory: {least} "
        f"bytes ({homed} of shards homed on the host, {least - homed} of NVMe staging: two "
        f"optimizer sub-groups of {sub} elements, {where} and a spare); raise it to "
        f"at least {least}, lower zero.sub_group_numel, or home more state on 'nvme'")


_PARAM_STAGING_SLOTS = 3
"""Host slots :func:`host_needs` gives NVMe parameters in a comfortable budget: a shard staged,
a shard prefetched, and the spare extent."""


def _param_share(sizes: StateSizes, request: OffloadRequest, sub: int) -> int:
    """[Note: the parameter share] DeepSpeed's ``offload_param.max_in_cpu`` bounds the parameter
    elements it keeps in host memory, beside whatever else lives there (a CPU-homed optimizer,
    the gradients); it is not a bound on the host as a whole (issue #15: mapped to the whole
    host budget, it could not hold a CPU-homed optimizer and initialize failed). So with
    parameters on NVMe and an 'auto' host budget, ``memory.host_param_cache_bytes`` replaces
    the comfortable budget's parameter slots (two shards in flight and the spare extent): the
    budget is what the rest needs, exactly, plus this share, raised to those three slots (the
    least that overlaps) and capped at every shard plus the spare. Everything else on the host
    is homed there or is the NVMe optimizer's pipeline, so the parameter copies the store keeps
    (evicted by its policy when the share is full) never take more than the share while the
    optimizer is homed on the host or the device; with the optimizer on NVMe they may also fill
    its staging slots while it is idle. 0: no share asked for, or parameters not on NVMe."""
    asked = request.host_param_cache_bytes
    if asked is None or request.param_home is not Tier.NVME or not sizes.param_shard_bytes:
        return 0
    slot = _slot_bytes(sizes, request, sub)
    least = _PARAM_STAGING_SLOTS * slot
    every = sum(map(extent_bytes, sizes.param_shard_bytes)) + slot
    if asked < least:
        warn_once(f"param-share:{asked}:{least}",
                  f"memory.host_param_cache_bytes={asked} (offload_param.max_in_cpu) is less than "
                  f"two parameter shards in flight and a spare extent; the host keeps {least} "
                  f"bytes for NVMe parameters")
    return min(max(asked, least), max(every, least))


def resolve_offload_budgets(sizes: StateSizes, request: OffloadRequest, *,
                            device: torch.device, device_working: DeviceWorkingSet | None = None
                            ) -> OffloadBudgets | None:
    """Budgets for the store when anything is offloaded (None otherwise); see the module
    docstring for what raises. ``device_working``: what the engine allocates on the device beside
    the store (an 'auto' device budget on a GPU subtracts it; None: nothing known)."""
    if not request.offloaded:
        return None
    largest_unit = max(sizes.unit_bytes, default=0)
    host, sub, overlap, grads_on_nvme, share = _resolve_host_budget(sizes, request)
    device_budget = request.device_budget_bytes
    device_needed = largest_unit + 2 * max(sizes.param_shard_bytes, default=0)
    if device_budget == "auto":
        device_budget = _auto_device_budget(device, device_needed,
                                            device_working or DeviceWorkingSet())
    elif device_budget < device_needed:
        raise ValueError(
            f"memory.device_budget_bytes={device_budget} cannot hold the largest unit gathered "
            f"({largest_unit} bytes) and its shard in flight; raise it to at least "
            f"{device_needed}, or choose smaller units (zero.unit_class_names/unit_min_numel)")
    # Every shard fits at once: after the first fetch of each, nothing is evicted from the device.
    holds_params = bool(sizes.param_shard_bytes) and device_budget >= sum(sizes.param_shard_bytes)
    # The parameter share beyond its staging slots is the parameters' cache, not the NVMe
    # optimizer's read-ahead room ([Note: the parameter share]).
    cache = max(0, share - _PARAM_STAGING_SLOTS * _slot_bytes(sizes, request, sub))
    cache += _gathered_room(sizes, request)  # the gathered units', not the optimizer's
    needs = host_needs(sizes, request, sub, grads_on_nvme=grads_on_nvme)
    activations = _activation_room(request, host, needs)
    window, resident = _optimizer_host_room(sizes, request, sub, host - cache - activations,
                                            device_holds_params=holds_params,
                                            grads_on_nvme=grads_on_nvme)
    return OffloadBudgets(device_budget_bytes=int(device_budget), host_budget_bytes=int(host),
                          nvme_path=request.nvme_path, sub_group_numel=sub,
                          largest_unit_bytes=largest_unit, overlap=overlap,
                          optimizer_window_sub_groups=window,
                          optimizer_host_resident_bytes=resident, device_holds_params=holds_params,
                          grads_on_nvme=grads_on_nvme, host_param_cache_bytes=share,
                          states_host_room_bytes=max(0, needs.comfortable_bytes
                                                     - needs.homed_bytes))


def _activation_room(request: OffloadRequest, host: int, needs: HostNeeds) -> int:
    """[Note: the activations' room] Saved activations in the store ([Note: saved activations
    are shards of the store] in infinity/zero/_stored_activations.py) share the arena with the
    states. The NVMe optimizer's read-ahead window and host-resident sub-groups take whatever
    room a budget leaves ([Note: optimizer read-ahead]) and pin it in a deferred step's forward,
    which is when activations are saved: the demo GPT with its activations offloaded 'host' into
    a budget of the states' least plus 1.25x the activations found every extent pinned. So an
    explicit budget with activations on HOST ('host', 'auto') keeps for them what it holds
    beyond the states' comfortable need (:func:`host_needs`), and one bound for NVMe ('nvme',
    'auto') at least their staging; the states' consumers of spare room size from the rest. An
    'auto' budget is sized for the states alone: it keeps only the staging. The other side of
    the same rule, ``states_host_room_bytes``, is what 'auto' activations leave the states."""
    if request.activations == "none":
        return 0
    room = 0
    if request.activations in ("host", "auto") and request.host_budget_bytes != "auto":
        room = max(0, host - needs.comfortable_bytes)
    if request.activations in ("nvme", "auto"):
        room = max(room, request.activation_staging_bytes)
    return room


def _optimizer_host_room(sizes: StateSizes, request: OffloadRequest, sub: int, host: int, *,
                         device_holds_params: bool, grads_on_nvme: bool) -> tuple[int, int]:
    """(read-ahead window in sub-groups, host-resident bytes) of the NVMe optimizer; (2, 0)
    otherwise.

    [Note: optimizer read-ahead] The host room the NVMe optimizer may pin: the budget less the
    host-homed shards, two parameter shards in flight (none when the device holds every
    parameter shard: nothing is staged through the host in the step) and one spare, in slots of
    the largest staging extent (as :func:`host_needs` counts them, so that arena holes always
    fit). At least two sub-groups (the one stepped and the next one read).

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
    if request.optimizer_home is not Tier.NVME:
        return 2, 0
    homed = host_needs(sizes, request, sub, grads_on_nvme=grads_on_nvme).homed_bytes
    param_nvme = request.param_home is Tier.NVME
    slot = _slot_bytes(sizes, request, sub)
    # Whole slots: sub-groups and parameter shards of different sizes fragment the arena, and
    # counting finer let a parameter shard find no hole beside a full window. Gradients on NVMe:
    # a slot for the slice being accumulated, and two slots per sub-group (its gradient slice).
    param_staged = 0 if device_holds_params else 2 * param_nvme
    slots = (host - homed) // slot - param_staged - grads_on_nvme - 1 if slot else 0
    slots //= 1 + grads_on_nvme
    # An 'auto' budget is the pipeline's need plus a margin: nothing to spare. Parameters read
    # from NVMe every step need the spare room as their host cache (it saves their reads).
    # Gradients on NVMe mean the host is short of room: nothing to spare either.
    spare = request.host_budget_bytes != "auto" and not param_staged and not grads_on_nvme
    resident = 0
    if slots > OPTIMIZER_WINDOW_SLOTS and spare:
        resident, slots = (slots - OPTIMIZER_WINDOW_SLOTS) * slot, OPTIMIZER_WINDOW_SLOTS
    return max(2, slots), resident


def _auto_device_budget(device: torch.device, needed: int, working: DeviceWorkingSet) -> int:
    """CUDA: :func:`auto_device_budget_bytes` of the free memory now; CPU (the device tier is host
    RAM): what the shards in flight need plus 64 MiB, so that DEVICE copies never pile up in RAM."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return auto_device_budget_bytes(free_bytes=free, working=working, needed_bytes=needed)
    return needed + _CPU_DEVICE_MARGIN_BYTES
