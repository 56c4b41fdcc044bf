"""Reading the native dict form of a config (what ``InfinityConfig.to_dict`` writes), with an
error naming any unknown key and the closest known one."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Mapping

from infinity.config._checks import fail
from infinity.config._mesh import MeshConfig
from infinity.config._pipeline import PipelineConfig
from infinity.config._scheduler import SchedulerConfig
from infinity.config._sections import (ActivationCheckpointingConfig, InfinityConfig, MemoryConfig,
                                       OffloadConfig, OptimizerConfig, PrecisionConfig,
                                       SwapperConfig, ZeroConfig)

_SECTIONS: dict[str, type] = {
    "zero": ZeroConfig,
    "offload_param": OffloadConfig,
    "offload_optimizer": OffloadConfig,
    "memory": MemoryConfig,
    "swapper": SwapperConfig,
    "precision": PrecisionConfig,
    "optimizer": OptimizerConfig,
    "activation_checkpointing": ActivationCheckpointingConfig,
    "scheduler": SchedulerConfig,
    "mesh": MeshConfig,
    "pipeline": PipelineConfig,
}
_DS_ACTIVATION_KEYS = frozenset({"partition_activations", "cpu_checkpointing", "number_checkpoints",
                                 "contiguous_memory_optimization", "synchronize_checkpoint_boundary",
                                 "profile"})
"""Keys of DeepSpeed's ``activation_checkpointing`` section, named in the native section's error."""
_TOP_SCALARS = ("gradient_clipping", "gradient_accumulation_steps", "train_micro_batch_size_per_gpu",
                "device")


def did_you_mean(key: str, known: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(known))}"


def unknown_key_error(path: str, key: str, known: list[str] | tuple[str, ...]) -> ValueError:
    where = f"{path}.{key}" if path else key
    return ValueError(f"unknown config key {where!r}{did_you_mean(key, known)}")


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.name != "name"]


def _build_section(name: str, cls: type, raw: Any) -> Any:
    if not isinstance(raw, Mapping):
        fail(name, "an object", raw)
    known = _field_names(cls)
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if cls is ActivationCheckpointingConfig and key in _DS_ACTIVATION_KEYS:
            raise ValueError(
                f"config key 'activation_checkpointing.{key}' belongs to DeepSpeed's checkpoint "
                f"API, which is not implemented; the native section takes 'units' ('all' or "
                f"class names) and 'offload' ('host': DeepSpeed's cpu_checkpointing, 'nvme', "
                f"'auto')")
        if key not in known:
            raise unknown_key_error(name, key, known)
        if isinstance(value, list):
            value = tuple(value)
        kwargs[key] = value
    if cls is OffloadConfig:
        kwargs["name"] = name
    return cls(**kwargs)


def config_from_native(raw: Mapping[str, Any]) -> InfinityConfig:
    """Build an :class:`InfinityConfig` from its native dict form (``InfinityConfig.to_dict``)."""
    known = list(_SECTIONS) + list(_TOP_SCALARS)
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _SECTIONS:
            kwargs[key] = _build_section(key, _SECTIONS[key], value)
        elif key in _TOP_SCALARS:
            kwargs[key] = value
        else:
            raise unknown_key_error("", key, known)
    return InfinityConfig(**kwargs)
