"""The device mesh: which ranks shard a unit together, which hold replicas of the same shards,
which form a tensor-parallel slice, and which hold the same place in each pipeline stage
([Note: mesh dimensions] in infinity/config/_mesh.py).

:func:`mesh_ranks` is the pure rule (world size and sizes -> rank lists); :func:`mesh_collectives`
creates the process groups and returns the :class:`~infinity.zero._collectives.Collectives` the
engine uses: parameter all-gathers and gradient reduce-scatters on the shard group, the gradient
shards' all-reduce on the replicate group, and broadcasts and agreement on the data-parallel
group (every rank of this tensor slice).

A ``torch.distributed.DeviceMesh`` passed to ``initialize(model, config, mesh=...)`` is read by its
dimension names: ``("replicate", "shard")`` (HSDP), ``("replicate", "shard", "tensor")``, with
``"pipeline"`` first or not, or any subset holding ``"shard"`` (a missing dimension has size 1).
With a pipeline each stage's ranks run their own engine: the groups below are this rank's stage's,
and ``Collectives.pipeline`` joins the ranks at the same place of every stage (the gradient norm
and the fp16 overflow are summed over it).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch.distributed as dist

from infinity.config import MeshConfig
from infinity.zero._collectives import Collectives, is_distributed

logger = logging.getLogger(__name__)

DIM_NAMES = ("pipeline", "replicate", "shard", "tensor")
"""The mesh dimensions, outermost first (rank order: tensor innermost)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshRanks:
    """The groups of one mesh, each a tuple of global ranks in group-rank order."""

    replicate: int
    shard: int
    tensor: int
    pipeline: int
    shard_groups: tuple[tuple[int, ...], ...]
    """One per (replica, tensor index): the S ranks that hold one unit's shards."""
    replicate_groups: tuple[tuple[int, ...], ...]
    """One per (shard index, tensor index): the R ranks holding the same shard."""
    tensor_groups: tuple[tuple[int, ...], ...]
    """One per (replica, shard index): the T ranks of one tensor-parallel slice."""
    data_parallel_groups: tuple[tuple[int, ...], ...]
    """One per (stage, tensor index): the R * S ranks holding copies or shards of the same
    tensors."""
    pipeline_groups: tuple[tuple[int, ...], ...]
    """One per (replica, shard index, tensor index): the P ranks at that place of each stage."""
    stage_groups: tuple[tuple[int, ...], ...]
    """One per stage: its R * S * T ranks."""

    def group_of(self, groups: tuple[tuple[int, ...], ...], rank: int) -> tuple[int, ...]:
        return next(g for g in groups if rank in g)


def mesh_ranks(*, world_size: int, replicate: int, shard: int, tensor: int = 1,
               pipeline: int = 1) -> MeshRanks:
    """The groups of a ``pipeline x replicate x shard x tensor`` mesh over ranks ``0 ..
    world_size - 1``, rank ``((p * replicate + r) * shard + s) * tensor + t`` at coordinates
    (p, r, s, t) ([Note: mesh dimensions])."""
    if pipeline * replicate * shard * tensor != world_size:
        raise ValueError(f"mesh: pipeline * replicate * shard * tensor = {pipeline} * {replicate} "
                         f"* {shard} * {tensor} = {pipeline * replicate * shard * tensor}, "
                         f"expected the world size {world_size}")

    def at(p: int, r: int, s: int, t: int) -> int:
        return ((p * replicate + r) * shard + s) * tensor + t

    P, R, S, T = range(pipeline), range(replicate), range(shard), range(tensor)
    return MeshRanks(
        replicate=replicate, shard=shard, tensor=tensor, pipeline=pipeline,
        shard_groups=tuple(tuple(at(p, r, s, t) for s in S) for p in P for r in R for t in T),
        replicate_groups=tuple(tuple(at(p, r, s, t) for r in R)
                               for p in P for s in S for t in T),
        tensor_groups=tuple(tuple(at(p, r, s, t) for t in T) for p in P for r in R for s in S),
        data_parallel_groups=tuple(tuple(at(p, r, s, t) for r in R for s in S)
                                   for p in P for t in T),
        pipeline_groups=tuple(tuple(at(p, r, s, t) for p in P) for r in R for s in S for t in T),
        stage_groups=tuple(tuple(at(p, r, s, t) for r in R for s in S for t in T) for p in P))


def _subgroup(groups: tuple[tuple[int, ...], ...], world_size: int) -> Any:
    """This rank's process group among ``groups`` (every rank creates all of them, in the same
    order, as ``new_group`` requires); None (the default group) when one group is the world."""
    if len(groups) == 1 and len(groups[0]) == world_size:
        return None
    mine = None
    for ranks in groups:
        pg = dist.new_group(list(ranks))
        if dist.get_rank() in ranks:
            mine = pg
    return mine


