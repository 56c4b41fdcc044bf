"""A full tier waits for moves already under way instead of refusing ([Note: wait, do not refuse]).

Slow swapper I/O (a sleep before each block) keeps the moves in flight while the next request
arrives, so these tests exercise the waiting path every run; the data is checked against what was
written, read back from disk by a fresh swap-in.
"""

from __future__ import annotations

import time

import pytest
import torch

from infinity.errors import TierCapacityError
from infinity.tiers import Residency, Tier
from tests._support.slow_io import slow_io
from tests._support.store import KB4, make_store, read_swap_file
from tests._support.tensors import random_values, same_bytes


def test_writebacks_wait_for_host_staging_in_flight(tmp_path, monkeypatch):
    # Six DEVICE copies of NVMe-homed shards are dirty; the HOST budget holds two staging extents.
    # Each write-back stages DEVICE -> HOST -> NVMe; later ones must wait for earlier ones' staging
    # extents to become evictable (this used to raise TierCapacityError).
    numel = KB4 // 4
    keys = [f"w{i}" for i in range(6)]
    with make_store(tmp_path, host_bytes=2 * KB4) as (store, swapper):
        for key in keys:
            store.register(key, numel, torch.float32, Tier.NVME)  # zeros, no file yet
        expected = {}
        for i, key in enumerate(keys):
            store.fetch(key, Tier.DEVICE).wait()
            expected[key] = random_values(numel, torch.float32, seed=i)
            store.get(key, Tier.DEVICE).copy_(expected[key])
            store.mark_dirty(key, Tier.DEVICE)
        slow_io(monkeypatch, swapper, "out")
        real_copy = store._mover._copy  # noqa: SLF001 - the write-back's copy, slowed

        def slow_copy(dst, src, ready):  # keeps each staging copy INFLIGHT for a while
            time.sleep(0.05)
            real_copy(dst, src, ready)

        monkeypatch.setattr(store._mover, "_copy", slow_copy)  # noqa: SLF001
        handles = [store.write_back(key) for key in keys]
        for handle in handles:
            assert handle.wait(timeout=60) is None
        for key in keys:
            assert store.is_dirty(key) is None
            on_disk = read_swap_file(swapper, key, numel * 4, swapper.alignment_bytes)
            assert same_bytes(on_disk.view(torch.float32), expected[key])
            assert same_bytes(store.fetch(key, Tier.DEVICE).wait(), expected[key])


def test_flush_under_a_one_extent_host_budget(tmp_path, monkeypatch):
    numel = KB4 // 4
    with make_store(tmp_path, host_bytes=KB4) as (store, swapper):
        expected = {}
        for i in range(4):
            key = f"f{i}"
            store.register(key, numel, torch.float32, Tier.NVME)
            store.fetch(key, Tier.DEVICE).wait()
            expected[key] = random_values(numel, torch.float32, seed=10 + i)
            store.get(key, Tier.DEVICE).copy_(expected[key])
            store.mark_dirty(key, Tier.DEVICE)
        slow_io(monkeypatch, swapper, "out")
        store.flush()
        for key, value in expected.items():
            on_disk = read_swap_file(swapper, key, numel * 4, swapper.alignment_bytes)
            assert same_bytes(on_disk.view(torch.float32), value)


def test_fetch_waits_for_an_unpinned_fetch_in_flight(tmp_path, monkeypatch):
    # One HOST extent; a prefetch of 'a' is still reading when 'b' is fetched: 'b' waits for 'a'
    # to land, evicts it, and reads its own bytes.
    data = {k: torch.full((KB4,), v, dtype=torch.uint8) for k, v in (("a", 7), ("b", 9))}
    with make_store(tmp_path, host_bytes=KB4) as (store, swapper):
        for key, value in data.items():
            store.register(key, KB4, torch.uint8, Tier.NVME, initial=value)
            store.flush()
            store.evict(key, Tier.HOST)
        slow_io(monkeypatch, swapper, "in")
        first = store.fetch("a", Tier.HOST)
        second = store.fetch("b", Tier.HOST)
        first.wait(timeout=60)
        assert same_bytes(second.wait(timeout=60), data["b"])
        assert store.state("a", Tier.HOST) is Residency.ABSENT


def test_a_pinned_fetch_in_flight_is_not_waited_for(tmp_path, monkeypatch):
    # The same, but 'a' is acquired: it will stay, so waiting would be for nothing. Refuse now.
    with make_store(tmp_path, host_bytes=KB4) as (store, swapper):
        store.register("a", KB4, torch.uint8, Tier.NVME, initial=torch.ones(KB4, dtype=torch.uint8))
        store.register("b", KB4, torch.uint8, Tier.NVME)
        store.flush()
        store.evict("a", Tier.HOST)
        slow_io(monkeypatch, swapper, "in")
        pinned = store.acquire("a", Tier.HOST)
        with pytest.raises(TierCapacityError, match="'b'"):
            store.fetch("b", Tier.HOST)
        assert torch.all(pinned.wait(timeout=60) == 1)
        store.release("a", Tier.HOST)



