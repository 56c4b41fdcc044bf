"""fp16 through a pipeline ([Note: ZeRO inside a pipeline stage]: each micro-batch's loss times
the loss scale over m; the overflow is decided on the norm over every stage), on 2 gloo
processes, PP=2 x DP=1, ZeRO-3, 1F1B: a static scale against plain PyTorch in fp16 with the
same scale; a dynamic scale whose last stage overflows: both stages skip that step and halve
their scale, the first stage though its own gradients are finite."""

from __future__ import annotations

import pytest

from tests._support.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread")]

MICRO, STEPS, LR = 4, 4, 1e-3




def _model():
    from infinity.models.gpt import GPTConfig
    from tests._support.engine import tiny_gpt

    return tiny_gpt(config=GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2,
                                     n_embd=32, tie_weights=False))


def _loss(logits, targets):
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _data():
    from tests._support.engine import batches

    return batches(STEPS, MICRO, config=_model().config)


def _whole(step_batches):
    import torch

    return torch.cat([b[0] for b in step_batches]), torch.cat([b[1] for b in step_batches])


def worker(rank: int, world_size: int, out_dir: str, precision: dict, overflow_step: int,
           dtype: str = "fp16") -> dict:
    import infinity.pipeline
    from infinity.models.gpt import as_sequential, sequential_names
    from tests._support.engine import engine_config

    model = _model()
    names = sequential_names(model)
    step = {"now": -1}

    def loss_fn(out, target):
        loss = _loss(out, target)
        return loss * float("inf") if step["now"] == overflow_step else loss

    cfg = engine_config(stage=3, dtype=dtype, gas=MICRO, mesh={"pipeline": 2},
                        optimizer={"lr": LR}, precision=precision)
    pipe = infinity.pipeline.initialize(as_sequential(model), cfg, loss_fn=loss_fn)
    out: dict = {"losses": [], "scales": [], "skipped": [], "states": []}
    for s, batch in enumerate(_data()):
        step["now"] = s
        out["losses"].append(float(pipe.train_batch(*_whole(batch)[:1],
                                                    target=_whole(batch)[1])))
        out["scales"].append(pipe.engine.loss_scale if dtype == "fp16" else 1.0)
        out["skipped"].append(pipe.engine.skipped_steps)
        out["states"].append({names[k]: v for k, v in pipe.full_state_dict().items()})
    pipe.close()
    return out


def test_fp16_static_scale_matches_plain_pytorch():
    from tests._support.engine import assert_close_run, reference_train

    results = launch(__file__, "worker", world_size=2, timeout_s=240,
                     args={"precision": {"loss_scale": 256.0}, "overflow_step": -2})
    ref_losses, ref_state = reference_train(
        _model(), _data(), dtype="fp16", loss_scale=256.0,
        param_groups=lambda m: [{"params": list(m.parameters()), "lr": LR}])
    merged: dict = {}
    for res in results:
        merged.update(res["states"][-1])
        assert res["scales"] == [256.0] * STEPS and res["skipped"] == [0] * STEPS
    assert_close_run(results[0]["losses"], merged, ref_losses, ref_state, "fp16")
    assert results[1]["losses"] == results[0]["losses"]


def test_fp16_overflow_on_the_last_stage_skips_the_step_on_both():
    import torch

    results = launch(__file__, "worker", world_size=2, timeout_s=240,
                     args={"precision": {"initial_scale_power": 10, "hysteresis": 1},
                           "overflow_step": 1})
    for stage, res in enumerate(results):
        assert res["skipped"] == [0, 1, 1, 1], (stage, res["skipped"])
        assert res["scales"][1] == res["scales"][0] / 2, (stage, res["scales"])
        before, after = res["states"][0], res["states"][1]
        assert all(torch.equal(before[k], after[k]) for k in before), stage  # step 1 skipped
        after2 = res["states"][2]
        assert any(not torch.equal(after[k], after2[k]) for k in after), stage  # step 2 taken


def test_bf16_matches_plain_pytorch():
    from tests._support.engine import assert_close_run, reference_train

    results = launch(__file__, "worker", world_size=2, timeout_s=240,
                     args={"precision": {}, "overflow_step": -2, "dtype": "bf16"})
    ref_losses, ref_state = reference_train(
        _model(), _data(), dtype="bf16",
        param_groups=lambda m: [{"params": list(m.parameters()), "lr": LR}])
    merged: dict = {}
    for res in results:
        merged.update(res["states"][-1])
    assert_close_run(results[0]["losses"], merged, ref_losses, ref_state, "bf16")
