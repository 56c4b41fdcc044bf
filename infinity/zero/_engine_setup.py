"""How an engine is assembled from its config: the checks before any state exists, the
parallelism, the parameter manager's resolved settings, and the set-up helpers
:class:`~infinity.zero._engine.InfinityEngine` calls once."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from torch import nn

from infinity._dtypes import torch_dtype
from infinity.config import AUTO, InfinityConfig, MeshConfig
from infinity.ledger import grad_staging_dtype, host_grad_dtype
from infinity.optim import OffloadedShardOptimizer, rebind_param_groups, resolve_param_groups
from infinity.tiers import OffloadBudgets, Tier
from infinity.zero._activations import select_modules
from infinity.zero._collectives import Collectives
from infinity.zero._flat_group import FlatGroup
from infinity.zero._lazy import materialise_placeholders, recording_of
from infinity.zero._managed import check_not_wrapped
from infinity.zero._manager_config import ManagerConfig
from infinity.zero._mesh import mesh_collectives
from infinity.zero._offload import param_reads_of
from infinity.zero._quantize import quant_policy
from infinity.zero._tensor_parallel import check_data_parallel_group, resolve_parallelism

__all__ = ["MasterStream", "check_copy_link", "check_writable_dirs", "checked_param_groups",
           "close_offload", "manager_config", "materialise", "parallelism"]


def check_writable_dirs(config: InfinityConfig) -> None:
    """Every NVMe swap directory exists (or can be made) and takes a file: before any state."""
    dirs = [(s.nvme_path, f"{s.name}.nvme_path") for s in (config.offload_param,
                                                             config.offload_optimizer)
            if s.device == "nvme"]
    acts = config.activation_checkpointing
    if acts.nvme_path is not None and acts.offload_tier in ("nvme", "auto"):
        dirs.append((acts.nvme_path, "activation_checkpointing.nvme_path"))
    for path, field in dirs:
        try:
            os.makedirs(path, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path, prefix=".infinity-probe-"):
                pass
        except OSError as e:
            raise ValueError(f"{field}: {path!r} is not a writable directory ({e.strerror or e}); "
                             f"point it at a directory on a local disk this process can write"
                             ) from None


def parallelism(model: nn.Module, config: InfinityConfig, mesh: Any,
                 data_parallel_group: Any) -> tuple[Any, Collectives]:
    """(the model's tensor parallelism or None, the engine's collectives).

    A mesh (``mesh=`` or a config ``mesh`` section) and ``data_parallel_group`` are two ways to
    say the same thing: one of them. Without either, a tensor-parallel model is sharded over
    the other dimension of its tensor mesh's parent and any other model over the world
    ([Note: collectives over a mesh], [Note: tensor-parallel parameters])."""
    explicit_mesh = mesh is not None or config.mesh != MeshConfig()
    if explicit_mesh and data_parallel_group is not None:
        raise ValueError("initialize: both a mesh (mesh=... or the config's 'mesh' section) and "
                         "data_parallel_group were given; pass one of them")
    tensor_parallel, group = resolve_parallelism(model, data_parallel_group)
    if tensor_parallel is None and group is None or explicit_mesh:
        collectives = mesh_collectives(config.mesh, mesh)
        if tensor_parallel is not None:  # the mesh's data ranks must share this tensor slice
            check_data_parallel_group(collectives.world.group, tensor_parallel)
        return tensor_parallel, collectives
    return tensor_parallel, Collectives(group)


def check_copy_link(config: InfinityConfig, device: torch.device) -> None:
    """A modeled host<->device link ([Note: the modeled link] in infinity/_modeled_link.py) is
    under the store's copies between HOST and DEVICE: there must be such copies (parameters
    offloaded: the store that holds them is built)."""
    if config.offload_param.device == "none":
        raise ValueError("initialize(copy_link=...): a modeled host<->device link needs "
                         "parameters offloaded (offload_param.device 'cpu' or 'nvme'): without "
                         "them nothing is copied between host and device")
    if device.type == "cpu" and config.memory.device_budget_bytes == AUTO:
        raise ValueError("initialize(copy_link=...): on a CPU engine set "
                         "memory.device_budget_bytes (the modeled device's memory): with 'auto' "
                         "gathers read the HOST copies and nothing crosses the link "
                         "([Note: a CPU engine reads parameter shards from HOST] in "
                         "infinity/zero/_manager_config.py)")


def manager_config(config: InfinityConfig, device: torch.device, world_size: int,
                    offload: OffloadBudgets | None, *, shard_world_size: int) -> ManagerConfig:
    """The parameter manager's settings, resolved from ``config`` once; ``world_size``: the
    data-parallel ranks gradients are summed over, ``shard_world_size``: the shard degree."""
    zero, precision = config.zero, config.precision
    compute = torch_dtype(precision.dtype)

    def number(value: Any) -> int | None:  # a knob that may be 'auto': the number, or None
        return None if value == AUTO else int(value)

    reuse = number(zero.max_reuse_distance_numel)
    holds = offload is not None and offload.device_holds_params
    host_grads = torch_dtype(host_grad_dtype(config, world_size))
    optimizer_offloaded = config.offload_optimizer.home_tier is not Tier.DEVICE
    return ManagerConfig(
        stage=zero.stage, device=device, compute_dtype=compute,
        param_home=config.offload_param.home_tier,
        optimizer_offloaded=optimizer_offloaded,
        reads=param_reads_of(config, device, shard_world_size=shard_world_size,
                             device_holds_params=holds),
        device_holds_params=holds,
        prefetch=offload is not None and offload.overlap,
        prefetch_lookahead_bytes=number(zero.prefetch_lookahead_bytes),
        max_live_bytes=number(zero.max_live_bytes),
        max_reuse_distance_bytes=None if reuse is None else reuse * compute.itemsize,
        reduce_dtype=compute if precision.reduce_dtype == "compute" else torch.float32,
        grad_host_dtype=host_grads,
        grad_staging_dtype=torch_dtype(grad_staging_dtype(config, world_size)),
        stored_grad_slice_numel=(offload.sub_group_numel
                                 if offload is not None and offload.grads_on_nvme else None),
        hpz_partition_size=zero.hpz_partition_size,
        overlap_param_gather=zero.overlap_param_gather,
        quant=quant_policy(zero, precision))


class MasterStream:
    """[Note: masters stream into the optimizer]
    With the optimizer on NVMe, each trainable group's fp32 master goes to the optimizer as soon
    as its unit is built, which registers (and writes) its NVMe-homed sub-groups at once; the
    master is then dropped. Built after the last unit instead, every master (4 B per trainable
    parameter, 13 GB at 3.3B) waited in host memory until then: set-up's peak grew with the
    model (tests/engine/test_init_host_memory.py). Two orders are kept as before. The
    host-resident sub-groups ([Note: host-resident sub-groups] in
    infinity/tiers/_offload_budgets.py) are long-lived HOST extents, so their keys are held back
    (their masters stay, at most the optimizer's host room / 3) and registered after the set-up
    copies of parameters and sub-groups are evicted ([Note: set-up copies strew the home
    extents] in infinity/zero/_unit_builder.py). And the optimizer's key order, the step's
    tie-break, is the order the groups were built in. A host-homed optimizer ('cpu') keeps the
    old order: its state is host memory by design."""

    def __init__(self, optimizer: OffloadedShardOptimizer):
        self.optimizer = optimizer

    def take(self, group: FlatGroup, partition: Any) -> None:
        self.optimizer.add(group.key, group.master, partition, param_key=group.store_key)

    def drop_setup_copies(self) -> None:
        self.optimizer.drop_setup_copies()


def close_offload(store: Any, swapper: Any) -> None:
    if store is not None:
        store.close()
    if swapper is not None:
        swapper.close()


def checked_param_groups(model: nn.Module, config: InfinityConfig, model_parameters: Any
                         ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The checks before anything is built (a bad group, directory or class name leaves the
    model untouched), and the optimizer's parameter groups with the config's defaults."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"initialize: expected a torch.nn.Module, got {type(model).__name__}")
    config.check_resolved("initialize")
    opt = config.optimizer
    defaults = {"lr": float(opt.lr), "betas": tuple(float(b) for b in opt.betas),
                "eps": float(opt.eps), "weight_decay": float(opt.weight_decay)}
    groups = resolve_param_groups(model, model_parameters, defaults)
    check_writable_dirs(config)
    check_not_wrapped(model)
    if isinstance(config.activation_checkpointing.units, tuple):
        select_modules(model, config.activation_checkpointing)  # unknown class names: fail early
    return groups, defaults


def materialise(model: nn.Module, groups: Any) -> tuple[Any, Any]:
    """A model built under ``infinity.init`` gets real parameters now (its values come unit by
    unit as the manager builds them); the parameter groups follow the new parameters. Returns
    the groups and the recorded initial values (None for an ordinary model)."""
    recording = recording_of(model)
    if recording is None:
        return groups, None
    names_before = {id(p): n for n, p in model.named_parameters()}
    initial_values = materialise_placeholders(model, recording)
    now = dict(model.named_parameters())
    return rebind_param_groups(groups, {i: now[n] for i, n in names_before.items()}), initial_values
