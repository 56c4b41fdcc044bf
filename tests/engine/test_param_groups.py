"""Parameter groups (``initialize(model, config, model_parameters=groups)``): per-segment
hyperparameters on the flat shards ([Note: runs of a flat partition] in infinity/optim/_runs.py)
against ``torch.optim.AdamW`` with the same groups, at stage 0 and 3, in memory and offloaded to
CPU and NVMe; one kernel call per key or sub-group with one group; bad groups are errors naming
the parameter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import infinity
import infinity.optim._runs as runs_module
from tests._support.engine import (LR, assert_close_state, batches, engine_config, engine_train,
                                   offload_config, reference_train, tiny_gpt)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 6


def hf_groups(model: nn.Module) -> list[dict]:
    """Hugging Face's rule (``Trainer.get_decay_parameter_names``): biases and norm weights take
    no weight decay; here the embeddings also get their own lr, betas and eps."""
    no_decay = {f"{m}.{n}" if m else n for m, mod in model.named_modules()
                for n, _ in mod.named_parameters(recurse=False)
                if isinstance(mod, nn.LayerNorm) or n == "bias"}
    decay, plain, embed = [], [], []
    for name, p in model.named_parameters():
        if name.startswith(("wte.", "wpe.")):
            embed.append(p)
        elif name in no_decay:
            plain.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": 0.1},
            {"params": plain, "weight_decay": 0.0},
            {"params": embed, "lr": LR / 3, "weight_decay": 0.05, "betas": (0.8, 0.99),
             "eps": 1e-6}]


def _config(tmp_path, stage: int, placement: str, gas: int = 1):
    # No persistent unit: biases and norms sit between the weights in the blocks' flat buffers,
    # so a shard holds many runs (and small sub-groups cut across them).
    if placement == "memory":
        return engine_config(stage=stage, gas=gas, persistence_threshold_numel=0)
    return offload_config(tmp_path / "swap", stage=stage, gas=gas, opt=placement,
                          param=placement if stage == 3 else "none", sub_group_numel=300,
                          zero={"persistence_threshold_numel": 0})


@pytest.mark.parametrize("placement", ["memory", "cpu", "nvme"])
@pytest.mark.parametrize("stage", [0, 3])
def test_groups_match_torch_adamw_with_the_same_groups(tmp_path, stage, placement):
    data = batches(STEPS, 2)
    ref_losses, ref_state = reference_train(tiny_gpt(), data, param_groups=hf_groups)
    model = tiny_gpt()
    engine = infinity.initialize(model, _config(tmp_path, stage, placement, gas=2),
                                 model_parameters=hf_groups(model))
    try:
        assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [0.1, 0.0, 0.05]
        losses = engine_train(engine, data)
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert_close_state(engine.full_state_dict(), ref_state, atol=2e-5)
    finally:
        engine.close()


@pytest.mark.parametrize("placement", ["memory", "nvme"])
def test_one_group_is_one_kernel_call_per_key_or_sub_group(tmp_path, monkeypatch, placement):
    engine = infinity.initialize(tiny_gpt(), _config(tmp_path, 3, placement))
    calls = []
    kernel_for = runs_module.adam_kernel_for

    def counting_kernel_for(device):
        kernel = kernel_for(device)

        def counted(*args, **kwargs):
            calls.append(args[0].numel())
            return kernel(*args, **kwargs)
        return counted

    monkeypatch.setattr(runs_module, "adam_kernel_for", counting_kernel_for)
    try:
        engine_train(engine, batches(1, 1))
        engine.shard_optimizer.drain()
        opt = engine.shard_optimizer
        if placement == "memory":
            expected = [opt.master_values(k).numel() for k in opt.keys()]
        else:
            expected = [sg.numel for k in opt.keys() for sg in opt.sub_groups(k)]
        assert sorted(calls) == sorted(expected)
    finally:
        engine.close()


def _expect_error(model_parameters, match, model=None):
    model = model or tiny_gpt()
    params = model_parameters(model) if callable(model_parameters) else model_parameters
    with pytest.raises(ValueError, match=match):
        infinity.initialize(model, engine_config(stage=3), model_parameters=params)


def test_bad_groups_are_errors_naming_the_parameter():
    def missing(m):
        return [{"params": [p for n, p in m.named_parameters() if n != "ln_f.bias"]}]

    _expect_error(missing, r"trainable parameter 'ln_f.bias' is in no group")

    def twice(m):
        return [{"params": list(m.parameters())}, {"params": [m.ln_f.weight]}]

    _expect_error(twice, r"'ln_f.weight' is in group 0 and in group 1")
    _expect_error(lambda m: [{"params": [torch.nn.Parameter(torch.zeros(3))]}],
                  r"not a parameter of the model")
    _expect_error(lambda m: [{"params": list(m.parameters()), "lr": -1.0}],
                  r"model_parameters\[0\]\['lr'\]")
    _expect_error(lambda m: [{"params": list(m.parameters()), "betas": (0.9, 1.5)}],
                  r"model_parameters\[0\]\['betas'\]")
    _expect_error(lambda m: [{"params": list(m.parameters()), "amsgrad": True}], r"amsgrad")
    _expect_error(lambda m: [{"params": set(m.parameters())}], r"a set has no fixed order")
    _expect_error(lambda m: [{"lr": 0.1}], r"needs a 'params' key")


def test_frozen_parameters_may_be_left_out_or_listed():
    model = tiny_gpt()
    model.ln_f.weight.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine = infinity.initialize(model, engine_config(stage=0), model_parameters=trainable)
    assert len(engine.optimizer.param_groups[0]["params"]) == len(trainable)
    model = tiny_gpt()
    model.ln_f.weight.requires_grad_(False)
    named = list(model.named_parameters())  # (name, parameter) pairs, as torch takes them
    engine = infinity.initialize(model, engine_config(stage=0),
                                 model_parameters=[{"params": named}])
    before = model.ln_f.weight.detach().clone()
    engine_train(engine, batches(2, 1))
    assert engine.optimizer.param_groups[0]["param_names"] == [n for n, _ in named]
    assert torch.equal(engine.full_state_dict()["ln_f.weight"], before)  # frozen: not stepped


def test_groups_of_a_model_built_under_infinity_init(tmp_path):
    """Groups taken from a model built under ``infinity.init`` (its placeholder parameters) follow
    the real parameters that replace them at initialize: the same run as from the eager model."""
    data = batches(3, 1)
    config = _config(tmp_path, 3, "memory")
    torch.manual_seed(0)
    with infinity.init(config):
        lazy = tiny_gpt()
    runs = []
    for model in (tiny_gpt(), lazy):
        engine = infinity.initialize(model, config, model_parameters=hf_groups(model))
        params = set(map(id, model.parameters()))
        assert all(id(p) in params for g in engine.optimizer.param_groups for p in g["params"])
        runs.append((engine_train(engine, data), engine.full_state_dict()))
    assert runs[0][0] == runs[1][0]
    assert_close_state(runs[1][1], runs[0][1], atol=0.0)
