"""Collectives issued early and waited late, on 2 gloo ranks under a slow modeled link whose
transfers land only at their wait ([Note: the modeled link] in infinity/_modeled_link.py,
``poison_until_wait``): training matches plain PyTorch on the global batch, and a wait taken out
gives a wrong number (NaN), not a lucky right one.
"""

from __future__ import annotations

import pytest

from tests._support.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread")]

STEPS = 4
LINK = dict(bandwidth_gbytes_per_s=0.2, latency_us=300.0, poison_until_wait=True)
"""~0.6 ms for a block's 120 KB fp32 gather: every collective lands well after its issue."""
CONFIGS = [  # (name, stage, dtype, gas, clip, zero section)
    ("s2-fp32", 2, "fp32", 1, 0.0, {}),
    ("s3-fp32", 3, "fp32", 1, 0.0, {}),
    ("s3-bf16-gas2-clip", 3, "bf16", 2, 0.05, {}),
    ("s1-fp32-gas2", 1, "fp32", 2, 0.0, {}),
    ("s3-fp32-hpz", 3, "fp32", 1, 0.0, {"hpz_partition_size": 2}),
    # [Note: the after-step gather overlaps the next forward] in infinity/zero/_step_gathers.py
    ("s2-fp32-overlap-gather", 2, "fp32", 1, 0.0, {"overlap_param_gather": True}),
    ("s1-bf16-gas2-clip-overlap-gather", 1, "bf16", 2, 0.05, {"overlap_param_gather": True}),
]
SABOTAGE = ("gather", "reduce", "step-gather", "outside-read")


def _reads_ahead():
    """Two Linear units; the forward reads ``late.weight`` before ``late`` runs (outside its
    module): with overlapped after-step gathers, the first forward must find that read."""
    import torch
    from torch import nn

    class ReadsAhead(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.early = nn.Linear(16, 16)
            self.late = nn.Linear(16, 16)

        def forward(self, x, y):
            x = x + 0.1 * (x @ self.late.weight.T)
            return nn.functional.mse_loss(self.late(torch.tanh(self.early(x))), y)

    return ReadsAhead()


def _reads_ahead_data():
    import torch

    g = torch.Generator().manual_seed(5)
    return [[(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g))]
            for _ in range(STEPS)]


def _train_reads_ahead(rank, world_size):
    import infinity
    from infinity import LinkModel
    from tests._support.engine import engine_config, engine_train

    cfg = engine_config(stage=2, unit_class_names=("Linear",), unit_min_numel=1,
                        persistence_threshold_numel=0, zero={"overlap_param_gather": True})
    engine = infinity.initialize(_reads_ahead(), cfg, comm_link=LinkModel(**LINK))
    losses = engine_train(engine, _reads_ahead_data(), rank=rank, world_size=world_size)
    out = {"losses": losses, "state": engine.full_state_dict()}
    engine.close()
    return out


def _train(rank, world_size, stage, dtype, gas, clip, zero):
    import infinity
    from infinity import LinkModel
    from tests._support.engine import batches, engine_config, engine_train, tiny_gpt

    from infinity.optim import _in_memory
    from infinity.zero._collectives import Phase

    engine = infinity.initialize(tiny_gpt(), engine_config(stage=stage, dtype=dtype, gas=gas,
                                                           clip=clip, zero=zero),
                                 comm_link=LinkModel(**LINK))
    # The after-step gathers' issues and the optimizer's updates, in order.
    events, manager, adam_runs = [], engine.manager, _in_memory.adam_runs

    def recorded(gather):  # issued and waited later, or waited at once
        def record(unit, phase, **kwargs):
            if phase is Phase.STEP_GATHER:
                events.append(("gather", unit.index))
            return gather(unit, phase, **kwargs)
        return record

    def update(*args, **kwargs):
        events.append(("update", None))
        return adam_runs(*args, **kwargs)

    manager._issue_gather = recorded(manager._issue_gather)
    manager._gather = recorded(manager._gather)
    _in_memory.adam_runs = update
    try:
        losses = engine_train(engine, batches(STEPS, gas), rank=rank, world_size=world_size)
    finally:
        _in_memory.adam_runs = adam_runs
    # Right after the last step (gathers in flight where overlapped): the module's own view.
    states = {u.state.name for u in engine.manager.units}
    module_state = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()
                    } if stage < 3 else None
    out = {"losses": losses, "state": engine.full_state_dict(), "stats": engine.stats(),
           "module_state": module_state, "states_after_step": states, "events": events,
           "units": len(engine.manager.units)}
    engine.close()
    return out


