"""Typed, validated configuration.

One frozen, keyword-only dataclass per component (:mod:`._sections`); every field documented, units
in its name. A component receives its own slice (``config.swapper``, ``config.zero``...), never the
whole.

``load_config`` takes an :class:`InfinityConfig`, a native dict (:mod:`._native`), a JSON file path,
or a DeepSpeed ``ds_config.json`` (dict or path), which :mod:`._deepspeed` maps key by key, so the
file a user already has works unchanged.

"auto" values: :func:`fill_auto` fills them from what a trainer knows; ``load_config`` resolves
what is left to ``transformers.TrainingArguments``' defaults (:mod:`._auto`). Every DeepSpeed key
and its fate (mapped / replaced / ignored / rejected) is listed in :mod:`._ds_keys`.

Module DAG inside the package: ``_checks`` <- ``_scheduler``, ``_mesh``, ``_pipeline`` <-
``_sections`` <- ``_native`` <- ``_ds_keys`` <- ``_auto`` <- ``_deepspeed`` <- ``_load``; this
``__init__`` is the public surface.
"""

from infinity.config._auto import TRAINING_ARGUMENTS_DEFAULTS, fill_auto, resolve_auto
from infinity.config._checks import AUTO
from infinity.config._deepspeed import (DS_ONLY_TOP_KEYS, config_from_deepspeed,
                                        config_to_deepspeed)
from infinity.config._ds_keys import TOP_KEYS as DEEPSPEED_KEYS
from infinity.config._ds_keys import Fate, fate_of
from infinity.config._load import is_deepspeed_config, load_config
from infinity.config._mesh import MeshConfig
from infinity.config._pipeline import PipelineConfig
from infinity.config._native import config_from_native, did_you_mean, unknown_key_error
from infinity.config._sections import (AUTO_SUB_GROUP_NUMEL, DTYPE_BYTES,
                                       ActivationCheckpointingConfig, DTypeName,
                                       InfinityConfig, MemoryConfig, OffloadConfig, OffloadDevice,
                                       OptimizerConfig, PrecisionConfig, SwapperConfig, ZeroConfig)
from infinity.config._scheduler import SchedulerConfig

__all__ = ["AUTO", "AUTO_SUB_GROUP_NUMEL", "DEEPSPEED_KEYS", "DS_ONLY_TOP_KEYS", "DTYPE_BYTES",
           "TRAINING_ARGUMENTS_DEFAULTS", "ActivationCheckpointingConfig", "DTypeName", "Fate",
           "InfinityConfig", "MemoryConfig", "MeshConfig", "OffloadConfig", "OffloadDevice",
           "OptimizerConfig", "PipelineConfig", "PrecisionConfig", "SchedulerConfig",
           "SwapperConfig", "ZeroConfig",
           "config_from_deepspeed", "config_from_native", "config_to_deepspeed", "did_you_mean",
           "fate_of", "fill_auto", "is_deepspeed_config", "load_config", "resolve_auto",
           "unknown_key_error"]
