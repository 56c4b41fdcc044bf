"""The global gradient norm's sum of squares (infinity.zero._grad_norm.sum_of_squares) against fp64.

Large low-precision gradients are where an fp32 reduction drifts: torch's fp32 vector norm of a
39M-element bf16 tensor read 0.5 % low on CPU, which moves every clip coefficient by as much."""

from __future__ import annotations

import math

import pytest
import torch

from infinity.zero._grad_norm import sum_of_squares


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sum_of_squares_of_a_large_gradient_matches_fp64(dtype):
    g = (torch.randn(2 ** 23 + 12345, generator=torch.Generator().manual_seed(0)) * 0.01).to(dtype)
    want = float(g.double().square().sum())
    got = sum_of_squares(g)
    assert got.dtype == torch.float64 and got.dim() == 0
    assert float(got) == pytest.approx(want, rel=1e-5)


def test_sum_of_squares_keeps_shape_and_non_finite_values():
    g = torch.ones(3, 5, dtype=torch.bfloat16)
    assert float(sum_of_squares(g)) == 15.0
    g[1, 2] = float("inf")
    assert math.isinf(float(sum_of_squares(g)))
    g[1, 2] = float("nan")
    assert math.isnan(float(sum_of_squares(g)))



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sum_of_squares_across_chunk_bounds_and_of_non_finite_values(dtype):
    """Merged from cpu_adam's removed grad_norm_sq test: a length that is not a multiple of the
    chunk, against fp64, and inf/nan anywhere give a non-finite sum."""
    g = (torch.randn((1 << 18) + 3, generator=torch.Generator().manual_seed(1)) * 10).to(dtype)
    want = float(g.double().square().sum())
    assert float(sum_of_squares(g)) == pytest.approx(want, rel=1e-5)
    for bad in (float("inf"), float("nan")):
        h = g.clone()
        h[-1] = bad
        assert not math.isfinite(float(sum_of_squares(h)))
