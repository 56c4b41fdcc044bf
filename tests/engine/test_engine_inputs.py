"""The engine moves its inputs to its device ([Note: the engine moves inputs] in
infinity/zero/_inputs.py), and tests outside tests/gpu run on the CPU even where CUDA exists
([Note: tests outside tests/gpu run on the CPU] in tests/_support/cpu_only.py). Issue #14,
defects 1 and 12: what a CPU shows of them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import infinity
from infinity.zero import _engine
from tests._support.cpu_only import hide_cuda
from tests._support.engine import engine_config, tiny_gpt

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class DictModel(nn.Module):
    """Takes a Hugging Face style batch (a mapping) and records what reached it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.seen = []

    def forward(self, batch, *, scale):
        self.seen.append((batch, scale))
        return (self.lin(batch["x"]) * scale).pow(2).mean()


def test_forward_passes_every_input_through_move_to_device(monkeypatch):
    """Positional and keyword inputs, nested, go through the mover with the engine's device, and
    the model receives what it returned (on a GPU: the moved tensors)."""
    calls = []

    def recording_move(obj, device):
        calls.append((obj, device))
        return _tagged(obj)

    monkeypatch.setattr(_engine, "move_to_device", recording_move)
    model = DictModel()
    engine = infinity.initialize(model, engine_config(stage=3, unit_class_names=("Linear",)))
    batch = {"x": torch.randn(3, 4)}
    loss = engine(batch, scale=torch.tensor(2.0))
    assert [device for _, device in calls] == [engine.device, engine.device]
    assert calls[0][0] == (batch,) and set(calls[1][0]) == {"scale"}
    seen_batch, seen_scale = model.seen[-1]
    assert getattr(seen_batch, "moved", False) and getattr(seen_scale, "moved", False)
    engine.backward(loss)
    engine.step()


class _Tagged(dict):
    moved = True


def _tagged(obj):
    """A stand-in mover: containers and tensors come back marked (clones of tensors)."""
    if isinstance(obj, tuple):
        return tuple(_tagged(v) for v in obj)
    if isinstance(obj, dict):
        return _Tagged({k: _tagged(v) for k, v in obj.items()})
    if isinstance(obj, torch.Tensor):
        out = obj.clone()
        out.moved = True
        return out
    return obj


def test_a_simulated_gpu_machine_still_runs_tests_on_cpu(monkeypatch):
    """On a GPU machine, 'auto' picks CUDA; under the suite's hiding the engine lands on the CPU
    (the failure of defect 12: CPU references against a CUDA engine, gloo ranks on cuda:0)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPU machine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _engine.resolve_device("auto") == torch.device("cuda", 0)
    hide_cuda(monkeypatch)  # what tests/conftest.py does for every test not marked gpu
    engine = infinity.initialize(tiny_gpt(), engine_config(stage=3))
    assert engine.device == torch.device("cpu")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_child_processes_of_a_cpu_test_see_no_gpu():
    """Distributed ranks and CLI subprocesses inherit the hiding (tests/_support/launch.py
    copies os.environ)."""
    out = subprocess.run([sys.executable, "-c", "import os, torch; print(repr("
                          "os.environ.get('CUDA_VISIBLE_DEVICES')), torch.cuda.device_count())"],
                         capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["''", "0"]
