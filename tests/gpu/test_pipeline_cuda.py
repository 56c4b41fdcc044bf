"""A pipeline stage on CUDA (#36): the GPU machine has one GPU, so one stage (mesh.pipeline 1)
over a one-process group, its m micro-batches run by torch's schedule through the engine on the
GPU, with parameters and optimizer on NVMe under a device budget smaller than the model: the shape
pass makes its zeros on the engine's device, the micro-batches' losses are averaged as plain
PyTorch's, and the result is plain PyTorch's on the GPU (fp32). The cross-rank sends need several
GPUs (NCCL point-to-point): not checked here."""

from __future__ import annotations

import os

import pytest
import torch

from tests._support.engine import (assert_close_run, batches, offload_config, reference_train,
                                   tiny_gpt)
from tests.gpu._cuda import CUDA, exact_fp32, set_cuda_tolerance

pytestmark = pytest.mark.gpu

MICRO, STEPS = 4, 4


@pytest.fixture(autouse=True)
def _tolerance(monkeypatch):
    set_cuda_tolerance(monkeypatch)


@pytest.fixture
def one_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def _untied():
    from infinity.models.gpt import GPTConfig
    from tests._support.engine import TINY

    return tiny_gpt(config=GPTConfig(**{**TINY.__dict__, "tie_weights": False}))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_one_stage_on_the_gpu_with_nvme_offload_matches_plain_pytorch(
        schedule, tmp_path, one_process_group, device=CUDA):
    import torch.nn.functional as F

    import infinity.pipeline
    from infinity.models.gpt import as_sequential, sequential_names

    exact_fp32()
    data = batches(STEPS, MICRO, config=_untied().config)
    ref_losses, ref_state = reference_train(_untied(), data, device=device)
    model = _untied()
    names = sequential_names(model)
    config = offload_config(os.path.join(tmp_path, "swap"), stage=3, gas=MICRO, opt="nvme",
                            param="nvme", device=device.type,
                            pipeline={"schedule": schedule})
    pipe = infinity.pipeline.initialize(
        as_sequential(model), config,
        loss_fn=lambda out, y: F.cross_entropy(out.float().reshape(-1, out.shape[-1]),
                                               y.reshape(-1)))
    try:
        assert pipe.engine.device.type == device.type
        losses = [float(pipe.train_batch(torch.cat([b[0] for b in step]),
                                         target=torch.cat([b[1] for b in step])))
                  for step in data]
        state = {names[k]: v for k, v in pipe.full_state_dict().items()}
        assert_close_run(losses, state, ref_losses, ref_state, "fp32")
    finally:
        pipe.close()
