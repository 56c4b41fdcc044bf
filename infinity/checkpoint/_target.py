"""What checkpointing reads from and writes to the training state: :class:`CheckpointTarget`.

[Note: what a checkpoint touches]
Saves, loads and weight loads see the engine only through :class:`CheckpointTarget`: the units
and their flat groups (names, shapes, the element ranges a rank owns), the parameter partitions
(read, and opened for writing), the optimizer's fp32 state per key (read, overwritten, the master
opened for writing), the step counters, the collectives that make every rank agree, and two
after-write hooks (flush to the home tiers, re-gather the always-gathered units). Nothing else: a
checkpoint does not walk the engine's manager, units or optimizer. The engine hands one out
(``engine.checkpoint_view()``, built in ``infinity/zero/_checkpoint_view.py``); the public
functions still take the engine itself (:func:`checkpoint_target`).

A protocol rather than a frozen record of values and callables: the counters it reads change
between calls (``global_steps``, ``between_steps``), most members are operations (context
managers, collectives), and a structural type lets a test hand in a fake without building an
engine.
"""

from __future__ import annotations

from typing import Any, ContextManager, Iterable, Mapping, Protocol, Sequence

import torch
from torch import nn


class CheckpointSlot(Protocol):
    """One parameter's place in a flat group."""

    name: str
    """Its first qualified name in ``model.state_dict()`` (the name it is saved under)."""
    shape: torch.Size
    offset: int
    """Its first element in the group's flat buffer."""
    numel: int
    param: nn.Parameter
    """The parameter itself (``state_dict()`` keys are matched to it by identity)."""


class CheckpointGroup(Protocol):
    """One flat group of a unit: the parameters stepped by one optimizer key."""

    key: str
    """The optimizer key of its state."""
    requires_grad: bool
    """Trainable: saved with its fp32 optimizer state."""
    slots: Sequence[CheckpointSlot]
    shard_numel: int
    """Elements of one rank's even slice of the padded flat buffer."""
    store_key: str | None
    """Its parameter shard in the tiered store (None: a tensor the engine holds)."""


class CheckpointUnit(Protocol):
    index: int
    """Its position (shard files are named by it)."""
    name: str
    in_use: bool
    """Gathered for a forward or backward under way (weights are loaded between steps only)."""
    groups: Sequence[CheckpointGroup]


class CheckpointWorld(Protocol):
    """Every data-parallel rank."""

    rank: int
    world_size: int

    def all_reduce_sum(self, tensor: torch.Tensor, *, context: str) -> Any: ...


class CheckpointCollectives(Protocol):
    """The collectives over the mesh ([Note: collectives over a mesh] in
    infinity/zero/_collectives.py), as far as a checkpoint uses them."""

    rank: int
    """This rank's shard rank (shard files are named by it)."""
    world: CheckpointWorld
    replicate_rank: int
    replicate_size: int
    data_parallel_size: int

    def broadcast(self, tensor: torch.Tensor, *, src: int = 0, context: str) -> Any: ...


class CheckpointTarget(Protocol):
    """[Note: what a checkpoint touches]: everything a checkpoint reads from and writes to."""

    # -- where and how the values live
    device: torch.device
    """Where the collectives' tensors go."""
    compute_dtype: torch.dtype
    """The parameters' dtype (saved as ``param`` where it is not fp32)."""
    collectives: CheckpointCollectives
    module: nn.Module
    """The model (its buffers and ``state_dict()`` keys)."""
    units: Sequence[CheckpointUnit]
    stage: int
    shard_rank: int
    """The rank whose partitions this process owns."""
    shard_world_size: int
    """The shard degree (what a save's ``world_size`` is)."""

    # -- the step counters
    between_steps: bool
    """No micro-batch of an accumulation window is pending (saves and loads happen only here)."""
    micro_steps: int
    gradient_accumulation_steps: int
    global_steps: int

    def step_state_dict(self) -> dict[str, Any]: ...

    def check_step_state_dict(self, state: Mapping[str, Any]) -> None:
        """ValueError when ``state`` does not fit (its groups, its step counts)."""

    def load_step_state_dict(self, state: Mapping[str, Any]) -> None: ...

    # -- the parameter partitions
    def partition_of(self, group: CheckpointGroup) -> tuple[int, int]:
        """``(first element, numel)`` of the partition of ``group`` this rank owns now."""

    def read_shard(self, group: CheckpointGroup) -> torch.Tensor:
        """This rank's compute-dtype shard of ``group`` (the live tensor where one is held)."""

    def open_param_partition(self, group: CheckpointGroup, *, overwrite: bool = False
                             ) -> ContextManager[torch.Tensor]:
        """The partition of ``group`` for writing (``overwrite``: every element is written)."""

    def flush_offload(self) -> None:
        """Every shard the store holds is current in its home tier."""

    def after_shards_written(self) -> None:
        """The shards were replaced: drop gradients, re-gather the always-gathered units."""

    # -- the optimizer's fp32 state, per key
    optimizer_state_is_copy: bool
    """``master_values`` and ``optimizer_state_of`` return copies (False: live tensors)."""

    def master_values(self, key: str) -> torch.Tensor: ...

    def optimizer_state_of(self, key: str) -> dict[str, torch.Tensor]:
        """``{"exp_avg", "exp_avg_sq"}`` of ``key``."""

    def load_optimizer_state(self, key: str, *, master: torch.Tensor, exp_avg: torch.Tensor,
                             exp_avg_sq: torch.Tensor) -> None: ...

    def open_master(self, key: str) -> ContextManager[
            Iterable[tuple[int, int, ContextManager[torch.Tensor | None]]]]:
        """The fp32 master of ``key`` for writing, window by window."""


def checkpoint_target(engine: Any) -> CheckpointTarget:
    """What checkpointing sees of ``engine``: its ``checkpoint_view()`` where it has one (the
    public functions take the engine), else ``engine`` itself, taken to be a target already."""
    view = getattr(engine, "checkpoint_view", None)
    return view() if callable(view) else engine