def test_fragmented_arena_waits_for_a_fetch_in_flight(tmp_path, monkeypatch):
    # Arena of 5 extents: [free][s1 pinned][s3 being fetched, unpinned][free][pad, a HOST home].
    # Two extents are free but apart; a 2-extent shard fits only once s3 lands and is evicted:
    # wait for it (this used to raise "fragmented ... no unpinned copy is left to evict").
    with make_store(tmp_path, host_bytes=5 * KB4) as (store, swapper):
        for i in range(4):
            store.register(f"s{i}", KB4, torch.uint8, Tier.NVME,
                           initial=torch.full((KB4,), i, dtype=torch.uint8))
        store.register("big", 2 * KB4, torch.uint8, Tier.NVME,
                       initial=torch.full((2 * KB4,), 42, dtype=torch.uint8))
        store.flush()
        for key in ("s0", "s1", "s2", "s3", "big"):
            store.evict(key, Tier.HOST)
        assert store.arena.extents() == []
        for i in range(4):  # extents 0..3 in order
            store.fetch(f"s{i}", Tier.HOST).wait()
        store.acquire("s1", Tier.HOST).wait()
        store.register("pad", KB4, torch.uint8, Tier.HOST)  # the last extent, for good
        store.evict("s2", Tier.HOST)
        store.evict("s3", Tier.HOST)
        slow_io(monkeypatch, swapper, "in")
        in_flight = store.fetch("s3", Tier.HOST)  # best fit: the 2-extent hole, at extent 2
        store.evict("s0", Tier.HOST)
        assert store.state("s3", Tier.HOST) is Residency.INFLIGHT
        assert [(h.offset_bytes, h.size_bytes) for h in store.arena.holes()] == [(0, KB4),
                                                                                (3 * KB4, KB4)]
        assert torch.all(store.fetch("big", Tier.HOST).wait(timeout=60) == 42)
        in_flight.wait(timeout=60)  # it landed (no error), then was evicted to make the hole
        assert store.state("s3", Tier.HOST) is Residency.ABSENT
        assert torch.all(store.fetch("s3", Tier.HOST).wait(timeout=60) == 3)
        assert torch.all(store.get("s1", Tier.HOST) == 1)
        assert torch.all(store.get("pad", Tier.HOST) == 0)
        store.release("s1", Tier.HOST)


def test_fetch_waits_for_a_host_copy_being_read(tmp_path, monkeypatch):
    # One HOST extent holds 'a' while it is copied to DEVICE (busy); fetching 'b' into HOST waits
    # for that copy to end instead of refusing, and both shards read back right.
    data = {k: torch.full((KB4,), v, dtype=torch.uint8) for k, v in (("a", 5), ("b", 6))}
    with make_store(tmp_path, host_bytes=KB4) as (store, swapper):
        store.register("b", KB4, torch.uint8, Tier.NVME, initial=data["b"])
        store.flush()
        store.evict("b", Tier.HOST)
        store.register("a", KB4, torch.uint8, Tier.NVME, initial=data["a"])
        store.flush()
        # The fetch's copy is issued by _issue_copy (patching _copy, the write-backs' copy, as
        # this test once did, left the fetch fast and the wait untested).
        real_issue = store._mover._issue_copy  # noqa: SLF001

        def slow_issue(dst, src, ready):
            time.sleep(0.2)
            return real_issue(dst, src, ready)

        monkeypatch.setattr(store._mover, "_issue_copy", slow_issue)  # noqa: SLF001
        to_device = store.fetch("a", Tier.DEVICE)  # reads the HOST copy of 'a' for 0.2 s
        assert same_bytes(store.fetch("b", Tier.HOST).wait(timeout=60), data["b"])
        assert same_bytes(to_device.wait(timeout=60), data["a"])
        assert store.state("a", Tier.HOST) is Residency.ABSENT


