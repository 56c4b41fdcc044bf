"""[Note: a gathered unit borrows its HOST copy] (infinity/zero/_param_manager.py): with one rank
and shards read on HOST, a gathered unit's parameters are the pinned HOST copy in the store's arena
(no copy), the release unpins it, a tight arena falls back to copying, and training matches plain
PyTorch either way, frozen parameters (LoRA's case: gathered again for the backward) included."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import infinity
import infinity.tiers._offload_budgets as offload_budgets
from infinity.tiers import Residency, Tier
from infinity.zero._collectives import Phase
from infinity.zero._manager_config import CAN_BORROW_STORAGE
from tests._support.engine import (TINY, assert_close_run, batches, engine_config, engine_train,
                                   reference_train, tiny_gpt)

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not CAN_BORROW_STORAGE, reason="this torch cannot swap storages")]
STEPS = 3
DEEP = dataclasses.replace(TINY, n_layer=6)


def _engine(tmp_path, model, host_budget_bytes):
    config = engine_config(stage=3, dtype="fp32", clip=0.05,
                           offload_param={"device": "nvme", "nvme_path": str(tmp_path / "swap")},
                           memory={"host_budget_bytes": host_budget_bytes})
    return infinity.initialize(model, config)


def _block_param_addresses(engine, model):
    """A forward hook on every block records its largest parameter's address and its storage
    bytes while the block runs (the engine's own pre-forward hook, installed first, has gathered
    it; the small ones are persistent, outside the units)."""
    seen = []

    def record(module, args):
        p = max(module.parameters(), key=lambda p: p.numel())
        seen.append((p.data_ptr(), p.untyped_storage().nbytes()))
    handles = [b.register_forward_pre_hook(record) for b in model.blocks]
    return seen, handles


def _within(address, buffer):
    start = buffer.data_ptr()
    return start <= address < start + buffer.numel() * buffer.element_size()


def _assert_all_given_back(engine, tier):
    """Between steps every unit is released: no ``tier`` copy stays pinned, every unit is empty."""
    assert engine.manager.storage.borrowed == {}
    assert all(not engine.store.copy_info(k, tier).pins for k in engine.store.keys())
    for u in engine.manager.units:
        if not u.always_gathered:
            assert all(g.full.untyped_storage().nbytes() == 0 for g in u.groups)


def _model(frozen: bool):
    """TINY at 6 layers; ``frozen``: the blocks' weight matrices frozen (``lora_like``'s rule)."""
    model = tiny_gpt(config=DEEP)
    if frozen:
        for name, p in model.named_parameters():
            if "blocks" in name and name.endswith("weight") and "ln" not in name:
                p.requires_grad_(False)
    return model


@pytest.mark.parametrize("host_budget", [60000, 40000], ids=["room", "tight"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_gathers_borrow_the_host_copy_and_train_like_pytorch(tmp_path, monkeypatch, frozen,
                                                             host_budget):
    """'room': most gathers borrow. 'tight' (the least budget the planner accepts, room for
    about two shards): a borrow would leave no room for the next reads, so most gathers copy."""
    monkeypatch.setattr(offload_budgets, "_CPU_DEVICE_MARGIN_BYTES", 0)  # not every shard fits
    data = batches(STEPS, 1)
    ref_losses, ref_state = reference_train(_model(frozen), data, clip=0.05)
    model = _model(frozen)
    engine = _engine(tmp_path, model, host_budget)
    try:
        assert engine.manager.partitions.read_tier is Tier.HOST
        seen, handles = _block_param_addresses(engine, model)
        losses = engine_train(engine, data)
        for h in handles:
            h.remove()
        assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
        arena = engine.store.arena.buffer
        borrowed = [addr for addr, _ in seen if _within(addr, arena)]
        if host_budget == 60000:  # most block gathers point into the arena
            assert engine.stats()["num_borrowed_gathers"] > 0 and len(borrowed) > len(seen) // 2
        else:
            assert len(borrowed) < len(seen) // 2
        _assert_all_given_back(engine, Tier.HOST)
    finally:
        engine.close()


def test_a_failed_write_into_a_borrowed_copy_is_dropped_when_the_unit_gives_it_back(
        tmp_path, monkeypatch):
    """An optimizer write that fails half-way leaves a HOST copy whose bytes are not the shard's.
    Unborrowed, it is evicted at once; borrowed, it is pinned by the gathered unit, so it is
    evicted when the unit gives it back: the next read of the shard gets its stored values."""
    monkeypatch.setattr(offload_budgets, "_CPU_DEVICE_MARGIN_BYTES", 0)
    engine = _engine(tmp_path, _model(False), 60000)
    try:
        m = engine.manager
        unit = next(u for u in m.units
                    if not u.always_gathered and all(g.store_key for g in u.groups))
        g = unit.groups[0]
        stored = m.read_shard(g)
        # Set-up's write-backs hold their HOST copies until written: settle them, so that the
        # gather finds the room a borrow needs (else it copies, and there is nothing to test).
        engine.store.flush()
        m._gather(unit, Phase.FORWARD_GATHER)
        assert id(g) in m.storage.borrowed
        with pytest.raises(RuntimeError, match="half-way"):
            with m.open_param_partition(g, overwrite=True) as shard:
                shard[: shard.numel() // 2].fill_(7.0)
                raise RuntimeError("the write failed half-way")
        assert engine.store.state(g.store_key, Tier.HOST) is Residency.RESIDENT  # still borrowed
        m._release(unit)
        assert engine.store.state(g.store_key, Tier.HOST) is Residency.ABSENT
        assert torch.equal(m.read_shard(g), stored)
    finally:
        engine.close()


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_gathers_borrow_the_device_copy_of_a_device_that_holds_every_shard(tmp_path, frozen):
    """A CPU engine whose DEVICE tier holds every parameter shard (an explicit device budget,
    the tests' stand-in for a GPU with room for them all) gathers by pointing each unit at its
    pinned DEVICE copy: no copy, training as plain PyTorch's, nothing pinned between steps."""
    data = batches(STEPS, 1)
    ref_losses, ref_state = reference_train(_model(frozen), data, clip=0.05)
    model = _model(frozen)
    engine = infinity.initialize(model, engine_config(
        stage=3, dtype="fp32", clip=0.05,
        offload_param={"device": "nvme", "nvme_path": str(tmp_path / "swap")},
        memory={"host_budget_bytes": 60000, "device_budget_bytes": 2**22}))
    try:
        assert engine.offload.device_holds_params and engine.manager.partitions.read_tier is Tier.DEVICE
        seen, handles = _block_param_addresses(engine, model)
        losses = engine_train(engine, data)
        for h in handles:
            h.remove()
        assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
        copies = {k: engine.store.copy_info(k, Tier.DEVICE).tensor for k in engine.store.keys()
                  if engine.store.copy_info(k, Tier.DEVICE).tensor is not None}
        borrowed = [addr for addr, _ in seen if any(_within(addr, t) for t in copies.values())]
        assert len(borrowed) == len(seen) > 0  # every block's gather is its DEVICE copy
        assert engine.stats()["num_borrowed_gathers"] >= len(seen)
        _assert_all_given_back(engine, Tier.DEVICE)
    finally:
        engine.close()
