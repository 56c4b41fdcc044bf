"""[Note: bf16 where the device computes it] (infinity/_compute_dtype.py): ``infinity train
--dtype auto`` trains in bf16 where the device's bf16 training products take at most
BF16_SLOWDOWN_LIMIT times their fp32 time, in fp32 otherwise, and says why."""

from __future__ import annotations

import math

import pytest
import torch

import infinity._compute_dtype as compute_dtype
from infinity._compute_dtype import BF16_SLOWDOWN_LIMIT, auto_compute_dtype, bf16_slowdown


@pytest.fixture
def fresh_probe():
    bf16_slowdown.cache_clear()
    yield
    bf16_slowdown.cache_clear()


@pytest.mark.parametrize("bf16_s, want", [(0.5, "bf16"), (BF16_SLOWDOWN_LIMIT, "bf16"),
                                          (BF16_SLOWDOWN_LIMIT * 1.01, "fp32"), (46.0, "fp32")])
def test_the_choice_follows_the_measured_slowdown(monkeypatch, fresh_probe, bf16_s, want):
    times = {torch.float32: 1.0, torch.bfloat16: bf16_s}
    monkeypatch.setattr(compute_dtype, "_pass_s", lambda dtype: times[dtype])
    dtype, why = auto_compute_dtype("cpu")
    assert dtype == want and why.startswith(want)
    assert f"{bf16_s:.1f}" in why or f"{bf16_s:.2f}" in why  # the measured ratio is named
    if want == "fp32":
        assert "--dtype bf16" in why  # how to overrule it


def test_the_probe_is_measured_once_per_process(monkeypatch, fresh_probe):
    calls = []
    monkeypatch.setattr(compute_dtype, "_pass_s", lambda dtype: calls.append(dtype) or 1.0)
    assert bf16_slowdown("cpu") == bf16_slowdown("cpu") == 1.0
    assert calls == [torch.bfloat16, torch.float32]


def test_the_probe_times_real_products(fresh_probe):
    """Each dtype's pass is a positive time, and the ratio is finite (whatever this CPU is)."""
    for dtype in (torch.float32, torch.bfloat16):
        assert 0 < compute_dtype._pass_s(dtype, repeats=1) < 60
    assert 0 < bf16_slowdown("cpu") < math.inf


def test_cuda_asks_torch_and_other_devices_are_refused(monkeypatch, fresh_probe):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert auto_compute_dtype("cuda")[0] == "fp32"
    bf16_slowdown.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert auto_compute_dtype("cuda")[0] == "bf16"
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        bf16_slowdown("mps")
