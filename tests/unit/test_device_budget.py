"""[Note: the 'auto' device budget]: the store's device budget leaves room for what the engine
itself allocates on the GPU (pure arithmetic, and the engine's working set of a real model).

The old budget was 80 % of the free memory for shard copies alone: with a card whose free memory
is mostly taken by gathered units and gradients, the store still planned to keep every shard
resident (``device_holds_params``), an out-of-memory error instead of eviction.
"""

from __future__ import annotations

import pytest
import torch

from infinity._common import GiB, MiB, reset_warnings_for_tests
from infinity.config import load_config
from infinity.ledger import flat_layout
from infinity.models.gpt import GPT, GPTConfig
from infinity.tiers import (CUDA_FREE_FRACTION, DeviceWorkingSet, OffloadRequest, StateSizes, Tier,
                            auto_device_budget_bytes, resolve_offload_budgets)
from infinity.zero._offload import device_working_set, offload_inputs
from infinity.zero._unit_choice import units_of

WORK = DeviceWorkingSet(gathered_bytes=3 * GiB, resident_bytes=1 * GiB, grad_bytes=2 * GiB,
                        optimizer_bytes=0)


def test_auto_budget_subtracts_the_engines_own_device_bytes():
    free = 40 * GiB
    got = auto_device_budget_bytes(free_bytes=free, working=WORK, needed_bytes=256 * MiB)
    assert got == int(free * CUDA_FREE_FRACTION) - 6 * GiB
    assert WORK.total_bytes == 6 * GiB


def test_auto_budget_never_below_the_least_need_and_warns(recwarn):
    reset_warnings_for_tests()
    with pytest.warns(UserWarning, match="out-of-memory"):
        got = auto_device_budget_bytes(free_bytes=8 * GiB, working=WORK, needed_bytes=512 * MiB)
    assert got == 512 * MiB
    reset_warnings_for_tests()


def test_shards_past_the_room_left_are_evicted_not_held(monkeypatch):
    """20 GiB of shards on a card with 40 GiB free: under the old rule (32 GiB for shards alone)
    every shard stayed resident; with 6 GiB of the engine's own buffers and 20 % for activations
    there is room for 26 GiB: still held. With 14 GiB of the engine's buffers: 18 GiB, not held."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * GiB, 80 * GiB))
    shards = (GiB,) * 20
    sizes = StateSizes(unit_bytes=(4 * GiB,) * 20, param_shard_bytes=shards,
                       optimizer_partition_numel=(GiB // 4,) * 20)
    request = OffloadRequest(param_home=Tier.HOST, optimizer_home=Tier.HOST,
                             host_budget_bytes=512 * GiB, device_budget_bytes="auto",
                             sub_group_numel=2 ** 22, grad_accumulator_bytes=4)
    cuda = torch.device("cuda", 0)
    plan = resolve_offload_budgets(sizes, request, device=cuda, device_working=WORK)
    assert plan.device_budget_bytes == 26 * GiB and plan.device_holds_params
    big = DeviceWorkingSet(gathered_bytes=12 * GiB, resident_bytes=0, grad_bytes=2 * GiB)
    plan = resolve_offload_budgets(sizes, request, device=cuda, device_working=big)
    assert plan.device_budget_bytes == 18 * GiB and not plan.device_holds_params


def test_engine_working_set_of_a_model():
    """Stage 3, optimizer and parameters on the host, bf16: the three largest non-persistent
    units gathered (current + DEFAULT_PREFETCH_UNITS = 2), the persistent ones resident, and the
    largest trainable unit's fp32 gradient staging plus its reduced shard, all padded."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=101, block_size=16, n_layer=4, n_head=1, n_embd=24))
    config = load_config({"zero": {"stage": 3, "unit_class_names": ["Block"],
                                   "persistence_threshold_numel": 100},
                          "precision": {"dtype": "bf16"},
                          "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}})
    choice = units_of(model, config.zero)
    got = device_working_set(choice, offload_inputs(config, world_size=2,
                                                    device=torch.device("cpu")))
    fulls, persistent, grads = [], 0, []
    for unit in choice.units:
        numels = [p.numel() for _, p in unit.params]
        lay = flat_layout(numels, 2, 2)
        if unit.persistent:
            persistent += lay.padded_numel * 2
        else:
            fulls.append(lay.padded_numel * 2)
        grads.append(lay.padded_numel * 4 + lay.shard_numel * 4)
    assert got.gathered_bytes == sum(sorted(fulls)[-3:])
    assert got.resident_bytes == persistent > 0
    assert got.grad_bytes == max(grads)
    assert got.optimizer_bytes == 0  # the optimizer is offloaded
