"""A modeled link under a CPU engine's host<->device copies ([Note: the modeled link] in
infinity/_modeled_link.py): parameters homed on HOST and a DEVICE budget smaller than them, so
shards cross the link every step; with ``poison_until_wait`` a copy's destination holds NaN until
its modeled end, so a read that does not wait for the copy gives a wrong number. Training still
matches plain PyTorch; bad settings are refused before anything is built."""

from __future__ import annotations

import pytest

import infinity
from infinity import LinkModel
from tests._support.engine import (assert_close_run, batches, engine_config, engine_train,
                                   offload_config, reference_train, tiny_gpt)
from tests._support.models import FOUR, four_gpt, unit_numels

LINK = LinkModel(bandwidth_gbytes_per_s=0.05, latency_us=200.0, poison_until_wait=True)


def _engine(tmp_path, *, opt: str = "cpu", link: LinkModel = LINK, gas: int = 1):
    """Parameters (and the optimizer unless ``opt`` says otherwise) homed on HOST, a DEVICE
    budget of 3 of the 5 units."""
    config = offload_config(tmp_path / "swap", stage=3, opt=opt, param="cpu", gas=gas,
                            memory={"device_budget_bytes": 3 * max(unit_numels(four_gpt())) * 4})
    return infinity.initialize(four_gpt(), config, copy_link=link)


def test_copies_under_a_slow_poisoned_link_train_as_plain_pytorch(tmp_path):
    steps = 4
    data = batches(steps, 1, config=FOUR)
    ref_losses, ref_state = reference_train(four_gpt(), data)
    numels = unit_numels(four_gpt())
    engine = _engine(tmp_path)
    losses = engine_train(engine, data)
    stats = engine.stats()
    # Most parameter bytes crossed the link again after the first step (the budget is 3 units
    # of the 5), each copy at the link's pace.
    assert stats["bytes_moved"]["HOST->DEVICE"] > 2 * sum(numels) * 4
    assert stats["copy"]["bytes_to_device"] >= stats["bytes_moved"]["HOST->DEVICE"]  # + in flight
    assert stats["copy"]["link_busy_s"] > 0
    # [Note: updated shards are written where the optimizer runs]: the optimizer's new values
    # go to the HOST home, not into DEVICE copies written back again.
    assert stats["bytes_moved"]["DEVICE->HOST"] == 0
    # [Note: gradients down a modeled link]: every step's gradients (fp32) crossed it.
    assert stats["copy"]["bytes_to_host"] == steps * sum(numels) * 4
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    engine.close()


def test_gradient_accumulation_under_the_link_trains_as_plain_pytorch(tmp_path):
    """Two micro-batches: the second's copy down adds into what the first's landed."""
    steps, gas = 3, 2
    data = batches(steps, gas, config=FOUR)
    ref_losses, ref_state = reference_train(four_gpt(), data)
    engine = _engine(tmp_path, gas=gas)
    losses = engine_train(engine, data)
    assert engine.stats()["copy"]["bytes_to_host"] == steps * gas * sum(
        unit_numels(four_gpt())) * 4
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    engine.close()


def test_write_backs_cross_the_link_when_the_device_writes(tmp_path):
    """The optimizer on the device writes DEVICE copies of HOST-homed shards: their write-backs
    are device->host copies, on the link."""
    steps = 3
    data = batches(steps, 1, config=FOUR)
    ref_losses, ref_state = reference_train(four_gpt(), data)
    engine = _engine(tmp_path, opt="none")
    losses = engine_train(engine, data)
    state = engine.full_state_dict()  # every write-back has landed
    stats = engine.stats()
    # Each step wrote back (nearly) every shard it updated.
    assert stats["bytes_moved"]["DEVICE->HOST"] > (steps - 1) * sum(unit_numels(four_gpt())) * 4
    assert stats["copy"]["bytes_to_host"] == stats["bytes_moved"]["DEVICE->HOST"]
    assert_close_run(losses, state, ref_losses, ref_state, "fp32")
    engine.close()


def test_a_copy_link_needs_copies_to_model(tmp_path):
    with pytest.raises(ValueError, match="offload_param"):
        infinity.initialize(tiny_gpt(), engine_config(stage=3), copy_link=LINK)
    with pytest.raises(ValueError, match="device_budget_bytes"):
        infinity.initialize(tiny_gpt(), offload_config(tmp_path / "swap", stage=3, opt="cpu",
                                                       param="cpu"), copy_link=LINK)


def test_a_read_before_the_copy_lands_gives_a_wrong_number(tmp_path, monkeypatch):
    """The same run with the store's move completed at the copy's issue instead of its landing:
    the reads see the poisoned bytes."""
    import math

    from infinity.tiers import Tier
    from infinity.tiers._mover import Mover  # where the store's moves are made

    def early(self, shard, src, dst):
        link = self.copy_link.toward(device=dst is Tier.DEVICE)
        dst_t, src_t = shard.copies[dst].tensor, shard.copies[src].tensor
        done_at = link.reserve(shard.nbytes)
        dst_t.fill_(float("nan"))
        self._finish_move(shard, src, dst, None)  # the reader may go before the bytes land
        self._modeled_lanes[dst].submit(lambda: link.wait_until(done_at),
                                        lambda: dst_t.copy_(src_t))

    monkeypatch.setattr(Mover, "_modeled_copy", early)
    engine = _engine(tmp_path)
    losses = engine_train(engine, batches(3, 1, config=FOUR))
    engine.close()
    assert not all(math.isfinite(x) for x in losses)


def test_reading_gradients_before_they_land_gives_a_wrong_number(tmp_path, monkeypatch):
    """The optimizer reads the host accumulators without waiting for the copies down: it sees
    the poisoned bytes (the link is slow enough that the last copies are still on it)."""
    import math

    from infinity.zero._grad_reducer import GradientReducer

    slow = LinkModel(bandwidth_gbytes_per_s=0.005, poison_until_wait=True)
    monkeypatch.setattr(GradientReducer, "_wait_landings", lambda self: None)
    engine = _engine(tmp_path, link=slow)
    losses = engine_train(engine, batches(3, 1, config=FOUR))
    engine.close()
    assert not all(math.isfinite(x) for x in losses)
