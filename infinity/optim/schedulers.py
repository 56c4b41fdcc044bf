"""DeepSpeed's learning-rate schedules as ``torch.optim.lr_scheduler.LRScheduler`` subclasses.

:class:`WarmupLR`, :class:`WarmupDecayLR`, :class:`WarmupCosineLR`, :class:`OneCycle` and
:class:`LRRangeTest` take DeepSpeed 0.19.8's parameter names and defaults
(``deepspeed/runtime/lr_schedules.py``) and give the same learning rate at every optimizer step.
They work on any ``torch.optim.Optimizer`` with ``param_groups`` (``engine.optimizer``, AdamW,
SGD), plug into torch's machinery (``state_dict``, ``get_last_lr``, ``SequentialLR``), and are
stepped once per optimizer step, after it. :func:`build_scheduler` makes one from the config's
``scheduler`` section (:class:`~infinity.config.SchedulerConfig`); the engine builds
``engine.lr_scheduler`` with it.

[Note: DeepSpeed's step offset] DeepSpeed counts a schedule's ``last_batch_iteration`` from -1:
making the schedule sets the lrs of iteration -1, which the first optimizer step runs with, and
its first ``step()`` moves to iteration 0, which the second optimizer step runs with. torch's
``LRScheduler`` takes its first step inside ``__init__`` (``last_epoch`` 0). So here DeepSpeed's
iteration is ``last_epoch - 1``: optimizer step ``k`` (from 1) runs at DeepSpeed's iteration
``k - 2``, exactly as under DeepSpeed. That is why a log or linear warmup holds ``warmup_min_lr``
for two steps, and why WarmupCosineLR's first step runs at lr 0 (DeepSpeed returns 0 before its
schedule starts).

Two departures, both where DeepSpeed's behaviour is an accident rather than a schedule:

* ``warmup_num_steps`` 0 (Hugging Face's default warmup, which DeepSpeed 0.19.8 refuses) means
  no warmup: the schedule starts at its peak. DeepSpeed counts any positive value below 2 as 2.
* :class:`OneCycle` cycles ``betas[0]`` and keeps each group's ``betas[1]``; DeepSpeed also
  overwrites ``betas[1]`` with 0.99, and sets ``betas[0]`` to ``cycle_min_mom`` before the first
  step, although its own formula (momentum moving inversely to the lr) gives ``cycle_max_mom``
  there, the value it jumps to at the next step. Here the formula holds from the first step.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch.optim.lr_scheduler import LRScheduler

from infinity._common import warn_once
from infinity.config import SchedulerConfig

_WARMUP_TYPES = ("log", "linear")


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list[float]:
    """One value per parameter group: a scalar for all, or a list of exactly one per group."""
    groups = optimizer.param_groups
    if isinstance(value, (list, tuple)):
        if len(value) != len(groups):
            raise ValueError(f"{name}: {len(value)} values for {len(groups)} parameter groups; "
                             f"give one number for all groups or one per group")
        return [float(v) for v in value]
    return [float(value)] * len(groups)


def _group_lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    """Each group's lr as the schedule is made (its ``initial_lr`` when a schedule set one)."""
    return [float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]


def _check_steps(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return value


def _check_warmup(warmup_num_steps: Any, warmup_type: Any) -> int:
    """The warmup length DeepSpeed uses (at least 2), or 0 for no warmup."""
    steps = _check_steps("warmup_num_steps", warmup_num_steps, minimum=0)
    if warmup_type not in _WARMUP_TYPES:
        raise ValueError(f"warmup_type: expected 'log' or 'linear', got {warmup_type!r}")
    return max(2, steps) if steps else 0


def _warmup_fraction(iteration: int, warmup_steps: int, warmup_type: str) -> float:
    """How far the warmup has risen at ``iteration`` (0 <= iteration < warmup_steps)."""
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_steps)
    return iteration / warmup_steps


class _DeepSpeedSchedule(LRScheduler):
    """A closed-form schedule over DeepSpeed's iteration (``last_epoch - 1``, [Note: DeepSpeed's
    step offset]); subclasses give the lrs (and momenta) of an iteration."""

    def _lrs_at(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return self._lrs_at(self.last_epoch - 1)

    _get_closed_form_lr = get_lr

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the schedule and set each group's values for the restored step (they are a
        function of the step alone), so that training resumes with the uninterrupted run's lr."""
        super().load_state_dict(state_dict)
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


