"""Tensor parallelism inside pipeline stages (#36: the planner's 70B choice is PP x TP): 4 gloo
processes on a ("pipeline", "tensor") = 2 x 2 mesh, each stage a piece of test_tp_dist's
TinyLlama cut by hand and parallelized with ``parallelize_module`` on its tensor submesh, handed to
``infinity.pipeline.initialize_stage`` at ZeRO-3 with clipping; losses and the full state against
the unparallelized model trained by plain PyTorch on the same global batch."""

from __future__ import annotations

import pytest

from tests._support.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread")]

CLIP = 0.05
STAGE_NAMES = ({"0.": "embed.", "1.": "blocks.0."},
               {"0.": "blocks.1.", "1.norm.": "norm.", "1.head.": "head."})
"""Each stage's parameter names -> the model's."""


def _model_name(stage: int, key: str) -> str:
    for prefix, name in STAGE_NAMES[stage].items():
        if key.startswith(prefix):
            return name + key[len(prefix):]
    raise KeyError(key)


def worker_pp_tp(rank: int, world_size: int, out_dir: str) -> dict:
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    import infinity.pipeline
    from tests._support.engine import engine_config
    from tests.distributed import test_tp_dist as tp

    class Head(nn.Module):
        def __init__(self, norm: nn.Module, head: nn.Module):
            super().__init__()
            self.norm, self.head = norm, head

        def forward(self, x):
            return self.head(self.norm(x))

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pipeline", "tensor"))
    model = tp.tiny_llama()
    tp.parallelize(model, mesh["tensor"])
    stage = mesh.get_local_rank("pipeline")
    module = (nn.Sequential(model.embed, model.blocks[0]) if stage == 0
              else nn.Sequential(model.blocks[1], Head(model.norm, model.head)))
    config = engine_config(stage=3, clip=CLIP, gas=4, mesh={"pipeline": 2, "tensor": 2},
                           pipeline={"schedule": "1f1b"})
    pipe = infinity.pipeline.initialize_stage(
        module, config, loss_fn=lambda out, y: F.cross_entropy(out.reshape(-1, tp.VOCAB),
                                                               y.reshape(-1)))
    losses = [float(pipe.train_batch(x, target=y)) for x, y in tp.global_batches()]
    state = {_model_name(stage, k): v for k, v in pipe.full_state_dict().items()}
    pipe.close()
    return {"losses": losses, "state": state}


def test_pipeline_stages_with_tensor_parallelism_match_plain_pytorch():
    from tests._support.engine import assert_close_state
    from tests.distributed import test_tp_dist as tp

    results = launch(__file__, "worker_pp_tp", world_size=4, timeout_s=300)
    ref_losses, _, ref_state = tp.reference(CLIP)
    merged: dict = {}
    for res in results:
        assert res["losses"] == pytest.approx(ref_losses, abs=1e-5)
        merged.update(res["state"])  # both tensor ranks of a stage give the full tensors
    assert_close_state(merged, ref_state, atol=2e-5)
