""""auto" values: filled from what a trainer knows (:func:`fill_auto`), and what is left resolved to
what Hugging Face ``TrainingArguments``' defaults give, with one warning naming each value.

DeepSpeed configs copied from Hugging Face fine-tuning scripts carry ``"auto"`` wherever the
Trainer fills in its own arguments (``HfTrainerDeepSpeedConfig`` in transformers does this for
DeepSpeed). Under :mod:`infinity.integrations.hf` the Trainer fills them the same way; outside
it, nothing knows the Trainer's values, so the remaining ones take TrainingArguments' defaults
(:data:`TRAINING_ARGUMENTS_DEFAULTS`), which is what the same script run with default arguments
would have used. Values that come from the model or the first batch (the micro-batch size, the
ZeRO bucket sizes) stay 'auto': the engine resolves those itself.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Mapping

from infinity._common import warn_once
from infinity.config._checks import AUTO
from infinity.config._ds_keys import fate_of
from infinity.config._scheduler import SchedulerConfig
from infinity.config._sections import InfinityConfig, OptimizerConfig

TRAINING_ARGUMENTS_DEFAULTS: dict[str, Any] = {
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer.params.lr": 5e-5,
    "optimizer.params.betas": (0.9, 0.999),
    "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0,
    "bf16.enabled": False,
    "fp16.enabled": False,
    "scheduler.params.warmup_min_lr": 0.0,
    "scheduler.params.warmup_num_steps": 0,
}
"""What ``transformers.TrainingArguments()`` gives each DeepSpeed key the Trainer fills, by
DeepSpeed's dotted name: ``gradient_accumulation_steps``, ``max_grad_norm`` 1.0,
``learning_rate`` 5e-5, ``adam_beta1/2`` (0.9, 0.999), ``adam_epsilon`` 1e-8, ``weight_decay`` 0,
``bf16``/``fp16`` off (unless the config enables one), ``warmup_steps`` 0, and the Trainer's
``warmup_min_lr`` 0. ``scheduler.params.warmup_max_lr`` takes the optimizer's lr (the Trainer
fills both from ``learning_rate``)."""

_NO_DEFAULT = {
    "scheduler.params.total_num_steps": "it is the number of optimizer steps of the run, which "
                                        "only a trainer knows"}


def fill_auto(raw: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the DeepSpeed-style config ``raw`` with its ``"auto"`` values filled from
    ``values``, keyed by DeepSpeed's dotted key names (``"train_micro_batch_size_per_gpu"``,
    ``"optimizer.params.lr"``, ``"bf16.enabled"``, ``"scheduler.params.total_num_steps"``...), as
    Hugging Face's ``HfTrainerDeepSpeedConfig`` does for DeepSpeed. Only values that are "auto"
    in ``raw`` change: a key absent from ``raw``, or set to something else, is left as it is (a
    trainer that wants to refuse a mismatch compares itself). ``raw`` itself is not modified.

    A name DeepSpeed does not know is a ``ValueError`` (a typo would leave "auto" behind)."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"fill_auto: expected a config dict, got {type(raw).__name__}")
    out = copy.deepcopy(dict(raw))
    for dotted, value in values.items():
        if not isinstance(dotted, str) or fate_of(dotted) is None:
            raise ValueError(f"fill_auto: {dotted!r} is not a DeepSpeed config key (use its "
                             f"dotted name, e.g. 'optimizer.params.lr')")
        if isinstance(value, tuple):
            value = list(value)  # the JSON form DeepSpeed configs have
        for path in _spellings(dotted):
            parent, leaf = _parent(out, path)
            if parent is not None and parent.get(leaf) == AUTO:
                parent[leaf] = value
    return out


def _spellings(dotted: str) -> list[str]:
    """``bf16.*`` also names the old ``bfloat16`` section."""
    if dotted.startswith("bf16."):
        return [dotted, "bfloat16." + dotted[len("bf16."):]]
    return [dotted]


def _node(raw: dict[str, Any], dotted: str) -> dict[str, Any] | None:
    """The section at ``dotted`` in ``raw`` (None when absent or not a section)."""
    node: Any = raw
    for name in dotted.split(".") if dotted else ():
        node = node.get(name) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def _parent(raw: dict[str, Any], dotted: str) -> tuple[dict[str, Any] | None, str]:
    section, _, leaf = dotted.rpartition(".")
    return _node(raw, section), leaf


def _warn_resolved(resolved: list[tuple[str, Any]]) -> None:
    if not resolved:
        return
    named = ", ".join(f"{key}={value!r}" for key, value in resolved)
    warn_once("auto:" + named,
              f"config values left 'auto' resolve to what transformers.TrainingArguments' defaults "
              f"give: {named}. Set them in the config, or fill them with "
              f"infinity.config.fill_auto(raw, values) (the Trainer integration does)")


def resolve_auto_raw(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the DeepSpeed-style ``raw`` whose "auto" values that a trainer fills take
    :data:`TRAINING_ARGUMENTS_DEFAULTS`, with one warning naming each value; the model- and
    batch-derived ones stay 'auto'. An 'auto' with no such default (``total_num_steps``, or a
    scheduler parameter no trainer fills) is a ``ValueError`` naming it."""
    out = copy.deepcopy(dict(raw))
    resolved: list[tuple[str, Any]] = []
    for dotted, default in TRAINING_ARGUMENTS_DEFAULTS.items():
        for path in _spellings(dotted):
            parent, leaf = _parent(out, path)
            if parent is not None and parent.get(leaf) == AUTO:
                parent[leaf] = list(default) if isinstance(default, tuple) else default
                resolved.append((path, default))
    for key, value in (_node(out, "scheduler.params") or {}).items():
        if value != AUTO:
            continue
        dotted = f"scheduler.params.{key}"
        if key != "warmup_max_lr":
            why = _NO_DEFAULT.get(dotted, "no trainer fills it")
            raise ValueError(f"{dotted}: 'auto' has no default ({why}); set it, or fill it with "
                             f"infinity.config.fill_auto(raw, {{{dotted!r}: ...}})")
        # The lr the optimizer runs with (the Trainer fills both from learning_rate).
        lr = (_node(out, "optimizer.params") or {}).get("lr", OptimizerConfig().lr)
        out["scheduler"]["params"][key] = lr
        resolved.append((dotted, lr))
    _warn_resolved(resolved)
    return out


