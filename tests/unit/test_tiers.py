"""Tiered store: round trips, write-back, eviction order, capacity errors, missing-wait detection.

Data is checked against the original tensors and against bytes read back from the swap files with a
fresh swap-in, never against the store's own bookkeeping alone.
"""

from __future__ import annotations

import itertools
import os
import threading

import pytest
import torch

from infinity.config import MemoryConfig
from infinity.errors import IllegalTransitionError, SwapIOError, TierCapacityError
from infinity.tiers import TRANSITIONS, Residency, StoreConfig, Tier
from infinity.tiers._records import _Shard
from tests._support.slow_io import slow_io
from tests._support.store import KB4, make_store, read_swap_file
from tests._support.tensors import random_values, same_bytes

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]


# -- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("home", [Tier.NVME, Tier.HOST, Tier.DEVICE])
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_every_path(tmp_path, home, dtype):
    numel = 3001  # not a multiple of the alignment in any dtype
    with make_store(tmp_path) as (store, swapper):
        original = random_values(numel, dtype, seed=1)
        store.register("s", numel, dtype, home, initial=original.clone())
        for tier in (Tier.DEVICE, Tier.HOST, Tier.DEVICE):
            got = store.fetch("s", tier).wait()
            assert got.dtype == dtype and got.numel() == numel
            assert same_bytes(got, original), f"{home.name} -> {tier.name}"
            if tier is not home:
                store.evict("s", tier)
        # Modify a non-home copy, write it back, drop it: the home copy has the new bytes.
        tier = Tier.DEVICE if home is not Tier.DEVICE else Tier.HOST
        copy = store.fetch("s", tier).wait()
        update = random_values(numel, dtype, seed=2)
        copy.copy_(update)
        store.mark_dirty("s", tier)
        store.write_back("s").wait()
        store.evict("s", tier)
        if home is Tier.NVME:
            store.evict("s", Tier.HOST)
            assert same_bytes(read_swap_file(swapper, "s", numel * dtype.itemsize,
                                             store.arena.alignment_bytes).view(dtype), update)
        for tier in (Tier.HOST, Tier.DEVICE):
            assert same_bytes(store.fetch("s", tier).wait(), update), f"after write-back {tier.name}"


def test_the_cheap_queries_say_what_stats_says(tmp_path):
    """budget_bytes, used_bytes and moved_bytes (for planners that ask on every decision) agree
    with stats() as shards come and go, are read and are written."""
    with make_store(tmp_path, device_bytes=1 << 16, host_bytes=1 << 18) as (store, _):
        assert store.budget_bytes(Tier.DEVICE) == 1 << 16
        assert store.budget_bytes(Tier.HOST) == 1 << 18

        def agree():
            s = store.stats()
            for tier in (Tier.DEVICE, Tier.HOST):
                assert store.used_bytes(tier) == s[f"{tier.label}_used_bytes"]
                assert store.budget_bytes(tier) == s[f"{tier.label}_budget_bytes"]
            for src, dst in ((Tier.NVME, Tier.HOST), (Tier.HOST, Tier.DEVICE),
                             (Tier.DEVICE, Tier.HOST), (Tier.HOST, Tier.NVME)):
                assert store.moved_bytes(src, dst) == s[f"bytes_{src.label}_to_{dst.label}"]
        agree()
        store.register("a", 1000, torch.float32, Tier.NVME,
                       initial=random_values(1000, torch.float32, 1))
        store.register("b", 500, torch.float32, Tier.HOST)
        store.flush()
        agree()
        assert store.moved_bytes(Tier.HOST, Tier.NVME) >= 4000
        store.evict("a", Tier.HOST)
        store.acquire("a", Tier.DEVICE).wait()
        agree()
        assert store.used_bytes(Tier.DEVICE) >= 4000
        assert store.moved_bytes(Tier.NVME, Tier.HOST) >= 4000
        store.release("a", Tier.DEVICE)
        store.unregister("b")
        agree()


def test_register_without_initial_is_zeros(tmp_path):
    with make_store(tmp_path) as (store, _):
        for home in Tier:
            store.register(f"z{home.name}", 1000, torch.float32, home)
            for tier in (Tier.DEVICE, Tier.HOST):
                assert torch.count_nonzero(store.fetch(f"z{home.name}", tier).wait()) == 0


def test_register_copies_initial(tmp_path):
    """The caller may reuse its tensor right after register (even while the swap-out runs)."""
    with make_store(tmp_path) as (store, _):
        data = random_values(5000, torch.float32, seed=3)
        keep = data.clone()
        store.register("a", 5000, torch.float32, Tier.NVME, initial=data)
        data.fill_(7.0)
        store.evict("a", Tier.HOST)
        assert same_bytes(store.fetch("a", Tier.DEVICE).wait(), keep)


