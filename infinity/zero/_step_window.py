"""The engine's gradient-accumulation window: where a training loop is between ``engine.step()`` calls.

One record, :class:`StepWindow`, owns the micro-step and optimizer-step counters and the window's
:class:`WindowState`; the engine asks it whether ``step()`` may run, whether it ends the window
(the optimizer runs), and whether the engine is between steps (checkpoints and weights are saved
and loaded only there). DeepSpeed's rule: every ``step()`` counts one micro-batch, and the optimizer
runs on every ``gradient_accumulation_steps``-th; a caller may end a window early
(``boundary=True``, a trainer's short last window) but never make it longer.
"""

from __future__ import annotations

import enum

from infinity._transitions import TransitionTable


class WindowState(enum.Enum):
    """Where the training loop is in an accumulation window (no tier holds bytes for it: the
    gradients of a pending window are the parameter manager's accumulators)."""

    BETWEEN_STEPS = "between-steps"
    """No micro-batch of a window is pending: the last ``step()`` ran the optimizer (or none ran
    yet) and no backward came since. Checkpoints and weights are saved and loaded only here."""
    IN_WINDOW = "in-window"
    """``step()`` counted micro-batches of a window whose optimizer step is still to come; no
    backward came since the last ``step()``."""
    BACKWARD_DONE = "backward-done"
    """A backward ran since the last ``step()``: the next ``step()`` counts its micro-batch."""


_B, _I, _D = WindowState.BETWEEN_STEPS, WindowState.IN_WINDOW, WindowState.BACKWARD_DONE
WINDOW_TRANSITIONS = TransitionTable("accumulation window", {
    (_B, _D): "the backward of a window's first micro-batch",
    (_I, _D): "the backward of a later micro-batch of the window",
    (_D, _D): "another backward before step() (several losses of one micro-batch)",
    (_D, _I): "step() counted a micro-batch inside the window",
    (_D, _B): "step() ended the window (the optimizer runs), or the window was discarded",
    (_I, _B): "the window was discarded (a pipeline step that raised midway)",
})
"""The window's allowed :class:`WindowState` changes, each with why (a checkpoint's load sets the
state from the loaded counters, outside this table: it replaces the window)."""


class StepWindow:
    """The accumulation window and the step counters of one engine."""

    def __init__(self, gradient_accumulation_steps: int):
        self.gradient_accumulation_steps = int(gradient_accumulation_steps)
        """Micro-batches per optimizer step (the config's; an early boundary may end one sooner)."""
        self.state = _B
        """Where the loop is (:class:`WindowState`); changed only by :meth:`_to` and :meth:`load`."""
        self.micro_steps = 0
        """``step()`` calls so far (micro-batches), rounded up to the window at an early boundary."""
        self.global_steps = 0
        """Optimizer steps taken (skipped fp16 overflow steps count too, as in DeepSpeed)."""
        self.skipped_steps = 0
        """Optimizer steps skipped for an fp16 overflow."""

    def _to(self, new: WindowState) -> None:
        WINDOW_TRANSITIONS.check("engine", self.state, new)
        self.state = new

    @property
    def between_steps(self) -> bool:
        return self.state is _B

    @property
    def is_boundary(self) -> bool:
        """The next ``step()`` ends the window by the config's count."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward_done(self) -> None:
        """A backward ended (its gradients are in the accumulators)."""
        self._to(_D)

    def require_backward(self) -> None:
        """RuntimeError unless a backward ran since the last ``step()``."""
        if self.state is not _D:
            raise RuntimeError("engine.step() called without engine.backward(loss) since the last "
                               "step; call engine.backward(loss) once per micro-batch, then step()")

    def count(self, boundary: bool | None) -> bool:
        """``step()``: count one micro-batch; True when it ends the window (the optimizer runs).
        ``boundary``: None ends it on every ``gradient_accumulation_steps``-th call; True or False
        is the caller's decision (never a window longer than the config's)."""
        self.require_backward()
        natural = self.is_boundary
        if boundary is False and natural:
            raise ValueError(
                f"engine.step(boundary=False): micro-batch {self.micro_steps + 1} completes a "
                f"window of gradient_accumulation_steps={self.gradient_accumulation_steps}; a "
                f"window may not be longer (raise gradient_accumulation_steps in the config)")
        self.micro_steps += 1
        if not (natural if boundary is None else boundary):
            self._to(_I)
            return False
        window = self.gradient_accumulation_steps
        self.micro_steps = -(-self.micro_steps // window) * window  # an early boundary ends it
        self._to(_B)
        return True

    def discard(self) -> None:
        """The window's micro-batches are dropped (their gradients zeroed by the caller): back to
        its start."""
        window = self.gradient_accumulation_steps
        self.micro_steps = self.micro_steps // window * window
        if self.state is not _B:
            self._to(_B)

    def optimizer_step(self, *, skipped: bool) -> None:
        """The window's optimizer step ran (``skipped``: an fp16 overflow skipped its update)."""
        self.global_steps += 1
        self.skipped_steps += int(skipped)

    def counters(self) -> dict[str, int]:
        """What a checkpoint keeps of the window."""
        return {"global_steps": self.global_steps, "micro_steps": self.micro_steps,
                "skipped_steps": self.skipped_steps}

    def load(self, *, global_steps: int, micro_steps: int, skipped_steps: int) -> None:
        """Replace the window by a checkpoint's counters (between steps). A save under another
        ``gradient_accumulation_steps`` may land inside this engine's window: then the next
        boundary is this window's."""
        self.global_steps, self.micro_steps = int(global_steps), int(micro_steps)
        self.skipped_steps = int(skipped_steps)
        self.state = _B if self.micro_steps % self.gradient_accumulation_steps == 0 else _I
