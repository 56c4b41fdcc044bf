"""``engine.optimizer`` as a ``torch.optim.Optimizer`` ([Note: the optimizer seen from outside] in
infinity/optim/_engine_optimizer.py): torch's LR schedulers and transformers' schedule wrap it and
give the same losses and weights as the same schedule on plain ``torch.optim.AdamW``, in memory and
offloaded; its state dict and engine checkpoints keep the groups' hyperparameters and step counts.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import infinity
from infinity.optim import EngineOptimizer
from tests._support.engine import (BETAS, EPS, LR, WD, assert_close_state, batches, engine_config,
                                   engine_train, offload_config, reference_train, tiny_gpt)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 6


def _cosine_with_warmup(opt):
    transformers = pytest.importorskip("transformers")
    return transformers.get_cosine_schedule_with_warmup(opt, num_warmup_steps=2,
                                                        num_training_steps=STEPS)


SCHEDULERS = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 3)),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS,
                                                                     eta_min=1e-3),
    # Cycles beta1 too (cycle_momentum): the engine reads every group's betas at each step.
    "onecycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05,
                                                                total_steps=STEPS),
    "sequential": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt, [torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.2, total_iters=2),
              torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7)], milestones=[2]),
    "hf-cosine-warmup": _cosine_with_warmup,
}


def _placement_config(tmp_path, placement: str):
    if placement == "memory":
        return engine_config(stage=3)
    return offload_config(tmp_path / "swap", stage=3, opt=placement)


@pytest.mark.parametrize("placement", ["memory", "cpu", "nvme"])
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scheduler_on_engine_optimizer_matches_plain_adamw(tmp_path, name, placement):
    data = batches(STEPS, 1)
    ref_losses, ref_state = reference_train(tiny_gpt(), data, scheduler=SCHEDULERS[name])
    engine = infinity.initialize(tiny_gpt(), _placement_config(tmp_path, placement))
    try:
        assert isinstance(engine.optimizer, torch.optim.Optimizer)
        with warnings.catch_warnings():
            # torch warns when a scheduler steps before the optimizer: engine.step() counts.
            warnings.filterwarnings("error", message=".*lr_scheduler.step.*")
            warnings.filterwarnings("error", message=".*optimizer.step.*")
            sched = SCHEDULERS[name](engine.optimizer)
            losses = []
            for micro in data:
                losses += engine_train(engine, [micro])
                engine.optimizer.step()  # no-ops, as trainers call them
                engine.optimizer.zero_grad(set_to_none=True)
                sched.step()
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert_close_state(engine.full_state_dict(), ref_state, atol=2e-5)
        assert engine.lr == pytest.approx(sched.get_last_lr()[0])
    finally:
        engine.close()


def test_surface_and_state_dict_round_trip():
    engine = infinity.initialize(tiny_gpt(), engine_config(stage=0))
    opt = engine.optimizer
    assert isinstance(opt, EngineOptimizer)
    params = list(engine.module.parameters())
    assert [p for g in opt.param_groups for p in g["params"]] == params  # the model's own
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (LR, BETAS, EPS,
                                                                                   WD)
    with pytest.raises(ValueError, match="model_parameters"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5 ** t)
    engine_train(engine, batches(2, 1))
    sched.step()
    engine.lr = 0.004  # the setter sets every group
    assert opt.param_groups[0]["lr"] == 0.004
    state = opt.state_dict()
    assert set(state["state"]) == set(range(len(params)))
    assert all(s == {"step": 2} for s in state["state"].values())
    assert state["param_groups"][0]["initial_lr"] == LR  # extra keys kept
    assert state["param_groups"][0]["params"] == list(range(len(params)))

    other = infinity.initialize(tiny_gpt(), engine_config(stage=0))
    other.optimizer.load_state_dict(state)
    assert other.lr == 0.004 and other.optimizer.param_groups[0]["initial_lr"] == LR
    assert other.optimizer.state_dict()["state"] == state["state"]
    bad = {**state, "state": {0: {"step": 1, "exp_avg": torch.zeros(1)}}}
    with pytest.raises(ValueError, match="engine.load_checkpoint"):
        other.optimizer.load_state_dict(bad)


def test_checkpoint_keeps_hyperparameters_and_step_counts(tmp_path):
    """Save after 3 steps of a OneCycle schedule (lr and beta1 change every step), resume in a
    fresh engine with the scheduler's own state: the same losses and weights as uninterrupted."""
    data = batches(6, 1)
    make = SCHEDULERS["onecycle"]
    engine = infinity.initialize(tiny_gpt(), engine_config(stage=3))
    sched = make(engine.optimizer)
    for micro in data[:3]:
        engine_train(engine, [micro])
        sched.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    saved_groups = [{k: v for k, v in g.items() if k != "params"}
                    for g in engine.optimizer.param_groups]
    saved_sched = sched.state_dict()
    want = []
    for micro in data[3:]:
        want += engine_train(engine, [micro])
        sched.step()

    resumed = infinity.initialize(tiny_gpt(), engine_config(stage=3))
    sched2 = make(resumed.optimizer)  # moves lr and betas to the schedule's start
    resumed.load_checkpoint(tmp_path / "ckpt")
    got_groups = [{k: v for k, v in g.items() if k != "params"}
                  for g in resumed.optimizer.param_groups]
    assert got_groups == saved_groups
    assert resumed.optimizer.state_dict()["state"][0] == {"step": 3}
    sched2.load_state_dict(saved_sched)
    got = []
    for micro in data[3:]:
        got += engine_train(resumed, [micro])
        sched2.step()
    assert got == pytest.approx(want, abs=1e-6)
    assert_close_state(resumed.full_state_dict(), engine.full_state_dict(), atol=1e-6)
