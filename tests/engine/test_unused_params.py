"""Parameters without a gradient in a step are not updated, with their own step counts, as in
``torch.optim.AdamW`` ([Note: parameters without a gradient] in infinity/zero/_grad_presence.py):
part of a unit unused and a whole unit unused, with gradient accumulation, at stage 0 and 3, in
memory and offloaded to CPU and NVMe; the step counts survive a checkpoint."""

from __future__ import annotations

import pytest
import torch

import infinity
from tests._support.engine import (BETAS, EPS, LR, WD, assert_close_state, engine_config,
                                   offload_config)
from tests._support.sometimes import UNITS, Sometimes, batch, set_use

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS, GAS = 7, 2


def pattern(step: int, micro: int) -> tuple[tuple[str, ...], bool]:
    """x every micro-batch; y in the first micro-batch of every third step (a gradient in the
    window: updated), else not; z never; the extra Linear (its own unit) every other step."""
    experts = ("x", "y") if step % 3 == 0 and micro == 0 else ("x",)
    return experts, step % 2 == 0


def _reference(steps=range(STEPS)):
    model = Sometimes()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = []
    for t in steps:
        total = 0.0
        for m in range(GAS):
            set_use(model, *pattern(t, m))
            loss = model(*batch(t, m)) / GAS
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    steps = {n: int(opt.state[p]["step"]) if p in opt.state else 0
             for n, p in model.named_parameters()}
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, steps


def _train(engine, steps=range(STEPS)):
    losses = []
    for t in steps:
        total = 0.0
        for m in range(GAS):
            set_use(engine.module, *pattern(t, m))
            loss = engine(*batch(t, m))
            engine.backward(loss)
            engine.step()
            total += loss.item() / GAS
        losses.append(total)
    return losses


def _config(tmp_path, stage, placement):
    if placement == "memory":
        return engine_config(stage=stage, gas=GAS, **UNITS)
    units = dict(UNITS)
    return offload_config(tmp_path / "swap", stage=stage, gas=GAS, opt=placement,
                          param=placement if stage == 3 else "none", sub_group_numel=200,
                          zero={"unit_class_names": list(units.pop("unit_class_names")),
                                **units})


@pytest.mark.parametrize("placement", ["memory", "cpu", "nvme"])
@pytest.mark.parametrize("stage", [0, 3])
def test_unused_parameters_are_skipped_as_in_torch(tmp_path, stage, placement):
    ref_losses, ref_state, ref_steps = _reference()
    model = Sometimes()
    initial_z = model.experts.z.weight.detach().clone()
    engine = infinity.initialize(model, _config(tmp_path, stage, placement))
    try:
        losses = _train(engine)
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        state = engine.full_state_dict()
        assert_close_state(state, ref_state, atol=2e-5)
        assert torch.equal(state["experts.z.weight"], initial_z)  # never a gradient: untouched
        got_steps = {n: engine.optimizer.step_of(p) for n, p in model.named_parameters()}
        assert got_steps == ref_steps
        assert got_steps["experts.y.weight"] == 3 and got_steps["extra.weight"] == 4
    finally:
        engine.close()


def test_step_counts_survive_a_checkpoint(tmp_path):
    """Save after 3 steps, resume in a fresh engine: the same as uninterrupted (the bias
    correction of each parameter goes on from its own step count)."""
    ref_losses, ref_state, _ = _reference()
    engine = infinity.initialize(Sometimes(), engine_config(stage=3, gas=GAS, **UNITS))
    first = _train(engine, range(3))
    engine.save_checkpoint(tmp_path / "ckpt")
    resumed = infinity.initialize(Sometimes(seed=5), engine_config(stage=3, gas=GAS, **UNITS))
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.optimizer.step_of(resumed.module.experts.y.weight) == 1
    assert resumed.optimizer.step_of(resumed.module.experts.x.weight) == 3
    rest = _train(resumed, range(3, STEPS))
    assert first + rest == pytest.approx(ref_losses, abs=1e-5)
    assert_close_state(resumed.full_state_dict(), ref_state, atol=2e-5)


def test_deferred_step_with_groups_and_skips_is_bitwise_the_step_in_place(tmp_path, slow_reads):
    """bf16, parameters and optimizer on NVMe, parameter groups and skipped parameters (runs that
    leave parts of a shard untouched, so the shard is read before it is written): the deferred
    step gives the same bits as the step run in place ([Note: deferred optimizer step])."""
    results = []
    for defer in (False, True):
        model = Sometimes()
        groups = [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")],
                   "weight_decay": 0.1},
                  {"params": [p for n, p in model.named_parameters() if n.endswith("bias")],
                   "weight_decay": 0.0, "lr": LR / 2}]
        config = _config(tmp_path / f"defer-{defer}", 3, "nvme")
        config["precision"] = {"dtype": "bf16"}
        engine = infinity.initialize(model, config, model_parameters=groups)
        engine.defer_optimizer_step = defer
        try:
            losses = _train(engine, range(4))
            assert bool(engine.shard_optimizer.pending_keys) == defer  # the last step waits
            results.append((losses, engine.full_state_dict()))
        finally:
            engine.close()
    (want_losses, want), (losses, got) = results
    assert losses == want_losses
    for k in want:
        assert torch.equal(got[k], want[k]), k