class WarmupLR(_DeepSpeedSchedule):
    """From ``warmup_min_lr`` up to ``warmup_max_lr`` over ``warmup_num_steps`` optimizer steps
    (log or linear), then flat. ``warmup_max_lr`` None: each group's own lr."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] | None = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_epoch: int = -1):
        self.warmup_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = (_group_lrs(optimizer) if warmup_max_lr is None
                        else _per_group(optimizer, warmup_max_lr, "warmup_max_lr"))
        super().__init__(optimizer, last_epoch)

    def _gamma(self, iteration: int) -> float:
        """The fraction of the way from min to max lr."""
        if not self.warmup_steps:
            return 1.0
        if iteration < 0:
            return 0.0  # DeepSpeed's lr before its schedule starts: the minimum
        if iteration < self.warmup_steps:
            return _warmup_fraction(iteration, self.warmup_steps, self.warmup_type)
        return 1.0

    def _lrs_at(self, iteration: int) -> list[float]:
        gamma = self._gamma(iteration)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`, then linearly down to 0 at ``total_num_steps``, and 0 after.
    ``warmup_max_lr`` defaults to 0.001, as in DeepSpeed (not to the groups' lr)."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int,
                 warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_epoch: int = -1):
        self.total_num_steps = _check_steps("total_num_steps", total_num_steps, minimum=1)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_epoch)
        if total_num_steps < warmup_num_steps:
            warn_once(f"WarmupDecayLR:{total_num_steps}<{warmup_num_steps}",
                      f"WarmupDecayLR: total_num_steps {total_num_steps} is less than "
                      f"warmup_num_steps {warmup_num_steps}")

    def _gamma(self, iteration: int) -> float:
        if self.warmup_steps and iteration < self.warmup_steps:
            return super()._gamma(iteration)
        decay_steps = max(1.0, float(self.total_num_steps - self.warmup_steps))
        return min(1.0, max(0.0, (self.total_num_steps - iteration) / decay_steps))


class WarmupCosineLR(_DeepSpeedSchedule):
    """Each group's own lr times a ratio: from ``warmup_min_ratio`` up to 1 over the warmup, then
    a cosine down to ``cos_min_ratio`` at ``total_num_steps``, flat after."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int,
                 warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                 cos_min_ratio: float = 0.0001, warmup_type: str = "log", last_epoch: int = -1):
        self.total_num_steps = _check_steps("total_num_steps", total_num_steps, minimum=1)
        self.warmup_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        if total_num_steps < warmup_num_steps:
            warn_once(f"WarmupCosineLR:{total_num_steps}<{warmup_num_steps}",
                      f"WarmupCosineLR: total_num_steps {total_num_steps} is less than "
                      f"warmup_num_steps {warmup_num_steps}")
        super().__init__(optimizer, last_epoch)

    def ratio(self, iteration: int) -> float:
        """The fraction of each group's lr at DeepSpeed's ``iteration``."""
        if self.warmup_steps:
            if iteration < 0:
                return 0.0  # DeepSpeed's lr before its schedule starts
            if iteration < self.warmup_steps:
                rise = _warmup_fraction(iteration, self.warmup_steps, self.warmup_type)
                return self.warmup_min_ratio + rise * (1.0 - self.warmup_min_ratio)
        # The progress clamps at 1: past the end the ratio stays at cos_min_ratio.
        done = iteration - self.warmup_steps + 1
        progress = min(1.0, done / max(1, self.total_num_steps - self.warmup_steps))
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def _lrs_at(self, iteration: int) -> list[float]:
        ratio = self.ratio(iteration)
        return [float(base) * ratio for base in self.base_lrs]


