"""[Note: staging in the accumulator's dtype] (infinity/ledger/_estimate.py): a unit's gradient
is staged in the host accumulator's compute dtype where nothing is summed in fp32 (optimizer
offloaded, one micro-batch, one rank), in fp32 elsewhere; training is bitwise what the fp32
staging gave, and the ledger's and the 'auto' device budget's staging terms follow the engine."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import infinity
from infinity.ledger import estimate_from_config
from infinity.tiers import Tier
from infinity.zero import least_host_budget_bytes
from infinity.zero._grad_reducer import GradientReducer
from infinity.zero._offload import device_working_set, offload_inputs
from infinity.zero._unit_choice import units_of
from tests._support.engine import (TINY, assert_close_run, batches, engine_train, offload_config,
                                   reference_train, tiny_gpt)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


DEEP = dataclasses.replace(TINY, n_layer=6)
"""Deep enough that, at the least host budget, the accumulators are stored slices on NVMe."""


def _train(config, data, monkeypatch, *, force_fp32: bool = False, model_config=TINY):
    """Train; the dtypes of the staging buffers the reducer made, the losses and final state."""
    made = []
    real = GradientReducer._new_staging

    def new_staging(self, g):
        staging = real(self, g)
        made.append(staging.dtype)
        return staging

    with monkeypatch.context() as m:
        m.setattr(GradientReducer, "_new_staging", new_staging)
        if force_fp32:  # the staging before this change, as the bitwise reference
            m.setattr(GradientReducer, "staging_dtype", property(lambda self: torch.float32))
        engine = infinity.initialize(tiny_gpt(config=model_config), config)
        try:
            losses = engine_train(engine, data)
            state = engine.full_state_dict()
            assert engine.stats()["grads_on_nvme"] == (model_config is DEEP)
        finally:
            engine.close()
    return set(made), losses, state


def test_bf16_staging_of_gradients_on_nvme_trains_bitwise_as_fp32_staging(tmp_path, monkeypatch):
    """At one rank on the CPU, host accumulators are staged in place already (the reducer's
    ``_stages_in_host``); stored gradient slices are where a staging buffer is made."""
    data = batches(3, 1)
    config = offload_config(tmp_path, stage=3, dtype="bf16", opt="nvme", param="nvme")
    config["memory"]["host_budget_bytes"] = least_host_budget_bytes(
        tiny_gpt(config=DEEP), infinity.load_config(config))
    dtypes, losses, state = _train(config, data, monkeypatch, model_config=DEEP)
    ref_dtypes, ref_losses, ref_state = _train(config, data, monkeypatch, force_fp32=True,
                                               model_config=DEEP)
    assert dtypes == {torch.bfloat16} and ref_dtypes == {torch.float32}
    assert losses == ref_losses
    for name, want in ref_state.items():
        assert torch.equal(state[name], want), name
    # and both are plain PyTorch's bf16 training
    plain_losses, plain_state = reference_train(tiny_gpt(config=DEEP), data, dtype="bf16")
    assert_close_run(losses, state, plain_losses, plain_state, "bf16")


@pytest.mark.parametrize("case", ["two-micro-batches", "fp32", "optimizer-on-device"])
def test_fp32_staging_where_fp32_sums_are_kept(tmp_path, monkeypatch, case):
    gas = 2 if case == "two-micro-batches" else 1
    dtype = "fp32" if case == "fp32" else "bf16"
    opt = "none" if case == "optimizer-on-device" else "cpu"
    config = offload_config(tmp_path, stage=3, dtype=dtype, gas=gas, opt=opt, param="none")
    dtypes, _, _ = _train(config, batches(2, gas), monkeypatch)
    assert dtypes == {torch.float32}


@pytest.mark.parametrize("gas, opt, qgz, per_element",
                         [(1, "nvme", False, 2), (2, "nvme", False, 4), (1, "none", False, 4),
                          (1, "nvme", True, 4)])  # qgZ's quantizer reads fp32 staging
def test_the_ledger_and_the_device_working_set_stage_as_the_engine(tmp_path, gas, opt, qgz,
                                                                      per_element):
    model = tiny_gpt()
    raw = offload_config(tmp_path, stage=3, dtype="bf16", gas=gas, opt=opt, param="nvme")
    raw["zero"]["quantized_gradients"] = qgz
    config = infinity.load_config(raw)
    unit = 1_000_000
    ledger = estimate_from_config(config, 10 * unit, 1, unit_numel=unit)
    assert ledger.buffers[Tier.DEVICE]["unit_gradient"] == unit * per_element
    engine = infinity.initialize(model, config)
    try:
        groups = [g for u in engine.manager.units for g in u.groups if g.requires_grad]
        # what a staging buffer is made in (at one rank a CPU engine stages in the accumulator)
        staged = engine.manager.reducer.staging_dtype
    finally:
        engine.close()
    assert staged.itemsize == per_element
    working = device_working_set(units_of(tiny_gpt(), config.zero),
                                 offload_inputs(config, world_size=1, device=torch.device("cpu")))
    # the largest trainable group: its staging and its reduced shard (the whole of it at world 1)
    assert working.grad_bytes == max(2 * g.padded_numel for g in groups) * per_element
