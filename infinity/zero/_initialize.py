"""``infinity.initialize``: a model and a config in, an :class:`~infinity.zero.InfinityEngine` out
(the config loaded and resolved from whatever form it comes in)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import torch.distributed as dist
from torch import nn

from infinity._modeled_link import LinkModel
from infinity.config import InfinityConfig, load_config
from infinity.zero._collectives import is_distributed
from infinity.zero._engine import InfinityEngine
from infinity.zero._lazy import recording_of
from infinity.zero._unit_builder import BuildProgress

__all__ = ["initialize", "pipeline_stage_of_rank"]

logger = logging.getLogger(__name__)


def pipeline_stage_of_rank(num_stages: int) -> int:
    """This rank's pipeline stage: the outermost mesh coordinate ([Note: mesh dimensions] in
    infinity/config/_mesh.py); ValueError when the stages do not divide the world."""
    world = dist.get_world_size() if is_distributed() else 1
    if world % num_stages:
        raise ValueError(f"mesh.pipeline: {num_stages} stages do not divide the world size "
                         f"{world}; choose a divisor")
    return (dist.get_rank() if is_distributed() else 0) // (world // num_stages)


def check_pipeline_stage(num_stages: int, stage: int | None) -> None:
    """A config with pipeline stages builds stage engines only, each at its rank's stage
    ([Note: mesh dimensions] in infinity/config/_mesh.py: the stage is the outermost coordinate)."""
    if num_stages == 1 and stage in (None, 0):
        return
    if stage is None:
        raise ValueError(f"mesh.pipeline: {num_stages} stages, but initialize() builds an engine "
                         f"for a whole model; build a pipeline with infinity.pipeline.initialize("
                         f"nn.Sequential(...), config, loss_fn=...), or set mesh.pipeline 1 (a "
                         f"DeepSpeed config's pipeline.stages) for data parallelism only")
    mine = pipeline_stage_of_rank(num_stages)
    if stage != mine:
        raise ValueError(f"initialize(pipeline_stage={stage}): this rank is at stage {mine} of "
                         f"mesh.pipeline {num_stages} (pipeline outermost in rank order)")


def initialize(model: nn.Module, config: "InfinityConfig | Mapping[str, Any] | str | None" = None,
               *, model_parameters: Any = None,
               progress: Callable[[BuildProgress], None] | None = None,
               mesh: Any = None, data_parallel_group: Any = None,
               comm_link: LinkModel | None = None,
               copy_link: LinkModel | None = None,
               pipeline_stage: int | None = None) -> InfinityEngine:
    """Wrap ``model`` for training with ``config`` (InfinityConfig, dict, JSON path; native or
    DeepSpeed-style; None: the config given to ``infinity.init`` when the model was built under
    it, else the defaults). ``model_parameters`` (DeepSpeed's name): None (every parameter with
    ``requires_grad``, the config's hyperparameters), the parameters to train, or torch-style
    parameter groups ``[{"params": [...], "weight_decay": 0.0, ...}, ...]`` whose missing keys
    take the config's values (:func:`~infinity.optim.resolve_param_groups`). ``progress``: called
    with a :class:`~infinity.zero.BuildProgress` after each unit is built (units done, bytes
    written to NVMe): building a large model under ``infinity.init`` writes its whole state and
    takes minutes. Uses the default process group when ``torch.distributed`` is initialised.
    ``mesh``: a ``torch.distributed.DeviceMesh`` with dims ``("replicate", "shard")`` (HSDP:
    shard over "shard", replicate over "replicate") or ``("replicate", "shard", "tensor")``
    (tensor innermost), instead of the one the config's ``mesh`` section builds
    ([Note: mesh dimensions] in infinity/config/_mesh.py).
    ``data_parallel_group``: the ranks to shard over instead of a mesh. A model parallelized with
    ``parallelize_module`` (DTensor parameters on a 1-D tensor mesh) is sharded over the other
    dimension of the mesh it was sliced from, or over ``data_parallel_group`` or the mesh's data
    dimensions ([Note: tensor-parallel parameters] in infinity/zero/_tensor_parallel.py).
    ``comm_link``: a modeled link under every collective; ``copy_link``: one under the store's
    host<->device copies (a CPU engine with ``memory.device_budget_bytes`` standing in for a
    GPU). Benchmarks and tests on machines without a GPU or a network: [Note: the modeled link]
    in infinity/_modeled_link.py. ``pipeline_stage``: this engine runs that stage of the config's
    ``mesh.pipeline`` stages (given by :mod:`infinity.pipeline`, which builds stage engines; a
    config with ``mesh.pipeline`` > 1 is refused without it)."""
    if config is None:
        recording = recording_of(model) if isinstance(model, nn.Module) else None
        config = recording.config if recording is not None else None
    config = load_config(config)
    check_pipeline_stage(config.mesh.pipeline, pipeline_stage)
    if is_distributed():
        logger.debug("using the default process group")
    return InfinityEngine(model, config, model_parameters=model_parameters, progress=progress,
                          mesh=mesh, data_parallel_group=data_parallel_group,
                          comm_link=comm_link, copy_link=copy_link)
