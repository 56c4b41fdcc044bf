"""Shared by the GPU tests: parity of the engine on CUDA with plain PyTorch on CUDA.

Inputs are given on the CPU, as a training loop reads them: the engine moves them ([Note: the
engine moves inputs] in infinity/zero/_inputs.py); the engine's device is 'cuda' (the index filled
in by [Note: one rank per device] in infinity/zero/_device.py).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

import infinity
from tests._support import engine as support
from tests._support.engine import (assert_close_run, batches, engine_config, engine_train,
                                   reference_train, tiny_gpt)

CUDA = torch.device("cuda", 0)
FP32_CUDA_TOL = dict(loss=1e-5, param=1e-4)
"""fp32 on CUDA: cuBLAS picks kernels by pointer alignment, and parameters are views into flat
buffers, so the reference may run other kernels with other rounding; Adam turns last-bit
differences of near-zero gradients into steps of up to ~lr * 1e-4. Element-wise 1e-4 instead of the
CPU's 2e-5."""


def exact_fp32() -> None:
    """fp32 parity needs true fp32 matmuls (TF32 rounds inputs to 10 bits of mantissa)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def parity_cuda(make_model: Callable[[], nn.Module] = tiny_gpt, *, stage: int, dtype: str,
                gas: int = 1, clip: float = 0.0, steps: int = 6, data=None,
                config: dict[str, Any] | None = None, **cfg: Any):
    """Train ``make_model()`` on the GPU with plain PyTorch and with the engine, assert losses and
    final parameters agree within ``dtype``'s tolerance; returns the engine (still open).
    ``config``: a whole engine config instead of ``engine_config(...)`` with ``cfg``."""
    exact_fp32()
    data = data or batches(steps, gas)
    loss_scale = (config or cfg).get("precision", {}).get("loss_scale", 1)
    ref_losses, ref_state = reference_train(make_model(), data, dtype=dtype, clip=clip,
                                            loss_scale=loss_scale, device=CUDA)
    config = config or engine_config(stage=stage, dtype=dtype, gas=gas, clip=clip,
                                     device="cuda", **cfg)
    engine = infinity.initialize(make_model(), config)
    assert engine.device == CUDA
    losses = engine_train(engine, data)
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, dtype)
    return engine


def set_cuda_tolerance(monkeypatch) -> None:
    monkeypatch.setitem(support.TOL, "fp32", FP32_CUDA_TOL)