@dataclasses.dataclass(frozen=True)
class MeshGroups:
    """This rank's process groups (None: the default group, or no group for a size-1 dim)."""

    ranks: MeshRanks
    shard: Any
    replicate: Any
    tensor: Any
    data_parallel: Any
    pipeline: Any = None


def groups_from_config(config: MeshConfig) -> MeshGroups:
    """Build the mesh of ``config`` over the default process group's world."""
    world = dist.get_world_size() if is_distributed() else 1
    r, s, t = config.resolve(world)
    p = config.pipeline
    ranks = mesh_ranks(world_size=world, replicate=r, shard=s, tensor=t, pipeline=p)
    if world == 1:
        return MeshGroups(ranks, None, None, None, None)
    return MeshGroups(ranks, shard=_subgroup(ranks.shard_groups, world),
                      replicate=_subgroup(ranks.replicate_groups, world) if r > 1 else None,
                      tensor=_subgroup(ranks.tensor_groups, world) if t > 1 else None,
                      data_parallel=_subgroup(ranks.data_parallel_groups, world),
                      pipeline=_subgroup(ranks.pipeline_groups, world) if p > 1 else None)


def groups_from_device_mesh(mesh: Any) -> MeshGroups:
    """The groups of a ``torch.distributed.DeviceMesh`` named by :data:`DIM_NAMES`."""
    names = tuple(mesh.mesh_dim_names or ())
    unknown = [n for n in names if n not in DIM_NAMES]
    if "shard" not in names or unknown or len(set(names)) != len(names):
        raise ValueError(f"initialize(mesh=...): expected a DeviceMesh whose mesh_dim_names are "
                         f"among {DIM_NAMES} and include 'shard', got {names}; build it with "
                         f"init_device_mesh(device, (R, S), mesh_dim_names=('replicate', 'shard'))")
    world = dist.get_world_size()
    if mesh.size() != world:
        raise ValueError(f"initialize(mesh=...): the mesh has {mesh.size()} ranks, the world "
                         f"{world}; the engine's mesh must cover every rank")
    sizes = {n: mesh.size(names.index(n)) if n in names else 1 for n in DIM_NAMES}
    ranks = mesh_ranks(world_size=world, **sizes)
    order = tuple(n for n in DIM_NAMES if n in names)
    # The rank lists above assume the standard order (tensor innermost); check the mesh's.
    if names != order or mesh.mesh.flatten().tolist() != list(range(world)):
        raise ValueError(f"initialize(mesh=...): expected dims in the order {order} over ranks "
                         f"0..{world - 1} in order (tensor innermost), got {names} over "
                         f"{mesh.mesh.tolist()}")
    mine = dist.get_rank()
    dp = ranks.group_of(ranks.data_parallel_groups, mine)
    return MeshGroups(
        ranks, shard=mesh.get_group("shard"),
        replicate=mesh.get_group("replicate") if sizes["replicate"] > 1 else None,
        tensor=mesh.get_group("tensor") if sizes["tensor"] > 1 else None,
        data_parallel=(None if len(dp) == world
                       else _subgroup(ranks.data_parallel_groups, world)),
        pipeline=mesh.get_group("pipeline") if sizes["pipeline"] > 1 else None)


def mesh_collectives(config: MeshConfig, device_mesh: Any = None) -> Collectives:
    """The engine's collectives over the mesh of ``device_mesh`` (if given) or ``config``."""
    if device_mesh is not None and config != MeshConfig():
        raise ValueError(f"initialize: both a DeviceMesh (mesh=...) and a config 'mesh' section "
                         f"{config} were given; pass one of them")
    groups = (groups_from_device_mesh(device_mesh) if device_mesh is not None
              else groups_from_config(config))
    r = groups.ranks
    logger.info("mesh: pipeline %d x replicate %d x shard %d x tensor %d", r.pipeline,
                r.replicate, r.shard, r.tensor)
    if not is_distributed() or (r.replicate == 1 and r.tensor == 1 and r.pipeline == 1):
        return Collectives()  # flat: the shard group is the world
    world = Collectives(groups.data_parallel)
    replicate = Collectives(groups.replicate, counts=world) if r.replicate > 1 else None
    pipeline = Collectives(groups.pipeline, counts=world) if r.pipeline > 1 else None
    return Collectives(groups.shard, replicate=replicate, world=world, tensor_group=groups.tensor,
                       pipeline=pipeline)
