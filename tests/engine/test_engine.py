"""The engine at world size 1: parity with plain PyTorch + torch.optim.AdamW, and its errors.

Every parity test trains the tiny GPT (tied LM head, LayerNorm, attention + MLP blocks) for 10
optimizer steps with the engine and with the reference of ``_engine_common`` on the same data and
compares the per-step losses and the final parameters.
"""

from __future__ import annotations

import json

import pytest
import torch

import infinity
from infinity.config import PrecisionConfig
from infinity.zero._loss_scale import LossScaler
from tests._support.engine import (BETAS, DTYPES, EPS, LR, WD, assert_close_run, assert_parity,
                                   batches, engine_config, engine_train, reference_train,
                                   tiny_gpt)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 10


def _parity(stage: int, dtype: str, gas: int, clip: float, **cfg) -> None:
    engine, ref_losses = assert_parity(stage=stage, dtype=dtype, gas=gas, clip=clip, steps=STEPS,
                                       **cfg)
    assert engine.global_steps == STEPS
    assert ref_losses[-1] < ref_losses[0] - 0.05, "the reference must actually learn"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype,gas,clip", [("fp32", 1, 0.0), ("fp32", 4, 0.05), ("bf16", 1, 0.0),
                                            ("bf16", 4, 0.05)],
                         ids=["fp32", "fp32-gas4-clip", "bf16", "bf16-gas4-clip"])
def test_parity_with_pytorch(stage, dtype, gas, clip):
    _parity(stage, dtype, gas, clip)


def test_parity_units_by_size_with_borrowed_tied_weight():
    """Units chosen by size: the embedding is its own unit, and the tied LM head (another module)
    must gather it whenever it runs."""
    engine = infinity.initialize(tiny_gpt(), engine_config(stage=3, unit_class_names=(),
                                                           unit_min_numel=500))
    names = [u.name for u in engine.manager.units]
    assert "wte" in names and "lm_head" not in names
    _parity(3, "fp32", 2, 0.05, unit_class_names=(), unit_min_numel=500)


def test_parity_fp16_static_scale():
    _parity(3, "fp16", 2, 0.0, precision={"loss_scale": 256.0})


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_deepspeed_style_config_json(tmp_path, dtype):
    """A DeepSpeed config file as users have them (stage 3, clipping, accumulation, AdamW's
    params) trains like plain PyTorch + AdamW with the same settings."""
    ds = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 40},
          "gradient_clipping": 0.05, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                    "weight_decay": WD}}}
    if dtype == "bf16":
        ds["bf16"] = {"enabled": True}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    data = batches(STEPS, 2)
    ref_losses, ref_state = reference_train(tiny_gpt(), data, dtype=dtype, clip=0.05)
    engine = infinity.initialize(tiny_gpt(), str(path))
    assert engine.compute_dtype == DTYPES[dtype] and engine.manager.stage == 3
    losses = engine_train(engine, data)
    assert engine.global_steps == STEPS
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, dtype)
    assert ref_losses[-1] < ref_losses[0] - 0.05, "the reference must actually learn"


# ---------------------------------------------------------------------------------------- fp16


def test_loss_scaler_dynamic_semantics():
    s = LossScaler(PrecisionConfig(dtype="fp16", initial_scale_power=4, loss_scale_window=2,
                                   hysteresis=2, min_loss_scale=2.0))
    assert s.scale == 16.0
    s.update(True)           # absorbed by hysteresis
    assert s.scale == 16.0
    s.update(True)           # hysteresis exhausted: halve
    assert s.scale == 8.0
    s.update(False)
    s.update(False)          # a window without overflow: double, hysteresis restored
    assert s.scale == 16.0
    for _ in range(4):
        s.update(True)
    assert s.scale == 2.0    # 16 -(absorbed)-> 16 -> 8 -> 4 -> 2, and never below min_loss_scale
    s.update(True)
    assert s.scale == 2.0


