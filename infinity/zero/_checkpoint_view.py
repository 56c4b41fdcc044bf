"""The engine as checkpointing sees it: :class:`EngineCheckpointView` satisfies
:class:`~infinity.checkpoint.CheckpointTarget` ([Note: what a checkpoint touches] in
infinity/checkpoint/_target.py) by forwarding each member to the engine, its parameter manager or
its shard optimizer, so that ``checkpoint/`` walks none of them."""

from __future__ import annotations

from typing import Any, ContextManager, Mapping, Sequence

import torch
from torch import nn


class EngineCheckpointView:
    """A live view (nothing is copied): counters read through to the engine at each use."""

    def __init__(self, engine: Any):
        self._engine = engine

    # -- where and how the values live
    @property
    def device(self) -> torch.device:
        return self._engine.device

    @property
    def compute_dtype(self) -> torch.dtype:
        return self._engine.compute_dtype

    @property
    def collectives(self) -> Any:
        return self._engine.collectives

    @property
    def module(self) -> nn.Module:
        return self._engine.manager.module

    @property
    def units(self) -> Sequence[Any]:
        return self._engine.manager.units

    @property
    def stage(self) -> int:
        return self._engine.manager.stage

    @property
    def shard_rank(self) -> int:
        return self._engine.manager.rank

    @property
    def shard_world_size(self) -> int:
        return self._engine.manager.world_size

    # -- the step counters
    @property
    def between_steps(self) -> bool:
        return self._engine.between_steps

    @property
    def micro_steps(self) -> int:
        return self._engine.micro_steps

    @property
    def gradient_accumulation_steps(self) -> int:
        return self._engine.gradient_accumulation_steps

    @property
    def global_steps(self) -> int:
        return self._engine.global_steps

    def step_state_dict(self) -> dict[str, Any]:
        return self._engine.step_state_dict()

    def check_step_state_dict(self, state: Mapping[str, Any]) -> None:
        self._engine.check_step_state_dict(state)

    def load_step_state_dict(self, state: Mapping[str, Any]) -> None:
        self._engine.load_step_state_dict(state)

    # -- the parameter partitions
    def partition_of(self, group: Any) -> tuple[int, int]:
        return self._engine.manager.partition_of(group)

    def read_shard(self, group: Any) -> torch.Tensor:
        return self._engine.manager.read_shard(group)

    def open_param_partition(self, group: Any, *, overwrite: bool = False
                             ) -> ContextManager[torch.Tensor]:
        return self._engine.manager.open_param_partition(group, overwrite=overwrite)

    def flush_offload(self) -> None:
        self._engine.flush_offload()

    def after_shards_written(self) -> None:
        self._engine.manager.after_step()

    # -- the optimizer's fp32 state, per key
    @property
    def optimizer_state_is_copy(self) -> bool:
        return bool(self._engine.shard_optimizer.offloaded)

    def master_values(self, key: str) -> torch.Tensor:
        return self._engine.shard_optimizer.master_values(key)

    def optimizer_state_of(self, key: str) -> dict[str, torch.Tensor]:
        return self._engine.shard_optimizer.state_of(key)

    def load_optimizer_state(self, key: str, *, master: torch.Tensor, exp_avg: torch.Tensor,
                             exp_avg_sq: torch.Tensor) -> None:
        self._engine.shard_optimizer.load_state(key, master=master, exp_avg=exp_avg,
                                                exp_avg_sq=exp_avg_sq)

    def open_master(self, key: str) -> ContextManager[Any]:
        return self._engine.shard_optimizer.open_master(key)
