"""The deferred NVMe optimizer step ([Note: deferred optimizer step] in
infinity/optim/_offloaded.py): ``engine.step()`` leaves the updates of units whose parameter shard
the store holds to the next forward, each run just before that shard is read. Reads are slow
(every NVMe block sleeps) so that a read of a shard before its update shows up as a wrong number;
the reference is the same engine with the step run in place, and plain PyTorch + AdamW."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import infinity
from tests._support.engine import (TINY, assert_close_run, batches, engine_config, engine_train,
                                   mark_backward, reference_train, tiny_gpt)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 4


def _engine(tmp_path, name: str, *, defer: bool, gas: int = 1, host: int = 120_000):
    path = str(tmp_path / name)
    engine = infinity.initialize(tiny_gpt(), engine_config(
        stage=3, dtype="bf16", gas=gas, clip=0.05,
        offload_optimizer={"device": "nvme", "nvme_path": path},
        offload_param={"device": "nvme", "nvme_path": path},
        memory={"host_budget_bytes": host}, zero={"sub_group_numel": 300}))
    engine.defer_optimizer_step = defer
    return engine


def _record_pending(engine) -> list[int]:
    """Pending keys right after each optimizer step and right after the next forward."""
    seen: list[int] = []
    step, forward = engine.step, engine.forward

    def recording_step():
        before = engine.global_steps
        step()
        if engine.global_steps > before:  # an optimizer step ran (not a micro-step)
            seen.append(len(engine.shard_optimizer.pending_keys))

    def recording_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        seen.append(-len(engine.shard_optimizer.pending_keys) - 1)  # negative: after a forward
        return out

    engine.step, engine.forward = recording_step, recording_forward
    return seen


LEAST_HOST = 7 * 8192
"""The least host budget here (``least_host_budget_bytes``): the gradients on NVMe ([Note:
gradients on NVMe] in infinity/zero/_grad_reducer.py), and 8 KiB slots for two sub-groups and
their gradient slices, the slice being accumulated, a shard and a spare; nothing is left for
host-resident sub-groups (the test asserts it). With two micro-batches (fp32 gradients), 120 000
bytes hold the gradients on the host (45 056 bytes) beside a comfortable pipeline."""


def _train_deferred_against_in_place(in_place, deferred, data, ref) -> dict:
    """Train ``in_place`` (``defer_optimizer_step`` False) and then ``deferred`` (True) on
    ``data``, closing each; assert the deferred run is bitwise the in-place one and close to
    ``ref`` (plain PyTorch's losses and state), that every update with a stored shard waited for
    the next forward and that forward ran them all. Returns the deferred engine's stats."""
    try:
        want_losses = engine_train(in_place, data)
        want_state = in_place.full_state_dict()
    finally:
        in_place.close()
    try:
        assert deferred._deferring
        pending = _record_pending(deferred)
        losses = engine_train(deferred, data)
        state = deferred.full_state_dict()
        stats = deferred.stats()
    finally:
        deferred.close()
    assert losses == want_losses
    for k in want_state:
        assert torch.equal(state[k], want_state[k]), k
    assert_close_run(losses, state, *ref, "bf16")
    after_step = [n for n in pending if n >= 0]
    after_forward = [-n - 1 for n in pending if n < 0]
    assert after_step and min(after_step) > 0, pending
    assert max(after_forward) == 0, pending
    return stats


@pytest.mark.parametrize("gas, host", [(1, 120_000), (2, 120_000), (2, LEAST_HOST)])
def test_deferred_step_trains_to_the_bits_of_the_step_run_in_place(tmp_path, slow_reads, gas,
                                                                    host):
    data = batches(STEPS, gas)
    ref_losses, ref_state = reference_train(tiny_gpt(), data, dtype="bf16", clip=0.05)
    in_place = _engine(tmp_path, "in-place", defer=False, gas=gas, host=host)
    assert (in_place.offload.optimizer_host_resident_bytes == 0) == (host == LEAST_HOST)
    assert in_place.offload.grads_on_nvme == (host == LEAST_HOST)
    deferred = _engine(tmp_path, "deferred", defer=True, gas=gas, host=host)
    stats = _train_deferred_against_in_place(in_place, deferred, data, (ref_losses, ref_state))
    assert stats["bytes"]["HOST"]["peak"] <= stats["bytes"]["HOST"]["budget"]


def test_reads_between_steps_see_the_updated_values(tmp_path, slow_reads):
    """Right after a deferred step: an evaluation forward, full_state_dict and a checkpoint all
    see the updated parameters, the same bits as with the step run in place."""
    data = batches(2, 1)
    x, _y = batches(1, 1, config=TINY)[0][0]
    results = {}
    for defer in (False, True):
        engine = _engine(tmp_path, f"defer-{defer}", defer=defer)
        try:
            engine_train(engine, data)
            if defer:
                assert engine.shard_optimizer.pending_keys
            engine.module.eval()
            with torch.no_grad():
                logits = engine(x).float()
            engine.module.train()
            engine_train(engine, data)  # pending again
            state = engine.full_state_dict()
            engine_train(engine, data)
            saved = engine.save_checkpoint(str(tmp_path / f"ckpt-{defer}"))
            results[defer] = (logits, state, saved)
        finally:
            engine.close()
    torch.testing.assert_close(results[True][0], results[False][0], rtol=0, atol=0)
    for k, v in results[False][1].items():
        assert torch.equal(results[True][1][k], v), k
    restored = {}
    for defer in (False, True):
        engine = _engine(tmp_path, f"restore-{defer}", defer=False)
        try:
            engine.load_checkpoint(results[defer][2])
            restored[defer] = engine.full_state_dict()
        finally:
            engine.close()
    for k, v in restored[False].items():
        assert torch.equal(restored[True][k], v), k


def test_finish_step_runs_the_pending_updates_now(tmp_path, slow_reads):
    """engine.finish_step() (a timed loop's last step): the deferred updates run and their
    write-backs reach NVMe before it returns; the values are those of the step run in place."""
    data = batches(2, 1)
    in_place = _engine(tmp_path, "in-place", defer=False)
    try:
        engine_train(in_place, data)
        want = in_place.full_state_dict()
    finally:
        in_place.close()
    engine = _engine(tmp_path, "deferred", defer=True)
    try:
        engine_train(engine, data)
        assert engine.shard_optimizer.pending_keys
        before = engine.stats()["nvme_bytes_by_kind"]
        engine.finish_step()
        assert engine.shard_optimizer.pending_keys == []
        after = engine.stats()["nvme_bytes_by_kind"]
        # The new moments are on NVMe (new parameters may stay in a dirty cached copy: lazy).
        assert after["opt"]["write"] > before["opt"]["write"]
        engine.finish_step()  # nothing waits: a no-op
        assert engine.stats()["nvme_bytes_by_kind"] == after
        state = engine.full_state_dict()
    finally:
        engine.close()
    for k, v in want.items():
        assert torch.equal(state[k], v), k


def test_checkpoint_load_is_not_overwritten_by_a_pending_update(tmp_path, slow_reads):
    """A checkpoint loaded while a deferred step is pending wins: the pending updates run first,
    then the loaded values replace them (nothing stale lands afterwards)."""
    data = batches(2, 1)
    source = _engine(tmp_path, "source", defer=False)
    try:
        engine_train(source, data)
        saved = source.save_checkpoint(str(tmp_path / "ckpt"))
        want = source.full_state_dict()
    finally:
        source.close()
    engine = _engine(tmp_path, "target", defer=True)
    try:
        engine_train(engine, batches(3, 1))
        assert engine.shard_optimizer.pending_keys
        engine.load_checkpoint(saved)
        got = engine.full_state_dict()
    finally:
        engine.close()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_each_sub_group_is_acquired_once_per_step(tmp_path, slow_reads):
    """The backward's read-ahead fills the window, so the step starts with its cursor behind
    items already read; an update must move the cursor past itself, or the next read ahead takes
    an item already updated again (a second acquire: a read when its copy was evicted, and a
    window slot pinned until the step ends)."""
    data = batches(STEPS, 1)
    engine = _engine(tmp_path, "once", defer=True)
    mark_backward(engine, slow_reads)
    acquire, acquires = engine.store.acquire, Counter()

    def counted_acquire(key, tier, **kwargs):
        if key.startswith("opt/"):
            acquires[key] += 1
        return acquire(key, tier, **kwargs)

    engine.store.acquire = counted_acquire
    try:
        engine_train(engine, data)
        engine.shard_optimizer.drain()
        in_backward = [k for k, bwd in slow_reads["reads"] if bwd and k.startswith("opt/")]
        assert in_backward, "the window is filled during backward"
        assert acquires and set(acquires.values()) == {STEPS}, acquires.most_common(3)
    finally:
        engine.close()


def _host_engine(tmp_path, name: str, *, defer: bool, gas: int = 1, device_budget="auto",
                 copy_link=None):
    from tests._support.models import four_gpt

    path = str(tmp_path / name)
    engine = infinity.initialize(four_gpt(), engine_config(
        stage=3, dtype="bf16", gas=gas, clip=0.05,
        offload_optimizer={"device": "cpu", "nvme_path": path},
        offload_param={"device": "cpu", "nvme_path": path},
        memory={"device_budget_bytes": device_budget}, zero={"sub_group_numel": 300}),
        copy_link=copy_link)
    engine.defer_optimizer_step = defer
    return engine


@pytest.mark.parametrize("gas", [1, 2])
def test_a_host_optimizer_defers_where_updated_shards_cross_to_the_device(tmp_path, gas):
    """[Note: a deferred step overlaps the copies up] in infinity/zero/_engine.py: a HOST
    optimizer with parameters read through a bounded DEVICE tier defers its updates into the next
    forward; under a slow, poisoned copy link (a shard read up before its update, or before its
    copy lands, is a wrong number) training is bitwise the step run in place, and plain PyTorch's.
    Where gathers read the HOST copies (an 'auto' device budget on a CPU), nothing crosses: the
    step runs in place."""
    from infinity import LinkModel
    from tests._support.models import FOUR, four_gpt, unit_numels

    link = LinkModel(bandwidth_gbytes_per_s=0.05, latency_us=200.0, poison_until_wait=True)
    budget = 3 * max(unit_numels(four_gpt())) * 2
    data = batches(STEPS, gas, config=FOUR)
    ref_losses, ref_state = reference_train(four_gpt(), data, dtype="bf16", clip=0.05)
    in_place = _host_engine(tmp_path, "in-place", defer=False, gas=gas, device_budget=budget,
                            copy_link=link)
    assert not in_place._deferring
    deferred = _host_engine(tmp_path, "deferred", defer=True, gas=gas, device_budget=budget,
                            copy_link=link)
    _train_deferred_against_in_place(in_place, deferred, data, (ref_losses, ref_state))
    on_host = _host_engine(tmp_path, "on-host", defer=True)
    try:
        assert not on_host._deferring  # the auto budget reads HOST copies: nothing crosses
    finally:
        on_host.close()
