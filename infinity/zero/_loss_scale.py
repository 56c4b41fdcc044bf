"""fp16 loss scaling: the scale the engine multiplies the loss by, and its dynamic update."""

from __future__ import annotations

from typing import Any, Mapping

from infinity.config import PrecisionConfig


class LossScaler:
    """fp16 loss scale: static (``precision.loss_scale > 0``), dynamic (0) or none (bf16/fp32).

    Dynamic: starts at ``2**initial_scale_power``; an overflow skips the step and, once
    ``hysteresis`` overflows have been absorbed, halves the scale (never below
    ``min_loss_scale``); ``loss_scale_window`` steps in a row without overflow double it and restore
    the hysteresis budget.
    """

    def __init__(self, precision: PrecisionConfig):
        self.dynamic = precision.dtype == "fp16" and precision.loss_scale == 0
        if precision.dtype != "fp16":
            self.scale = 1.0
        elif precision.loss_scale > 0:
            self.scale = float(precision.loss_scale)
        else:
            self.scale = float(2 ** precision.initial_scale_power)
        self.window = precision.loss_scale_window
        self.min_scale = precision.min_loss_scale
        self.hysteresis = precision.hysteresis
        self._hysteresis_left = precision.hysteresis
        """Overflows still absorbed before the scale drops."""
        self._good_steps = 0
        """Steps without overflow since the last overflow or scale increase."""

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            if self._hysteresis_left <= 1:
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self._hysteresis_left -= 1
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps % self.window == 0:
            self.scale *= 2.0
            self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        """The scale and the dynamic update's counters (a checkpoint keeps them)."""
        return {"scale": self.scale, "hysteresis_left": self._hysteresis_left,
                "good_steps": self._good_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self._good_steps = int(state["good_steps"])