class OneCycle(_DeepSpeedSchedule):
    """One cycle from ``cycle_min_lr`` up to ``cycle_max_lr`` (``cycle_first_step_size`` steps)
    and back (``cycle_second_step_size``, default the first), optionally in stairs; then decay
    by ``decay_lr_rate`` per ``decay_step_size`` steps (0: none, the lr stays at the minimum).
    With ``cycle_momentum``, ``betas[0]`` moves inversely, between ``cycle_max_mom`` and
    ``cycle_min_mom`` (groups without ``betas``: not cycled, one warning, as in DeepSpeed)."""

    def __init__(self, optimizer: torch.optim.Optimizer, cycle_min_lr: float | Sequence[float],
                 cycle_max_lr: float | Sequence[float], decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True,
                 cycle_min_mom: float | Sequence[float] = 0.8,
                 cycle_max_mom: float | Sequence[float] = 0.9, decay_mom_rate: float = 0.0,
                 last_epoch: int = -1):
        first = _check_steps("cycle_first_step_size", cycle_first_step_size, minimum=1)
        second = first if cycle_second_step_size is None else _check_steps(
            "cycle_second_step_size", cycle_second_step_size, minimum=0)
        self.first_size, self.second_size = float(first), float(second)
        self.total_size = self.first_size + self.second_size
        self.step_ratio = self.first_size / self.total_size
        self.first_stairs = _check_steps("cycle_first_stair_count", cycle_first_stair_count,
                                         minimum=0)
        self.second_stairs = self.first_stairs if cycle_second_stair_count is None else (
            _check_steps("cycle_second_stair_count", cycle_second_stair_count, minimum=0))
        self.decay_step_size = _check_steps("decay_step_size", decay_step_size, minimum=0)
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = float(decay_lr_rate)
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        self.decay_mom_rate = float(decay_mom_rate)
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and not all("betas" in g for g in optimizer.param_groups):
            warn_once(f"OneCycle:no-betas:{type(optimizer).__name__}",
                      f"OneCycle: {type(optimizer).__name__}'s parameter groups have no 'betas'; "
                      f"momentum is not cycled (set cycle_momentum false to silence this)")
            self.cycle_momentum = False
        super().__init__(optimizer, last_epoch)

    def scale(self, iteration: int) -> float:
        """How far up the cycle DeepSpeed's ``iteration`` is (0: bottom, 1: top)."""
        batch = iteration + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stairs
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stairs
        if stairs > 0:
            # From the integer offset, as DeepSpeed does: the float scale at a half-cycle edge
            # can land a hair below a whole stair, and flooring that would drop a stair.
            offset = batch % self.total_size
            if offset <= self.first_size:
                position = offset * stairs / self.first_size
            else:
                position = (self.total_size - offset) * stairs / self.second_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_intervals(self, iteration: int) -> float:
        return (iteration - self.total_size + 1) / self.decay_step_size

    def _lrs_at(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            scale = self.scale(iteration)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if not self.decay_step_size or math.isclose(self.decay_lr_rate, 0.0):
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * self._decay_intervals(iteration)
        return [lo / factor for lo in self.min_lrs]

    def momenta_at(self, iteration: int) -> list[float]:
        """``betas[0]`` of each group at DeepSpeed's ``iteration``."""
        if iteration < self.total_size:
            scale = self.scale(iteration)
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        if not self.decay_step_size or math.isclose(self.decay_mom_rate, 0.0):
            return list(self.max_moms)
        factor = 1.0 + self.decay_mom_rate * self._decay_intervals(iteration)
        return [hi * factor for hi in self.max_moms]

    def _set_momenta(self) -> None:
        if not self.cycle_momentum:
            return
        for group, beta1 in zip(self.optimizer.param_groups, self.momenta_at(self.last_epoch - 1),
                                strict=True):
            group["betas"] = (beta1, group["betas"][1])

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        self._set_momenta()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._set_momenta()


class LRRangeTest(_DeepSpeedSchedule):
    """The lr range test: ``lr_range_test_min_lr * (1 + step_rate * intervals)``, ``intervals``
    of ``lr_range_test_step_size`` steps (whole ones with ``lr_range_test_staircase``)."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 lr_range_test_min_lr: float | Sequence[float] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_epoch: int = -1):
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _check_steps("lr_range_test_step_size", lr_range_test_step_size,
                                      minimum=1)
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        super().__init__(optimizer, last_epoch)

    def _lrs_at(self, iteration: int) -> list[float]:
        intervals = (iteration + 1) / self.step_size
        if self.staircase:
            intervals = math.floor(intervals)
        return [lo * (1.0 + self.step_rate * intervals) for lo in self.min_lrs]


def build_scheduler(optimizer: torch.optim.Optimizer, config: SchedulerConfig
                    ) -> LRScheduler | None:
    """The schedule ``config`` describes over ``optimizer`` (None for type 'none'); it sets the
    groups' lr for the first step now. 'auto' values must be resolved first
    (:func:`infinity.config.resolve_auto`, which ``load_config`` runs)."""
    if not config.enabled:
        return None
    if config.unresolved():
        raise ValueError(f"scheduler: {', '.join(config.unresolved())} still 'auto'; resolve the "
                         f"config first (infinity.config.resolve_auto / load_config)")
    c = config
    warmup = dict(warmup_num_steps=c.warmup_num_steps, warmup_type=c.warmup_type)
    if c.type == "warmup_lr":
        return WarmupLR(optimizer, warmup_min_lr=c.warmup_min_lr, warmup_max_lr=c.warmup_max_lr,
                        **warmup)
    if c.type == "warmup_decay_lr":
        max_lr = {} if c.warmup_max_lr is None else {"warmup_max_lr": c.warmup_max_lr}
        return WarmupDecayLR(optimizer, c.total_num_steps, warmup_min_lr=c.warmup_min_lr,
                             **max_lr, **warmup)
    if c.type == "warmup_cosine_lr":
        return WarmupCosineLR(optimizer, c.total_num_steps, warmup_min_ratio=c.warmup_min_ratio,
                              cos_min_ratio=c.cos_min_ratio, **warmup)
    if c.type == "one_cycle":
        return OneCycle(optimizer, c.cycle_min_lr, c.cycle_max_lr, decay_lr_rate=c.decay_lr_rate,
                        cycle_first_step_size=c.cycle_first_num_steps,
                        cycle_second_step_size=c.cycle_second_num_steps,
                        cycle_first_stair_count=c.cycle_first_num_stairs,
                        cycle_second_stair_count=c.cycle_second_num_stairs,
                        decay_step_size=c.decay_interval_num_steps,
                        cycle_momentum=c.cycle_momentum, cycle_min_mom=c.cycle_min_mom,
                        cycle_max_mom=c.cycle_max_mom, decay_mom_rate=c.decay_mom_rate)
    if c.type == "lr_range_test":
        return LRRangeTest(optimizer, lr_range_test_min_lr=c.lr_range_test_min_lr,
                           lr_range_test_step_size=c.lr_range_test_interval_num_steps,
                           lr_range_test_step_rate=c.lr_range_test_step_rate,
                           lr_range_test_staircase=c.lr_range_test_staircase)
    raise AssertionError(f"unhandled scheduler type {c.type!r}")  # SchedulerConfig checks it


__all__ = ["LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR",
           "build_scheduler"]