# -- dirty data --------------------------------------------------------------------------------------


def test_dirty_host_copy_of_nvme_shard_survives_eviction(tmp_path):
    numel = 2500
    with make_store(tmp_path) as (store, swapper):
        store.register("w", numel, torch.float32, Tier.NVME, initial=random_values(numel, torch.float32, 0))
        host = store.acquire("w", Tier.HOST).wait()
        modified = random_values(numel, torch.float32, seed=9)
        host.copy_(modified)
        store.mark_dirty("w", Tier.HOST)
        store.release("w", Tier.HOST)
        del host
        store.evict("w", Tier.HOST)
        assert store.state("w", Tier.HOST) is Residency.ABSENT
        on_disk = read_swap_file(swapper, "w", numel * 4, store.arena.alignment_bytes).view(torch.float32)
        assert same_bytes(on_disk, modified)
        assert same_bytes(store.fetch("w", Tier.HOST).wait(), modified)


def test_overwrite_acquire_reads_nothing_and_the_written_bytes_reach_nvme(tmp_path):
    """acquire(overwrite=True) of an NVMe-homed shard cached nowhere allocates the device copy
    without any read (no NVMe->HOST or HOST->DEVICE bytes); what the caller writes is what lands
    in the swap file. A resident copy is handed out as it is."""
    numel = 2500
    with make_store(tmp_path) as (store, swapper):
        store.register("w", numel, torch.float32, Tier.NVME,
                       initial=random_values(numel, torch.float32, 0))
        store.flush()
        store.evict("w", Tier.HOST)
        before = store.stats()
        new = random_values(numel, torch.float32, seed=5)
        dev = store.acquire("w", Tier.DEVICE, overwrite=True).wait()
        dev.copy_(new)
        store.mark_dirty("w", Tier.DEVICE)
        store.release("w", Tier.DEVICE)
        store.write_back("w").wait()
        after = store.stats()
        assert after["bytes_nvme_to_host"] == before["bytes_nvme_to_host"]
        assert after["bytes_host_to_device"] == before["bytes_host_to_device"]
        assert after["fetch_overwrites"] == before["fetch_overwrites"] + 1
        on_disk = read_swap_file(swapper, "w", numel * 4, store.arena.alignment_bytes)
        assert same_bytes(on_disk.view(torch.float32), new)
        again = store.acquire("w", Tier.DEVICE, overwrite=True).wait()  # resident: as it is
        assert same_bytes(again, new)
        store.release("w", Tier.DEVICE)


@pytest.mark.parametrize("tier", [Tier.DEVICE, Tier.HOST])
def test_stage3_optimizer_write_failing_midway_leaves_the_old_shard(tmp_path, tier):
    """The parameter manager's write path (overwrite): a write that raises half way evicts the
    copy written (DEVICE; HOST where an offloaded optimizer, or a CPU engine reading shards there,
    writes them), so the next read sees the shard's previous bytes, never the half-written ones."""
    from types import SimpleNamespace

    from infinity.zero._param_partitions import ParamPartitions

    numel = 2500
    old = random_values(numel, torch.float32, 0)
    with make_store(tmp_path) as (store, _):
        store.register("w", numel, torch.float32, Tier.NVME, initial=old)
        store.flush()
        store.evict("w", Tier.HOST)
        partitions = SimpleNamespace(store=store, write_tier=tier,
                                     storage=SimpleNamespace(borrowed={}),  # no unit gathered
                                     param_home=Tier.NVME)
        group = SimpleNamespace(store_key="w")
        with pytest.raises(RuntimeError, match="boom"):
            with ParamPartitions._open_stored_shard(partitions, group, overwrite=True) as dev:
                dev[:100].fill_(7.0)
                raise RuntimeError("boom")
        assert store.state("w", tier) is Residency.ABSENT
        assert same_bytes(store.fetch("w", tier).wait(), old)


def test_budget_eviction_writes_back_dirty_device_copy(tmp_path):
    """A dirty DEVICE copy evicted to make room goes DEVICE -> HOST -> NVME before it is dropped."""
    numel = 1024  # 4 KiB each; DEVICE holds one shard, HOST two extents
    with make_store(tmp_path, device_bytes=4096, host_bytes=2 * KB4) as (store, swapper):
        for key in "ab":
            store.register(key, numel, torch.float32, Tier.NVME)
        dev = store.fetch("a", Tier.DEVICE).wait()
        new = random_values(numel, torch.float32, seed=4)
        dev.copy_(new)
        store.mark_dirty("a", Tier.DEVICE)
        del dev
        store.fetch("b", Tier.DEVICE).wait()  # evicts a from DEVICE: must write it back first
        assert store.state("a", Tier.DEVICE) is Residency.ABSENT
        assert same_bytes(read_swap_file(swapper, "a", numel * 4, store.arena.alignment_bytes)
                          .view(torch.float32), new)
        store.evict("a", Tier.HOST)
        assert same_bytes(store.fetch("a", Tier.DEVICE).wait(), new)


