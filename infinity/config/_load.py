"""``load_config``: an :class:`InfinityConfig` from what a user has (the object, a native or
DeepSpeed dict, or a JSON file of either)."""

from __future__ import annotations

import os
from typing import Any, Mapping

from infinity._common import read_json_object
from infinity.config._deepspeed import DS_ONLY_TOP_KEYS, config_from_deepspeed
from infinity.config._native import config_from_native
from infinity.config._sections import InfinityConfig


def is_deepspeed_config(raw: Mapping[str, Any]) -> bool:
    return any(key in DS_ONLY_TOP_KEYS for key in raw) or (
        isinstance(raw.get("optimizer"), Mapping) and "type" in raw["optimizer"]
        and "params" in raw["optimizer"])


def load_config(source: "InfinityConfig | Mapping[str, Any] | str | os.PathLike[str] | None"
                ) -> InfinityConfig:
    """Accept an InfinityConfig, a native or DeepSpeed dict, or a path to a JSON file of either."""
    if source is None:
        return InfinityConfig()
    if isinstance(source, InfinityConfig):
        return source
    if isinstance(source, (str, os.PathLike)):
        source = read_json_object(os.fspath(source), "config file")
    if not isinstance(source, Mapping):
        raise ValueError(f"config: expected a dict, a JSON path or an InfinityConfig, got "
                         f"{type(source).__name__}")
    if is_deepspeed_config(source):
        return config_from_deepspeed(source)
    return config_from_native(source)
