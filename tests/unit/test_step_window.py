"""The accumulation window (:class:`~infinity.zero._step_window.StepWindow`) against DeepSpeed's
rule written out by hand: the optimizer runs on every ``gradient_accumulation_steps``-th
``step()``, an early boundary ends a window and restarts the count, and the engine is between
steps exactly when no backward is pending and the count is a whole number of windows."""

from __future__ import annotations

import random

import pytest

from infinity.errors import IllegalTransitionError
from infinity.zero._step_window import StepWindow, WindowState


@pytest.mark.parametrize("gas", [1, 2, 3, 4])
def test_the_window_follows_deepspeeds_count_with_early_boundaries(gas):
    rng = random.Random(gas)
    window = StepWindow(gas)
    micro, optimizer_steps, pending = 0, 0, False  # the reference's own state
    for _ in range(200):
        assert window.between_steps == (not pending and micro % gas == 0)
        if not pending or rng.random() < 0.3:  # another backward (several losses) or the first
            window.backward_done()
            pending = True
            continue
        natural = (micro + 1) % gas == 0
        boundary = rng.choice([None, None, True, False])
        if boundary is False and natural:
            with pytest.raises(ValueError, match="may not be longer"):
                window.count(boundary)
            continue
        ran = window.count(boundary)
        micro += 1
        pending = False
        expect = natural if boundary is None else boundary
        if expect:
            micro = -(-micro // gas) * gas
            optimizer_steps += 1
            window.optimizer_step(skipped=False)
        assert ran == expect and window.micro_steps == micro
    assert window.global_steps == optimizer_steps > 0


def test_step_without_a_backward_is_refused_and_changes_nothing():
    window = StepWindow(2)
    with pytest.raises(RuntimeError, match="without engine.backward"):
        window.count(None)
    window.backward_done()
    assert not window.count(None)
    with pytest.raises(RuntimeError, match="without engine.backward"):
        window.count(None)
    assert window.micro_steps == 1 and window.state is WindowState.IN_WINDOW


def test_a_load_under_another_window_lands_inside_this_one():
    """A save at micro-step 6 (windows of 3) loaded with windows of 4: two micro-batches of this
    window are counted, so the engine is not between steps and the next boundary is at 8."""
    window = StepWindow(4)
    window.load(global_steps=2, micro_steps=6, skipped_steps=1)
    assert not window.between_steps and window.state is WindowState.IN_WINDOW
    window.backward_done()
    assert not window.count(None)
    window.backward_done()
    assert window.count(None) and window.micro_steps == 8 and window.between_steps
    assert window.counters() == {"global_steps": 2, "micro_steps": 8, "skipped_steps": 1}


def test_only_the_tables_changes_are_made():
    window = StepWindow(2)
    with pytest.raises(IllegalTransitionError):
        window._to(WindowState.IN_WINDOW)  # no backward came: nothing was counted
