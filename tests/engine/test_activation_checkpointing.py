"""Activation checkpointing chosen by the engine (``activation_checkpointing`` section).

Checked against independent references: plain PyTorch + torch.optim.AdamW training of the same model
without checkpointing (parity), forward calls of a module inside each checkpointed block (2 per step
with recomputation, 1 without), and the bytes autograd saves, counted by a saved-tensors hook of
the test's own (only the blocks' inputs are kept with checkpointing: b*s*h elements per block).
"""

from __future__ import annotations

import copy

import pytest
import torch

import infinity
from infinity.config import ActivationCheckpointingConfig, InfinityConfig, load_config
from infinity.zero._activations import apply_activation_checkpointing, select_modules
from tests._support.engine import (TINY, assert_close_run, batches, engine_config, engine_train,
                                   reference_train, tiny_gpt)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 5
BATCH, SEQ = 8, 16


def _count_block_calls(model) -> list[int]:
    """Forward calls of the first layer of each block's MLP (inside every checkpointed region
    tested here): its hook fires in the forward and in any recompute."""
    calls = [0]

    def hook(module, args):
        calls[0] += 1

    for block in model.blocks:
        block.mlp.fc.register_forward_pre_hook(hook)
    return calls


def _ckpt(units, offload=False) -> dict:
    return {"activation_checkpointing": {"units": units, "offload_to_host": offload}}


@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "offload"])
@pytest.mark.parametrize("units", ["all", ["Block"]], ids=["all", "by-class"])
@pytest.mark.parametrize("stage", [0, 3])
def test_parity_and_recompute(stage, units, offload):
    data = batches(STEPS, 1)
    ref_losses, ref_state = reference_train(tiny_gpt(), data)
    model = tiny_gpt()
    calls = _count_block_calls(model)
    engine = infinity.initialize(model, engine_config(stage=stage, **_ckpt(units, offload)))
    losses = engine_train(engine, data)
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    # forward + recompute in backward, for every block, every step
    assert calls[0] == 2 * STEPS * TINY.n_layer
    assert set(engine.module.state_dict(keep_vars=True)) == set(tiny_gpt().state_dict())
    engine.close()


def test_without_checkpointing_each_block_runs_once():
    model = tiny_gpt()
    calls = _count_block_calls(model)
    engine = infinity.initialize(model, engine_config(stage=3))
    engine_train(engine, batches(2, 1))
    assert calls[0] == 2 * TINY.n_layer
    engine.close()


class _SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes autograd saves, split by whether a block's forward was running."""

    def __init__(self, model):
        self.inside, self.outside, self.inside_shapes = 0, 0, []
        self._depth = 0
        for block in model.blocks:
            block.register_forward_pre_hook(lambda m, a: self._enter())
            block.register_forward_hook(lambda m, a, o: self._leave())
        super().__init__(self._pack, lambda x: x)

    def _enter(self):
        self._depth += 1

    def _leave(self):
        self._depth -= 1

    def _pack(self, t):
        if isinstance(t, torch.nn.Parameter) or t._base is not None and isinstance(
                t._base, torch.nn.Parameter):
            return t  # parameters are model state, not activations
        nbytes = t.numel() * t.element_size()
        if self._depth:
            self.inside += nbytes
            self.inside_shapes.append(tuple(t.shape))
        else:
            self.outside += nbytes
        return t


def _saved_bytes(cfg: dict, stage: int = 3) -> "_SavedBytes":
    model = tiny_gpt()
    engine = infinity.initialize(model, engine_config(stage=stage, **cfg))
    idx, targets = batches(1, 1, batch_size=BATCH, seq_len=SEQ)[0][0]
    counter = _SavedBytes(model)
    with counter:
        loss = engine(idx, targets)
    engine.backward(loss)
    engine.close()
    return counter


def test_checkpointing_keeps_only_the_block_inputs():
    plain = _saved_bytes({})
    ckpt = _saved_bytes(_ckpt(["Block"]))
    block_input_bytes = BATCH * SEQ * TINY.n_embd * 4  # fp32: the residual stream entering a block
    assert ckpt.inside == TINY.n_layer * block_input_bytes
    assert ckpt.inside_shapes == [(BATCH, SEQ, TINY.n_embd)] * TINY.n_layer
    assert plain.inside > 5 * ckpt.inside  # the blocks' activations that are no longer kept
    assert ckpt.outside == plain.outside  # embeddings, head and loss are not checkpointed


