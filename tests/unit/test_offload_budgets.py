"""Host budget resolution of the offload budgets (``infinity.tiers.resolve_offload_budgets``): the
sub-group size and whether the budget leaves room to overlap (prefetch), for a GPT with parameters and optimizer state on NVMe.

The reference staging is written here from the pipeline's description, not read from the code:
fp32 [master | exp_avg | exp_avg_sq] sub-groups (12 bytes an element) and bf16 parameter shards
(2 bytes an element) are staged in slots of the largest 4 KiB-aligned extent; the host also homes
the gradient accumulators, bf16 here (2 bytes an element: one rank, one micro-batch, so nothing is
summed in fp32). Overlap needs six slots (the read of i+1,
the update of i, the write of i-1, two parameter shards, a spare); the least that works, four
(two sub-groups, one parameter shard, a spare).

Where the budget cannot hold the accumulators so, they are NVMe-homed slices ([Note: gradients
on NVMe] in infinity/zero/_grad_reducer.py): nothing is homed on the host, each optimizer
sub-group in flight takes a second slot for its gradient slice, and one more slot takes the slice
being accumulated: ten slots for overlap, seven at the least. The gradients stay on the host
whenever the budget holds them there.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from infinity.config import load_config
from infinity.models.gpt import GPT, PRESETS
from infinity.tiers import (AUTO_HOST_RAM_FRACTION, AUTO_SUB_GROUP_NUMEL, StateSizes,
                            resolve_offload_budgets)
from infinity.zero import least_host_budget_bytes
from infinity.zero._manager_config import CAN_BORROW_STORAGE, DEFAULT_LIVE_UNITS
from infinity.zero._offload import offload_inputs, offload_request, resolve_offload, state_sizes
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
    return load_config(_config_dict(host, sub))


def _config_dict(host, sub="auto"):
    return {
        "zero": {"stage": 3, "sub_group_numel": sub,
                 "unit_class_names": list(UNITS["unit_class_names"]),
                 "unit_min_numel": UNITS["unit_min_numel"],
                 "persistence_threshold_numel": UNITS["persistence_threshold_numel"]},
        "precision": {"dtype": "bf16"},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/nonexistent/swap"},
        "offload_param": {"device": "nvme", "nvme_path": "/nonexistent/swap"},
        "memory": {"host_budget_bytes": host}}


def _extent(nbytes):
    return -(-nbytes // 4096) * 4096


@pytest.fixture(scope="module")
def reference(model):
    """(sub, gradients on NVMe) -> (homed bytes, least budget, budget with overlap), from the
    units' element counts."""
    numels = [sum(p.numel() for _, p in u.params) for u in choose_units(model, **UNITS).units]
    assert len(numels) >= 5 and sum(numels) == sum(p.numel() for p in model.parameters())
    param_slot = _extent(2 * max(numels))

    def needs(sub, grads_on_nvme=False):
        n = min(sub, max(numels))
        slot = max(_extent(12 * n), param_slot)
        if grads_on_nvme:
            return 0, 7 * slot, 10 * slot
        homed = sum(_extent(2 * n) for n in numels)  # bf16 gradient accumulators
        return homed, homed + 4 * slot, homed + 6 * slot
    return needs


def _expected(reference, host, sub="auto"):
    """(sub, overlap, grads on NVMe) the documented rule picks for an explicit ``host`` budget
    ('auto' or one sub-group size); None when nothing fits."""
    overlap_sizes = [s for s in AUTO_SIZES if s >= OVERLAP_FLOOR] if sub == "auto" else [sub]
    least_sizes = AUTO_SIZES if sub == "auto" else [sub]
    for grads in (False, True):
        for level, sizes in ((2, overlap_sizes), (1, least_sizes)):
            for sub in sizes:
                if reference(sub, grads)[level] <= host:
                    return sub, level == 2, grads
    return None


def plan_offload(model, config, *, world_size, device):
    """The engine's budget resolution for ``model`` under ``config`` (as ``initialize`` runs it)."""
    return resolve_offload(units_of(model, config.zero),
                           offload_inputs(config, world_size=world_size, device=device),
                           device=device)


def _too_small(least):
    """The error for a budget one byte short: it names the key, the budget and the least."""
    return rf"memory\.host_budget_bytes={least - 1} .* at least {least}\b"