def test_mark_dirty_drops_stale_copies_and_home_is_rewritten(tmp_path):
    with make_store(tmp_path) as (store, _):
        store.register("h", 800, torch.float32, Tier.HOST, initial=torch.zeros(800))
        store.fetch("h", Tier.DEVICE).wait()
        home = store.get("h", Tier.HOST)
        home.fill_(3.0)
        store.mark_dirty("h", Tier.HOST)  # the DEVICE copy is stale now
        assert store.state("h", Tier.DEVICE) is Residency.ABSENT
        assert torch.all(store.fetch("h", Tier.DEVICE).wait() == 3.0)
        dev = store.get("h", Tier.DEVICE)
        dev.fill_(5.0)
        store.mark_dirty("h", Tier.DEVICE)
        with pytest.raises(ValueError, match="stale"):
            store.get("h", Tier.HOST)
        # fetch of the stale home copy writes back first
        assert torch.all(store.fetch("h", Tier.HOST).wait() == 5.0)
        assert store.is_dirty("h") is None


def test_mark_dirty_refuses_when_a_stale_copy_is_acquired(tmp_path):
    with make_store(tmp_path) as (store, _):
        store.register("p", 100, torch.float32, Tier.HOST)
        store.acquire("p", Tier.DEVICE).wait()
        with pytest.raises(ValueError, match="acquired"):
            store.mark_dirty("p", Tier.HOST)


def test_flush_writes_every_dirty_shard(tmp_path):
    with make_store(tmp_path) as (store, swapper):
        expect = {}
        for i in range(4):
            store.register(f"f{i}", 300, torch.float32, Tier.NVME)
            t = store.fetch(f"f{i}", Tier.HOST).wait()
            expect[f"f{i}"] = random_values(300, torch.float32, seed=i)
            t.copy_(expect[f"f{i}"])
            store.mark_dirty(f"f{i}", Tier.HOST)
        store.flush()
        for key, value in expect.items():
            assert store.is_dirty(key) is None
            assert same_bytes(read_swap_file(swapper, key, 1200, store.arena.alignment_bytes)
                              .view(torch.float32), value)


# -- eviction order -----------------------------------------------------------------------------------


def _three_on_device(store):
    for key in "abcd":
        store.register(key, 1024, torch.float32, Tier.HOST)
    for key in "abc":
        store.fetch(key, Tier.DEVICE).wait()


def test_lru_eviction_order(tmp_path):
    with make_store(tmp_path, device_bytes=3 * 4096) as (store, _):
        _three_on_device(store)
        store.fetch("a", Tier.DEVICE).wait()  # a is now the most recently used
        store.fetch("d", Tier.DEVICE).wait()
        absent = [k for k in "abcd" if store.state(k, Tier.DEVICE) is Residency.ABSENT]
        assert absent == ["b"]
        store.fetch("b", Tier.DEVICE).wait()
        absent = [k for k in "abcd" if store.state(k, Tier.DEVICE) is Residency.ABSENT]
        assert absent == ["c"]


def test_belady_eviction_with_next_use_per_fetch(tmp_path):
    with make_store(tmp_path, device_bytes=3 * 4096) as (store, _):
        for key in "abcd":
            store.register(key, 1024, torch.float32, Tier.HOST)
        for key, dist in (("a", 5.0), ("b", 1.0), ("c", 9.0)):
            store.fetch(key, Tier.DEVICE, next_use=dist).wait()
        store.fetch("d", Tier.DEVICE, next_use=2.0).wait()
        absent = [k for k in "abcd" if store.state(k, Tier.DEVICE) is Residency.ABSENT]
        assert absent == ["c"]  # furthest next use, although a is the least recently used


def test_belady_eviction_with_callable(tmp_path):
    distance = {"a": 3.0, "b": 7.0, "c": 1.0, "d": 0.0}
    with make_store(tmp_path, device_bytes=3 * 4096, next_use=distance.get) as (store, _):
        _three_on_device(store)
        store.fetch("d", Tier.DEVICE).wait()
        assert store.state("b", Tier.DEVICE) is Residency.ABSENT
        distance.update(a=10.0)  # evaluated at eviction time
        store.fetch("b", Tier.DEVICE).wait()
        assert store.state("a", Tier.DEVICE) is Residency.ABSENT


