"""The DeepSpeed drop-in (issue #32 item 3): a training loop written the way DeepSpeed's
getting-started tutorial writes it (from its documented API: ``deepspeed.initialize`` with
``model_parameters`` and ``training_data``, ``model_engine(...)``, ``model_engine.backward``,
``model_engine.step``, ``save_checkpoint(dir, tag, client_state)``, ``load_checkpoint(dir)``),
run with ``import infinity.deepspeed as deepspeed`` against plain PyTorch (fp32, stage 3, NVMe
offload); checkpoints resume exactly and hand back ``client_state``; ``zero.GatheredParameters``
edits land in the shards; what is not supported raises naming the DeepSpeed name."""

from __future__ import annotations

import os

import pytest
import torch

import infinity.deepspeed as deepspeed
from tests._support.deepspeed_loop import (MICRO, STEPS, dataset, ds_config, edit_rows_and_tie,
                                           plain_losses)
from tests._support.engine import LR, tiny_gpt

pytestmark = pytest.mark.usefixtures("one_torch_thread")

def test_a_deepspeed_style_loop_trains_like_plain_pytorch(tmp_path):
    model = tiny_gpt()
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), training_data=dataset(),
        config=ds_config(tmp_path))
    assert optimizer is model_engine.optimizer
    assert model_engine.train_batch_size() == MICRO
    assert model_engine.gradient_accumulation_steps() == 1
    assert model_engine.get_lr() == [LR]
    batches, losses = [], []
    model_engine.train()
    for x, y in trainloader:
        batches.append((x, y))
        loss = model_engine(x, y)
        model_engine.backward(loss)
        assert model_engine.is_gradient_accumulation_boundary()
        model_engine.step()
        model_engine.zero_grad()
        losses.append(loss.item())
    assert model_engine.global_steps == STEPS and len(batches) == STEPS
    seen = torch.cat([b[0] for b in batches])  # every row once, in a shuffled order
    rows = dataset().tensors[0]
    assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, rows.tolist()))
    assert not torch.equal(seen, rows)
    ref, _ = plain_losses(batches)
    assert losses == pytest.approx(ref, abs=1e-5)
    model_engine.close()


def test_checkpoints_resume_exactly_and_return_client_state(tmp_path):
    data = [dataset()[i * MICRO:(i + 1) * MICRO] for i in range(STEPS)]

    def run(engine, part):
        out = []
        for x, y in part:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out

    engine, *_ = deepspeed.initialize(model=tiny_gpt(), config=ds_config(tmp_path / "a"))
    run(engine, data[:3])
    path = engine.save_checkpoint(tmp_path / "ckpt", client_state={"epoch": 2, "seen": [1, 2]})
    assert os.path.basename(path) == "global_step3"  # DeepSpeed's default tag
    with pytest.raises(Exception, match="global_step3.*never overwritten"):
        engine.save_checkpoint(tmp_path / "ckpt")  # the same tag again
    engine.save_checkpoint(tmp_path / "ckpt", tag="mine")
    want = run(engine, data[3:])
    engine.close()

    engine, *_ = deepspeed.initialize(model=tiny_gpt(1), config=ds_config(tmp_path / "b"))
    loaded, client_state = engine.load_checkpoint(tmp_path / "ckpt", tag="global_step3")
    assert loaded.endswith("global_step3") and client_state == {"epoch": 2, "seen": [1, 2]}
    assert engine.global_steps == 3
    assert run(engine, data[3:]) == want  # bitwise: the whole state came back
    _, latest_state = engine.load_checkpoint(tmp_path / "ckpt")  # 'latest': the newest, "mine"
    assert latest_state == {}
    engine.close()


@pytest.mark.parametrize("stage,offload", [(3, "nvme"), (2, "none")])
def test_gathered_parameters_edits_land_in_the_shards(stage, offload, tmp_path):
    data = [dataset()[i * MICRO:(i + 1) * MICRO] for i in range(STEPS)]
    cfg = ds_config(tmp_path)
    cfg["zero_optimization"]["stage"] = stage
    if offload == "none":
        cfg["zero_optimization"].pop("offload_param")
        cfg["zero_optimization"].pop("offload_optimizer")
    model = tiny_gpt()
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    losses = []
    for i, (x, y) in enumerate(data):
        if i == 3:
            params = [model.wte.weight, model.blocks[0].mlp.fc.weight,
                      model.blocks[1].mlp.fc.weight]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                assert all(p.numel() > 0 for p in params)  # whole inside, at stage 3 too
                with torch.no_grad():
                    edit_rows_and_tie(model)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.full_state_dict()
    engine.close()
    ref, ref_model = plain_losses(data, edit=edit_rows_and_tie, edit_after=3)
    assert losses == pytest.approx(ref, abs=1e-5)
    for k, v in ref_model.state_dict().items():
        torch.testing.assert_close(state[k], v, atol=1e-5, rtol=0, msg=k)


def test_gathered_parameters_on_a_model_built_under_zero_init(tmp_path):
    """Before initialize, the block is recorded into the model's construction: the edit (and a
    module built inside it) replays as eager code ran it."""
    cfg = ds_config(tmp_path)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = tiny_gpt()
    with deepspeed.zero.GatheredParameters(model.wte.weight, modifier_rank=0):
        with torch.no_grad():
            edit_rows_and_tie(model)
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    state = engine.full_state_dict()
    engine.close()
    want = tiny_gpt()
    with torch.no_grad():
        edit_rows_and_tie(want)
    for k, v in want.state_dict().items():
        assert torch.equal(state[k], v), k


def _resize_positions(model, rows: int = 24):
    """A resize as Hugging Face's resize_token_embeddings does one: a new embedding, the old rows
    copied in, the new ones initialised from the old mean, the module swapped in."""
    old = model.wpe
    new = torch.nn.Embedding(rows, old.embedding_dim)
    with torch.no_grad():
        new.weight[:old.num_embeddings] = old.weight
        new.weight[old.num_embeddings:] = old.weight.mean(dim=0, keepdim=True)
    model.wpe = new


def test_an_embedding_resized_under_gathered_parameters_before_initialize(tmp_path):
    cfg = ds_config(tmp_path)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = tiny_gpt()
    with deepspeed.zero.GatheredParameters(model.wpe.weight, modifier_rank=0):
        _resize_positions(model)
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    state = engine.full_state_dict()
    engine.close()
    torch.manual_seed(0)
    want = tiny_gpt()
    _resize_positions(want)
    assert state["wpe.weight"].shape == (24, 16)
    for k, v in want.state_dict().items():
        assert torch.equal(state[k], v), k


def test_what_is_not_supported_names_the_deepspeed_name(tmp_path):
    model = tiny_gpt()
    with pytest.raises(ValueError, match=r"optimizer=SGD.*'optimizer' section"):
        deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             config=ds_config(tmp_path))
    with pytest.raises(AttributeError, match="deepspeed.comm is not wrapped: use torch.distributed"):
        deepspeed.comm  # noqa: B018
    engine, *_ = deepspeed.initialize(model=tiny_gpt(), config=ds_config(tmp_path))
    with pytest.raises(ValueError, match="retain_graph"):
        engine.backward(engine(*dataset()[:MICRO]), retain_graph=True)
    with pytest.raises(ValueError, match="load_module_only"):
        engine.load_checkpoint(tmp_path, load_module_only=True)
    engine.close()
