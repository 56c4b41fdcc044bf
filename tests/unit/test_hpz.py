"""ZeRO++ hpZ without a process group: the secondary groups (a pure function of the world size
and the partition size), the config field and its DeepSpeed key, and the ledger's hpZ term
([Note: hpZ secondary shards] in infinity/zero/_hpz.py, [Note: the hpZ term] in
infinity/ledger/_estimate.py). The collectives themselves: tests/distributed/test_hpz_dist.py."""

from __future__ import annotations

import pytest

from infinity.config import config_to_deepspeed, load_config
from infinity.ledger import StateTerms, Tier, estimate_from_config, estimate_model_states
from infinity.zero._hpz import check_partition_size, secondary_group_ranks


@pytest.mark.parametrize("world, size, groups", [
    (4, 2, [[0, 1], [2, 3]]),
    (8, 4, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (6, 3, [[0, 1, 2], [3, 4, 5]]),
    (4, 4, [[0, 1, 2, 3]]),
    (3, 1, [[0], [1], [2]]),
])
def test_secondary_groups_are_consecutive_ranks(world, size, groups):
    assert secondary_group_ranks(world, size) == groups
    # Every rank in exactly one group, the rank's place in it is rank % size.
    flat = [r for g in groups for r in g]
    assert flat == list(range(world))
    assert all(g.index(r) == r % size for g in groups for r in g)


@pytest.mark.parametrize("world, size", [(4, 3), (2, 4), (6, 4), (1, 2)])
def test_partition_size_must_divide_the_world(world, size):
    with pytest.raises(ValueError, match=r"zero.hpz_partition_size: expected a divisor of the "
                                         rf"data-parallel world size {world}, got {size}"):
        secondary_group_ranks(world, size)
    with pytest.raises(ValueError, match="zero.hpz_partition_size"):
        check_partition_size(size, world)


def test_engine_at_one_process_rejects_hpz_before_building_units():
    import infinity
    from tests._support.engine import engine_config, tiny_gpt

    model = tiny_gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"zero.hpz_partition_size: expected a divisor of the "
                                         r"data-parallel world size 1, got 2"):
        infinity.initialize(model, engine_config(stage=3, zero={"hpz_partition_size": 2}))
    assert all(v.numel() and v.equal(before[k]) for k, v in model.state_dict().items())


def test_config_field_default_and_validation():
    assert load_config({}).zero.hpz_partition_size == 1
    assert load_config({"zero": {"stage": 3, "hpz_partition_size": 8}}).zero.hpz_partition_size == 8
    for bad in (0, -2, 2.0, True, "8"):
        with pytest.raises(ValueError, match=r"zero.hpz_partition_size: expected an integer >= 1"):
            load_config({"zero": {"stage": 3, "hpz_partition_size": bad}})
    with pytest.raises(ValueError, match=r"zero.hpz_partition_size: expected 1 below stage 3.*"
                                         r"stage 3"):
        load_config({"zero": {"stage": 2, "hpz_partition_size": 2}})
    for device in ("cpu", "nvme"):
        with pytest.raises(ValueError, match=r"zero.hpz_partition_size: expected 1 with "
                                             r"offload_param.*offload_param.device 'none'"):
            load_config({"zero": {"stage": 3, "hpz_partition_size": 2},
                         "offload_param": {"device": device, "nvme_path": "/tmp/x"}})
    # The optimizer may be offloaded: the parameters stay on the device.
    config = load_config({"zero": {"stage": 3, "hpz_partition_size": 2},
                          "offload_optimizer": {"device": "cpu"}})
    assert config.zero.hpz_partition_size == 2


def test_deepspeed_key_maps_and_round_trips():
    raw = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}
    config = load_config(raw)
    assert config.zero.hpz_partition_size == 8
    assert config_to_deepspeed(config)["zero_optimization"]["zero_hpz_partition_size"] == 8
    assert load_config(config_to_deepspeed(config)).zero.hpz_partition_size == 8
    assert load_config(config.to_dict()) == config
    off = load_config({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1}})
    assert "zero_hpz_partition_size" not in config_to_deepspeed(off)["zero_optimization"]
    with pytest.raises(ValueError, match=r"zero.hpz_partition_size: expected 1 below stage 3"):
        load_config({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 8}})


@pytest.mark.parametrize("dtype, size", [("bf16", 2), ("bf16", 8), ("fp32", 4)])
def test_ledger_prices_the_secondary_shards_at_param_bytes_over_h(dtype, size):
    numel, world = 1_000_003, 16
    terms = StateTerms.for_training(dtype=dtype)
    on = estimate_model_states(numel, 3, world, terms, hpz_partition_size=size, unit_numel=1000)
    off = estimate_model_states(numel, 3, world, terms, unit_numel=1000)
    item = {"bf16": 2, "fp32": 4}[dtype]
    term = on.buffers[Tier.DEVICE]["hpz_secondary"]
    assert term == -(-numel * item // size)  # bf16: 2/H bytes per parameter
    assert on.tier_bytes(Tier.DEVICE) - off.tier_bytes(Tier.DEVICE) == term
    assert on.states == off.states  # a buffer beside the model states, not a state
    for tier in (Tier.HOST, Tier.NVME):
        assert on.tier_bytes(tier) == off.tier_bytes(tier)
    assert "hpz_secondary" not in off.buffers.get(Tier.DEVICE, {})


def test_ledger_from_config_and_its_checks():
    config = load_config({"zero": {"stage": 3, "hpz_partition_size": 4},
                          "precision": {"dtype": "bf16"}})
    ledger = estimate_from_config(config, 4000, 8)
    assert ledger.buffers[Tier.DEVICE]["hpz_secondary"] == 4000 * 2 // 4
    with pytest.raises(ValueError, match="hpz_partition_size = 4 must divide world_size = 6"):
        estimate_from_config(config, 4000, 6)
    with pytest.raises(ValueError, match="needs stage 3 with parameters on the device"):
        estimate_model_states(4000, 2, 8, hpz_partition_size=2)
    with pytest.raises(ValueError, match="needs stage 3 with parameters on the device"):
        estimate_model_states(4000, 3, 8, offload_param="cpu", hpz_partition_size=2)
    with pytest.raises(ValueError, match="hpz_partition_size: expected an integer >= 1"):
        estimate_model_states(4000, 3, 8, hpz_partition_size=0)
