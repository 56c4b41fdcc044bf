"""memory.host_param_cache_bytes (DeepSpeed's offload_param.max_in_cpu) sizes the parameter share
of an 'auto' host budget only ([Note: the parameter share] in infinity/tiers/_offload_budgets.py).

The expected budgets are written from the rule, on made-up sizes: the host homes the optimizer
(12 B an element, one 4 KiB extent per shard rounded up) and the fp32 gradient accumulators
(4 B an element); NVMe parameter shards are staged in slots of the largest shard's extent; the
share replaces the comfortable budget's three parameter slots (two in flight, a spare)."""

from __future__ import annotations

import pytest
import torch

from infinity.config import config_to_deepspeed, load_config
from infinity.tiers import OffloadRequest, StateSizes, Tier, resolve_offload_budgets

CPU = torch.device("cpu")
K4 = 4096
SIZES = StateSizes(unit_bytes=(40_000,) * 4, param_shard_bytes=(40_000, 30_000, 40_000, 20_000),
                   optimizer_partition_numel=(10_000, 7_500, 10_000, 5_000))


def _extent(n):
    return -(-n // K4) * K4


HOMED = sum(_extent(12 * n) + _extent(4 * n) for n in SIZES.optimizer_partition_numel)
SLOT = _extent(40_000)
EVERY = sum(_extent(b) for b in SIZES.param_shard_bytes) + SLOT


def _request(cache):
    return OffloadRequest(param_home=Tier.NVME, optimizer_home=Tier.HOST, host_budget_bytes="auto",
                          device_budget_bytes=10 ** 9, sub_group_numel="auto",
                          grad_accumulator_bytes=4, nvme_path="/nonexistent",
                          host_param_cache_bytes=cache)


@pytest.mark.parametrize("asked, share", [
    (4 * SLOT, 4 * SLOT),  # between the least and every shard: as asked
    (10 ** 12, EVERY),  # more than every shard: every shard and the spare
    (1, 3 * SLOT),  # less than the staging: the staging (with a warning)
])
def test_the_share_is_added_to_what_the_rest_needs(asked, share):
    if asked < 3 * SLOT:
        with pytest.warns(UserWarning, match="host_param_cache_bytes=1 .* less than two"):
            budgets = resolve_offload_budgets(SIZES, _request(asked), device=CPU)
    else:
        budgets = resolve_offload_budgets(SIZES, _request(asked), device=CPU)
    assert budgets.host_param_cache_bytes == share
    assert budgets.host_budget_bytes == HOMED + share
    assert budgets.overlap


def test_without_a_share_the_auto_budget_is_unchanged():
    auto = resolve_offload_budgets(SIZES, _request(None), device=CPU)
    comfortable = HOMED + 3 * SLOT
    assert auto.host_budget_bytes == comfortable + comfortable // 10 + 2 ** 20
    assert auto.host_param_cache_bytes == 0


def test_max_in_cpu_maps_to_the_parameter_share_not_the_host_budget(tmp_path):
    raw = {"bf16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path),
                                      "max_in_cpu": 1e6},
        "offload_optimizer": {"device": "cpu"}}}
    memory = load_config(raw).memory
    assert memory.host_budget_bytes == "auto"
    assert memory.host_param_cache_bytes == 2 * 10 ** 6  # elements x bf16 bytes
    written = config_to_deepspeed(load_config(raw))  # `infinity plan`'s DeepSpeed form
    assert written["zero_optimization"]["offload_param"]["max_in_cpu"] == 10 ** 6
    raw["zero_optimization"]["offload_param"]["device"] = "cpu"  # DeepSpeed ignores it then
    assert load_config(raw).memory.host_param_cache_bytes == "auto"


def test_the_share_and_an_explicit_host_budget_are_one_or_the_other(tmp_path):
    with pytest.raises(ValueError, match=r"memory\.host_param_cache_bytes: expected 'auto' when "
                                         r"memory\.host_budget_bytes is set"):
        load_config({"memory": {"host_budget_bytes": 10 ** 8, "host_param_cache_bytes": 10 ** 6}})
    with pytest.raises(ValueError, match=r"memory\.host_param_cache_bytes: expected 'auto' unless "
                                         r"offload_param\.device is 'nvme'"):
        load_config({"memory": {"host_param_cache_bytes": 10 ** 6},
                     "offload_param": {"device": "cpu"}})
