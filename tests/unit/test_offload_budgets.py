"""Host budget resolution of the offload budgets (``infinity.tiers.resolve_offload_budgets``): the
sub-group size and whether the budget leaves room to overlap (prefetch), for a GPT with parameters and optimizer state on NVMe.

The reference staging is written here from the pipeline's description, not read from the code:
fp32 [master | exp_avg | exp_avg_sq] sub-groups (12 bytes an element) and bf16 parameter shards
(2 bytes an element) are staged in slots of the largest 4 KiB-aligned extent; the host also homes
the gradient accumulators, bf16 here (2 bytes an element: one rank, one micro-batch, so nothing is
summed in fp32). Overlap needs six slots (the read of i+1,
the update of i, the write of i-1, two parameter shards, a spare); the least that works, four
(two sub-groups, one parameter shard, a spare).
"""

from __future__ import annotations

import pytest
import torch

from infinity.config import load_config
from infinity.models.gpt import GPT, PRESETS
from infinity.tiers import AUTO_SUB_GROUP_NUMEL
from infinity.zero import least_host_budget_bytes
from infinity.zero._offload import resolve_offload
from infinity.zero._unit_choice import choose_units, units_of

CPU = torch.device("cpu")
OVERLAP_FLOOR = 2 ** 16  # smallest 'auto' sub-group tried for overlap
LEAST_FLOOR = 2 ** 14  # smallest 'auto' sub-group at all
AUTO_SIZES = [AUTO_SUB_GROUP_NUMEL >> k for k in range(23)
              if AUTO_SUB_GROUP_NUMEL >> k >= LEAST_FLOOR]
UNITS = dict(unit_class_names=("Block",), unit_min_numel=1, persistence_threshold_numel=0)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(PRESETS["small"])


def _config(host, sub="auto"):
    return load_config({
        "zero": {"stage": 3, "sub_group_numel": sub,
                 "unit_class_names": list(UNITS["unit_class_names"]),
                 "unit_min_numel": UNITS["unit_min_numel"],
                 "persistence_threshold_numel": UNITS["persistence_threshold_numel"]},
        "precision": {"dtype": "bf16"},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/nonexistent/swap"},
        "offload_param": {"device": "nvme", "nvme_path": "/nonexistent/swap"},
        "memory": {"host_budget_bytes": host}})


def _extent(nbytes):
    return -(-nbytes // 4096) * 4096


@pytest.fixture(scope="module")
def reference(model):
    """sub -> (homed bytes, least budget, budget with overlap), from the units' element counts."""
    numels = [sum(p.numel() for _, p in u.params) for u in choose_units(model, **UNITS).units]
    assert len(numels) >= 5 and sum(numels) == sum(p.numel() for p in model.parameters())
    homed = sum(_extent(2 * n) for n in numels)  # bf16 gradient accumulators
    param_slot = _extent(2 * max(numels))

    def needs(sub):
        slot = max(_extent(12 * min(sub, max(numels))), param_slot)
        return homed, homed + 4 * slot, homed + 6 * slot
    return needs


def plan_offload(model, config, *, world_size, device):
    """The engine's budget resolution for ``model`` under ``config`` (as ``initialize`` runs it)."""
    return resolve_offload(units_of(model, config.zero), config, world_size=world_size,
                           device=device)


def _too_small(least):
    """The error for a budget one byte short: it names the key, the budget and the least."""
    return rf"memory\.host_budget_bytes={least - 1} .* at least {least}\b"


def _plan(model, host, sub="auto"):
    return plan_offload(model, _config(host, sub), world_size=1, device=CPU)


def _sweep_budgets(reference):
    least = reference(LEAST_FLOOR)[1]
    full = reference(AUTO_SUB_GROUP_NUMEL)[2]
    budgets = {least + (full - least) * i // 60 for i in range(61)}
    for sub in AUTO_SIZES:  # every threshold, exactly and one byte short
        for b in reference(sub)[1:]:
            budgets |= {b - 1, b}
    return sorted(b for b in budgets if least <= b <= full)


def test_auto_overlap_is_monotonic_in_the_host_budget(model, reference):
    budgets = _sweep_budgets(reference)
    overlaps = []
    for host in budgets:
        plan = _plan(model, host)
        assert plan.host_budget_bytes == host
        sub = plan.sub_group_numel
        assert sub in AUTO_SIZES
        homed, least, comfortable = reference(sub)
        if plan.overlap:
            assert sub >= OVERLAP_FLOOR and comfortable <= host, (host, sub)
            if sub < AUTO_SUB_GROUP_NUMEL:  # the largest size that fits with overlap
                assert reference(2 * sub)[2] > host, (host, sub)
        else:
            assert least <= host, (host, sub)
            assert all(reference(s)[2] > host for s in AUTO_SIZES if s >= OVERLAP_FLOOR), host
            if sub < AUTO_SUB_GROUP_NUMEL:
                assert reference(2 * sub)[1] > host, (host, sub)
        overlaps.append(plan.overlap)
    first_on = overlaps.index(True)
    assert 0 < first_on and all(overlaps[first_on:]) and not any(overlaps[:first_on]), \
        list(zip(budgets, overlaps))
    # the threshold is the least budget with overlap at the smallest size allowed for it
    assert budgets[first_on] == min(reference(s)[2] for s in AUTO_SIZES if s >= OVERLAP_FLOOR)


def test_auto_budget_below_the_least_is_an_error_naming_the_fix(model, reference):
    least = reference(LEAST_FLOOR)[1]
    with pytest.raises(ValueError, match=_too_small(least)):
        _plan(model, least - 1)
    assert not _plan(model, least).overlap


@pytest.mark.parametrize("sub", [2 ** 20, 3000])
def test_explicit_sub_group_numel_is_kept(model, reference, sub):
    _homed, least, comfortable = reference(sub)
    for host in sorted({least, (least + comfortable) // 2, comfortable - 1, comfortable,
                        2 * comfortable}):
        plan = _plan(model, host, sub)
        assert plan.sub_group_numel == sub and plan.host_budget_bytes == host
        assert plan.overlap == (comfortable <= host), host
    with pytest.raises(ValueError, match=_too_small(least)):
        _plan(model, least - 1, sub)
    auto = _plan(model, "auto", sub)
    assert auto.sub_group_numel == sub and auto.overlap and auto.host_budget_bytes >= comfortable


@pytest.mark.parametrize("sub_group", [2 ** 14, "auto"])
@pytest.mark.parametrize("param_device", ["nvme", "cpu"])
def test_least_host_budget_is_exactly_the_threshold_plan_offload_accepts(model, tmp_path,
                                                                         sub_group, param_device):
    def config(host):
        return load_config({
            "zero": {"stage": 3, "unit_class_names": ["Block"], "sub_group_numel": sub_group},
            "precision": {"dtype": "bf16"},
            "offload_param": {"device": param_device, "nvme_path": str(tmp_path)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
            "memory": {"host_budget_bytes": host}})

    least = least_host_budget_bytes(model, config(1))
    assert least > 0
    assert plan_offload(model, config(least), world_size=1, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="host_budget_bytes"):
        plan_offload(model, config(least - 1), world_size=1, device=torch.device("cpu"))