def test_fp16_overflow_skips_step_and_lowers_scale():
    engine = infinity.initialize(tiny_gpt(), engine_config(
        stage=3, dtype="fp16", precision={"initial_scale_power": 10, "hysteresis": 1}))
    before = engine.full_state_dict()
    x, y = batches(1, 1)[0][0]
    loss = engine(x, y)
    engine.backward(loss * float("inf"))
    engine.step()
    assert engine.skipped_steps == 1 and engine.loss_scale == 512.0
    after = engine.full_state_dict()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    engine.backward(engine(x, y))   # the next step is taken
    engine.step()
    assert engine.skipped_steps == 1
    assert any(not torch.equal(before[k], engine.full_state_dict()[k]) for k in before)


# ---------------------------------------------------------------------------------------- errors


def test_step_before_backward_is_an_error():
    engine = infinity.initialize(tiny_gpt(), engine_config(stage=3))
    with pytest.raises(RuntimeError, match="without engine.backward"):
        engine.step()


def test_model_wrapped_twice_is_an_error():
    model = tiny_gpt()
    infinity.initialize(model, engine_config(stage=3))
    with pytest.raises(ValueError, match="already managed"):
        infinity.initialize(model, engine_config(stage=3))
    with pytest.raises(ValueError, match="already managed"):
        infinity.initialize(model.blocks[0], engine_config(stage=3))


def test_unwritable_nvme_path_is_an_error_before_any_state_changes(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    model = tiny_gpt()
    ids = [id(p.untyped_storage()) for p in model.parameters()]
    cfg = engine_config(stage=3, offload_optimizer={"device": "nvme",
                                                    "nvme_path": str(blocker / "swap")})
    with pytest.raises(ValueError, match="offload_optimizer.nvme_path"):
        infinity.initialize(model, cfg)
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    assert len(ids) == len(list(model.parameters()))
    infinity.initialize(model, engine_config(stage=3))  # the model was not marked as wrapped


def test_bad_config_is_rejected_with_the_field_named():
    with pytest.raises(ValueError, match="zero_optimization.stage"):
        infinity.initialize(tiny_gpt(), {"zero": {"stage": 4}})
    with pytest.raises(ValueError, match="did you mean"):
        infinity.initialize(tiny_gpt(), {"zero": {"stagee": 3}})


def test_backward_of_a_no_grad_loss_is_an_error():
    engine = infinity.initialize(tiny_gpt(), engine_config(stage=3))
    x, y = batches(1, 1)[0][0]
    with torch.no_grad():
        loss = engine(x, y)
    with pytest.raises(ValueError, match="does not require grad"):
        engine.backward(loss)


def test_stats_report_bytes_per_tier():
    engine = infinity.initialize(tiny_gpt(), engine_config(stage=3))
    engine_train(engine, batches(2, 1))
    stats = engine.stats()
    assert stats["bytes"]["DEVICE"]["current"] > 0
    assert stats["bytes"]["DEVICE"]["peak"] >= stats["bytes"]["DEVICE"]["current"]
    assert "stall_s" in stats and "bytes_moved" in stats
    # fp32 AdamW: master is the parameter shard; two fp32 moments per element.
    numel = sum(g.padded_numel for g in engine.manager.trainable_groups())
    assert stats["model_state_bytes"]["optimizer_state"] == 2 * 4 * numel


def test_meta_and_integer_parameters_are_rejected_before_any_change():
    with torch.device("meta"):
        meta = tiny_gpt()
    with pytest.raises(ValueError, match="meta device"):
        infinity.initialize(meta, engine_config(stage=3))
    model = tiny_gpt()
    model.register_parameter("count", torch.nn.Parameter(torch.zeros(3, dtype=torch.int64),
                                                         requires_grad=False))
    before = {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="only floating-point"):
        infinity.initialize(model, engine_config(stage=3, persistence_threshold_numel=0))
    assert before == {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()}
