"""Which models and parameters an engine already manages: wrapping one twice (or one that
DeepSpeed, FSDP or DDP already wrapped) would install hooks and flat buffers twice."""

from __future__ import annotations

import weakref

import torch
from torch import nn

_MANAGED_MODULES: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_MANAGED_PARAMS: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
"""id -> parameter of every managed parameter (tensors compare elementwise, so no WeakSet)."""


_ENGINE_OF: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
"""id(parameter) -> the engine managing it (:func:`engine_of`)."""


def mark_managed(module: nn.Module, params: list[torch.Tensor]) -> None:
    _MANAGED_MODULES.add(module)
    for p in params:
        _MANAGED_PARAMS[id(p)] = p


def register_engine(engine: object, params: list[torch.Tensor]) -> None:
    for p in params:
        _ENGINE_OF[id(p)] = engine


def engine_of(param: torch.Tensor) -> object | None:
    """The engine that manages ``param`` (None: no live engine does)."""
    if _MANAGED_PARAMS.get(id(param)) is not param:
        return None
    return _ENGINE_OF.get(id(param))


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
    # DTensor parameters of tensor parallelism are managed ([Note: tensor-parallel parameters]
    # in infinity/zero/_tensor_parallel.py); FSDP2's (its modules subclass FSDPModule) are not.
    for name, sub in module.named_modules():
        if any(cls.__name__ == "FSDPModule" for cls in type(sub).__mro__):
            raise ValueError(f"module {name or type(module).__name__!r} is already sharded by "
                             f"FSDP2 (fully_shard); pass the model before fully_shard (tensor "
                             f"parallelism alone is fine: the engine shards over data-parallel "
                             f"ranks itself)")
    if type(module).__name__ in ("FullyShardedDataParallel", "DistributedDataParallel",
                                 "DeepSpeedEngine"):
        raise ValueError(f"the model is already wrapped in {type(module).__name__}; pass the "
                         f"inner module (model.module) instead")
