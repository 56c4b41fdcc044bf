"""The engine's config under a trainer or wrapper: the user's ``infinity_config`` completed with
the values the trainer already knows (batch size, accumulation, clipping, precision, optimizer).

[Note: values the trainer drives] A few config values have a second source of truth outside the
config: ``TrainingArguments`` for the Trainer, the ``Accelerator``'s arguments and the optimizer
handed to ``prepare`` for accelerate. Hugging Face resolves the same overlap for DeepSpeed
(``HfTrainerDeepSpeedConfig.fill_match``), and so do we, with the same rule:

* a value the config leaves out, or sets to ``"auto"``, is taken from the trainer;
* a value the config sets explicitly must agree with the trainer's, or :func:`resolve_config`
  raises one ``ValueError`` listing every disagreement (the config key, the trainer's name for
  the value, and both values), before any state is built.

"Explicitly" depends on the form the config comes in: a key present (and not ``"auto"``) in a
DeepSpeed-style or native dict or JSON file; a field that differs from its default in an
:class:`~infinity.config.InfinityConfig` object (an object cannot say which fields were written).
DeepSpeed-style ``"auto"`` values are filled by :func:`infinity.config.fill_auto` before the config
is read, as Hugging Face fills them for DeepSpeed, so that reading it warns about none of them.

No transformers or accelerate import (unit-tested without them).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import torch

from infinity._common import read_json_object
from infinity.config import AUTO, InfinityConfig, fill_auto, is_deepspeed_config, load_config

DRIVEN: dict[str, tuple[str, ...]] = {
    "gradient_accumulation_steps": ("gradient_accumulation_steps",),
    "train_micro_batch_size_per_gpu": ("train_micro_batch_size_per_gpu",),
    "gradient_clipping": ("gradient_clipping",),
    "precision.dtype": ("bf16.enabled", "fp16.enabled"),
    "optimizer.type": ("optimizer.type",),
    "optimizer.lr": ("optimizer.params.lr",),
    "optimizer.betas": ("optimizer.params.betas",),
    "optimizer.eps": ("optimizer.params.eps",),
    "optimizer.weight_decay": ("optimizer.params.weight_decay",),
    "device": (),  # native only: DeepSpeed takes the device from the launcher
}
"""Native config path of each value a trainer may drive -> the DeepSpeed keys that hold it."""

Values = Mapping[str, "tuple[Any, str]"]
"""Native config path (a key of :data:`DRIVEN`) -> (value, where it comes from, for errors:
``"TrainingArguments.learning_rate"``)."""


def device_name(device: Any) -> str:
    """The config's ``device`` value for a torch device: 'cpu' (accelerate's multi-process CPU
    device is ``cpu:<rank>``, which the engine does not distinguish), or 'cuda:N'."""
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    return str(device) if device.index is not None else f"{device.type}:0"


def _lookup(raw: Mapping[str, Any], dotted: str) -> Any:
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _typed(config: InfinityConfig, path: str) -> Any:
    node: Any = config
    for part in path.split("."):
        node = getattr(node, part)
    return node


def _with(config: InfinityConfig, path: str, value: Any) -> InfinityConfig:
    head, _, rest = path.partition(".")
    if not rest:
        return dataclasses.replace(config, **{head: value})
    section = getattr(config, head)
    return dataclasses.replace(config, **{head: dataclasses.replace(section, **{rest: value})})


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, str) or isinstance(b, str):
        return str(a).lower() == str(b).lower()
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def _explicit_in_deepspeed(raw: Mapping[str, Any], path: str) -> bool:
    if path == "precision.dtype":
        # Explicit only when the file picks a dtype: enables one, or disables both
        # ("fp16": {"enabled": false} alone says nothing about bf16).
        flags = [_lookup(raw, key) for key in DRIVEN[path]]
        return True in flags or flags == [False, False]
    return any(_lookup(raw, key) not in (None, AUTO) for key in DRIVEN[path])


def _deepspeed_values(values: Values) -> dict[str, Any]:
    """The driven values under DeepSpeed's keys (what :func:`fill_auto` fills "auto" with)."""
    out: dict[str, Any] = {}
    for path, (value, _) in values.items():
        if path == "precision.dtype":
            out["bf16.enabled"], out["fp16.enabled"] = value == "bf16", value == "fp16"
        elif path == "optimizer.betas":
            out["optimizer.params.betas"] = list(value)
        elif path != "optimizer.type" and DRIVEN[path]:
            out[DRIVEN[path][0]] = value
    return out


def _fill_native_auto(raw: Mapping[str, Any], values: Values) -> dict[str, Any]:
    """A copy of the native dict ``raw`` with its driven "auto" values replaced by ``values``."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
    for path, (value, _) in values.items():
        if _lookup(out, path) == AUTO:
            head, _, rest = path.partition(".")
            if rest:
                out[head][rest] = list(value) if isinstance(value, tuple) else value
            else:
                out[head] = value
    return out


def resolve_config(source: "InfinityConfig | Mapping[str, Any] | str | os.PathLike[str] | None",
                   values: Values, *, deepspeed_only: Mapping[str, Any] | None = None
                   ) -> InfinityConfig:
    """The engine config: ``source`` (as :func:`infinity.load_config` takes it) completed with
    ``values`` under [Note: values the trainer drives]. ``deepspeed_only``: values under
    DeepSpeed keys with no native field (``train_batch_size``, ``scheduler.params.*``), used
    only to fill a DeepSpeed-style config's "auto" values."""
    unknown = sorted(set(values) - set(DRIVEN))
    if unknown:
        raise ValueError(f"resolve_config: {unknown} are not driven config values; known: "
                         f"{sorted(DRIVEN)}")
    if isinstance(source, (str, os.PathLike)):
        source = read_json_object(os.fspath(source), "infinity_config file")
    if source is None or isinstance(source, InfinityConfig):
        config = source if source is not None else InfinityConfig()
        default = InfinityConfig()
        explicit = {p for p in values if _typed(config, p) != AUTO
                    and not _same(_typed(config, p), _typed(default, p))}
    elif isinstance(source, Mapping):
        raw = dict(source)
        if is_deepspeed_config(raw):
            explicit = {p for p in values if _explicit_in_deepspeed(raw, p)}
            raw = fill_auto(raw, {**_deepspeed_values(values), **(deepspeed_only or {})})
        else:
            explicit = {p for p in values if _lookup(raw, p) not in (None, AUTO)}
            raw = _fill_native_auto(raw, values)
        config = load_config(raw)
    else:
        raise ValueError(f"infinity_config: expected a dict, a JSON path or an InfinityConfig, "
                         f"got {type(source).__name__}")
    mismatches = []
    for path, (value, origin) in values.items():
        if path in explicit:
            if not _same(_typed(config, path), value):
                mismatches.append(f"{path} is {_typed(config, path)!r} in the infinity_config but "
                                  f"{value!r} from {origin}")
        else:
            config = _with(config, path, tuple(value) if path == "optimizer.betas" else value)
    if mismatches:
        raise ValueError("the infinity_config disagrees with values the trainer sets: "
                         + "; ".join(mismatches)
                         + ". Set these keys to \"auto\" (or leave them out) to take the trainer's "
                           "values, or change the trainer's arguments to match")
    return config
