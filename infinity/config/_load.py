"""``load_config``: an :class:`InfinityConfig` from what a user has (the object, a native or
DeepSpeed dict, or a JSON file of either)."""

from __future__ import annotations

import os
from typing import Any, Mapping

from infinity._common import read_json_object
from infinity.config._auto import resolve_auto
from infinity.config._deepspeed import DS_ONLY_TOP_KEYS, DS_SCHEDULER_TYPES, config_from_deepspeed
from infinity.config._ds_keys import PIPELINE_KEYS
from infinity.config._native import config_from_native
from infinity.config._sections import InfinityConfig


def is_deepspeed_config(raw: Mapping[str, Any]) -> bool:
    """A key only DeepSpeed configs have, an ``optimizer`` / ``scheduler`` section in
    DeepSpeed's ``{"type": ..., "params": {...}}`` form (or naming a DeepSpeed schedule), or a
    ``pipeline`` section with DeepSpeed's keys (the section's name is both configs')."""
    sched, pipe = raw.get("scheduler"), raw.get("pipeline")
    return any(key in DS_ONLY_TOP_KEYS for key in raw) or any(
        isinstance(raw.get(key), Mapping) and "params" in raw[key]
        for key in ("optimizer", "scheduler")) or (
        isinstance(sched, Mapping) and sched.get("type") in DS_SCHEDULER_TYPES) or (
        isinstance(pipe, Mapping) and any(key in PIPELINE_KEYS for key in pipe))


def load_config(source: "InfinityConfig | Mapping[str, Any] | str | os.PathLike[str] | None"
                ) -> InfinityConfig:
    """Accept an InfinityConfig, a native or DeepSpeed dict, or a path to a JSON file of either.

    "auto" values a trainer would fill and nothing did resolve here to what
    ``transformers.TrainingArguments``' defaults give, with one warning naming each
    (:func:`~infinity.config.resolve_auto`); fill them first with
    :func:`~infinity.config.fill_auto` to use other values."""
    if source is None:
        return InfinityConfig()
    if isinstance(source, InfinityConfig):
        return resolve_auto(source)
    if isinstance(source, (str, os.PathLike)):
        source = read_json_object(os.fspath(source), "config file")
    if not isinstance(source, Mapping):
        raise ValueError(f"config: expected a dict, a JSON path or an InfinityConfig, got "
                         f"{type(source).__name__}")
    if is_deepspeed_config(source):
        return resolve_auto(config_from_deepspeed(source))
    return resolve_auto(config_from_native(source))
