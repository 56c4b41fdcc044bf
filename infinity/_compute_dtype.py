"""Whether this device computes in bf16 at a useful speed, measured once per process.

[Note: bf16 where the device computes it]
A GPU with bf16 support, or a CPU with AVX-512 BF16 or AMX, multiplies bf16 matrices at least as
fast as fp32. A CPU without them (AVX2 only: Zen 2/3, older Xeons) runs torch's bf16 GEMM through
a fallback whose speed depends on the operands' layout: on the 2-core AVX2 EPYC VM (torch
2.13.0+cpu) a 512x512 @ 512x2048 product ran at 76-137 GFLOP/s in fp32 and at 0.5 GFLOP/s in bf16
with both operands untransposed (the backward's grad @ W), 11-23 in the other layouts; the main
job (25M GPT, batch 4 x 128) took 40.6 s a step in bf16 against 0.83 s in fp32, 98% of it in
aten::mm. bf16 halves the parameters' bytes on the disk and on the wire, which a compute a little
slower can buy back, never fifty times slower. So ``infinity train --dtype auto`` (its default)
trains in bf16 where one Linear layer's three training products (x W^T, g W, g^T x) take at most
BF16_SLOWDOWN_LIMIT times their fp32 time, in fp32 otherwise, and says which and why.
"""

from __future__ import annotations

import functools
import math
import time

import torch

__all__ = ["BF16_SLOWDOWN_LIMIT", "auto_compute_dtype", "bf16_slowdown"]

BF16_SLOWDOWN_LIMIT = 2.0
"""bf16 is chosen where its training matmuls take at most this many times their fp32 time."""

_ROWS, _WIDTH = 512, 256
"""The probe's layer: a (512 x 256) batch through a 256 x 256 weight, 200 MFLOP a pass. Not
smaller: on the AVX2 VM products of at most 256 x 256 x 256 were as fast in bf16 as in fp32 in
one process (0.8-1.6x) and 64-74x slower in another, 512 x 256 x 256 slow in both (46x, 94x:
benchmarks/bf16_gemm.py); a pass there takes ~0.1 s."""


def _pass_s(dtype: torch.dtype, repeats: int = 2) -> float:
    """The fastest of ``repeats`` passes of the three products of a Linear layer's training."""
    g = torch.Generator().manual_seed(0)
    x, w, grad = (torch.randn(shape, generator=g).to(dtype)
                  for shape in ((_ROWS, _WIDTH), (_WIDTH, _WIDTH), (_ROWS, _WIDTH)))
    best = math.inf
    for _ in range(repeats + 1):  # the first warms the kernels up
        start = time.perf_counter()
        torch.mm(x, w.t())      # forward: x W^T
        torch.mm(grad, w)       # backward, input: g W
        torch.mm(grad.t(), x)   # backward, weight: g^T x
        best = min(best, time.perf_counter() - start)
    return best


@functools.cache
def bf16_slowdown(device_type: str) -> float:
    """bf16 time over fp32 time of one Linear layer's training products on a ``device_type``
    ('cpu' or 'cuda') device ([Note: bf16 where the device computes it]); on CUDA 1.0 where
    ``torch.cuda.is_bf16_supported()``, infinite where not."""
    if device_type == "cuda":
        return 1.0 if torch.cuda.is_bf16_supported() else math.inf
    if device_type != "cpu":
        raise ValueError(f"bf16_slowdown: expected a 'cpu' or 'cuda' device, got {device_type!r}")
    return _pass_s(torch.bfloat16) / _pass_s(torch.float32)


def auto_compute_dtype(device_type: str) -> tuple[str, str]:
    """('bf16' or 'fp32', why) for a run on ``device_type`` that leaves the choice to the engine
    ([Note: bf16 where the device computes it])."""
    slowdown = bf16_slowdown(device_type)
    if slowdown <= BF16_SLOWDOWN_LIMIT:
        return "bf16", (f"bf16: this {device_type} multiplies bf16 matrices at "
                        f"{slowdown:.2f}x the time of fp32")
    return "fp32", (f"fp32: this {device_type} multiplies bf16 matrices at {slowdown:.1f}x the "
                    f"time of fp32 (no native bf16; above {BF16_SLOWDOWN_LIMIT:g}x); pass "
                    f"--dtype bf16 to train in bf16 anyway")