def _plan(model, host, sub="auto"):
    return plan_offload(model, _config(host, sub), world_size=1, device=CPU)


def _sweep_budgets(reference):
    least = min(reference(LEAST_FLOOR, g)[1] for g in (False, True))
    full = reference(AUTO_SUB_GROUP_NUMEL)[2]
    budgets = {least + (full - least) * i // 60 for i in range(61)}
    for sub in AUTO_SIZES:  # every threshold, exactly and one byte short
        for grads in (False, True):
            for b in reference(sub, grads)[1:]:
                budgets |= {b - 1, b}
    return sorted(b for b in budgets if least <= b <= full)


def test_auto_overlap_is_monotonic_in_the_host_budget(model, reference):
    """Overlap grows with the budget on each side of the least budget that holds the gradients
    on the host: below it they go to NVMe, from it on they stay on the host."""
    budgets = _sweep_budgets(reference)
    host_least = reference(LEAST_FLOOR)[1]
    for grads in (True, False):
        side = [b for b in budgets if (b < host_least) == grads]
        overlaps = []
        for host in side:
            plan = _plan(model, host)
            assert plan.host_budget_bytes == host
            assert (plan.sub_group_numel, plan.overlap, plan.grads_on_nvme) == \
                (*_expected(reference, host)[:2], grads), host
            overlaps.append(plan.overlap)
        # the threshold: the least budget with overlap at the smallest size allowed for it
        threshold = min(reference(s, grads)[2] for s in AUTO_SIZES if s >= OVERLAP_FLOOR)
        if threshold > side[-1]:  # this small model: no overlap before the gradients fit
            assert grads and not any(overlaps)
            continue
        first_on = overlaps.index(True)
        assert 0 < first_on and all(overlaps[first_on:]) and not any(overlaps[:first_on]), \
            list(zip(side, overlaps))
        assert side[first_on] == threshold, grads


def test_auto_budget_below_the_least_is_an_error_naming_the_fix(model, reference):
    least = reference(LEAST_FLOOR, True)[1]
    assert least < reference(LEAST_FLOOR)[1]  # the gradients' room is what NVMe saves
    with pytest.raises(ValueError, match=_too_small(least)):
        _plan(model, least - 1)
    plan = _plan(model, least)
    assert not plan.overlap and plan.grads_on_nvme


@pytest.mark.parametrize("ram_gib, on_nvme", [(64, False), (2, True)])
def test_auto_host_budget_keeps_gradients_on_the_host_only_within_a_fraction_of_ram(
        ram_gib, on_nvme):
    """'auto': the comfortable budget plus a margin, gradients on the host while that is within
    AUTO_HOST_RAM_FRACTION of the RAM, so that host memory does not grow with the model. A
    160M-parameter model of 40 units (bf16 gradients: 320 MiB; sub-groups of 4 Mi elements): on
    the host with 64 GiB of RAM, on NVMe with 2 GiB."""
    numel, units = AUTO_SUB_GROUP_NUMEL, 40
    sizes = StateSizes(unit_bytes=(2 * numel,) * units, param_shard_bytes=(2 * numel,) * units,
                       optimizer_partition_numel=(numel,) * units)
    request = dataclasses.replace(offload_request(_config("auto"), 1),
                                  host_ram_bytes=ram_gib * 2 ** 30)
    plan = resolve_offload_budgets(sizes, request, device=CPU)
    state_slot, grad_slot = 12 * numel, 2 * numel  # already whole extents
    with_host_grads = units * grad_slot + 6 * state_slot
    with_nvme_grads = 10 * state_slot
    comfortable = with_nvme_grads if on_nvme else with_host_grads
    assert plan.grads_on_nvme is on_nvme and plan.sub_group_numel == numel and plan.overlap
    assert plan.host_budget_bytes == comfortable + comfortable // 10 + 2 ** 20
    assert with_nvme_grads < with_host_grads  # NVMe is chosen only where it saves host room
    assert (with_host_grads * 1.1 > AUTO_HOST_RAM_FRACTION * ram_gib * 2 ** 30) is on_nvme


@pytest.mark.parametrize("sub", [2 ** 20, 3000])
def test_explicit_sub_group_numel_is_kept(model, reference, sub):
    _homed, least, comfortable = reference(sub)
    _, least_nvme, comfortable_nvme = reference(sub, True)
    for host in sorted({least_nvme, comfortable_nvme - 1, comfortable_nvme, least,
                        (least + comfortable) // 2, comfortable - 1, comfortable,
                        2 * comfortable}):
        plan = _plan(model, host, sub)
        assert plan.sub_group_numel == sub and plan.host_budget_bytes == host
        assert plan.overlap == (min(comfortable, comfortable_nvme) <= host), host
        assert (sub, plan.overlap, plan.grads_on_nvme) == _expected(reference, host, sub), host
    with pytest.raises(ValueError, match=_too_small(min(least, least_nvme))):
        _plan(model, min(least, least_nvme) - 1, sub)
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


def test_auto_host_budget_has_room_for_gathered_units_that_borrow_host_copies(model):
    """[Note: a gathered unit borrows its HOST copy]: where gathered units live in the arena
    (one rank, a CPU engine reading shards from HOST), an 'auto' budget holds the extents of the
    DEFAULT_LIVE_UNITS largest units (distinct units: the GPT's embedding + head unit once, the
    blocks after it) more than the same request without them, and the NVMe optimizer's room is
    the same; an explicit budget is kept as it is. More ranks (units are all-gathered into their
    own buffers) or an explicit device budget (the DEVICE tier in the read path) add nothing."""
    numels = [sum(p.numel() for _, p in u.params) for u in choose_units(model, **UNITS).units]
    largest = sorted((_extent(2 * n) for n in numels), reverse=True)[:DEFAULT_LIVE_UNITS]
    assert largest[0] > largest[1]  # the head unit: priced once, not DEFAULT_LIVE_UNITS times
    request = offload_request(_config("auto"), 1)
    assert request.gathered_units_on_host == 0
    sizes = state_sizes(units_of(model, _config("auto").zero), stage=3, world_size=1,
                        param_bytes=2)
    without = resolve_offload_budgets(sizes, request, device=CPU)
    borrowing = resolve_offload_budgets(
        sizes, dataclasses.replace(request, gathered_units_on_host=DEFAULT_LIVE_UNITS),
        device=CPU)
    assert borrowing.host_budget_bytes == \
        without.host_budget_bytes + sum(largest)
    assert (borrowing.optimizer_window_sub_groups, borrowing.optimizer_host_resident_bytes) == \
        (without.optimizer_window_sub_groups, without.optimizer_host_resident_bytes)
    # The engine's resolution asks for them exactly where the units borrow.
    assert _plan(model, "auto").host_budget_bytes == (borrowing if CAN_BORROW_STORAGE
                                                      else without).host_budget_bytes
    two_ranks = plan_offload(model, _config("auto"), world_size=2, device=CPU)
    two_ranks_alone = resolve_offload_budgets(
        state_sizes(units_of(model, _config("auto").zero), stage=3, world_size=2, param_bytes=2),
        offload_request(_config("auto"), 2), device=CPU)
    assert two_ranks.host_budget_bytes == two_ranks_alone.host_budget_bytes
    # Two replicas of unsharded units (HSDP, shard degree 1): each rank's gathers borrow as one
    # rank's do (nothing crosses ranks to gather), so the budget has the same room.
    replicas = resolve_offload(units_of(model, _config("auto").zero),
                               offload_inputs(_config("auto"), world_size=1, device=CPU,
                                              data_parallel_size=2), device=CPU)
    replicas_alone = resolve_offload_budgets(sizes, offload_request(_config("auto"), 2),
                                             device=CPU)
    assert replicas.host_budget_bytes == replicas_alone.host_budget_bytes + (
        sum(largest) if CAN_BORROW_STORAGE else 0)
    explicit_device = load_config({**_config_dict("auto"),
                                   "memory": {"host_budget_bytes": "auto",
                                              "device_budget_bytes": 10 ** 9}})
    assert plan_offload(model, explicit_device, world_size=1, device=CPU).host_budget_bytes \
        == without.host_budget_bytes
    host = borrowing.host_budget_bytes
    assert _plan(model, host).host_budget_bytes == host  # explicit: as given
