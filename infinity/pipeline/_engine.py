"""A pipeline-parallel engine: ``torch.distributed.pipelining`` runs the schedule, an
:class:`~infinity.zero.InfinityEngine` per stage runs ZeRO and offload inside it.

[Note: ZeRO inside a pipeline stage]
Each stage is an ordinary engine over its own layers and its own ranks (the R x S x T ranks of
its place on the mesh's pipeline dimension, [Note: mesh dimensions] in infinity/config/_mesh.py):
stages 0-3, CPU and NVMe offload, the prefetcher, all as without a pipeline. What the pipeline
changes, and where:

* The schedule (GPipe, 1F1B, Interleaved1F1B: ``torch.distributed.pipelining``'s, never our own)
  calls the stage's module for each micro-batch's forward and ``torch.autograd.backward`` for its
  backward, in its own interleaved order (interleaved: one engine per rank over all the rank's
  chunks, :class:`RankChunks`); the engine sees a ``loss.backward()``-style backward per micro-batch
  ([Note: the end of backward] in infinity/zero/_param_manager.py) and accumulates its gradients
  into the shards, reduced over the stage's data-parallel ranks as usual.
* The whole schedule step is one prefetch step ([Note: one prefetch step per schedule step] in
  infinity/zero/_param_manager.py), then one optimizer step (``engine.step(boundary=True)``).
* The loss of each micro-batch is divided by the number of micro-batches m (and multiplied by
  the fp16 loss scale) before its backward: the gradient of the mean over the step's samples,
  as one process on the whole batch computes it; the schedule's own gradient scaling is off.
* Clipping and the fp16 overflow use the norm over every stage: each stage's squared norm is
  summed over the pipeline group (``Collectives.pipeline``) in the engine's step.
* The reported loss is the mean of the micro-batches' losses, sent from the last stage to every
  stage of its pipeline group.
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, pipeline)

from infinity.config import InfinityConfig, load_config
from infinity.ledger import StateTerms
from infinity.pipeline._split import (StageSplit, balanced_split, check_split,
                                      check_stage_bytes, child_costs, shared_across_stages)
from infinity.pipeline._stage_module import CountingStage, P2PCounts, StageModule, meta_copy
from infinity.zero import initialize as zero_initialize
from infinity.zero import pipeline_stage_of_rank

__all__ = ["PipelineEngine", "RankChunks", "StageChain", "initialize", "initialize_stage"]

_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
LAYOUT_FILE = "pipeline.json"
"""Written beside each stage's checkpoints: the split the stage was saved with."""


def _stage_dir(directory: str, stage: int, num_stages: int) -> str:
    return os.path.join(os.fspath(directory), f"pipeline-stage-{stage:02d}-of-{num_stages:02d}")


