"""Typed, validated configuration.

One frozen, keyword-only dataclass per component (:mod:`._sections`); every field documented, units
in its name. A component receives its own slice (``config.swapper``, ``config.zero``...), never the
whole.

``load_config`` takes an :class:`InfinityConfig`, a native dict (:mod:`._native`), a JSON file path,
or a DeepSpeed ``ds_config.json`` (dict or path), which :mod:`._deepspeed` maps key by key, so the
file a user already has works unchanged.

Module DAG inside the package: ``_checks`` <- ``_sections`` <- ``_native`` <- ``_deepspeed`` <-
``_load``; this ``__init__`` is the public surface.
"""

from infinity.config._checks import AUTO
from infinity.config._deepspeed import (DS_ONLY_TOP_KEYS, config_from_deepspeed,
                                        config_to_deepspeed)
from infinity.config._load import is_deepspeed_config, load_config
from infinity.config._native import config_from_native, did_you_mean, unknown_key_error
from infinity.config._sections import (DTYPE_BYTES, ActivationCheckpointingConfig, DTypeName,
                                       InfinityConfig, MemoryConfig, OffloadConfig, OffloadDevice,
                                       OptimizerConfig, PrecisionConfig, SwapperConfig, ZeroConfig)

__all__ = ["AUTO", "DS_ONLY_TOP_KEYS", "DTYPE_BYTES", "ActivationCheckpointingConfig", "DTypeName",
           "InfinityConfig", "MemoryConfig", "OffloadConfig", "OffloadDevice", "OptimizerConfig",
           "PrecisionConfig", "SwapperConfig", "ZeroConfig", "config_from_deepspeed",
           "config_from_native", "config_to_deepspeed", "did_you_mean", "is_deepspeed_config",
           "load_config", "unknown_key_error"]