def test_pinned_and_home_copies_are_never_evicted(tmp_path):
    with make_store(tmp_path, device_bytes=2 * 4096) as (store, _):
        store.register("home", 1024, torch.float32, Tier.DEVICE)
        for key in "ab":
            store.register(key, 1024, torch.float32, Tier.HOST)
        store.acquire("a", Tier.DEVICE).wait()
        with pytest.raises(TierCapacityError):
            store.fetch("b", Tier.DEVICE)
        store.release("a", Tier.DEVICE)
        store.fetch("b", Tier.DEVICE).wait()
        assert store.state("a", Tier.DEVICE) is Residency.ABSENT
        assert store.state("home", Tier.DEVICE) is Residency.RESIDENT
        with pytest.raises(ValueError, match="home"):
            store.evict("home", Tier.DEVICE)


# -- capacity ---------------------------------------------------------------------------------------------


def test_capacity_error_when_everything_is_pinned(tmp_path):
    with make_store(tmp_path, device_bytes=10_000, host_bytes=4 * KB4) as (store, _):
        for key in "abc":
            store.register(key, 1000, torch.float32, Tier.NVME)  # 4000 B, one 4 KiB extent each
        store.register("big", 2000, torch.float32, Tier.NVME)  # 8000 B, two extents
        store.acquire("a", Tier.DEVICE).wait()
        store.acquire("b", Tier.DEVICE).wait()
        with pytest.raises(TierCapacityError) as info:
            store.acquire("c", Tier.DEVICE)
        err = info.value
        assert (err.tier, err.requested_bytes, err.used_bytes, err.budget_bytes) == (
            "DEVICE", 4000, 8000, 10_000)
        assert "'c'" in str(err)
        for key in "ab":
            store.acquire(key, Tier.HOST).wait()
        store.acquire("c", Tier.HOST).wait()
        with pytest.raises(TierCapacityError) as info:
            store.fetch("big", Tier.HOST)
        err = info.value
        assert (err.tier, err.requested_bytes, err.used_bytes, err.budget_bytes) == (
            "HOST", 2 * KB4, 3 * KB4, 4 * KB4)
        with pytest.raises(TierCapacityError, match="whole budget"):
            store.register("huge", 5 * KB4, torch.uint8, Tier.HOST)


def test_fragmented_arena_evicts_to_make_a_hole(tmp_path):
    with make_store(tmp_path, host_bytes=4 * KB4) as (store, _):
        for i in range(4):
            store.register(f"s{i}", KB4, torch.uint8, Tier.NVME, initial=torch.full((KB4,), i, dtype=torch.uint8))
        store.register("big", 2 * KB4, torch.uint8, Tier.NVME,
                       initial=None)  # no HOST copy (zeros)
        store.flush()
        for i in range(4):
            store.fetch(f"s{i}", Tier.HOST).wait()
        store.evict("s0", Tier.HOST)
        store.evict("s2", Tier.HOST)
        for i in (1, 3):  # pinned: 2 extents free, but not contiguous
            store.acquire(f"s{i}", Tier.HOST).wait()
        with pytest.raises(TierCapacityError, match="fragmented"):
            store.fetch("big", Tier.HOST)
        store.release("s1", Tier.HOST)
        assert torch.count_nonzero(store.fetch("big", Tier.HOST).wait()) == 0
        assert store.state("s3", Tier.HOST) is Residency.RESIDENT
        assert torch.all(store.get("s3", Tier.HOST) == 3)


def test_a_prefetch_never_evicts_a_copy_used_sooner(tmp_path):
    """[Note: a prefetch never evicts a sooner use]: free bytes enough for 'big', but in two holes,
    so a hole must be made; the only evictable copies are used before 'big'. A prefetch is refused
    and leaves them resident; once a copy used after it is evictable, the prefetch takes that
    one; a demand fetch still takes copies used sooner (furthest first)."""
    distance = {"s0": 1.0, "s1": 0.0, "s2": 3.0, "big": 2.0}
    with make_store(tmp_path, host_bytes=4 * KB4, next_use=distance.get) as (store, _):
        for i in range(4):
            store.register(f"s{i}", KB4, torch.uint8, Tier.NVME,
                           initial=torch.full((KB4,), i, dtype=torch.uint8))
        store.register("big", 2 * KB4, torch.uint8, Tier.NVME, initial=None)
        store.flush()
        for i in range(4):
            store.fetch(f"s{i}", Tier.HOST).wait()
        store.evict("s3", Tier.HOST)
        store.evict("s1", Tier.HOST)  # free: extents 1 and 3, not contiguous
        store.fetch("s1", Tier.HOST).wait()  # back in a hole: s0 s1 s2 _
        store.evict("s2", Tier.HOST)  # s0 s1 _ _: 'big' fits without eviction ...
        store.fetch("s2", Tier.HOST, prefetch=True).wait()  # ... until s2 lands best-fit: s0 s1 s2 _
        assert [store.state(f"s{i}", Tier.HOST) for i in range(3)] == [Residency.RESIDENT] * 3
        store.acquire("s2", Tier.HOST).wait()  # the one copy used after 'big': pinned
        with pytest.raises(TierCapacityError, match="used sooner"):
            store.fetch("big", Tier.HOST, prefetch=True)
        assert [store.state(f"s{i}", Tier.HOST) for i in range(3)] == [Residency.RESIDENT] * 3
        store.release("s2", Tier.HOST)
        store.fetch("big", Tier.HOST, prefetch=True).wait()  # s2, used after it, makes way
        assert store.state("s2", Tier.HOST) is Residency.ABSENT
        assert store.state("s0", Tier.HOST) is Residency.RESIDENT
        store.evict("big", Tier.HOST)
        store.fetch("s2", Tier.HOST).wait()
        store.acquire("s2", Tier.HOST).wait()
        store.fetch("big", Tier.HOST).wait()  # demand: takes copies used sooner all the same
        assert store.state("big", Tier.HOST) is Residency.RESIDENT
        assert store.state("s0", Tier.HOST) is Residency.ABSENT
        store.release("s2", Tier.HOST)