@pytest.mark.parametrize("ahead", [False, True])
def test_a_read_ahead_waits_for_room_on_the_room_lane(tmp_path, monkeypatch, ahead):
    """[Note: a read ahead never waits for room on its caller]: the HOST budget holds one extent,
    taken by a dirty copy whose write-back is slow. A blocking acquire returns once the
    write-back has made room (the copy is clean by then); one issued ahead returns while it is
    still being written, and its handle gives the other shard's bytes once the lane has made
    room. Both leave the written copy's bytes on disk."""
    numel = KB4 // 4
    with make_store(tmp_path, host_bytes=KB4) as (store, swapper):
        first, second = random_values(numel, torch.float32, seed=1), \
            random_values(numel, torch.float32, seed=2)
        store.register("a", numel, torch.float32, Tier.NVME, initial=first)
        store.register("b", numel, torch.float32, Tier.NVME, initial=second)
        store.flush()
        store.evict("b", Tier.HOST)
        updated = random_values(numel, torch.float32, seed=3)
        store.acquire("a", Tier.HOST).wait().copy_(updated)
        store.mark_dirty("a", Tier.HOST)
        store.release("a", Tier.HOST)
        slow_io(monkeypatch, swapper, "out", seconds=0.5)
        handle = store.acquire("b", Tier.HOST, ahead=ahead)
        assert store.is_dirty("a") is (Tier.HOST if ahead else None)
        assert same_bytes(handle.wait(timeout=60), second)
        assert store.is_dirty("a") is None and store.state("a", Tier.HOST) is Residency.ABSENT
        store.release("b", Tier.HOST)
        on_disk = read_swap_file(swapper, "a", numel * 4, swapper.alignment_bytes)
        assert same_bytes(on_disk.view(torch.float32), updated)


def test_a_read_ahead_without_any_room_fails_through_its_handle(tmp_path, monkeypatch):
    """Where no room can be made at all the error is the blocking acquire's (TierCapacityError,
    naming the shard), raised at issue when nothing is under way, and through the handle when
    the room lane found out; either way nothing stays pinned."""
    numel = KB4 // 4
    with make_store(tmp_path, host_bytes=KB4) as (store, swapper):
        for key in ("a", "b"):
            store.register(key, numel, torch.float32, Tier.NVME)
        store.acquire("a", Tier.HOST).wait()  # pinned: the only extent
        with pytest.raises(TierCapacityError, match="'b'"):
            store.acquire("b", Tier.HOST, ahead=True)
        store.release("a", Tier.HOST)
        store.acquire("a", Tier.HOST).wait().fill_(1.0)
        store.mark_dirty("a", Tier.HOST)
        store.release("a", Tier.HOST)
        slow_io(monkeypatch, swapper, "out", seconds=0.5)
        handle = store.acquire("b", Tier.HOST, ahead=True)  # the lane waits for 'a''s write
        pinned = store.acquire("a", Tier.HOST)  # ... and this pin lands first
        with pytest.raises(TierCapacityError, match="'b'"):
            handle.wait(timeout=60)
        assert pinned.wait(timeout=60).eq(1.0).all()
        store.release("a", Tier.HOST)
        store.evict("a", Tier.HOST)  # nothing pinned is left: both copies can go
        assert store.state("b", Tier.HOST) is Residency.ABSENT


def test_write_backs_hold_no_copy_thread(tmp_path, monkeypatch):
    """[Note: a write-back holds no copy thread] in infinity/tiers/_writeback.py: six NVMe write-backs
    are issued through a store with two copy threads; all six are on the disk at once, and a read
    issued after them completes while they are still being written (its completion used to queue
    behind them on the copy threads). Every byte lands where it belongs."""
    numel = KB4 // 4
    keys = [f"w{i}" for i in range(6)]
    with make_store(tmp_path, host_bytes=16 * KB4) as (store, swapper):
        assert store.config.num_copy_threads == 2
        stored = random_values(numel, torch.float32, seed=7)
        store.register("r", numel, torch.float32, Tier.NVME, initial=stored)
        store.flush()
        store.evict("r", Tier.HOST)
        updated = {}
        for i, key in enumerate(keys):
            store.register(key, numel, torch.float32, Tier.NVME)
            updated[key] = random_values(numel, torch.float32, seed=10 + i)
            store.acquire(key, Tier.HOST).wait().copy_(updated[key])
            store.mark_dirty(key, Tier.HOST)
            store.release(key, Tier.HOST)
        log = slow_io(monkeypatch, swapper, "out", seconds=0.5)
        writes = [store.write_back(key) for key in keys]
        got = store.acquire("r", Tier.HOST).wait(timeout=60)
        assert log.in_flight["out"] > 0, "the read waited for the write-backs"
        assert same_bytes(got, stored)
        store.release("r", Tier.HOST)
        for handle in writes:
            handle.wait(timeout=60)
        assert log.most_in_flight["out"] == len(keys)
        for key in keys:
            on_disk = read_swap_file(swapper, key, numel * 4, swapper.alignment_bytes)
            assert same_bytes(on_disk.view(torch.float32), updated[key])
