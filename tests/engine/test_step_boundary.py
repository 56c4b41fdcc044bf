"""Windows the caller ends (what the Trainer and accelerate integrations rely on):
``engine.backward(loss, scale_wrt_gas=False)`` leaves the loss as given, ``engine.step(boundary=)``
ends a window early (the short last window of an epoch) and ``step(gradient_clipping=)`` clips
that step to its own norm; against plain PyTorch with the same windows."""

from __future__ import annotations

import pytest

import infinity
from tests._support.engine import (assert_close_run, batches, engine_config, reference_train,
                                   tiny_gpt)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_short_windows_and_per_step_clipping_match_torch():
    data = batches(4, 4)
    data[1], data[3] = data[1][:2], data[3][:1]  # windows of 4, 2, 4, 1 micro-batches
    ref_losses, ref_state = reference_train(tiny_gpt(), data, clip=0.05)
    engine = infinity.initialize(tiny_gpt(), engine_config(stage=3, gas=4))
    losses = []
    for window in data:
        total = 0.0
        for i, (x, y) in enumerate(window):
            loss = engine(x, y)
            engine.backward(loss / len(window), scale_wrt_gas=False)
            total += loss.item() / len(window)
            last = i == len(window) - 1
            engine.step(boundary=last, gradient_clipping=0.05 if last else None)
        assert engine.between_steps  # a short window restarts the count
        losses.append(total)
    assert engine.global_steps == 4 and engine.micro_steps == 16
    assert engine.config.gradient_clipping == 0.0  # the override was per step
    assert engine.last_grad_norm > 0.05  # so every step clipped
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    engine.close()


def test_a_window_longer_than_the_config_is_refused():
    engine = infinity.initialize(tiny_gpt(), engine_config(stage=0, gas=2))
    (x, y), = batches(1, 1)[0]
    for _ in range(2):
        engine.backward(engine(x, y))
        if engine.is_gradient_accumulation_boundary:
            with pytest.raises(ValueError, match="may not be longer"):
                engine.step(boundary=False)
        engine.step()  # the refused call left the window as it was
    assert engine.global_steps == 1
    engine.backward(engine(x, y))
    for bad in (-1.0, "1.0", float("nan")):
        with pytest.raises(ValueError, match="gradient_clipping must be a number >= 0"):
            engine.step(gradient_clipping=bad)
    engine.close()