def test_a_set_up_copy_is_dropped_once_written_and_the_next_reuses_its_extent(tmp_path):
    """[Note: set-up copies are dropped once written]: registered with keep_host_copy=False, an
    NVMe shard's HOST copy is gone once its write completed (the bytes on disk are the initial
    values), the next such registration reuses the same extent at the arena's bottom, and the
    default keeps the copy as a cache."""
    with make_store(tmp_path, host_bytes=8 * KB4) as (store, swapper):
        offsets = []
        for i in range(3):
            store.register(f"s{i}", KB4, torch.uint8, Tier.NVME,
                           initial=torch.full((KB4,), i + 1, dtype=torch.uint8),
                           keep_host_copy=False)
            offsets.append(store.arena.extents()[0].offset_bytes if store.arena.extents() else 0)
            store.write_back(f"s{i}").wait()  # its write has completed: the copy is dropped
            assert store.state(f"s{i}", Tier.HOST) is Residency.ABSENT
            assert store.arena.extents() == []
            on_disk = read_swap_file(swapper, f"s{i}", KB4, swapper.alignment_bytes)
            assert torch.all(on_disk == i + 1)
        assert offsets == [0, 0, 0]
        store.register("kept", KB4, torch.uint8, Tier.NVME,
                       initial=torch.full((KB4,), 9, dtype=torch.uint8))
        store.write_back("kept").wait()
        assert store.state("kept", Tier.HOST) is Residency.RESIDENT
        assert torch.all(store.fetch("s1", Tier.HOST).wait() == 2)  # read back from NVMe


def test_store_config_validation():
    with pytest.raises(ValueError, match="auto"):
        StoreConfig.from_memory(MemoryConfig())
    cfg = StoreConfig.from_memory(MemoryConfig(device_budget_bytes=10, host_budget_bytes=8192))
    assert (cfg.device_budget_bytes, cfg.host_budget_bytes) == (10, 8192)
    with pytest.raises(ValueError, match="host_budget_bytes"):
        StoreConfig(device_budget_bytes=1, host_budget_bytes=-1)


def test_register_validation(tmp_path):
    with make_store(tmp_path) as (store, _):
        store.register("k", 10, torch.float32, Tier.HOST)
        with pytest.raises(ValueError, match="already registered"):
            store.register("k", 10, torch.float32, Tier.HOST)
        with pytest.raises(ValueError, match="initial"):
            store.register("x", 10, torch.float32, Tier.HOST, initial=torch.zeros(11))
        with pytest.raises(ValueError, match="escape"):
            store.register("../x", 10, torch.float32, Tier.NVME)
        with pytest.raises(KeyError, match="not registered"):
            store.fetch("nope", Tier.HOST)
        with pytest.raises(ValueError, match="not resident"):
            store.get("k", Tier.DEVICE)
        with pytest.raises(ValueError, match="not acquired"):
            store.release("k", Tier.HOST)
        store.unregister("k")
        assert store.keys() == [] and store.stats()["host_used_bytes"] == 0


# -- residency table ------------------------------------------------------------------------------------


def test_transition_table_rejects_illegal_transitions():
    states = list(Residency)
    for old, new in itertools.product(states, states):
        if (old, new) in TRANSITIONS:
            TRANSITIONS.check("k", old, new, tier=Tier.HOST)
        else:
            with pytest.raises(IllegalTransitionError) as info:
                TRANSITIONS.check("key-7", old, new, tier=Tier.DEVICE)
            msg = str(info.value)
            assert "key-7" in msg and f"{old.name} -> {new.name}" in msg and "DEVICE" in msg
            allowed = [n.name for (o, n) in TRANSITIONS.edges if o is old]
            assert all(name in msg for name in allowed)
    shard = _Shard("s", 10, torch.float32, Tier.NVME)
    with pytest.raises(IllegalTransitionError):
        shard.set_state(Tier.HOST, Residency.WRITING)  # ABSENT -> WRITING: nothing to write
    assert (Residency.RESIDENT, Residency.RESIDENT) not in TRANSITIONS


