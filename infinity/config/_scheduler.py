"""The ``scheduler`` section: a learning-rate schedule the engine steps after each optimizer step
that is not skipped (DeepSpeed's semantics). The schedules themselves are
:mod:`infinity.optim.schedulers`; this is their typed configuration.

The five schedules are DeepSpeed's (``deepspeed/runtime/lr_schedules.py``, 0.19.8), with its
defaults; the DeepSpeed config's names map onto these fields in :mod:`._deepspeed`
(``cycle_first_step_size`` -> ``cycle_first_num_steps``...). A field a schedule does not read
must stay at its default: a value set there would be silently unused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from infinity.config._checks import AUTO, check_choice, check_float, check_int, fail

SchedulerType = Literal["none", "warmup_lr", "warmup_decay_lr", "warmup_cosine_lr", "one_cycle",
                        "lr_range_test"]
SCHEDULER_TYPES: tuple[str, ...] = ("none", "warmup_lr", "warmup_decay_lr", "warmup_cosine_lr",
                                    "one_cycle", "lr_range_test")

LrValue = float | tuple[float, ...]
"""A learning rate (or momentum) for every parameter group, or one per group."""

_WARMUP = ("warmup_num_steps", "warmup_type")
FIELDS_OF: dict[str, tuple[str, ...]] = {
    "none": (),
    "warmup_lr": ("warmup_min_lr", "warmup_max_lr", *_WARMUP),
    "warmup_decay_lr": ("warmup_min_lr", "warmup_max_lr", *_WARMUP, "total_num_steps"),
    "warmup_cosine_lr": (*_WARMUP, "total_num_steps", "warmup_min_ratio", "cos_min_ratio"),
    "one_cycle": ("cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_num_steps",
                  "cycle_second_num_steps", "cycle_first_num_stairs", "cycle_second_num_stairs",
                  "decay_interval_num_steps", "cycle_momentum", "cycle_min_mom", "cycle_max_mom",
                  "decay_mom_rate"),
    "lr_range_test": ("lr_range_test_min_lr", "lr_range_test_interval_num_steps",
                      "lr_range_test_step_rate", "lr_range_test_staircase"),
}
"""The fields each schedule reads."""

_LR_FIELDS = ("warmup_min_lr", "warmup_max_lr", "cycle_min_lr", "cycle_max_lr", "cycle_min_mom",
              "cycle_max_mom", "lr_range_test_min_lr")


def _check_lr_value(path: str, value: Any, *, allow_none: bool = False,
                    allow_auto: bool = False) -> None:
    if (allow_none and value is None) or (allow_auto and value == AUTO):
        return
    if isinstance(value, tuple):
        if not value:
            fail(path, "a number or a non-empty list (one per parameter group)", list(value))
        for v in value:
            check_float(path, v)
        return
    what = "a number >= 0 or a list (one per parameter group)"
    if allow_auto:
        what += " or 'auto'"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        fail(path, what, value)


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The learning-rate schedule (``engine.lr_scheduler``); 'none': the optimizer's lr is kept.

    Steps count optimizer steps (one per ``gradient_accumulation_steps`` micro-batches), not
    micro-batches, and an fp16 step skipped for an overflow does not advance the schedule.
    """

    type: SchedulerType = "none"
    """'warmup_lr', 'warmup_decay_lr', 'warmup_cosine_lr', 'one_cycle', 'lr_range_test'
    (DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest), or 'none'."""

    # -- warmup_lr, warmup_decay_lr, warmup_cosine_lr
    warmup_num_steps: int | Literal["auto"] = 1000
    """Optimizer steps of the warmup (at least 2 count, as in DeepSpeed); 0: no warmup (the
    schedule starts at its peak; DeepSpeed refuses 0, Hugging Face's default warmup)."""
    warmup_type: Literal["log", "linear"] = "log"
    """How the warmup rises: 'log' (``log(step + 1) / log(warmup_num_steps)``) or 'linear'."""
    warmup_min_lr: LrValue | Literal["auto"] = 0.0
    """warmup_lr, warmup_decay_lr: the lr the warmup starts from."""
    warmup_max_lr: LrValue | Literal["auto"] | None = None
    """warmup_lr, warmup_decay_lr: the lr the warmup ends at. None: DeepSpeed's default, each
    group's own lr for warmup_lr and 0.001 for warmup_decay_lr."""
    total_num_steps: int | Literal["auto"] | None = None
    """warmup_decay_lr, warmup_cosine_lr (required): optimizer steps of the whole schedule; the lr
    reaches its end value here and stays there."""
    warmup_min_ratio: float = 0.0
    """warmup_cosine_lr: the fraction of each group's lr the warmup starts from."""
    cos_min_ratio: float = 0.0001
    """warmup_cosine_lr: the fraction of each group's lr the cosine decay ends at."""

    # -- one_cycle
    cycle_min_lr: LrValue | None = None
    """one_cycle (required): the lr at both ends of the cycle (DeepSpeed's cycle_min_lr)."""
    cycle_max_lr: LrValue | None = None
    """one_cycle (required): the lr at the top of the cycle."""
    decay_lr_rate: float = 0.0
    """one_cycle: after the cycle, lr = cycle_min_lr / (1 + decay_lr_rate * intervals)."""
    cycle_first_num_steps: int = 2000
    """one_cycle: optimizer steps of the rising half (DeepSpeed's cycle_first_step_size)."""
    cycle_second_num_steps: int | None = None
    """one_cycle: optimizer steps of the falling half; None: cycle_first_num_steps."""
    cycle_first_num_stairs: int = 0
    """one_cycle: the rising half moves in this many flat stairs; 0: continuously."""
    cycle_second_num_stairs: int | None = None
    """one_cycle: stairs of the falling half; None: cycle_first_num_stairs."""
    decay_interval_num_steps: int = 0
    """one_cycle: optimizer steps per decay interval after the cycle (DeepSpeed's
    decay_step_size); 0: no decay, the lr stays at cycle_min_lr."""
    cycle_momentum: bool = True
    """one_cycle: cycle ``betas[0]`` (or SGD's ``momentum``) inversely to the lr."""
    cycle_min_mom: LrValue = 0.8
    """one_cycle: betas[0] at the top of the cycle."""
    cycle_max_mom: LrValue = 0.9
    """one_cycle: betas[0] at both ends of the cycle."""
    decay_mom_rate: float = 0.0
    """one_cycle: after the cycle, betas[0] = cycle_max_mom * (1 + decay_mom_rate * intervals)."""

    # -- lr_range_test
    lr_range_test_min_lr: LrValue = 0.001
    """lr_range_test: the lr it starts from."""
    lr_range_test_interval_num_steps: int = 2000
    """lr_range_test: optimizer steps per interval (DeepSpeed's lr_range_test_step_size)."""
    lr_range_test_step_rate: float = 1.0
    """lr_range_test: lr = min_lr * (1 + step_rate * intervals)."""
    lr_range_test_staircase: bool = False
    """lr_range_test: whole intervals only (a staircase) instead of a continuous rise."""

    def __post_init__(self) -> None:
        check_choice("scheduler.type", self.type, SCHEDULER_TYPES)
        p = "scheduler."
        check_int(p + "warmup_num_steps", self.warmup_num_steps, allow_auto=True)
        check_choice(p + "warmup_type", self.warmup_type, ("log", "linear"))
        _check_lr_value(p + "warmup_min_lr", self.warmup_min_lr, allow_auto=True)
        _check_lr_value(p + "warmup_max_lr", self.warmup_max_lr, allow_none=True, allow_auto=True)
        check_int(p + "total_num_steps", self.total_num_steps, minimum=1, allow_auto=True,
                  allow_none=True)
        check_float(p + "warmup_min_ratio", self.warmup_min_ratio)
        check_float(p + "cos_min_ratio", self.cos_min_ratio)
        _check_lr_value(p + "cycle_min_lr", self.cycle_min_lr, allow_none=True)
        _check_lr_value(p + "cycle_max_lr", self.cycle_max_lr, allow_none=True)
        check_float(p + "decay_lr_rate", self.decay_lr_rate)
        check_int(p + "cycle_first_num_steps", self.cycle_first_num_steps, minimum=1)
        check_int(p + "cycle_second_num_steps", self.cycle_second_num_steps, allow_none=True)
        check_int(p + "cycle_first_num_stairs", self.cycle_first_num_stairs)
        check_int(p + "cycle_second_num_stairs", self.cycle_second_num_stairs, allow_none=True)
        check_int(p + "decay_interval_num_steps", self.decay_interval_num_steps)
        for name in ("cycle_momentum", "lr_range_test_staircase"):
            if not isinstance(getattr(self, name), bool):
                fail(p + name, "true or false", getattr(self, name))
        _check_lr_value(p + "cycle_min_mom", self.cycle_min_mom)
        _check_lr_value(p + "cycle_max_mom", self.cycle_max_mom)
        check_float(p + "decay_mom_rate", self.decay_mom_rate)
        _check_lr_value(p + "lr_range_test_min_lr", self.lr_range_test_min_lr)
        check_int(p + "lr_range_test_interval_num_steps", self.lr_range_test_interval_num_steps,
                  minimum=1)
        check_float(p + "lr_range_test_step_rate", self.lr_range_test_step_rate)
        self._check_fields_of_type()

    def _check_fields_of_type(self) -> None:
        used = FIELDS_OF[self.type]
        for f in dataclasses.fields(self):
            if f.name == "type" or f.name in used:
                continue
            if getattr(self, f.name) != f.default:
                fail(f"scheduler.{f.name}", f"its default {f.default!r} with type {self.type!r} "
                     f"(which does not read it)", getattr(self, f.name),
                     f"{self.type!r} reads {', '.join(used) or 'nothing'}")
        if self.type in ("warmup_decay_lr", "warmup_cosine_lr") and self.total_num_steps is None:
            fail("scheduler.total_num_steps", f"the number of optimizer steps with type "
                 f"{self.type!r}", None, "set it (or 'auto' under a trainer that fills it)")
        if self.type == "one_cycle":
            for name in ("cycle_min_lr", "cycle_max_lr"):
                if getattr(self, name) is None:
                    fail(f"scheduler.{name}", "a number with type 'one_cycle'", None)

    @property
    def enabled(self) -> bool:
        return self.type != "none"

    def unresolved(self) -> list[str]:
        """The fields still 'auto' (resolved by :func:`infinity.config.resolve_auto`)."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) == AUTO]

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name in _LR_FIELDS:
            if isinstance(out[name], tuple):
                out[name] = list(out[name])
        return out
