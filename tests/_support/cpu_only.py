"""[Note: tests outside tests/gpu run on the CPU]

The suite must pass on a GPU machine as on a CPU one. The engine's default device is 'auto' (the
GPU when there is one), so a test outside ``tests/gpu`` on a GPU machine would otherwise put its
engine on CUDA, feed it CPU references, and put both gloo ranks of a distributed test on cuda:0.
Every such test therefore sees a machine without CUDA, in its own process and in every process it
starts (distributed ranks, CLI and bench subprocesses): ``tests/conftest.py`` applies
:func:`hide_cuda` to every test not marked ``gpu``.
"""

from __future__ import annotations

import pytest
import torch


def hide_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process and the processes it starts see no GPU until the test ends."""
    # Child processes: CUDA reads CUDA_VISIBLE_DEVICES when it initialises there.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    # This process: CUDA may already be initialised (pytest's collection asked), so the variable
    # alone no longer hides it; the engine and the store ask through these two functions.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
