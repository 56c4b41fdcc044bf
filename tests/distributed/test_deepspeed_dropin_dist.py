"""The DeepSpeed drop-in on 2 gloo ranks (issue #32): ``zero.GatheredParameters(params,
modifier_rank=0)`` edits made on rank 0 (embedding rows set as a resize does, one weight tied to
another by value) land in the shards on both ranks, at stage 3 with parameters and optimizer on
NVMe and at stage 2 in memory, and training goes on like plain PyTorch with the same edit on the
global batch; rank 1's own edits inside the block are discarded, as under DeepSpeed (also of a
parameter rank 0 left unchanged, which at stage 2 stays gathered on rank 1)."""

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


def worker(rank: int, world_size: int, out_dir: str, stage: int) -> dict:
    import os

    import torch

    import infinity.deepspeed as deepspeed
    from tests._support.engine import tiny_gpt
    from tests._support.deepspeed_loop import ds_config, edit_rows_and_tie

    deepspeed.init_distributed()
    cfg = ds_config(__import__("pathlib").Path(os.path.join(out_dir, f"r{rank}")))
    cfg["train_micro_batch_size_per_gpu"] = 4
    cfg["zero_optimization"]["stage"] = stage
    if stage < 3:  # stage 2 in memory: every unit stays gathered on every rank
        cfg["zero_optimization"].pop("offload_param")
        cfg["zero_optimization"].pop("offload_optimizer")
    model = tiny_gpt()
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    assert engine.train_batch_size() == 8
    losses = []
    for i, (x, y) in enumerate(global_batches()):
        if i == EDIT_AT:
            params = [model.wte.weight, model.wpe.weight, model.blocks[0].mlp.fc.weight,
                      model.blocks[1].mlp.fc.weight]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                with torch.no_grad():
                    if rank == 0:
                        edit_rows_and_tie(model)
                    else:  # not the modifier: discarded, also where rank 0 changed nothing
                        model.wte.weight.fill_(99.0)
                        model.wpe.weight.fill_(99.0)
        if i == EDIT_AT + 1:  # rank 0 changes nothing: rank 1's edit is still discarded
            with deepspeed.zero.GatheredParameters([model.wpe.weight], modifier_rank=0):
                if rank == 1:
                    with torch.no_grad():
                        model.wpe.weight.fill_(99.0)
        loss = engine(x.chunk(2)[rank], y.chunk(2)[rank])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world_size)
    state = engine.full_state_dict()
    engine.close()
    return {"losses": losses, "state": state}


@pytest.mark.parametrize("stage", [3, 2])
def test_gathered_parameters_edits_on_rank_0_land_on_both_ranks(stage):
    import torch

    from tests._support.deepspeed_loop import edit_rows_and_tie, plain_losses

    results = launch(__file__, "worker", timeout_s=240, args={"stage": stage})
    ref, ref_model = plain_losses(global_batches(), edit=edit_rows_and_tie, edit_after=EDIT_AT)
    for res in results:
        assert res["losses"] == pytest.approx(ref, abs=1e-5)
        for k, v in ref_model.state_dict().items():
            torch.testing.assert_close(res["state"][k], v, atol=1e-5, rtol=0, msg=k)
