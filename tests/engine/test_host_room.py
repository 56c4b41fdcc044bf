"""How the NVMe optimizer spends host room and device room it does not strictly need.

- [Note: host-resident sub-groups] (infinity/tiers/_offload_budgets.py): an explicit host budget larger than the
  pipeline's window homes whole optimizer sub-groups on HOST; they are never read from or written
  to NVMe, training matches plain PyTorch + AdamW, and the memory ledger moves those bytes from
  its NVMe row to its HOST row as the engine reports them.
- ``OffloadBudgets.device_holds_params``: when the device budget holds every parameter shard, an
  updated shard stays dirty on the device; its swap file keeps the old bytes until a flush
  writes the new ones (read back from disk here). A device that cannot hold them all has each
  updated shard written on the host and sent home right after its update.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import infinity
from infinity.io import aligned_empty
from infinity.ledger import estimate_from_config
from infinity.tiers import Tier
from infinity.zero import host_needs_of
from infinity.zero._training_state import ParamWriteback
from tests._support.engine import (TINY, assert_close_run, batches, engine_config, engine_train,
                                   reference_train, tiny_gpt)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 4


DEEP = dataclasses.replace(TINY, n_layer=6)
"""Deep enough that a device budget can hold the largest unit with two shards in flight and
still not every shard."""


def _engine(tmp_path, *, host="auto", device="auto", config=TINY):
    path = str(tmp_path / "swap")
    return infinity.initialize(tiny_gpt(config=config), engine_config(
        stage=3, dtype="bf16", clip=0.05,
        offload_optimizer={"device": "nvme", "nvme_path": path},
        offload_param={"device": "nvme", "nvme_path": path},
        memory={"host_budget_bytes": host, "device_budget_bytes": device},
        zero={"sub_group_numel": 300}))


def _param_shards(engine) -> dict[str, int]:
    """Store key -> elements of each stored parameter shard."""
    return {g.store_key: g.shard_numel for u in engine.manager.units for g in u.groups
            if g.store_key is not None}


def _on_disk(engine, key: str, numel: int) -> torch.Tensor:
    """The shard in ``key``'s swap file (bf16), read back through the swapper (the store swaps
    whole arena extents out as bytes)."""
    out = aligned_empty(engine.store.arena.extent_bytes(2 * numel), dtype=torch.uint8)
    engine._swapper.swap_in(key, out).wait()
    return out[:2 * numel].view(torch.bfloat16).clone()


def test_host_resident_sub_groups_train_like_adamw_and_skip_nvme(tmp_path):
    data = batches(STEPS, 1)
    ref_losses, ref_state = reference_train(tiny_gpt(), data, dtype="bf16", clip=0.05)
    probe = _engine(tmp_path / "probe")  # the 'auto' budget: the pipeline's own need
    assert probe.offload.optimizer_host_resident_bytes == 0  # 'auto' keeps its margin
    # The least budget with the gradients on the host (below it they would go to NVMe).
    least = host_needs_of(probe.module, probe.config, 300).least_bytes
    probe.close()
    # Slots of 8 KiB (a block's parameter shard; a sub-group of 300 fp32 x 3 takes 4 KiB): the
    # least budget holds 4 of them, this one 12: one spare, a window of 3, and 8 slots for
    # sub-groups on HOST, 16 of them.
    host = least + 8 * 8192
    engine = _engine(tmp_path, host=host)
    try:
        opt = engine.shard_optimizer
        homes = {sg.store_key: engine.store.home(sg.store_key) for k in opt.keys()
                 for sg in opt.sub_groups(k)}
        on_host = [sk for sk, home in homes.items() if home is Tier.HOST]
        assert len(on_host) == 16 < len(homes)
        before = engine.stats()["bytes_moved"]
        losses = engine_train(engine, data)
        assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "bf16")
        stats = engine.stats()
        assert stats["bytes_moved"]["NVME->HOST"] > before["NVME->HOST"]  # the rest still moves
        # The ledger, given the plan's resident bytes, agrees with the engine's tiers.
        resident = stats["optimizer_host_resident_bytes"]
        assert stats["bytes"]["HOST"]["current"] >= resident  # they really live in the arena
        assert resident == sum(12 * sg.numel for k in opt.keys()
                               for sg in opt.sub_groups(k) if sg.store_key in on_host)
        numel = sum(p.numel() for p in engine.module.parameters())
        ledger = estimate_from_config(engine.config, numel, 1, optimizer_host_resident_bytes=resident)
        without = estimate_from_config(engine.config, numel, 1)
        assert ledger.tier_bytes(Tier.NVME) == without.tier_bytes(Tier.NVME) - resident
        assert ledger.tier_bytes(Tier.HOST) == without.tier_bytes(Tier.HOST) + resident
        assert stats["bytes"]["NVME"]["current"] == pytest.approx(ledger.tier_bytes(Tier.NVME),
                                                                  rel=0.02)
    finally:
        engine.close()


def test_updated_shards_stay_on_a_device_that_holds_them_all_until_a_flush(tmp_path):
    data = batches(STEPS, 1)
    ref_losses, ref_state = reference_train(tiny_gpt(), data, dtype="bf16", clip=0.05)
    engine = _engine(tmp_path)
    try:
        assert engine.offload.device_holds_params
        shards = _param_shards(engine)
        engine.store.flush()  # the initial values are on disk
        initial = {k: _on_disk(engine, k, n) for k, n in shards.items()}
        losses = engine_train(engine, data)
        assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "bf16")
        assert engine.manager.param_writeback is ParamWriteback.LAZY
        assert engine.stats()["bytes_moved"]["DEVICE->HOST"] == 0  # no parameter write-back
        engine.shard_optimizer.drain()
        dirty = [k for k in shards if engine.store.is_dirty(k) is Tier.DEVICE]
        assert dirty == list(shards)  # every trained shard
        for k in dirty:  # the swap file still holds the initial bytes
            assert torch.equal(_on_disk(engine, k, shards[k]), initial[k])
        on_device = {k: engine.store.get(k, Tier.DEVICE).clone() for k in dirty}
        engine.store.flush()
        for k in dirty:  # now it holds the updated ones, bit for bit
            assert engine.store.is_dirty(k) is None
            assert torch.equal(_on_disk(engine, k, shards[k]), on_device[k].cpu())
            assert not torch.equal(on_device[k].cpu(), initial[k])
    finally:
        engine.close()


def test_a_device_too_small_for_every_shard_writes_each_update_back(tmp_path):
    probe = _engine(tmp_path / "probe", config=DEEP)
    shard_bytes = [2 * n for n in _param_shards(probe).values()]
    least = probe.offload.largest_unit_bytes + 2 * max(shard_bytes)  # the plan's least device
    probe.close()
    assert least < sum(shard_bytes)
    data = batches(STEPS, 1)
    ref_losses, ref_state = reference_train(tiny_gpt(config=DEEP), data, dtype="bf16", clip=0.05)
    engine = _engine(tmp_path, device=sum(shard_bytes) - 1, config=DEEP)
    try:
        assert not engine.offload.device_holds_params and engine.manager.param_writeback is ParamWriteback.EAGER
        assert engine.offload.optimizer_host_resident_bytes == 0
        engine.store.flush()  # set-up's writes of the initial values have landed
        before = engine.stats()["nvme_bytes_by_kind"]["param"]["write"]
        losses = engine_train(engine, data)
        engine.store.flush()  # the write-backs in flight land (none is left dirty: eager)
        stats = engine.stats()
        # Each update went home: written on the host where the optimizer made it ([Note:
        # updated shards are written where the optimizer runs]), nothing copied back from the
        # device; the deferred step applies a step's updates in the next forward, so the last
        # step's may still be pending.
        assert stats["bytes_moved"]["DEVICE->HOST"] == 0
        written = stats["nvme_bytes_by_kind"]["param"]["write"] - before
        assert (STEPS - 1) * sum(shard_bytes) <= written <= STEPS * sum(shard_bytes)
        assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "bf16")
    finally:
        engine.close()


def test_a_step_run_in_place_keeps_writing_each_update_back(tmp_path):
    """Optimizer in host memory: the step runs in place and flushes right after, so laziness
    would only move the write-backs behind the last update; each shard goes home as updated."""
    engine = infinity.initialize(tiny_gpt(), engine_config(
        stage=3, dtype="bf16", offload_optimizer={"device": "cpu"},
        offload_param={"device": "cpu"}))
    try:
        assert engine.offload.device_holds_params and engine.manager.param_writeback is ParamWriteback.EAGER
        engine_train(engine, batches(2, 1))
        assert engine.stats()["bytes_moved"]["DEVICE->HOST"] > 0
    finally:
        engine.close()


def test_a_step_run_in_place_after_init_writes_each_update_back(tmp_path):
    """``defer_optimizer_step = False`` set after initialize: the step runs in place and
    flushes, so each update is written back as it is made (decided at every step)."""
    engine = _engine(tmp_path)
    try:
        engine.defer_optimizer_step = False
        engine_train(engine, batches(2, 1))
        assert engine.manager.param_writeback is ParamWriteback.EAGER
        assert engine.stats()["bytes_moved"]["DEVICE->HOST"] > 0
        assert all(engine.store.is_dirty(k) is None for k in _param_shards(engine))
    finally:
        engine.close()


def test_an_update_failing_midway_keeps_the_lazy_shard_and_releases_the_window(tmp_path):
    """A deferred update that fails in a key's second sub-group: the error that surfaces is that
    failure (the error path writes nothing, even with no host room to stage a write-back), the
    window's pins are released, and the dirty device copy stays: its first sub-group carries
    the new values (matching their new masters), the rest the old ones."""
    data = batches(3, 1)
    engine = _engine(tmp_path, host=120_000)
    try:
        engine_train(engine, data[:2])
        x, y = data[2][0]
        engine.backward(engine(x, y))
        engine.step()
        opt = engine.shard_optimizer
        key = next(k for k in opt.pending_keys if len(opt.sub_groups(k)) > 1
                   and opt.param_store_key(k) is not None)
        pk, first_hi = opt.param_store_key(key), opt.sub_groups(key)[0].hi
        assert engine.store.is_dirty(pk) is Tier.DEVICE
        before = engine.store.get(pk, Tier.DEVICE).clone()
        update = opt._update

        def failing_update(buf, grad, out, lo, hi, run):
            if run.items[run.done].key == key and lo > 0:
                raise RuntimeError("injected failure")
            return update(buf, grad, out, lo, hi, run)

        reserve = engine.store.budgets.reserve

        def no_host_staging(tier, shard, *, for_key):
            if tier is Tier.HOST and for_key.startswith("param/"):
                engine.store.budgets.capacity_error(tier, for_key, 0, "no room (test)")
            return reserve(tier, shard, for_key=for_key)

        opt._update, engine.store.budgets.reserve = failing_update, no_host_staging
        with pytest.raises(RuntimeError, match="injected failure"):
            opt.drain()
        engine.store.budgets.reserve = reserve
        assert opt.pending_keys == []
        assert engine.store.is_dirty(pk) is Tier.DEVICE
        after = engine.store.get(pk, Tier.DEVICE)
        assert not torch.equal(after[:first_hi], before[:first_hi])
        assert torch.equal(after[first_hi:], before[first_hi:])
        for k in engine.store.keys():  # nothing is left pinned (a pinned copy cannot go)
            if k.startswith("opt/"):
                engine.store.unregister(k)
    finally:
        engine.close()