def resolve_auto(config: InfinityConfig) -> InfinityConfig:
    """``config`` with the "auto" values a trainer fills set to :data:`TRAINING_ARGUMENTS_DEFAULTS`
    (one warning naming each; the same object when there are none): the optimizer's
    hyperparameters, ``gradient_accumulation_steps``, ``gradient_clipping`` and the schedule's
    warmup. ``scheduler.total_num_steps`` 'auto' is a ``ValueError``. What the engine resolves
    from the model, the first batch or the machine (budgets, the micro-batch) stays 'auto'."""
    resolved: list[tuple[str, Any]] = []
    changes: dict[str, Any] = {}
    opt = config.optimizer
    opt_changes = {}
    for name in ("lr", "betas", "eps", "weight_decay"):
        if getattr(opt, name) == AUTO:
            opt_changes[name] = TRAINING_ARGUMENTS_DEFAULTS[f"optimizer.params.{name}"]
            resolved.append((f"optimizer.params.{name}", opt_changes[name]))
    if opt_changes:
        changes["optimizer"] = opt = _replace(opt, **opt_changes)
    for name in ("gradient_accumulation_steps", "gradient_clipping"):
        if getattr(config, name) == AUTO:
            changes[name] = TRAINING_ARGUMENTS_DEFAULTS[name]
            resolved.append((name, changes[name]))
    sched = config.scheduler
    if sched.total_num_steps == AUTO:
        raise ValueError("scheduler.total_num_steps: 'auto' has no default (it is the number of "
                         "optimizer steps of the run, which only a trainer knows); set it")
    sched_changes: dict[str, Any] = {}
    for name in ("warmup_min_lr", "warmup_num_steps"):
        if getattr(sched, name) == AUTO:
            sched_changes[name] = TRAINING_ARGUMENTS_DEFAULTS[f"scheduler.params.{name}"]
    if sched.warmup_max_lr == AUTO:
        sched_changes["warmup_max_lr"] = opt.lr
    if sched_changes:
        changes["scheduler"] = _replace(sched, **sched_changes)
        resolved += [(f"scheduler.{k}", v) for k, v in sched_changes.items()]
    if not changes:
        return config
    _warn_resolved(resolved)
    return config.replace(**changes)


def _replace(section: OptimizerConfig | SchedulerConfig, **changes: Any) -> Any:
    return dataclasses.replace(section, **changes)


__all__ = ["TRAINING_ARGUMENTS_DEFAULTS", "fill_auto", "resolve_auto", "resolve_auto_raw"]