def test_offload_sends_the_block_inputs_to_host(monkeypatch):
    # [Note: activations on the host] in infinity/zero/_activations.py: the engine's own saved-tensor
    # hooks (torch's save_on_cpu before them) see exactly the blocks' inputs, once each way.
    from infinity.zero._activations import HostActivations

    real_pack, real_unpack = HostActivations.pack, HostActivations.unpack
    packed, unpacked = [], []

    def pack(self, t):
        out = real_pack(self, t)
        packed.append(out if isinstance(out, torch.Tensor) else out.tensor)
        return out

    def unpack(p):
        unpacked.append(p)
        return real_unpack(p)

    monkeypatch.setattr(HostActivations, "pack", pack)
    monkeypatch.setattr(HostActivations, "unpack", staticmethod(unpack))
    ckpt = _saved_bytes(_ckpt(["Block"], offload=True))
    assert ckpt.inside == 0  # nothing of the blocks is saved by the test's (outer) hook any more
    assert [tuple(t.shape) for t in packed] == [(BATCH, SEQ, TINY.n_embd)] * TINY.n_layer
    assert all(t.device.type == "cpu" for t in packed)
    assert len(unpacked) == TINY.n_layer  # each came back once for its block's recompute


def test_no_grad_forward_is_unchanged():
    model = tiny_gpt()
    reference = tiny_gpt()
    calls = _count_block_calls(model)
    engine = infinity.initialize(model, engine_config(stage=3, **_ckpt("all", offload=True)))
    idx, _ = batches(1, 1)[0][0]
    with torch.no_grad():
        got = engine(idx)
        want = reference(idx)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert calls[0] == TINY.n_layer
    engine.close()


@pytest.mark.parametrize("units", ["all", ["Block"]], ids=["all", "blocks-around-units"])
def test_parity_with_units_by_size(units):
    """Units by size (each block's MLP is one): 'all' checkpoints those units; ['Block'] puts a
    unit inside each checkpointed region, whose hooks then also fire in the recompute."""
    data = batches(STEPS, 1)
    ref_losses, ref_state = reference_train(tiny_gpt(), data)
    model = tiny_gpt()
    calls = _count_block_calls(model)
    cfg = engine_config(stage=3, unit_class_names=(), unit_min_numel=2000, **_ckpt(units))
    engine = infinity.initialize(model, cfg)
    losses = engine_train(engine, data)
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    assert calls[0] == 2 * STEPS * TINY.n_layer
    assert all(u.users == 0 for u in engine.manager.units)  # every gather was released
    engine.close()


def test_all_follows_the_units_chosen_by_size():
    """units='all' with units by size: the modules the parameter manager made units of."""
    model = tiny_gpt()
    cfg = engine_config(stage=3, unit_class_names=(), unit_min_numel=2000, **_ckpt("all"))
    engine = infinity.initialize(model, cfg)
    unit_names = {u.name for u in engine.manager.units}
    assert engine.activations.names and set(engine.activations.names) <= unit_names
    for name in engine.activations.names:
        assert sum(p.numel() for p in model.get_submodule(name).parameters()) >= 2000
    engine.close()


def test_remove_restores_forward_and_deepcopy_rebinds():
    model = tiny_gpt()
    handle = apply_activation_checkpointing(model, ActivationCheckpointingConfig(units=("Block",)))
    assert handle.names == ["blocks.0", "blocks.1"]
    clone = copy.deepcopy(model)
    calls_clone = _count_block_calls(clone)
    calls_model = _count_block_calls(model)
    idx, targets = batches(1, 1)[0][0]
    clone(idx, targets).backward()
    assert calls_clone[0] == 2 * TINY.n_layer and calls_model[0] == 0  # the copy runs itself
    with pytest.raises(ValueError, match="'blocks.0' is already checkpointed"):
        apply_activation_checkpointing(model, ActivationCheckpointingConfig(units="all"),
                                       unit_module_names=["blocks.0"])
    handle.remove()
    assert "forward" not in model.blocks[0].__dict__
    model(idx, targets).backward()
    assert calls_model[0] == TINY.n_layer