def test_zeros_is_a_state_of_an_unwritten_nvme_home_only(tmp_path):
    shard = _Shard("s", 10, torch.float32, Tier.NVME)
    with pytest.raises(IllegalTransitionError, match="HOST"):
        shard.set_state(Tier.HOST, Residency.ZEROS)
    shard.set_state(Tier.NVME, Residency.ZEROS)
    assert shard.settled() and not Residency.ZEROS.holds_bytes and Residency.ZEROS.valid
    with make_store(tmp_path) as (store, swapper):
        store.register("z", 1024, torch.float32, Tier.NVME)
        assert store.state("z", Tier.NVME) is Residency.ZEROS
        assert store.fetch("z", Tier.HOST).wait().eq(0).all()
        assert store.stats()["bytes_nvme_to_host"] == 0  # nothing read: there is no file
        store.get("z", Tier.HOST).fill_(3.0)
        store.mark_dirty("z", Tier.HOST)
        store.write_back("z").wait()
        assert store.state("z", Tier.NVME) is Residency.RESIDENT
        store.evict("z", Tier.HOST)
        assert store.fetch("z", Tier.HOST).wait().eq(3.0).all()
        assert store.stats()["bytes_nvme_to_host"] == 4096


# -- I/O failures and missing waits ------------------------------------------------------------------------


def test_swap_error_reaches_wait_and_frees_the_extent(tmp_path):
    with make_store(tmp_path) as (store, swapper):
        store.register("bad", 2000, torch.float32, Tier.NVME, initial=torch.ones(2000))
        store.flush()
        store.evict("bad", Tier.HOST)
        with open(swapper.path_of("bad"), "r+b") as f:
            f.truncate(4096 + 100)
        handle = store.fetch("bad", Tier.DEVICE)
        with pytest.raises(SwapIOError):
            handle.wait()
        assert store.state("bad", Tier.HOST) is Residency.ABSENT
        assert store.state("bad", Tier.DEVICE) is Residency.ABSENT
        stats = store.stats()
        assert stats["host_used_bytes"] == 0 and stats["device_used_bytes"] == 0


def test_a_missing_wait_would_show_stale_data(tmp_path, monkeypatch):
    numel = 4096
    with make_store(tmp_path) as (store, swapper):
        data = random_values(numel, torch.float32, seed=5)
        store.register("slow", numel, torch.float32, Tier.NVME, initial=data)
        store.flush()
        store.evict("slow", Tier.HOST)
        # A released extent is reused: fill the arena with a marker so stale bytes are recognisable.
        store.arena.buffer.fill_(0xAB)
        slow_io(monkeypatch, swapper, seconds=0.3)  # a consumer that skips wait() sees stale data
        handle = store.fetch("slow", Tier.DEVICE)
        # Control: the HOST extent is still stale while the read sleeps, so the slow-down is real and
        # a store that copied HOST -> DEVICE without waiting for the read would fail below.
        staging = store.copy_info("slow", Tier.HOST).tensor
        assert not same_bytes(staging, data)
        assert same_bytes(handle.wait(), data)
        assert store.stats()["wait_s"] > 0
        # Slow write-back: evicting the dirty copy must wait for the swap-out before dropping it.
        host = store.get("slow", Tier.HOST)
        host.mul_(2)
        store.mark_dirty("slow", Tier.HOST)
        del host
        store.evict("slow", Tier.HOST)
        store.arena.buffer.fill_(0xCD)
        assert same_bytes(store.fetch("slow", Tier.HOST).wait(), data * 2)


# -- counters ---------------------------------------------------------------------------------------------


