"""The DeepSpeed drop-in on 2 gloo ranks (issue #32): ``zero.GatheredParameters(params,
modifier_rank=0)`` edits made on rank 0 (embedding rows set as a resize does, one weight tied to
another by value) land in the shards on both ranks, at stage 3 with parameters and optimizer on
NVMe, and training goes on like plain PyTorch with the same edit on the global batch; rank 1's
own edits inside the block are discarded, as under DeepSpeed."""

from __future__ import annotations

import pytest

from tests._support.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread")]

STEPS, EDIT_AT = 6, 3


def global_batches():
    import torch

    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, 64, (8, 16), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def worker(rank: int, world_size: int, out_dir: str) -> dict:
    import os

    import torch

    import infinity.deepspeed as deepspeed
    from tests._support.engine import tiny_gpt
    from tests.engine.test_deepspeed_dropin import _edit, ds_config

    deepspeed.init_distributed()
    cfg = ds_config(__import__("pathlib").Path(os.path.join(out_dir, f"r{rank}")))
    cfg["train_micro_batch_size_per_gpu"] = 4
    model = tiny_gpt()
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    assert engine.train_batch_size() == 8
    losses = []
    for i, (x, y) in enumerate(global_batches()):
        if i == EDIT_AT:
            params = [model.wte.weight, model.blocks[0].mlp.fc.weight,
                      model.blocks[1].mlp.fc.weight]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                with torch.no_grad():
                    if rank == 0:
                        _edit(model)
                    else:
                        model.wte.weight.fill_(99.0)  # not the modifier: discarded
        loss = engine(x.chunk(2)[rank], y.chunk(2)[rank])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world_size)
    state = engine.full_state_dict()
    engine.close()
    return {"losses": losses, "state": state}


def test_gathered_parameters_edits_on_rank_0_land_on_both_ranks():
    import torch

    from tests.engine.test_deepspeed_dropin import _edit, plain_losses

    results = launch(__file__, "worker", timeout_s=240)
    ref, ref_model = plain_losses(global_batches(), edit=_edit, edit_after=EDIT_AT)
    for res in results:
        assert res["losses"] == pytest.approx(ref, abs=1e-5)
        for k, v in ref_model.state_dict().items():
            torch.testing.assert_close(res["state"][k], v, atol=1e-5, rtol=0, msg=k)