def test_unknown_class_name_fails_before_any_state_with_a_suggestion():
    model = tiny_gpt()
    with pytest.raises(ValueError,
                       match=r"activation_checkpointing.units.*'Blok'.*did you mean 'Block'"):
        infinity.initialize(model, engine_config(stage=3, **_ckpt(["Blok"])))
    assert not model.blocks[0]._forward_pre_hooks  # the parameter manager was never built
    assert select_modules(model, ActivationCheckpointingConfig()) == []


@pytest.mark.parametrize("section, match", [
    ({"units": "some"}, r"activation_checkpointing.units: expected one of 'none', 'all'"),
    ({"units": []}, r"activation_checkpointing.units: expected 'none', 'all' or a non-empty list"),
    ({"units": ["Block", 3]}, r"activation_checkpointing.units"),
    ({"offload_to_host": "yes", "units": "all"}, r"activation_checkpointing.offload_to_host: "
                                                 r"expected true or false"),
    ({"offload_to_host": True}, r"activation_checkpointing.offload_to_host: .*units"),
    ({"unit": "all"}, r"activation_checkpointing.unit'.*did you mean 'units'"),
    ({"cpu_checkpointing": True}, r"activation_checkpointing.cpu_checkpointing' belongs to "
                                  r"DeepSpeed.*'offload' \('host': DeepSpeed's cpu_checkpointing"),
])
def test_config_errors_name_the_field(section, match):
    with pytest.raises(ValueError, match=match):
        load_config({"activation_checkpointing": section})


def test_config_round_trip_and_default():
    assert InfinityConfig().activation_checkpointing.units == "none"
    cfg = load_config({"activation_checkpointing": {"units": ["Block"], "offload_to_host": True}})
    assert cfg.activation_checkpointing == ActivationCheckpointingConfig(units=("Block",),
                                                                         offload_to_host=True)
    assert cfg.to_dict()["activation_checkpointing"] == {"units": ["Block"], "offload_to_host": True,
                                                         "offload": "none", "nvme_path": None}
    assert cfg.activation_checkpointing.offload_tier == "host"
    assert load_config(cfg.to_dict()) == cfg


def test_deepspeed_section_is_ignored_pointing_at_the_native_one():
    """DeepSpeed's section configures deepspeed.checkpointing, which a model calls itself: a
    config that has it runs (as under DeepSpeed with a model that does not call that API), with
    one warning naming the native section, and checkpoints nothing."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config({"zero_optimization": {"stage": 3},
                           "activation_checkpointing": {"partition_activations": True,
                                                        "cpu_checkpointing": True,
                                                        "contiguous_memory_optimization": True}})
    assert cfg.activation_checkpointing == ActivationCheckpointingConfig()
    warned = [str(w.message) for w in caught if "activation_checkpointing" in str(w.message)]
    assert len(warned) == 1 and "native 'activation_checkpointing' section" in warned[0], warned


@pytest.mark.parametrize("gas", [1, 2])
def test_parity_with_parameters_and_optimizer_on_nvme(tmp_path, gas):
    """Checkpointing beside parameter offload and the trace-driven prefetcher: the recompute reads
    the parameters the backward gathered, whichever tier they came from."""
    data = batches(STEPS, gas)
    ref_losses, ref_state = reference_train(tiny_gpt(), data)
    model = tiny_gpt()
    calls = _count_block_calls(model)
    path = str(tmp_path / "swap")
    cfg = engine_config(stage=3, gas=gas, offload_optimizer={"device": "nvme", "nvme_path": path},
                        offload_param={"device": "nvme", "nvme_path": path},
                        zero={"sub_group_numel": 300}, **_ckpt("all", offload=True))
    engine = infinity.initialize(model, cfg)
    losses = engine_train(engine, data)
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    assert calls[0] == 2 * STEPS * gas * TINY.n_layer
    engine.close()