def test_counters_follow_the_bytes_moved(tmp_path):
    numel = 3000  # 12000 B payload, 3 extents of the host arena
    nbytes = numel * 4
    with make_store(tmp_path) as (store, _):
        store.register("c", numel, torch.float32, Tier.NVME, initial=torch.ones(numel))
        store.flush()  # register staged the data in HOST and wrote it: HOST -> NVME once
        store.evict("c", Tier.HOST)
        store.reset_peaks()
        base = store.stats()
        assert base["bytes_host_to_nvme"] == nbytes and base["host_used_bytes"] == 0
        dev = store.fetch("c", Tier.DEVICE).wait()  # NVME -> HOST -> DEVICE: a miss
        store.fetch("c", Tier.DEVICE).wait()  # a hit
        dev.add_(1)
        store.mark_dirty("c", Tier.DEVICE)  # drops the HOST copy (stale)
        del dev
        store.evict("c", Tier.DEVICE)  # DEVICE -> HOST -> NVME
        stats = store.stats()
        assert stats["bytes_nvme_to_host"] == nbytes
        assert stats["bytes_host_to_device"] == nbytes
        assert stats["bytes_device_to_host"] == nbytes
        assert stats["bytes_host_to_nvme"] == 2 * nbytes
        assert (stats["fetch_misses"], stats["fetch_hits"], stats["fetch_late"]) == (1, 1, 0)
        assert stats["device_peak_bytes"] == nbytes and stats["device_used_bytes"] == 0
        assert stats["host_peak_bytes"] == 3 * KB4 and stats["host_used_bytes"] == 3 * KB4
        assert stats["evictions_device"] == 1 and stats["writebacks"] == 2
        assert stats["host_homed_bytes"] == 0  # an NVMe-homed shard's HOST copy is not homed
        store.register("h", 1500, torch.float32, Tier.HOST)  # 6000 B: two 4 KiB extents
        assert store.stats()["host_homed_bytes"] == 2 * KB4
        from infinity.tiers import STATS_KEYS
        assert sorted(stats) == sorted(STATS_KEYS)


def test_nvme_bytes_by_kind_follow_the_key_prefix(tmp_path):
    """NVMe bytes are split by a key's first path component (what `infinity train` reports per
    kind of state); bytes that never touch NVMe are not counted there."""
    numel = 3000
    nbytes = numel * 4
    with make_store(tmp_path) as (store, _):
        store.register("param/a", numel, torch.float32, Tier.NVME, initial=torch.ones(numel))
        store.register("opt/a", numel, torch.float32, Tier.NVME, initial=torch.ones(numel))
        store.register("grad/a", numel, torch.float32, Tier.HOST, initial=torch.ones(numel))
        store.flush()
        store.evict("param/a", Tier.HOST)
        store.evict("opt/a", Tier.HOST)
        store.fetch("param/a", Tier.HOST).wait()
        store.fetch("param/a", Tier.HOST).wait()  # a hit: no bytes
        store.fetch("grad/a", Tier.DEVICE).wait()  # HOST -> DEVICE: not NVMe
        assert store.nvme_bytes_by_kind() == {
            "param": {"read": nbytes, "write": nbytes},
            "opt": {"read": 0, "write": nbytes},
        }
        stats = store.stats()
        assert stats["bytes_nvme_to_host"] == nbytes
        assert stats["bytes_host_to_nvme"] == 2 * nbytes


def test_refused_swap_in_fails_through_the_handle(tmp_path, monkeypatch):
    with make_store(tmp_path) as (store, swapper):
        store.register("r", 100, torch.float32, Tier.NVME, initial=torch.ones(100))
        store.flush()
        store.evict("r", Tier.HOST)

        def refuse(key, out):
            raise SwapIOError("refused", path="x")

        monkeypatch.setattr(swapper, "swap_in", refuse)
        with pytest.raises(SwapIOError):
            store.fetch("r", Tier.DEVICE).wait()
        assert store.state("r", Tier.HOST) is Residency.ABSENT
        monkeypatch.undo()
        assert torch.all(store.fetch("r", Tier.DEVICE).wait() == 1)


# -- CUDA (skipped without a GPU) ---------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_round_trip_through_every_tier(tmp_path):
    from infinity.io import Swapper
    from infinity.tiers import TieredStore

    with Swapper(tmp_path / "swap") as swapper, TieredStore(
            "cuda", StoreConfig(device_budget_bytes=3 * 40_000, host_budget_bytes=1 << 20),
            swapper=swapper) as store:
        data = {k: random_values(10_000, torch.float32, seed=i) for i, k in enumerate("abcd")}
        for key, value in data.items():
            store.register(key, 10_000, torch.float32, Tier.NVME, initial=value)
        for key, value in data.items():  # the 4th evicts the 1st from the device
            got = store.acquire(key, Tier.DEVICE).wait()
            assert got.is_cuda and same_bytes(got, value)
            got.mul_(2)  # on the current stream; the write-back must wait for it
            store.mark_dirty(key, Tier.DEVICE)
            store.release(key, Tier.DEVICE)
        store.flush()
        for key, value in data.items():
            assert same_bytes(read_swap_file(swapper, key, 40_000, store.arena.alignment_bytes)
                              .view(torch.float32), value * 2)
            assert same_bytes(store.fetch(key, Tier.DEVICE).wait(), value * 2)


# -- copies on the store's threads ([Note: no OpenMP on copy threads]) ---------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_host_copy_copies_every_byte(dtype):
    from infinity.tiers._records import host_copy

    src = random_values(100_003, dtype, seed=3)
    dst = torch.zeros_like(src)
    host_copy(dst, src)
    assert same_bytes(dst, src)
    strided = random_values(2 * 5001, dtype, seed=4)[::2]  # not contiguous: torch's copy
    out = torch.zeros(5001, dtype=dtype)
    host_copy(out, strided)
    assert same_bytes(out, strided.contiguous())


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2,
                    reason="counts threads through /proc with an intra-op pool of 2+ threads")