def worker_parity(rank: int, world_size: int, out_dir: str) -> dict:
    out = {name: _train(rank, world_size, stage, dtype, gas, clip, zero)
           for name, stage, dtype, gas, clip, zero in CONFIGS}
    out["reads-ahead"] = _train_reads_ahead(rank, world_size)
    return out


def worker_sabotaged(rank: int, world_size: int, out_dir: str, what: str) -> dict:
    """The same training with one kind of wait taken out of the engine."""
    from infinity.zero import _grad_reducer
    from infinity.zero._flat_group import UnitState
    from infinity.zero._param_manager import ParameterManager
    from infinity.zero._unit_storage import UnitStorage

    if what == "outside-read":  # the first forward does not look for reads outside modules
        ParameterManager._check_outside_use = lambda self, tensor, func_name: None
        return _train_reads_ahead(rank, world_size)
    if what in ("gather", "step-gather"):  # marked gathered without waiting for its all-gathers
        def no_wait(self, unit):
            if unit.state is UnitState.GATHERING:
                for item in unit.pending:
                    if callable(item):
                        item()
                unit.pending = []
                unit.transition(UnitState.GATHERED)
        UnitStorage.wait_gather = no_wait
        if what == "step-gather":  # stage 2: the after-step gathers overlap the next forward
            return _train(rank, world_size, 2, "fp32", 1, 0.0, {"overlap_param_gather": True})
    else:  # the reduced gradient is accumulated without waiting for its reduce-scatter
        def no_wait(self):
            self.reducer._finish(self.group, self.result())
            self.buffers = ()
        _grad_reducer._GroupReduction.wait = no_wait
    return _train(rank, world_size, 3, "fp32", 1, 0.0, {})


def test_overlapped_collectives_train_as_plain_pytorch_under_a_slow_link():
    from tests._support.engine import assert_close_run, batches, reference_train, tiny_gpt

    results = launch(__file__, "worker_parity", timeout_s=300)
    for name, stage, dtype, gas, clip, zero in CONFIGS:
        ref_losses, ref_state = reference_train(tiny_gpt(), batches(STEPS, gas), dtype=dtype,
                                                clip=clip, splits=1 if dtype == "fp32" else 2)
        for res in results:
            got = res[name]
            assert_close_run(got["losses"], got["state"], ref_losses, ref_state, dtype)
            comm = got["stats"]["comm"]
            # Every collective crossed the link; the training thread's waits are counted.
            assert comm["issued"] > 0 and comm["link_busy_s"] > 0 and comm["exposed_s"] > 0
            # step() returned with the after-step gathers in flight only where overlapped.
            assert ("GATHERING" in got["states_after_step"]) == bool(
                zero.get("overlap_param_gather")), (name, got["states_after_step"])
            if dtype == "fp32" and stage < 3:  # read right after step(): gathered, not poisoned
                assert_close_run(got["losses"], got["module_state"], ref_losses, ref_state, dtype)
            if stage < 3:  # every unit gathered once per step; overlapped: while the step runs
                steps = _per_step(got["events"], got["units"])
                assert len(steps) == STEPS, (name, len(steps))
                for events in steps:
                    kinds = [kind for kind, _ in events]
                    assert sorted(i for kind, i in events if kind == "gather") == list(
                        range(got["units"])), (name, events)
                    assert (kinds.index("gather") < len(kinds) - 1 - kinds[::-1].index("update")
                            ) == bool(zero.get("overlap_param_gather")), (name, kinds)
    ref_losses, ref_state = reference_train(_reads_ahead(), _reads_ahead_data())
    for res in results:
        got = res["reads-ahead"]
        assert_close_run(got["losses"], got["state"], ref_losses, ref_state, "fp32")


def _per_step(events: list, units: int) -> list[list]:
    """The events split into optimizer steps: each ends with its ``units``-th gather."""
    steps, current = [], []
    for event in events:
        current.append(event)
        if sum(kind == "gather" for kind, _ in current) == units:
            steps.append(current)
            current = []
    assert not current, current
    return steps


@pytest.mark.parametrize("what", SABOTAGE)
def test_a_missing_wait_gives_a_wrong_number(what):
    import math

    results = launch(__file__, "worker_sabotaged", timeout_s=240, args={"what": what})
    for res in results:
        values = res["losses"] + [float(v.abs().sum()) for v in res["state"].values()]
        assert not all(math.isfinite(v) for v in values), what
