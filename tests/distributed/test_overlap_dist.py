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
]
SABOTAGE = ("gather", "reduce")


def _train(rank, world_size, stage, dtype, gas, clip, zero):
    import infinity
    from infinity import LinkModel
    from tests._support.engine import batches, engine_config, engine_train, tiny_gpt

    engine = infinity.initialize(tiny_gpt(), engine_config(stage=stage, dtype=dtype, gas=gas,
                                                           clip=clip, zero=zero),
                                 comm_link=LinkModel(**LINK))
    losses = engine_train(engine, batches(STEPS, gas), rank=rank, world_size=world_size)
    out = {"losses": losses, "state": engine.full_state_dict(), "stats": engine.stats()}
    engine.close()
    return out


def worker_parity(rank: int, world_size: int, out_dir: str) -> dict:
    return {name: _train(rank, world_size, stage, dtype, gas, clip, zero)
            for name, stage, dtype, gas, clip, zero in CONFIGS}


def worker_sabotaged(rank: int, world_size: int, out_dir: str, what: str) -> dict:
    """The same training with one kind of wait taken out of the engine."""
    from infinity.zero import _grad_reducer
    from infinity.zero._flat_group import UnitState
    from infinity.zero._unit_storage import UnitStorage

    if what == "gather":  # the unit is marked gathered without waiting for its all-gathers
        def no_wait(self, unit):
            if unit.state is UnitState.GATHERING:
                for item in unit.pending:
                    if callable(item):
                        item()
                unit.pending = []
                unit.transition(UnitState.GATHERED)
        UnitStorage.wait_gather = no_wait
    else:  # the reduced gradient is accumulated without waiting for its reduce-scatter
        def no_wait(self):
            self.reducer._finish(self.group, self.result())
            self.buffers = ()
        _grad_reducer._GroupReduction.wait = no_wait
    return _train(rank, world_size, 3, "fp32", 1, 0.0, {})


def test_overlapped_collectives_train_as_plain_pytorch_under_a_slow_link():
    from tests._support.engine import assert_close_run, batches, reference_train, tiny_gpt

    results = launch(__file__, "worker_parity", timeout_s=300)
    for name, _stage, dtype, gas, clip, _zero in CONFIGS:
        ref_losses, ref_state = reference_train(tiny_gpt(), batches(STEPS, gas), dtype=dtype,
                                                clip=clip, splits=1 if dtype == "fp32" else 2)
        for res in results:
            got = res[name]
            assert_close_run(got["losses"], got["state"], ref_losses, ref_state, dtype)
            comm = got["stats"]["comm"]
            # Every collective crossed the link; the training thread's waits are counted.
            assert comm["issued"] > 0 and comm["link_busy_s"] > 0 and comm["exposed_s"] > 0


@pytest.mark.parametrize("what", SABOTAGE)
def test_a_missing_wait_gives_a_wrong_number(what):
    import math

    results = launch(__file__, "worker_sabotaged", timeout_s=240, args={"what": what})
    for res in results:
        values = res["losses"] + [float(v.abs().sum()) for v in res["state"].values()]
        assert not all(math.isfinite(v) for v in values), what
