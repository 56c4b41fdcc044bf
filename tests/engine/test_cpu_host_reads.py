"""[Note: a CPU engine reads parameter shards from HOST] (infinity/zero/_manager_config.py): with
an 'auto' device budget a CPU engine gathers offloaded shards straight from their HOST copies (no
HOST -> DEVICE copy per gather) and trains exactly as with a DEVICE tier in the read path, which
an explicit device budget keeps (the small-GPU stand-in of the other tests)."""

from __future__ import annotations

import dataclasses

import pytest

import infinity
import infinity.tiers._offload_budgets as offload_budgets
from infinity.tiers import Tier
from infinity.zero._manager_config import CAN_BORROW_STORAGE
from tests._support.engine import (TINY, assert_close_run, batches, engine_config, engine_train,
                                   reference_train, tiny_gpt)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
STEPS = 4
DEEP = dataclasses.replace(TINY, n_layer=6)  # more shards than the least device budget holds


def _config(tmp_path, device_budget):
    path = str(tmp_path / "swap")
    return engine_config(stage=3, dtype="fp32", clip=0.05,
                         offload_param={"device": "nvme", "nvme_path": path},
                         # room for prefetches but not for every shard: they stream from NVMe
                         memory={"device_budget_bytes": device_budget, "host_budget_bytes": 60000})


def test_gathers_read_host_copies_with_an_auto_device_budget(tmp_path, monkeypatch):
    # Without the 64 MiB margin the 'auto' CPU device budget is the plan's least (the largest
    # unit and two shards in flight): it cannot hold every shard of the tiny model, as at 7B.
    monkeypatch.setattr(offload_budgets, "_CPU_DEVICE_MARGIN_BYTES", 0)
    data = batches(STEPS, 1)
    ref_losses, ref_state = reference_train(tiny_gpt(config=DEEP), data, clip=0.05)
    runs = {}
    for name, budget in (("auto", "auto"), ("explicit", None)):
        if budget is None:  # the same bytes, given explicitly: the DEVICE tier stays in the path
            budget = runs["auto"]["device_budget"]
        engine = infinity.initialize(tiny_gpt(config=DEEP), _config(tmp_path / name, budget))
        try:
            assert not engine.offload.device_holds_params
            assert engine.stats()["prefetch"]["enabled"]
            losses = engine_train(engine, data)
            assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
            s = engine.stats()
            units = engine.manager.units
            gathered = [sum(g.padded_numel * g.full.element_size() for g in u.groups)
                        for u in units]
            always = sum(b for u, b in zip(units, gathered) if u.always_gathered)
            runs[name] = {"read_tier": engine.manager.partitions.read_tier,
                          "device_to_host": s["bytes_moved"]["DEVICE->HOST"],
                          "peak_parts": s["bytes"]["DEVICE"]["peak_parts"],
                          "live_bound": always + 3 * max(gathered),
                          "device_budget": engine.offload.device_budget_bytes,
                          "host_to_device": s["bytes_moved"]["HOST->DEVICE"],
                          "nvme_to_host": s["bytes_moved"]["NVME->HOST"],
                          "hits": s["prefetch"]["hits"], "losses": losses,
                          "borrowed": s["num_borrowed_gathers"]}
        finally:
            engine.close()
    auto, explicit = runs["auto"], runs["explicit"]
    assert auto["read_tier"] is Tier.HOST and explicit["read_tier"] is Tier.DEVICE
    # Gathers read the HOST copies and the optimizer writes its updated shards there: nothing
    # moves between HOST and DEVICE at all.
    assert auto["host_to_device"] == 0 and auto["device_to_host"] == 0
    assert auto["peak_parts"]["store_copies"] == 0  # updated shards are written on HOST too
    assert explicit["host_to_device"] > 0 and explicit["device_to_host"] > 0
    # Gathered units are bounded (the persistent ones and three of the largest) where the
    # DEVICE tier no longer bounds them.
    assert auto["peak_parts"]["param"] <= auto["live_bound"]
    assert auto["nvme_to_host"] > 0 and auto["hits"] > 0  # shards stream and are prefetched
    assert auto["losses"] == explicit["losses"]
    # [Note: a gathered unit borrows its HOST copy]: one rank, shards read on HOST: gathers
    # point the units at the pinned HOST copies; the DEVICE path copies as before.
    assert (auto["borrowed"] > 0) is CAN_BORROW_STORAGE and explicit["borrowed"] == 0