def test_store_moves_on_cpu_start_no_openmp_team(tmp_path):
    """A big Tensor.copy_ on a copy thread would start an OpenMP team there (more threads than the
    pool's): every later move must run on the pool's threads alone."""
    numel = 4 << 20  # far above torch's parallel grain: copy_ would go parallel
    with make_store(tmp_path, device_bytes=16 * numel, host_bytes=16 * numel) as (store, _):
        store.register("warm", 1024, torch.float32, Tier.HOST)
        for _ in range(2 * store.config.num_copy_threads):  # start every pool thread first
            store.fetch("warm", Tier.DEVICE).wait()
            store.evict("warm", Tier.DEVICE)
        before = len(os.listdir("/proc/self/task"))
        original = random_values(numel, torch.float32, seed=5)
        store.register("big", numel, torch.float32, Tier.HOST, initial=original)
        for _ in range(4):
            assert same_bytes(store.fetch("big", Tier.DEVICE).wait(), original)
            store.mark_dirty("big", Tier.DEVICE)
            store.write_back("big").wait()
            store.evict("big", Tier.DEVICE)
        assert len(os.listdir("/proc/self/task")) == before


# -- the read gate ([Note: the read gate] in infinity/tiers/_read_gate.py) -------------------------

class _OwedWriter:
    """A writer that owes shard 'owed' new bytes and writes them when the store asks."""

    def __init__(self, store, value: float):
        self.store, self.value, self.calls, self.threads = store, value, [], []

    def apply_before_read(self, key: str) -> None:
        self.calls.append(key)
        self.threads.append(threading.get_ident())
        if key == "owed" and self.calls.count(key) == 1:  # uses the store: no lock is held
            self.store.acquire(key, Tier.HOST, overwrite=True).wait().fill_(self.value)
            self.store.mark_dirty(key, Tier.HOST)
            self.store.release(key, Tier.HOST)


def test_the_read_gate_runs_before_every_read_in_the_callers_thread(tmp_path):
    with make_store(tmp_path) as (store, _):
        store.register("owed", 256, torch.float32, Tier.NVME)
        store.register("other", 256, torch.float32, Tier.HOST)
        gate = _OwedWriter(store, 7.0)
        store.set_read_gate(gate)
        # The first read gets the bytes the gate wrote (the overwrite acquire inside the gate
        # does not call it again).
        assert store.fetch("owed", Tier.DEVICE).wait().eq(7.0).all()
        assert gate.calls == ["owed"]
        store.acquire("other", Tier.DEVICE).wait()
        store.release("other", Tier.DEVICE)
        store.evict("owed", Tier.HOST)
        handle = store.acquire("owed", Tier.HOST, ahead=True)  # a read ahead asks first too
        assert handle.wait(timeout=60).eq(7.0).all()
        store.release("owed", Tier.HOST)
        store.acquire("other", Tier.DEVICE, overwrite=True).wait()  # not a read: no call
        store.release("other", Tier.DEVICE)
        assert gate.calls == ["owed", "other", "owed"]
        assert set(gate.threads) == {threading.get_ident()}


def test_a_store_has_one_read_gate(tmp_path):
    with make_store(tmp_path) as (store, _):
        gate = _OwedWriter(store, 1.0)
        with pytest.raises(ValueError, match="apply_before_read"):
            store.set_read_gate(object())
        store.set_read_gate(gate)
        store.set_read_gate(gate)  # the same gate again: no change
        with pytest.raises(ValueError, match="already has a read gate"):
            store.set_read_gate(_OwedWriter(store, 2.0))


def test_copy_info_is_a_snapshot_of_one_copy(tmp_path):
    with make_store(tmp_path) as (store, _):
        store.register("z", 64, torch.float32, Tier.NVME)
        assert store.copy_info("z", Tier.NVME).state is Residency.ZEROS
        tensor = store.acquire("z", Tier.HOST).wait()
        info = store.copy_info("z", Tier.HOST)
        assert (info.state, info.pins, info.busy) == (Residency.RESIDENT, 1, 0)
        assert info.tensor.data_ptr() == tensor.data_ptr()
        store.release("z", Tier.HOST)
        assert info.pins == 1 and store.copy_info("z", Tier.HOST).pins == 0  # a snapshot
        store.mark_dirty("z", Tier.HOST)
        store.write_back("z").wait()
        assert store.state("z", Tier.NVME) is Residency.RESIDENT  # written: the file holds it
        with pytest.raises(KeyError):
            store.copy_info("nope", Tier.HOST)
