"""Tensor parallelism composed with ZeRO: a model that
``torch.distributed.tensor.parallel.parallelize_module`` parallelized (ColwiseParallel /
RowwiseParallel: DTensor parameters on a 1-D "tensor" mesh) trains under the engine, which shards
each parameter's tensor-parallel *local* tensor over the data-parallel ranks.

[Note: tensor-parallel parameters]
A DTensor parameter is managed through its local tensor (``param._local_tensor``): the unit's
flat buffer holds the local tensor's elements (its local numel and shape, not the global ones),
and the local tensor, not the parameter, is made a view of the flat buffer
(``local.data = full[offset:offset + numel].view(local_shape)``). The parameter stays the same
DTensor object with the same mesh, placements and global shape, so the redistribute hooks that
``parallelize_module`` installed keep working, and [Note: release keeps parameter identity] holds
unchanged: releasing a unit frees the storage under the local tensor. FSDP2 builds new DTensors
over its gathered buffer instead (``_fsdp_param.py``: ``_from_local_no_grad``); we keep one object
so that optimizers and the engine's id()-keyed records need no swap. Its gradient is a DTensor
too: it is brought to the parameter's placements (under sequence parallelism a norm's Replicate
weight receives a Partial gradient, summed over the tensor ranks here as FSDP2 does, and a
rowwise embedding's Shard(0) weight a Replicate one, sliced) and its local tensor is staged,
reduced and accumulated like any other gradient. The data-parallel group holds the ranks with
the same tensor-parallel coordinate, so every flat buffer has the same layout on all its members.

[Note: gradient norm across tensor ranks]
The clip norm is over the whole model. A parameter sharded over the tensor mesh (a ``Shard``
placement) has a different slice on each tensor rank: its squares are summed over the tensor
group as well. A plain or Replicate parameter has the same gradient on every tensor rank: its
squares are counted once, not tensor-size times. The two kinds never share a flat group
(``is_tensor_sharded`` is part of the group key, ``.tp`` in its name), so the engine sums each
group's squares into the right one of two totals.

[Note: full state dict under tensor parallelism]
``engine.full_state_dict()`` returns full tensors: each DTensor parameter's value is gathered
over the data-parallel ranks (as every parameter's is), then over the tensor ranks
(``DTensor.full_tensor()``), so its keys and shapes are those of the unparallelized model and
every rank holds the same dict. Loading weights files into the shards (``load_weights``) is not
supported under tensor parallelism yet: it raises.

[Note: checkpoints under tensor parallelism]
``save_checkpoint(DIR)`` writes each tensor rank's training state as an ordinary checkpoint of its
data-parallel group under ``DIR/tensor-<r>-of-<T>`` (its parameters' local shapes in the
manifest). ``load_checkpoint`` maps ``DIR``, ``DIR/tensor-<any>-of-<T>`` or a ``step-*`` folder
inside one onto this rank's folder, so every rank may pass the same path (rank 0's). A checkpoint
loads at another data-parallel size (the loader reshards each folder), not at another tensor size
nor into a model without tensor parallelism (the local shapes differ: the loader's shape check
refuses); ``infinity consolidate`` on one folder gives that tensor rank's local shards.

Offload works unchanged (each rank's swap directory is its own). Its budgets and the NVMe space
check are sized from the model's parameters before set-up, at their global sizes: for a
tensor-parallel model an upper bound (tensor size times the sharded parameters' local bytes).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from infinity.zero._collectives import Collectives

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from torch.distributed.tensor import DeviceMesh, DTensor


def _dtensor_type() -> "type[DTensor] | None":
    """DTensor's class if ``torch.distributed.tensor`` is loaded, else None. Never imported
    here: a model holding DTensors was parallelized by code that imported it, and importing it
    for every engine loads DTensor's dispatch machinery into processes that never use it."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_dtensor(t: object) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose elements a flat buffer holds: a DTensor's local tensor, else ``t``
    ([Note: tensor-parallel parameters])."""
    return t._local_tensor if is_dtensor(t) else t


def set_local_view(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``param`` (its local tensor, for a DTensor) a view of ``view``'s storage
    ([Note: release keeps parameter identity], [Note: tensor-parallel parameters]). A DTensor
    whose dtype changes (fp32 parameters, bf16 compute) takes the new dtype in its own metadata
    and spec too: ``set_data`` changes the wrapper's dtype, not its Python attributes, and DTensor
    propagates shardings from the spec's dtype."""
    if is_dtensor(param) and param.dtype != view.dtype:
        cast = _dtensor_type().from_local(view, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
        param.data = cast
        param._spec = cast._spec
    local_tensor(param).data = view


def is_tensor_sharded(param: torch.Tensor) -> bool:
    """The parameter holds a different slice on each tensor rank ([Note: gradient norm across
    tensor ranks])."""
    return is_dtensor(param) and any(p.is_shard() for p in param.placements)


def local_grad(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient's elements laid out like the parameter's local tensor: a DTensor gradient is
    redistributed to the parameter's placements first (a Partial gradient is summed over the
    tensor ranks: a collective, issued in the same order on every rank since autograd runs the
    same graph there)."""
    if not is_dtensor(grad):
        return grad
    if tuple(grad.placements) != tuple(param.placements):
        grad = grad.redistribute(param.device_mesh, param.placements)
    return grad.to_local()


def full_value(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The unsharded value of ``param`` from its local tensor's values ``local``: gathered over
    the tensor ranks for a DTensor (a collective), ``local`` itself otherwise ([Note: full state
    dict under tensor parallelism])."""
    if not is_dtensor(param):
        return local
    dt = _dtensor_type().from_local(local, param.device_mesh, param.placements, run_check=False,
                            shape=param.shape, stride=param.stride())
    return dt.full_tensor()


def tensor_mesh_of(model: nn.Module) -> "DeviceMesh | None":
    """The one 1-D mesh every DTensor parameter of ``model`` lives on, or None without DTensors.
    ValueError for DTensors on several meshes or on a mesh of more than one dimension (FSDP2's
    2-D parameters: a model already sharded over data-parallel ranks)."""
    mesh = None
    for name, p in model.named_parameters():
        if not is_dtensor(p):
            continue
        if p.device_mesh.ndim != 1:
            raise ValueError(
                f"parameter {name!r} is a DTensor on a {p.device_mesh.ndim}-D mesh "
                f"{p.device_mesh}; the engine composes with 1-D tensor parallelism only: pass "
                f"parallelize_module the mesh's 'tensor' dimension (mesh['tensor']), and no "
                f"FSDP2 (the engine shards over the data-parallel ranks itself)")
        if mesh is None:
            mesh = p.device_mesh
        elif p.device_mesh != mesh:
            raise ValueError(f"parameter {name!r} is a DTensor on {p.device_mesh}, others on "
                             f"{mesh}; parallelize the whole model over one tensor mesh")
    return mesh


def data_parallel_group_of(tensor_mesh: "DeviceMesh") -> "dist.ProcessGroup | None":
    """The data-parallel group that goes with ``tensor_mesh``: the other dimension of the 2-D
    mesh it was sliced from (``init_device_mesh(..., (dp, tp), mesh_dim_names=(..., 'tensor'))``
    then ``mesh['tensor']``); None (the default group) when the tensor mesh holds one rank.
    Uses the groups the mesh already made (no collective). ValueError when there is no such
    dimension (the tensor mesh spans every rank) or several (pass ``data_parallel_group``)."""
    root = tensor_mesh._get_root_mesh()
    if root is tensor_mesh or root.ndim == 1:
        if tensor_mesh.size() == 1:
            return None
        if dist.get_world_size() == tensor_mesh.size():
            raise ValueError(
                "the tensor mesh spans every rank, so there is no data-parallel dimension to "
                "shard over; build the mesh with init_device_mesh(device, (dp, tp), "
                "mesh_dim_names=('shard', 'tensor')) or pass initialize(..., "
                "data_parallel_group=...)")
        raise ValueError(f"cannot tell the data-parallel ranks of tensor mesh {tensor_mesh}: "
                         f"slice it from a 2-D mesh (mesh['tensor']) or pass "
                         f"initialize(..., data_parallel_group=...)")
    if root.ndim != 2:
        raise ValueError(f"the tensor mesh was sliced from a {root.ndim}-D mesh {root}; pass "
                         f"initialize(..., data_parallel_group=...) (the ranks that share this "
                         f"rank's tensor-parallel coordinate)")
    tensor_dim = root.mesh_dim_names.index(tensor_mesh.mesh_dim_names[0])
    return root.get_group(1 - tensor_dim)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorParallel:
    """The tensor-parallel side of one engine: the tensor mesh its DTensor parameters live on
    and the collectives over its group (the gradient norm's second sum)."""

    mesh: "DeviceMesh"
    group: "dist.ProcessGroup"
    collectives: Collectives


def tensor_parallel_of(model: nn.Module) -> TensorParallel | None:
    """The model's tensor parallelism, None when no parameter is a DTensor."""
    mesh = tensor_mesh_of(model)
    if mesh is None:
        return None
    group = mesh.get_group()
    return TensorParallel(mesh=mesh, group=group, collectives=Collectives(group))


def resolve_parallelism(model: nn.Module, data_parallel_group: "dist.ProcessGroup | None"
                        ) -> tuple[TensorParallel | None, "dist.ProcessGroup | None"]:
    """(the model's tensor parallelism or None, the group the engine shards over: None for the
    default group). ``data_parallel_group``: the caller's, else, under tensor parallelism, the
    other dimension of the tensor mesh's parent (:func:`data_parallel_group_of`)."""
    tp = tensor_parallel_of(model)
    if tp is None:
        return None, data_parallel_group
    group = (data_parallel_group if data_parallel_group is not None
             else data_parallel_group_of(tp.mesh))
    check_data_parallel_group(group, tp)
    logger.info("tensor parallel over %d ranks %s; sharding over %s", tp.mesh.size(),
                dist.get_process_group_ranks(tp.group),
                "every rank" if group is None else dist.get_process_group_ranks(group))
    return tp, group


def check_data_parallel_group(group: "dist.ProcessGroup | None", tp: TensorParallel) -> None:
    """ValueError unless ``group`` and the tensor group meet in this rank alone: data-parallel
    peers must hold the same tensor-parallel slice ([Note: tensor-parallel parameters])."""
    if not dist.is_initialized():
        return
    dp = set(dist.get_process_group_ranks(group) if group is not None
             else range(dist.get_world_size()))
    common = dp & set(dist.get_process_group_ranks(tp.group))
    if common != {dist.get_rank()}:
        raise ValueError(f"the data-parallel group (ranks {sorted(dp)}) and the tensor group "
                         f"(ranks {sorted(dist.get_process_group_ranks(tp.group))}) share ranks "
                         f"{sorted(common)}, expected only this rank ({dist.get_rank()}); the "
                         f"data-parallel group must hold the ranks with this rank's "
                         f"tensor-parallel coordinate (the other dimension of the mesh)")


_TENSOR_DIR = re.compile(r"^tensor-(\d+)-of-(\d+)$")


def tensor_rank_dir(tp: TensorParallel, directory: str) -> str:
    """This tensor rank's checkpoint folder for ``directory`` ([Note: checkpoints under tensor
    parallelism]): a root gets ``tensor-<r>-of-<T>`` appended; a path through another tensor
    rank's folder is redirected to this rank's."""
    mine = f"tensor-{tp.mesh.get_local_rank()}-of-{tp.mesh.size()}"
    parts = os.path.normpath(directory).split(os.sep)
    for i in (len(parts) - 1, len(parts) - 2):  # the folder itself, or a step-* folder in it
        found = _TENSOR_DIR.match(parts[i]) if i >= 0 else None
        if found is None:
            continue
        if int(found.group(2)) != tp.mesh.size():
            raise ValueError(f"{directory}: saved with tensor-parallel size {found.group(2)}, "
                             f"this model has {tp.mesh.size()}; load it at the size it was "
                             f"saved with (resharding across tensor sizes is not supported)")
        parts[i] = mine
        return os.sep.join(parts)
    return os.path.join(directory, mine)
