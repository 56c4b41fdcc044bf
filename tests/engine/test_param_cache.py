"""Issue #15: a DeepSpeed config with ``offload_param: nvme`` + ``max_in_cpu`` +
``offload_optimizer: cpu`` failed at initialize (max_in_cpu became the whole host budget, which
then could not hold the CPU-homed optimizer). Now it trains like plain PyTorch + AdamW, and the
parameter copies on the host stay within the share max_in_cpu asks for."""

from __future__ import annotations

import dataclasses

import pytest

import infinity
from infinity.tiers import Residency, Tier, extent_bytes
from infinity.zero import host_needs_of
from tests._support.engine import (BETAS, EPS, LR, WD, assert_close_run, batches, engine_train,
                                   reference_train, tiny_gpt)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 4
SLOT = 8192
"""TINY's largest parameter shard (1088 fp32 elements with units of >= 1000 elements) in 4 KiB
extents: the host's staging slot for NVMe parameters."""


def _ds_config(swap, max_in_cpu):
    return {"zero_optimization": {
                "stage": 3, "stage3_param_persistence_threshold": 40,
                "stage3_module_granularity_threshold": 1000,
                "offload_param": {"device": "nvme", "nvme_path": str(swap), "pin_memory": True,
                                  "max_in_cpu": max_in_cpu},
                "offload_optimizer": {"device": "cpu", "pin_memory": True}},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                      "weight_decay": WD}},
            "gradient_clipping": 0.0}


def _train(tmp_path, max_in_cpu, data):
    config = infinity.load_config(_ds_config(tmp_path / f"swap{max_in_cpu}", max_in_cpu))
    # A device budget below every shard: units are fetched again each step, through the host.
    config = config.replace(memory=dataclasses.replace(config.memory, device_budget_bytes=16384))
    engine = infinity.initialize(tiny_gpt(), config)
    homed = host_needs_of(tiny_gpt(), config, engine.offload.sub_group_numel).homed_bytes
    peak_param_copies = 0
    losses = []
    for step in data:
        losses += engine_train(engine, [step])
        copies = sum(extent_bytes(4 * g.shard_numel) for u in engine.manager.units
                     for g in u.groups if g.store_key is not None
                     and engine.store.state(g.store_key, Tier.HOST) is not Residency.ABSENT)
        peak_param_copies = max(peak_param_copies, copies)
    return engine, losses, homed, peak_param_copies


@pytest.mark.filterwarnings("ignore:DeepSpeed key")
def test_max_in_cpu_with_the_optimizer_in_cpu_memory_trains_like_pytorch(tmp_path):
    data = batches(STEPS, 1)
    ref_losses, ref_state = reference_train(tiny_gpt(), data)
    share = 4 * SLOT  # more than the staging (3 slots), less than every shard (7 slots)
    engine, losses, homed, param_copies = _train(tmp_path, share // 4, data)
    try:
        assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
        stats = engine.stats()
        assert engine.offload.host_param_cache_bytes == share
        assert stats["bytes"]["HOST"]["budget"] == homed + share  # the rest, plus the share
        assert stats["bytes"]["HOST"]["peak"] - homed <= share
        assert 0 < param_copies <= share
        small_reads = stats["bytes_moved"]["NVME->HOST"]
        assert small_reads > 0, "the share is smaller than the shards: some are read again"
    finally:
        engine.close()
    # A share that holds every shard: after the first reads, the host cache serves the device.
    engine, losses, homed, param_copies = _train(tmp_path, 10 ** 9, data)
    try:
        assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
        assert engine.stats()["bytes_moved"]["NVME->HOST"] < small_reads
        assert param_copies <= engine.offload.host_param_cache_bytes
    finally:
        engine.close()