def initialize(model: nn.Module, config: "InfinityConfig | dict | str | None" = None, *,
               loss_fn: Callable[[Any, Any], torch.Tensor],
               split_points: "list[int] | None" = None, split_spec: "dict[str, Any] | None" = None,
               example_args: "tuple[Any, ...] | None" = None, **engine_kwargs: Any
               ) -> "PipelineEngine":
    """A pipeline over ``model`` (an ``nn.Sequential`` whose children run in order, each
    taking the previous one's output) with ``mesh.pipeline`` stages ([Note: mesh dimensions]):
    every rank builds the whole model, keeps its stage's children ([Note: the pipeline split])
    and wraps them in an engine (interleaved-1f1b: ``pipeline.stages_per_rank`` chunks of
    children per rank, one engine over all of them). ``loss_fn(output, target)``: the loss of
    one micro-batch on the last stage (its mean over the micro-batch's samples, as a plain
    training loop computes it). ``split_points``: the first child of each stage after the first
    (of every chunk with interleaving); None: the balanced split. ``engine_kwargs`` go to
    :func:`infinity.initialize`.

    Any other model: ``split_spec`` (``{"layers.4": SplitPoint.BEGINNING, ...}``) and
    ``example_args`` (one micro-batch's inputs: the tracer bakes their shapes into the stages)
    cut it with ``torch.distributed.pipelining.pipeline`` (torch.export's tracer: the model's
    forward must trace), each stage's traced module keeping the model's parameter names."""
    cfg = load_config(config)
    if split_spec is not None:
        return _initialize_traced(model, cfg, loss_fn=loss_fn, split_spec=split_spec,
                                  example_args=example_args, engine_kwargs=engine_kwargs)
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"infinity.pipeline.initialize: expected an nn.Sequential (the stages are "
                        f"cut between its children) or a split_spec with example_args (torch's "
                        f"tracer cuts it), got {type(model).__name__} without; or build each "
                        f"stage's module yourself and use infinity.pipeline.initialize_stage")
    ranks, chunks = cfg.mesh.pipeline, cfg.pipeline.stages_per_rank
    rank = pipeline_stage_of_rank(ranks)
    costs = child_costs(model)
    bytes_per_param = StateTerms.from_config(cfg).per_param_bytes
    split = (balanced_split(costs, ranks * chunks) if split_points is None else
             check_split(costs, split_points, ranks * chunks,
                         max_imbalance=cfg.pipeline.max_stage_imbalance,
                         bytes_per_param=bytes_per_param))
    shared = shared_across_stages(model, split)
    if shared is not None:
        raise ValueError(f"pipeline: a parameter is shared by two stages: {shared}; each stage's "
                         f"engine owns its parameters: untie them, or choose split_points that "
                         f"keep both users in one stage")
    children = list(model.named_children())
    # Interleaved: this rank runs virtual stages rank, rank + P, ... (torch's looped placement).
    stages = [rank + v * ranks for v in range(chunks)]
    pieces = [StageChain(OrderedDict(children[i] for i in split.children(k))) for k in stages]
    if chunks == 1:
        return _build(pieces[0], cfg, rank, loss_fn=loss_fn, split=split, stages=stages,
                      pieces=None, engine_kwargs=engine_kwargs)
    held = RankChunks(OrderedDict(children[i] for k in stages for i in split.children(k)),
                      pieces)
    return _build(held, cfg, rank, loss_fn=loss_fn, split=split, stages=stages, pieces=pieces,
                  engine_kwargs=engine_kwargs)


def _initialize_traced(model: nn.Module, cfg: InfinityConfig, *,
                       loss_fn: Callable[[Any, Any], torch.Tensor], split_spec: dict[str, Any],
                       example_args: "tuple[Any, ...] | None",
                       engine_kwargs: dict[str, Any]) -> "PipelineEngine":
    """``model`` cut at ``split_spec`` by torch's tracer ([Note: the pipeline split]: the
    stages' bytes are checked as for ``split_points``, against an even share)."""
    ranks = cfg.mesh.pipeline
    if cfg.pipeline.stages_per_rank > 1:
        raise ValueError("pipeline.stages_per_rank > 1 (interleaved-1f1b) with a split_spec is "
                         "not supported: cut an nn.Sequential with split_points instead")
    if example_args is None:
        raise ValueError("infinity.pipeline.initialize(split_spec=...): give example_args, one "
                         "micro-batch's inputs, for torch's tracer")
    rank = pipeline_stage_of_rank(ranks)
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    pipe = pipeline(model, mb_args=args, split_spec=split_spec)
    if pipe.num_stages != ranks:
        raise ValueError(f"pipeline: split_spec {sorted(split_spec)} cuts the model into "
                         f"{pipe.num_stages} stages, the mesh has {ranks} (mesh.pipeline); give "
                         f"{ranks - 1} split points")
    numel = [sum(p.numel() for p in pipe.get_stage_module(k).parameters())
             for k in range(ranks)]
    check_stage_bytes(numel, max_imbalance=cfg.pipeline.max_stage_imbalance,
                      bytes_per_param=StateTerms.from_config(cfg).per_param_bytes)
    return _build(pipe.get_stage_module(rank), cfg, rank, loss_fn=loss_fn, split=None,
                  stages=[rank], pieces=None, engine_kwargs=engine_kwargs)


class StageChain(nn.Sequential):
    """A stage's children in order, as in the ``nn.Sequential`` they came from. The schedule
    passes a tuple the previous stage returned as separate arguments; the first child gets them
    back as the one tuple the whole model would have passed it."""

    def forward(self, *inputs: Any) -> Any:
        x = inputs[0] if len(inputs) == 1 else inputs
        for module in self:
            x = module(x)
        return x


class RankChunks(nn.Module):
    """The children of every chunk a rank holds with interleaving, under their names in the whole
    model; ``forward(chunk, *args)`` runs chunk ``chunk`` (one engine over all of them: its
    forward is the module's, so every hook of the root runs around each chunk's forward)."""

    def __init__(self, children: "OrderedDict[str, nn.Module]", pieces: list[StageChain]):
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)
        self._pieces = pieces  # views over the children above, not registered twice

    def forward(self, chunk: int, *args: Any, **kwargs: Any) -> Any:
        return self._pieces[chunk](*args, **kwargs)


