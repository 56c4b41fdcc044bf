"""The parameter manager: choosing units, release semantics, and the cases where ZeRO-3
implementations break (each trained against plain PyTorch with the same data)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import infinity
from infinity.zero._param_manager import UnitState
from infinity.zero._unit_choice import choose_units
from tests._support.engine import (assert_close_run, assert_parity, batches, engine_config,
                                   engine_train, lora_like, reference_train, tiny_gpt)
from tests._support.models import BatchNormNet, SometimesGPT

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 6


def _parity(make_model, **kwargs):
    return assert_parity(make_model, steps=STEPS, **kwargs)[0]


# ---------------------------------------------------------------------------------------- units


def test_units_by_class_name_persistent_and_root_leftovers():
    model = tiny_gpt()
    plan = choose_units(model, unit_class_names=("Block",), unit_min_numel=1,
                      persistence_threshold_numel=40)
    names = [u.name for u in plan.units]
    assert names == ["<persistent>", "<root>", "blocks.0", "blocks.1"]
    persistent = {n for n, _ in plan.units[0].params}
    assert all(p.numel() < 40 for _, p in plan.units[0].params)
    assert "blocks.0.ln_1.weight" in persistent
    root = {n for n, _ in plan.units[1].params}
    assert root == {"wte.weight", "wpe.weight"}  # lm_head.weight is the same tensor as wte.weight
    every = [id(p) for u in plan.units for _, p in u.params]
    assert len(every) == len(set(every)) == len(list(model.parameters()))


def test_units_by_size_skip_containers_and_tied_head_borrows_the_embedding():
    model = tiny_gpt()
    plan = choose_units(model, unit_min_numel=500, persistence_threshold_numel=40)
    names = [u.name for u in plan.units]
    assert "blocks" not in names  # a ModuleList never runs, so it cannot be a unit
    assert "wte" in names and "lm_head" not in names
    hooked = {name: [plan.units[i].name for i in idx] for _, name, idx in plan.hooked}
    assert hooked["lm_head"] == ["wte"]


def test_release_keeps_parameter_identity_and_shape():
    model = tiny_gpt()
    params_before = {n: (p, p.shape) for n, p in model.named_parameters()}
    engine = infinity.initialize(model, engine_config(stage=3))
    block_unit = next(u for u in engine.manager.units if u.name == "blocks.0")
    assert block_unit.state is UnitState.RELEASED
    weight = model.blocks[0].attn.qkv.weight
    assert weight.untyped_storage().nbytes() == 0 and weight.shape == (48, 16)
    seen = {}
    def probe(module, args):  # runs after the manager's pre-forward hook
        seen["bytes"] = module.attn.qkv.weight.untyped_storage().nbytes()

    model.blocks[0].register_forward_pre_hook(probe)
    engine_train(engine, batches(1, 1))
    assert seen["bytes"] > 0                      # gathered while the block ran
    assert weight.untyped_storage().nbytes() == 0  # released after forward and backward
    for n, p in model.named_parameters():
        assert p is params_before[n][0] and p.shape == params_before[n][1], n
        assert p.grad is None


def test_at_most_a_few_units_are_gathered_at_once():
    """Units are released after their forward and after their backward: with 4 blocks, never
    more than the root (embeddings, used first and last), the current block and the next."""
    from infinity.models.gpt import GPTConfig

    config = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=16)
    engine = infinity.initialize(tiny_gpt(config=config), engine_config(stage=3))
    manager, live = engine.manager, []
    original = manager.storage.wait_gather  # where an issued gather lands: the unit is GATHERED

    def counting_gather(unit):
        landing = unit.state is UnitState.GATHERING
        original(unit)
        if landing:
            live.append(sum(u.state is not UnitState.RELEASED and not u.always_gathered
                            for u in manager.units))

    manager.storage.wait_gather = counting_gather
    engine_train(engine, batches(2, 1, config=config))
    assert len(live) >= 2 * 2 * 5  # every unit gathered in forward and again in backward
    assert max(live) <= 3, live


# ---------------------------------------------------------------------------------------- edge cases


class TwiceGPT(nn.Module):
    """Block 0 runs twice in one forward (weight sharing across depth)."""

    def __init__(self):
        super().__init__()
        self.gpt = tiny_gpt()

    def forward(self, idx, targets):
        g = self.gpt
        x = g.wte(idx) + g.wpe(torch.arange(idx.shape[1]))
        x = g.blocks[1](g.blocks[0](g.blocks[0](x)))
        logits = g.lm_head(g.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@pytest.mark.parametrize("stage", [1, 3])
def test_module_called_twice_in_one_forward(stage):
    _parity(TwiceGPT, stage=stage, gas=2)


class OutsideUseGPT(nn.Module):
    """The root forward reads block 1's MLP weight directly (``F.linear(x, other.weight)``)."""

    def __init__(self):
        super().__init__()
        self.gpt = tiny_gpt()

    def forward(self, idx, targets):
        g = self.gpt
        x = g.wte(idx) + g.wpe(torch.arange(idx.shape[1]))
        for block in g.blocks:
            x = block(x)
        x = x + 0.1 * F.linear(F.linear(x, g.blocks[1].mlp.fc.weight), g.blocks[1].mlp.proj.weight)
        logits = g.lm_head(g.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def test_parameter_used_outside_its_module_is_kept_gathered():
    with pytest.warns(UserWarning, match="outside the modules that hold it"):
        engine = _parity(OutsideUseGPT)
    unit = next(u for u in engine.manager.units if u.name == "gpt.blocks.1")
    assert unit.always_gathered and unit.state is UnitState.GATHERED


@pytest.mark.parametrize("stage", [2, 3])
def test_frozen_parameters_stay_unchanged_and_units_are_released(stage):
    engine = _parity(lora_like, stage=stage, gas=2)
    frozen = {n: p.detach().clone() for n, p in lora_like().named_parameters()
              if not p.requires_grad}
    state = engine.full_state_dict()
    for name, value in frozen.items():
        assert torch.equal(state[name], value), name
    for unit in engine.manager.units:
        if not unit.always_gathered:
            assert unit.state is UnitState.RELEASED, unit.name


def test_frozen_parameters_with_activation_checkpointing():
    _parity(lambda: CheckpointedGPT(lora_like()))


class CheckpointedGPT(nn.Module):
    """Every block under non-reentrant activation checkpointing."""

    def __init__(self, gpt=None):
        super().__init__()
        self.gpt = gpt if gpt is not None else tiny_gpt()

    def forward(self, idx, targets):
        g = self.gpt
        x = g.wte(idx) + g.wpe(torch.arange(idx.shape[1]))
        for block in g.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = g.lm_head(g.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_activation_checkpointing_non_reentrant(dtype):
    _parity(CheckpointedGPT, dtype=dtype, gas=2)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_parameters_unused_in_some_steps(stage):
    _parity(SometimesGPT, stage=stage, unit_class_names=("Block",))


@dataclasses.dataclass
class Output:
    loss: torch.Tensor
    extras: dict


class DictBlock(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return {"hidden": self.block(x), "aux": [x.mean()]}


class DictGPT(nn.Module):
    """Units return dicts; the model returns a dataclass (hooks must find tensors inside)."""

    def __init__(self):
        super().__init__()
        self.gpt = tiny_gpt()
        self.wrapped = nn.ModuleList(DictBlock(b) for b in self.gpt.blocks)

    def forward(self, idx, targets):
        g = self.gpt
        x = g.wte(idx) + g.wpe(torch.arange(idx.shape[1]))
        for block in self.wrapped:
            x = block(x)["hidden"]
        logits = g.lm_head(g.ln_f(x))
        return Output(loss=F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)),
                      extras={"logits": logits})


def test_outputs_in_dicts_and_dataclasses():
    _parity(DictGPT, unit_class_names=("DictBlock",), loss_fn=lambda m, b: m(*b).loss)


def test_buffers_batchnorm_running_stats():
    engine = _parity(BatchNormNet, unit_class_names=("Linear",))
    assert engine.full_state_dict()["body.1.num_batches_tracked"].item() == STEPS


def test_no_grad_generate_loop_between_steps_matches_plain_model():
    engine = infinity.initialize(tiny_gpt(), engine_config(stage=3))
    plain = tiny_gpt()
    for step, micro in enumerate(batches(3, 1)):
        engine_train(engine, [micro])
        plain.load_state_dict(engine.full_state_dict())
        engine.module.eval()
        plain.eval()
        prompt = micro[0][0][:2, :4]
        with torch.no_grad():
            ours, ref = prompt, prompt
            for _ in range(4):  # greedy decoding, one token at a time
                ours = torch.cat([ours, engine(ours)[:, -1:].argmax(-1)], dim=1)
                ref = torch.cat([ref, plain(ref)[:, -1:].argmax(-1)], dim=1)
            torch.testing.assert_close(engine(ours), plain(ours), atol=1e-5, rtol=0)
        assert torch.equal(ours, ref)
        engine.module.train()
    assert all(u.state is UnitState.RELEASED for u in engine.manager.units
               if not u.always_gathered)


def test_eval_forward_does_not_change_training():
    """A no_grad forward between steps leaves the training trajectory unchanged."""
    data = batches(STEPS, 1)
    ref_losses, ref_state = reference_train(tiny_gpt(), data)
    engine = infinity.initialize(tiny_gpt(), engine_config(stage=3))
    losses = []
    for micro in data:
        losses += engine_train(engine, [micro])
        with torch.no_grad():
            engine(micro[0][0])
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")


def test_warnings_are_not_raised_for_plain_models():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _parity(tiny_gpt, unit_class_names=("Block",))


def test_outside_use_first_seen_after_the_traced_step_is_a_clear_error():
    model = OutsideUseGPT()
    calls = {"n": 0}
    plain_forward = model.forward

    def forward(idx, targets):
        calls["n"] += 1
        if calls["n"] < 3:  # the traced first forward does not use the weight outside
            g = model.gpt
            return g(idx, targets)
        return plain_forward(idx, targets)

    model.forward = forward
    engine = infinity.initialize(model, engine_config(stage=3))
    data = batches(3, 1)
    engine_train(engine, data[:2])
    with pytest.raises(RuntimeError, match="parameter of a released unit was read"):
        engine_train(engine, data[2:])


@pytest.mark.parametrize("stage", [2, 3])
def test_module_state_dict_between_steps_refuses_released_parameters(stage):
    """Stage 3: a released parameter's storage holds 0 bytes, so module.state_dict() raises a
    clear error (reading such a view would crash the process) instead of handing it out; the
    engine's own lookups (keep_vars=True) and stages 0-2 keep working, with the engine's values."""
    model = tiny_gpt(0)
    engine = infinity.initialize(model, engine_config(stage=stage))
    x, y = batches(1, 1)[0][0]
    engine.backward(engine(x, y))
    engine.step()
    assert set(model.state_dict(keep_vars=True)) == set(engine.full_state_dict())
    if stage == 3:
        with pytest.raises(RuntimeError, match=r"wte\.weight.*engine\.full_state_dict\(\)"):
            model.state_dict()
        with pytest.raises(RuntimeError, match="attn"):
            model.blocks[0].state_dict()
    else:
        full = engine.full_state_dict()
        for k, v in model.state_dict().items():
            assert torch.equal(v, full[k]), k
    engine.close()


def test_training_goes_on_after_a_forward_and_a_backward_that_raised():
    """A forward interrupted (KeyboardInterrupt in a block, as from a notebook) and a backward
    that raised before any gradient reached a parameter leave the manager IDLE; training then
    matches plain PyTorch on the batches that did train, and releases every unit as usual."""
    from infinity.zero._training_state import TrainingState

    data = batches(STEPS, 1)
    ref_losses, ref_state = reference_train(tiny_gpt(), data)
    engine = infinity.initialize(tiny_gpt(), engine_config(stage=3))
    block = engine.module.blocks[1]
    real_forward = block.forward

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    block.forward = interrupted
    x, y = data[0][0]
    with pytest.raises(KeyboardInterrupt):
        engine(x, y)
    block.forward = real_forward
    loss = engine(x, y)

    def failing(grad):
        raise RuntimeError("injected backward failure")

    loss.register_hook(failing)
    with pytest.raises(RuntimeError, match="injected backward failure"):
        engine.backward(loss)
    assert engine.manager.state is TrainingState.IDLE
    losses = engine_train(engine, data)
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    assert all(u.state is UnitState.RELEASED for u in engine.manager.units
               if not u.always_gathered)
