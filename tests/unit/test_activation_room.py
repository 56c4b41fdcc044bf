"""[Note: the activations' room] in infinity/tiers/_offload_budgets.py: with activations saved into
the store, an explicit host budget keeps for them what it holds beyond the states' comfortable
need (activations on HOST) or at least their staging (bound for NVMe), and the NVMe optimizer's
read-ahead window and host-resident sub-groups size from the rest.

Expected windows are written from the rule on made-up sizes: the optimizer on NVMe, 12 B an
element staged in slots of the largest sub-group's extent (4 KiB extents), the fp32 gradient
accumulators homed on the host, parameters on the device; the window is the free slots less one
spare, capped at OPTIMIZER_WINDOW_SLOTS with the rest of an explicit budget homed on HOST."""

from __future__ import annotations

import pytest
import torch

from infinity.tiers import OffloadRequest, StateSizes, Tier, host_needs, resolve_offload_budgets

CPU = torch.device("cpu")
SUB = 10_000
SIZES = StateSizes(unit_bytes=(40_000,) * 4, param_shard_bytes=(),
                   optimizer_partition_numel=(SUB,) * 4)
SLOT = -(-12 * SUB // 4096) * 4096

def _request(activations: str, host: int | str) -> OffloadRequest:
    return OffloadRequest(param_home=Tier.DEVICE, optimizer_home=Tier.NVME, host_budget_bytes=host,
                          device_budget_bytes=10 ** 9, sub_group_numel=SUB,
                          grad_accumulator_bytes=4, nvme_path="/nonexistent",
                          activations=activations, activation_staging_bytes=2 * SLOT)

def _room(request: OffloadRequest) -> int:
    """Host bytes the NVMe optimizer sizes itself into: its window and resident sub-groups."""
    budgets = resolve_offload_budgets(SIZES, request, device=CPU)
    return budgets.optimizer_window_sub_groups * SLOT + budgets.optimizer_host_resident_bytes

def test_activations_on_host_leave_the_states_their_comfortable_room():
    comfortable = host_needs(SIZES, _request("none", "auto"), SUB).comfortable_bytes
    budget = comfortable + 20 * SLOT
    none, host = _room(_request("none", budget)), _room(_request("host", budget))
    assert none - host == pytest.approx(20 * SLOT, abs=SLOT)  # the 20 slots left for activations
    assert host >= 2 * SLOT  # the pipeline's two sub-groups stay

def test_activations_bound_for_nvme_keep_their_staging():
    comfortable = host_needs(SIZES, _request("none", "auto"), SUB).comfortable_bytes
    budget = comfortable + 20 * SLOT
    assert _room(_request("none", budget)) - _room(_request("nvme", budget)) == 2 * SLOT
    # 'auto' keeps the larger of the two
    assert _room(_request("auto", budget)) == _room(_request("host", budget))

def test_an_auto_budget_is_sized_for_the_states_alone():
    auto = resolve_offload_budgets(SIZES, _request("host", "auto"), device=CPU)
    plain = resolve_offload_budgets(SIZES, _request("none", "auto"), device=CPU)
    assert auto.host_budget_bytes == plain.host_budget_bytes
    assert auto == plain


def test_the_states_room_is_the_other_side_of_the_same_rule():
    """What 'auto' activations leave the states (``states_host_room_bytes``) is their
    comfortable need less their homed shards, from the same :func:`host_needs` the activations'
    room is cut by."""
    needs = host_needs(SIZES, _request("none", "auto"), SUB)
    comfortable = needs.comfortable_bytes
    budgets = resolve_offload_budgets(SIZES, _request("auto", comfortable + 20 * SLOT), device=CPU)
    assert budgets.states_host_room_bytes == comfortable - needs.homed_bytes
    assert _room(_request("none", comfortable + 20 * SLOT)) - _room(
        _request("auto", comfortable + 20 * SLOT)) == pytest.approx(20 * SLOT, abs=SLOT)