def initialize_stage(stage_module: nn.Module, config: "InfinityConfig | dict | str | None" = None,
                     *, loss_fn: Callable[[Any, Any], torch.Tensor], stage_index: int | None = None,
                     **engine_kwargs: Any) -> "PipelineEngine":
    """A pipeline stage over a module the caller cut (torchtitan's way: each rank builds its
    stage's layers). ``stage_index``: None: this rank's place on the mesh's pipeline dimension."""
    cfg = load_config(config)
    ranks = cfg.mesh.pipeline
    expected = pipeline_stage_of_rank(ranks)
    if stage_index is not None and stage_index != expected:
        raise ValueError(f"initialize_stage: stage_index {stage_index}, but this rank is at "
                         f"stage {expected} of mesh.pipeline {ranks} (pipeline outermost: "
                         f"[Note: mesh dimensions] in infinity/config/_mesh.py)")
    if cfg.pipeline.stages_per_rank > 1:
        raise ValueError("initialize_stage: pipeline.stages_per_rank > 1 (interleaved-1f1b) "
                         "needs the model's chunks: give the whole nn.Sequential to "
                         "infinity.pipeline.initialize")
    return _build(stage_module, cfg, expected, loss_fn=loss_fn, split=None, stages=[expected],
                  pieces=None, engine_kwargs=engine_kwargs)


def _build(module: nn.Module, cfg: InfinityConfig, rank: int, *,
           loss_fn: Callable[[Any, Any], torch.Tensor], split: StageSplit | None,
           stages: list[int], pieces: list[StageChain] | None,
           engine_kwargs: dict[str, Any]) -> "PipelineEngine":
    # The shapes' meta copies are made before the engine takes the parameters.
    shapes = [meta_copy(p) for p in pieces] if pieces is not None else [meta_copy(module)]
    engine = zero_initialize(module, cfg, pipeline_stage=rank, **engine_kwargs)
    # The copies were made from the caller's (fp32) modules; the engine computes in its own dtype,
    # and the shapes' pass must give the dtypes the micro-batches send: a bf16 stage posted fp32
    # receive buffers and its next stage's first layer norm failed on them ("mixed dtype").
    # [Note: the stage's shapes from a meta copy] in _stage_module.py.
    for shape in shapes:
        shape.to(engine.compute_dtype)
    return PipelineEngine(engine, stages=stages, loss_fn=loss_fn, split=split,
                          shape_modules=shapes, chunked=pieces is not None)


