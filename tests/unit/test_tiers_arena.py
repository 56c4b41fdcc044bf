"""The host arena: aligned, non-overlapping extents, coalescing, one allocation for the whole tier."""

from __future__ import annotations

import random

import pytest
import torch

import infinity.tiers.store as store_mod
from infinity.io import aligned_empty
from infinity.tiers import HostArena, Tier
from tests._support.store import KB4, make_store
from tests._support.tensors import random_values, same_bytes


def _check_layout(arena: HostArena) -> None:
    extents = arena.extents()
    holes = arena.holes()
    spans = sorted([(e.offset_bytes, e.end_bytes, "x") for e in extents]
                   + [(h.offset_bytes, h.end_bytes, "h") for h in holes])
    pos = 0
    for start, end, _ in spans:  # extents and holes tile the arena exactly: no overlap, no gap
        assert start == pos and end > start
        assert start % arena.alignment_bytes == 0 and end % arena.alignment_bytes == 0
        pos = end
    assert pos == arena.capacity_bytes
    for a, b in zip(holes, holes[1:]):  # coalesced: no two holes touch
        assert a.end_bytes < b.offset_bytes


def test_random_allocate_free_keeps_extents_aligned_and_disjoint():
    rng = random.Random(0)
    arena = HostArena(64 * KB4, alignment_bytes=KB4, allocate_fn=aligned_empty)
    assert arena.buffer.data_ptr() % KB4 == 0
    live = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            arena.free(live.pop(rng.randrange(len(live))))
        else:
            extent = arena.allocate(rng.randint(1, 5 * KB4), long_lived=rng.random() < 0.3)
            if extent is not None:
                live.append(extent)
        _check_layout(arena)
    for extent in live:
        arena.free(extent)
    assert [(h.offset_bytes, h.size_bytes) for h in arena.holes()] == [(0, 64 * KB4)]


def test_long_lived_extents_pack_at_the_top_so_evicting_the_rest_leaves_one_hole():
    """Home copies interleaved in time with cache copies of other sizes: once every cache copy is
    freed (evicted), the free bytes are one hole, not the gaps between home copies."""
    rng = random.Random(1)
    for _ in range(20):
        arena = HostArena(256 * KB4, alignment_bytes=KB4, allocate_fn=aligned_empty)
        home, cache = [], []
        for _ in range(60):
            long_lived = rng.random() < 0.4
            extent = arena.allocate(rng.randint(1, 6 * KB4), long_lived=long_lived)
            if extent is None:
                break
            (home if long_lived else cache).append(extent)
            if cache and rng.random() < 0.3:
                arena.free(cache.pop(rng.randrange(len(cache))))
        for extent in cache:
            arena.free(extent)
        holes = arena.holes()
        assert len(holes) == 1 and holes[0].offset_bytes == 0, holes
        assert holes[0].size_bytes == 256 * KB4 - sum(e.size_bytes for e in home)
        _check_layout(arena)


def test_extent_views_do_not_alias():
    arena = HostArena(16 * KB4, alignment_bytes=KB4, allocate_fn=aligned_empty)
    extents = [arena.allocate(n) for n in (100, KB4, KB4 + 1, 3 * KB4)]
    views = [arena.view(e, e.size_bytes // 4 if i else 25, torch.float32) for i, e in enumerate(extents)]
    for i, v in enumerate(views):
        v.fill_(i + 1)
    for i, v in enumerate(views):
        assert torch.all(v == i + 1)
        assert arena.raw(extents[i]).data_ptr() % KB4 == 0
    with pytest.raises(RuntimeError, match="not allocated"):
        arena.free(extents[0].__class__(extents[0].offset_bytes + KB4 * 100, KB4))


def test_allocate_returns_none_without_a_large_enough_hole():
    arena = HostArena(4 * KB4, alignment_bytes=KB4, allocate_fn=aligned_empty)
    a, b, c, d = (arena.allocate(KB4) for _ in range(4))
    arena.free(a)
    arena.free(c)
    assert arena.allocate(2 * KB4) is None and arena.free_bytes() == 2 * KB4
    arena.free(b)  # a, b, c coalesce into one hole
    assert arena.allocate(3 * KB4) == a.__class__(0, 3 * KB4)


def test_store_host_memory_is_one_arena(tmp_path, monkeypatch):
    calls = []
    real = store_mod.aligned_empty

    def counting(numel, dtype, **kwargs):
        calls.append((numel, dtype))
        return real(numel, dtype, **kwargs)

    monkeypatch.setattr(store_mod, "aligned_empty", counting)
    with make_store(tmp_path, host_bytes=20 * KB4 + 100) as (store, _):
        assert store.stats()["host_budget_bytes"] == 20 * KB4  # whole extents only
        base = store.arena.buffer.data_ptr()
        expect = {}
        for i, numel in enumerate((1, 1000, 1024, 1025, 3000, 7)):
            key = f"k{i}"
            expect[key] = random_values(numel, torch.float32, seed=i)
            store.register(key, numel, torch.float32, Tier.NVME, initial=expect[key])
            store.fetch(key, Tier.DEVICE).wait()
        store.flush()
        for key, value in expect.items():
            host = store.get(key, Tier.HOST)
            assert host.data_ptr() % KB4 == 0
            assert base <= host.data_ptr() and host.data_ptr() + host.numel() * 4 <= base + 20 * KB4
            assert same_bytes(host, value)
        _check_layout(store.arena)
    assert calls == [(20 * KB4, torch.uint8)]  # no per-tensor host allocation, ever
