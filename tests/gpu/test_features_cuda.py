"""The engine's features on CUDA (issue #14), each against plain PyTorch on the GPU or against
itself: fp16 with loss scaling and an overflow skip, gradient clipping, stages 0 and 2,
checkpoint save/load (CUDA RNG state included), ``load_weights`` into CUDA shards,
``infinity.init`` on CUDA, ``infinity train --steps 3`` on CUDA, and which CPU Adam ran."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

import infinity
from tests._support.engine import (assert_close_run, assert_close_state, assert_exactly_equal,
                                   batches, engine_config, engine_train, offload_config,
                                   reference_train, tiny_gpt)
from tests._support.tensors import seed_all
from tests.gpu._cuda import CUDA, exact_fp32, parity_cuda, set_cuda_tolerance

pytestmark = pytest.mark.gpu
REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _tolerance(monkeypatch):
    set_cuda_tolerance(monkeypatch)


def _on_cuda(engine) -> None:
    for unit in engine.manager.units:
        for group in unit.groups:
            assert group.shard.is_cuda, (unit.name, group.key)
    assert all(p.is_cuda for p in engine.module.parameters())


def test_fp16_static_loss_scale_matches_plain_pytorch():
    """fp16 with a static loss scale of 128: the reference scales its loss by the same and
    unscales its fp32 gradients."""
    engine = parity_cuda(stage=3, dtype="fp16", precision={"loss_scale": 128})
    assert engine.loss_scale == 128 and engine.skipped_steps == 0


def test_fp16_overflow_skips_the_step_on_cuda():
    engine = infinity.initialize(tiny_gpt(), engine_config(
        stage=3, dtype="fp16", device="cuda", precision={"initial_scale_power": 10,
                                                          "hysteresis": 1}))
    before = engine.full_state_dict()
    x, y = batches(1, 1)[0][0]
    engine.backward(engine(x, y) * float("inf"))
    engine.step()
    assert engine.skipped_steps == 1 and engine.loss_scale == 512.0
    assert_exactly_equal(engine.full_state_dict(), before, "after the skipped step")
    engine.backward(engine(x, y))
    engine.step()
    assert engine.skipped_steps == 1
    after = engine.full_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_gradient_clipping_on_cuda():
    """A clip norm well below the gradients' norm: every step is clipped, in both."""
    engine = parity_cuda(stage=3, dtype="fp32", clip=0.05, gas=2)
    assert engine.last_grad_norm is not None and engine.last_grad_norm > 0.05


@pytest.mark.parametrize("stage", [0, 2])
def test_stages_0_and_2_on_cuda(stage):
    engine = parity_cuda(stage=stage, dtype="bf16", gas=2)
    _on_cuda(engine)


def _noisy_loss(m, batch):
    """Draws from the CUDA generator: a resume matches only if its state was restored."""
    noise = float(torch.rand((), device=CUDA))
    return m(*batch) * (1.0 + 0.1 * noise)


def test_checkpoint_resume_on_cuda_restores_cuda_rng(tmp_path):
    """3 steps, save, a fresh engine (other init, other RNG) loads and runs 3 more: bitwise the
    run that never stopped, the CUDA generator included (the loss draws from it)."""
    exact_fp32()
    cfg = offload_config(tmp_path / "swap", stage=3, opt="cpu", param="none", device="cuda")
    data = batches(6, 1)
    seed_all(1)
    straight = infinity.initialize(tiny_gpt(), cfg)
    want_losses = engine_train(straight, data, loss_fn=_noisy_loss)
    want_state = straight.full_state_dict()
    straight.close()

    seed_all(1)
    first = infinity.initialize(tiny_gpt(), cfg)
    losses = engine_train(first, data[:3], loss_fn=_noisy_loss)
    first.save_checkpoint(str(tmp_path / "ckpt"))
    first.close()
    seed_all(99)
    torch.rand(7, device=CUDA)  # move the CUDA generator on
    resumed = infinity.initialize(tiny_gpt(seed=7), cfg)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    _on_cuda(resumed)
    losses += engine_train(resumed, data[3:], loss_fn=_noisy_loss)
    # Not bitwise as on the CPU: CUDA's embedding backward accumulates with atomics.
    assert losses == pytest.approx(want_losses, rel=1e-6, abs=1e-6)
    assert_close_state(resumed.full_state_dict(), want_state, atol=1e-5)
    resumed.close()


def test_load_weights_into_cuda_shards(tmp_path):
    from safetensors import torch as safetensors_torch

    source = tiny_gpt(seed=3)
    want = {k: v.detach().clone() for k, v in source.state_dict().items()}
    seen, stored = set(), {}
    for k, v in source.state_dict(keep_vars=True).items():  # a tied alias stored once, as HF does
        if id(v) not in seen:
            seen.add(id(v))
            stored[k] = v.detach().clone().contiguous()
    safetensors_torch.save_file(stored, str(tmp_path / "model.safetensors"))
    engine = infinity.initialize(tiny_gpt(seed=0), engine_config(stage=3, device="cuda"))
    assert engine.load_weights(str(tmp_path)) == {"missing_keys": [], "unexpected_keys": []}
    _on_cuda(engine)
    assert_exactly_equal(engine.full_state_dict(), want, "loaded")
    engine_train(engine, batches(2, 1))  # and it trains from there


def test_infinity_init_on_cuda():
    """Built on meta under infinity.init, materialised unit by unit into CUDA shards: the same
    values as the eager model, and training matches plain PyTorch on the GPU."""
    exact_fp32()
    config = engine_config(stage=3, device="cuda")
    with infinity.init(config):
        model = tiny_gpt()
    engine = infinity.initialize(model)
    _on_cuda(engine)
    assert_exactly_equal(engine.full_state_dict(), tiny_gpt().state_dict(), "materialised")
    data = batches(4, 1)
    ref_losses, ref_state = reference_train(tiny_gpt(), data, device=CUDA)
    losses = engine_train(engine, data)
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")


def test_train_cli_three_steps_on_cuda(tmp_path):
    """The README's main job on the GPU: parameters and optimizer on NVMe, 3 steps."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "infinity", "train", "--model", "tiny", "--steps",
                           "3", "--seq-len", "64", "--no-roofline", "--json", "--dir",
                           str(tmp_path / "swap")], capture_output=True, text=True, env=env,
                          timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert summary["device"] == "cuda:0" and summary["steps"] == 3
    assert np.isfinite(summary["final_loss"])


def test_cpu_adam_runs_the_cpp_kernel():
    """The offloaded optimizer's Adam is the compiled kernel (gpu_check.sh builds it with the
    local toolchain), not the pure-torch fallback."""
    from infinity.optim import _cpu_adam_ext, cpu_adam

    if _cpu_adam_ext._compiler() is None:  # nothing to build it with: not this machine's defect
        pytest.skip("no C++ compiler (CXX, g++, c++, clang++): the kernel cannot be built here")
    assert cpu_adam.backend() in ("native-avx512", "native-scalar"), cpu_adam.backend()