class PipelineEngine:
    """One rank's stage (or, interleaved, chunks) of a pipeline ([Note: ZeRO inside a pipeline
    stage]).

    Usage (every rank of every stage, with the same batch: the first stage reads the inputs,
    the last the targets)::

        pipe = infinity.pipeline.initialize(nn.Sequential(...), config, loss_fn=loss_fn)
        loss = pipe.train_batch(inputs, target=targets)   # m micro-batches, one optimizer step
        loss = pipe.eval_batch(inputs, target=targets)    # forwards only, nothing changes
        pipe.stats(); pipe.save_checkpoint(dir); pipe.load_checkpoint(dir); pipe.close()
    """

    def __init__(self, engine: Any, *, stages: list[int],
                 loss_fn: Callable[[Any, Any], torch.Tensor], split: StageSplit | None,
                 shape_modules: list[nn.Module | None], chunked: bool):
        cfg = engine.config
        self.engine = engine
        self.num_ranks = cfg.mesh.pipeline
        self.stages_per_rank = len(stages)
        self.num_stages = self.num_ranks * self.stages_per_rank
        """Stages of the whole pipeline (virtual stages with interleaving)."""
        self.stage_indices = stages
        self.stage_index = stages[0]
        self.split = split
        self.micro_batches = cfg.pipeline.resolve_micro_batches(
            int(cfg.gradient_accumulation_steps))
        self.schedule_name = cfg.pipeline.schedule
        if self.micro_batches < self.num_ranks and self.schedule_name != "gpipe":
            raise ValueError(f"pipeline.micro_batches: {self.schedule_name} needs at least as many "
                             f"micro-batches as stages ({self.num_ranks}), got "
                             f"{self.micro_batches}")
        self._loss_fn = loss_fn
        self._losses: list[torch.Tensor] = []
        self._evaluating = False
        self.is_first, self.is_last = 0 in stages, self.num_stages - 1 in stages
        group = engine.collectives.pipeline
        self._group = None if group is None else group.group
        self._modules = [StageModule(engine, shape, chunk=v if chunked else None)
                         for v, shape in enumerate(shape_modules)]
        self._p2p = [P2PCounts() for _ in stages]
        self._make_schedule()

    def _make_schedule(self) -> None:
        """The stages and the schedule, new: torch's keep a step's state (received buffers, the
        micro-batches' losses) until the step ends, so a step that raised leaves them behind."""
        self.stages = [CountingStage(m, k, self.num_stages, self.engine.device, group=self._group,
                                     counts=c)
                       for m, k, c in zip(self._modules, self.stage_indices, self._p2p)]
        if self.schedule_name == "interleaved-1f1b":
            self.schedule = ScheduleInterleaved1F1B(self.stages, self.micro_batches,
                                                    loss_fn=self._micro_loss, scale_grads=False)
        else:
            self.schedule = _SCHEDULES[self.schedule_name](
                self.stages[0], self.micro_batches, loss_fn=self._micro_loss, scale_grads=False)

    @property
    def module(self) -> nn.Module:
        """This stage's layers (``engine.module``)."""
        return self.engine.module

    @property
    def bubble_fraction(self) -> float:
        """(P - 1) / (m + P - 1): the share of a GPipe or 1F1B step a stage waits; interleaved
        with v chunks per rank, (P - 1) / (v m + P - 1) (each chunk's turn is 1/v as long)."""
        p, m, v = self.num_ranks, self.micro_batches, self.stages_per_rank
        return (p - 1) / (v * m + p - 1)

    def _micro_loss(self, output: Any, target: Any) -> torch.Tensor:
        loss = self._loss_fn(output, target)
        if any(m.is_shape_output(output) for m in self._modules):
            return loss  # [Note: the stage's shapes from a meta copy]
        self._losses.append(loss.detach())
        if self._evaluating:
            return loss
        return loss * (self.engine.loss_scale / self.micro_batches)

    def train_batch(self, *args: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        """One optimizer step over the batch ``args`` (split into ``micro_batches`` along the
        first dimension): the schedule's forwards and backwards, then the step. Returns the mean
        of the micro-batches' losses on every stage."""
        self._losses = []
        try:
            with self.engine.schedule_step():
                self._run(self.schedule.step, args, target, kwargs)
        except BaseException:
            # The micro-batches that finished must not reach the next step, nor torch's state
            # of this one (its losses, received buffers): the next step starts afresh.
            self.engine.discard_window()
            self._make_schedule()
            raise
        self.engine.step(boundary=True)
        return self._mean_loss()

    def eval_batch(self, *args: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        """The batch's mean loss without training (an evaluation between steps): the schedule's
        forwards only, under ``torch.no_grad`` (nothing saved for a backward, no gradient, the
        prefetcher's evaluation phase); the same micro-batches and the same mean as
        :meth:`train_batch`."""
        self._losses = []
        self._evaluating = True
        try:
            with torch.no_grad():
                self._run(self.schedule.eval, args, target, kwargs)
        except BaseException:
            self._make_schedule()  # torch's state of the failed step
            raise
        finally:
            self._evaluating = False
        return self._mean_loss()

    def _run(self, call: Callable[..., Any], args: tuple[Any, ...], target: Any,
             kwargs: dict[str, Any]) -> None:
        """``schedule.step`` or ``schedule.eval`` with what this rank's stages take: the first
        stage the inputs, the last the targets."""
        call(*(args if self.is_first else ()), **kwargs,
             **({"target": target} if self.is_last else {}))

    def _mean_loss(self) -> torch.Tensor:
        """The step's loss: the mean over the micro-batches and the stage's data-parallel ranks
        (the global batch's mean), taken on the last stage and sent to every stage."""
        loss = torch.zeros((), dtype=torch.float32, device=self.engine.device)
        if self.is_last:
            loss = torch.stack([x.float() for x in self._losses]).mean()
            world = self.engine.collectives.world
            if world.world_size > 1:
                world.all_reduce_sum(loss, context="pipeline loss")
                loss /= world.world_size
        if self.num_ranks > 1:
            last = (self.num_ranks - 1 if self._group is None
                    else dist.get_global_rank(self._group, self.num_ranks - 1))
            dist.broadcast(loss, src=last, group=self._group)
        return loss

    def stats(self) -> dict[str, Any]:
        """``engine.stats()`` of this stage, with a ``pipeline`` entry: the stage, the schedule,
        its bubble, the layers held and the activation bytes sent and received so far (in all and
        by neighbour: ``send_bytes_prev`` ... ``recv_bytes_next``)."""
        out = self.engine.stats()
        out["pipeline"] = {
            "stage": self.stage_index, "stages": list(self.stage_indices),
            "num_stages": self.num_stages, "num_ranks": self.num_ranks,
            "schedule": self.schedule_name, "micro_batches": self.micro_batches,
            "bubble_fraction": self.bubble_fraction, "children": self._children(),
            **{k: sum(s.p2p.as_dict()[k] for s in self.stages)
               for k in self.stages[0].p2p.as_dict()}}
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's layers' full state dict, keyed as in the whole model (a collective over
        the stage's ranks)."""
        return self.engine.full_state_dict()

    # ------------------------------------------------------------------ checkpoints

    def _children(self) -> list[int] | None:
        if self.split is None:
            return None
        return [i for k in self.stage_indices for i in self.split.children(k)]

    def _layout(self) -> dict[str, Any]:
        return {"num_stages": self.num_stages, "stage": self.stage_index,
                "children": self._children(),
                "parameters": sorted(n for n, _ in self.engine.module.named_parameters())}

    def save_checkpoint(self, directory: str, *, tag: str | None = None,
                        client_state: Any = None) -> str:
        """Each stage saves its engine's checkpoint under ``directory/pipeline-stage-KK-of-PP``
        (a collective over every rank); the stage's layout is kept beside it."""
        stage_dir = _stage_dir(directory, self.stage_index, self.num_stages)
        if self._is_stage_leader():  # written before the save, whose end every rank waits for
            os.makedirs(stage_dir, exist_ok=True)
            tmp = os.path.join(stage_dir, LAYOUT_FILE + ".tmp")
            with open(tmp, "w") as f:
                json.dump(self._layout(), f, indent=1)
            os.replace(tmp, os.path.join(stage_dir, LAYOUT_FILE))
        return self.engine.save_checkpoint(stage_dir, tag=tag, client_state=client_state)

    def _is_stage_leader(self) -> bool:
        """This rank is its stage's first (the one rank of the stage that writes its layout,
        whatever the stage's replicas, shards and tensor slices)."""
        if not (dist.is_available() and dist.is_initialized()):
            return True
        per_stage = dist.get_world_size() // self.num_ranks
        return dist.get_rank() % per_stage == 0

    def load_checkpoint(self, directory: str, *, tag: str | None = None) -> dict[str, Any]:
        """Restore this stage from a checkpoint saved by a pipeline with the same stages (at
        any data-parallel size); a different pipeline size or split is refused, naming both."""
        stage_dir = _stage_dir(directory, self.stage_index, self.num_stages)
        layout_path = os.path.join(stage_dir, LAYOUT_FILE)
        if not os.path.isfile(layout_path):
            sizes = _saved_sizes(directory)
            raise FileNotFoundError(
                f"pipeline checkpoint {directory}: no save of stage {self.stage_index} of "
                f"{self.num_stages} (found saves of a pipeline of {sizes or 'no'} stages); load "
                f"it at the pipeline size it was saved with (mesh.pipeline)")
        with open(layout_path) as f:
            theirs = json.load(f)
        mine = self._layout()
        if theirs["parameters"] != mine["parameters"]:
            raise ValueError(
                f"pipeline checkpoint {stage_dir}: saved by stage {theirs['stage']} of "
                f"{theirs['num_stages']} holding children {theirs['children']}; this stage holds "
                f"children {mine['children']}: a checkpoint loads only into the same split "
                f"(split_points and mesh.pipeline as saved)")
        return self.engine.load_checkpoint(stage_dir, tag=tag)

    def close(self) -> None:
        self.engine.close()


def _saved_sizes(directory: str) -> list[int]:
    """The pipeline sizes saved under ``directory`` (by their stages' folder names)."""
    if not os.path.isdir(directory):
        return []
    found = {m.group(1) for m in (re.fullmatch(r"pipeline-stage-\d+-of-(\d+)", name)
                                  for name in os.listdir(directory)) if m}
    return sorted(int(n) for n in found)
