"""The C++ Adam kernel's fp16 conversions and its build path (issue #14, defect 10).

The fp16 conversions are checked bit for bit against torch's own casts (``.half()`` / ``.float()``,
the independent reference) on the edge values: zeros, subnormals and their ties, the largest
finite value and the ties around it, infinities, NaN. Both compiled variants run: ``scalar`` is
the portable loop (the bit-operation conversions), ``native`` the AVX-512 one where the CPU has it.
The source must compile without ``_Float16``, which x86 GCC has only from GCC 12.
"""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch

from infinity import _common
from infinity.optim import _cpu_adam_ext, cpu_adam
from infinity.optim.cpu_adam import adam_step_flat


def _edge_floats() -> torch.Tensor:
    """fp32 values whose fp16 rounding is easy to get wrong."""
    sub = 2.0 ** -24  # the smallest fp16 subnormal
    vals = [0.0, -0.0, sub, -sub, sub / 2, 3 * sub / 2, 5 * sub / 2, sub * 0.49, sub * 0.51,
            1023 * sub, 1023.5 * sub, 1024 * sub, 2.0 ** -14, 2.0 ** -14 - 2.0 ** -25,
            1.0, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 1.0 + 2.0 ** -11 + 2.0 ** -20,
            2049.0, 2051.0, 65504.0, -65504.0, 65519.0, 65519.99, 65520.0, -65520.0, 1e6,
            3.4e38, 1e-30, -1e-30, math.inf, -math.inf, math.nan, -math.nan]
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(4000, generator=gen) * torch.logspace(-30, 17, 4000, base=2.0)
    return torch.cat([torch.tensor(vals, dtype=torch.float32), spread.float()])


def _edge_halves() -> torch.Tensor:
    """Every fp16 bit pattern class: zeros, each subnormal, normals, Inf, quiet NaN, both signs."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32)
    bits = bits[(bits & 0x7C00) != 0x7C00]  # finite values: every one of them
    special = torch.tensor([0x7C00, 0xFC00, 0x7E00, 0xFE00], dtype=torch.int32)  # +-Inf, +-qNaN
    return torch.cat([bits, special]).to(torch.int16).view(torch.float16)


@pytest.fixture(params=["scalar", "native"])
def kernel(request, monkeypatch):
    _cpu_adam_ext.load(request.param, raise_on_error=True)
    monkeypatch.setenv(cpu_adam.BACKEND_ENV, request.param)
    return request.param


def _step(p, g, out=None):
    """One step with lr 0 and beta1 0: ``exp_avg`` is the loaded gradient and ``out`` the cast of
    ``p``, exactly (see each test)."""
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    adam_step_flat(p, g, m, v, step=1, lr=0.0, beta1=0.0, beta2=0.999, eps=1e-8,
                   weight_decay=0.0, out=out)
    return m


def test_fp16_copy_out_matches_torch_bitwise(kernel):
    # lr 0 and a zero gradient: p is unchanged (p - 0 * 0), so ``out`` is exactly the cast of p.
    p = _edge_floats()
    out = torch.empty(p.numel(), dtype=torch.float16)
    _step(p.clone(), torch.zeros_like(p), out)
    ref = p.half()
    bad = (out.view(torch.int16) != ref.view(torch.int16)).nonzero().flatten()
    assert bad.numel() == 0, [(p[i].item(), hex(out.view(torch.int16)[i].item() & 0xFFFF),
                               hex(ref.view(torch.int16)[i].item() & 0xFFFF)) for i in bad[:8]]


def test_fp16_gradient_load_matches_torch_bitwise(kernel):
    # beta1 0: exp_avg = fma(1, g - 0, 0) = g, so the moment holds the loaded fp16 gradient,
    # bit for bit, except what that arithmetic itself changes: -0 - 0 + 0 is +0, and a NaN's
    # sign and payload are the CPU's. Those two classes are checked by value.
    g = _edge_halves()
    p = torch.zeros(g.numel(), dtype=torch.float32)
    m = _step(p, g)
    ref = g.float()
    assert torch.isnan(m).equal(torch.isnan(ref)) and (m[ref == 0] == 0).all()
    exact = ~torch.isnan(ref) & (ref != 0)
    bad = ((m.view(torch.int32) != ref.view(torch.int32)) & exact).nonzero().flatten()
    assert bad.numel() == 0, [(hex(g.view(torch.int16)[i].item() & 0xFFFF), m[i].item(),
                               ref[i].item()) for i in bad[:8]]


def test_kernel_compiles_without_float16(tmp_path):
    # Any use of _Float16 becomes an undeclared identifier, as on GCC 11 for x86.
    cxx = _cpu_adam_ext._compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    flags = _cpu_adam_ext.BASE_FLAGS + ("-D_Float16=no_Float16_before_GCC_12",)
    _cpu_adam_ext._build(cxx, flags, str(tmp_path / "lib.so"))
    assert os.path.getsize(tmp_path / "lib.so") > 0


def test_failed_build_logs_the_compiler_error(tmp_path, monkeypatch, caplog):
    if _cpu_adam_ext._compiler() is None:
        pytest.skip("no C++ compiler")
    broken = tmp_path / "broken.cpp"
    broken.write_text("int main() { return this_identifier_does_not_exist_42; }\n")
    monkeypatch.setattr(_cpu_adam_ext, "SOURCE_PATH", str(broken))
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(_cpu_adam_ext, "_libs", {})
    monkeypatch.setattr(_cpu_adam_ext, "_errors", {})
    monkeypatch.setenv(cpu_adam.BACKEND_ENV, "auto")
    _common.reset_warnings_for_tests()
    with caplog.at_level(logging.WARNING, logger=_cpu_adam_ext.__name__):
        with pytest.warns(UserWarning) as warned:
            assert cpu_adam.backend() == "torch"
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "this_identifier_does_not_exist_42" in logged  # the compiler's stderr, in the log
    message = str(warned[0].message)
    assert "this_identifier_does_not_exist_42" in message and "pure-torch path" in message
    assert "no C++ compiler?" not in message
    assert "this_identifier_does_not_exist_42" in _cpu_adam_ext.load_error("native")
    _common.reset_warnings_for_tests()
