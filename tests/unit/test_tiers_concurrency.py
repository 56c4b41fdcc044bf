"""Concurrent fetches (one I/O per key, data right) and random workloads against a simple model."""

from __future__ import annotations

import gc
import os
import random
import threading
import weakref

import pytest
import torch

import infinity.tiers._budgets as budget_mod
from infinity.errors import TierCapacityError
from infinity.tiers import Residency, Tier
from tests._support.store import KB4, make_store, read_swap_file
from tests._support.tensors import random_values, same_bytes

SLOW = os.environ.get("INFINITY_SLOW") == "1"


def _count_swap_ins(monkeypatch, swapper) -> dict[str, int]:
    counts: dict[str, int] = {}
    lock = threading.Lock()
    real = swapper.swap_in

    def counting(key, out):
        with lock:
            counts[key] = counts.get(key, 0) + 1
        return real(key, out)

    monkeypatch.setattr(swapper, "swap_in", counting)
    return counts


def _run_threads(num_threads: int, body) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(num_threads)

    def run(i: int) -> None:
        try:
            barrier.wait()
            body(i)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


def test_concurrent_fetches_of_one_key_do_one_read(tmp_path, monkeypatch):
    numel, rounds, num_threads = 50_000, 8, 12
    with make_store(tmp_path, device_bytes=1 << 20, host_bytes=1 << 20) as (store, swapper):
        data = random_values(numel, torch.float32, seed=0)
        store.register("k", numel, torch.float32, Tier.NVME, initial=data)
        store.flush()
        counts = _count_swap_ins(monkeypatch, swapper)
        for r in range(rounds):
            store.evict("k", Tier.DEVICE)
            store.evict("k", Tier.HOST)
            tier = Tier.DEVICE if r % 2 else Tier.HOST

            def body(_i: int) -> None:
                got = store.acquire("k", tier).wait()
                try:
                    assert same_bytes(got, data)
                finally:
                    store.release("k", tier)

            _run_threads(num_threads, body)
            assert counts["k"] == r + 1, "concurrent fetches of one key must share one read"
        stats = store.stats()
        assert stats["fetch_misses"] == rounds
        assert stats["fetch_hits"] + stats["fetch_late"] == rounds * (num_threads - 1)


def test_concurrent_fetches_and_writes_of_different_keys(tmp_path):
    num_threads, ops = 8, (200 if SLOW else 60)
    numel = 3000  # 12000 B: 3 extents
    shared = {f"r{i}": random_values(numel, torch.float32, seed=100 + i) for i in range(10)}
    own = {f"w{t}_{i}": random_values(numel, torch.float32, seed=200 + 10 * t + i)
           for t in range(num_threads) for i in range(3)}
    # Each thread pins at most one copy and has at most one move in flight (+ its HOST staging).
    with make_store(tmp_path, device_bytes=num_threads * 2 * numel * 4,
                    host_bytes=num_threads * 3 * 3 * KB4) as (store, swapper):
        for key, value in {**shared, **own}.items():
            store.register(key, numel, torch.float32, Tier.NVME, initial=value)
        store.flush()
        expected = dict(own)

        def body(t: int) -> None:
            rng = random.Random(t)
            mine = [k for k in own if k.startswith(f"w{t}_")]
            for _ in range(ops):
                tier = rng.choice([Tier.DEVICE, Tier.HOST])
                if rng.random() < 0.3:
                    key = rng.choice(mine)
                    got = store.acquire(key, tier).wait()
                    assert same_bytes(got, expected[key]), key
                    got.add_(1.0)
                    expected[key] = got.clone()
                    store.mark_dirty(key, tier)
                    store.release(key, tier)
                else:
                    key = rng.choice(list(shared))
                    got = store.acquire(key, tier).wait()
                    try:
                        assert same_bytes(got, shared[key]), key
                    finally:
                        store.release(key, tier)

        _run_threads(num_threads, body)
        store.flush()
        for key, value in expected.items():
            on_disk = read_swap_file(swapper, key, numel * 4, store.arena.alignment_bytes)
            assert same_bytes(on_disk.view(torch.float32), value), key
        assert store.stats()["device_peak_bytes"] <= num_threads * 2 * numel * 4


class _DeviceLedger:
    """Counts live DEVICE allocations independently of the store (weak references to its tensors)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.lock = threading.Lock()

    def wrap(self, real):
        def empty(numel, dtype, device):
            tensor = real(numel, dtype, device)
            nbytes = numel * dtype.itemsize
            with self.lock:
                self.live += nbytes
                live = self.live
            weakref.finalize(tensor, self._freed, nbytes)
            if live > self.budget:
                gc.collect()  # only reference cycles could hold a freed copy alive
            with self.lock:
                self.peak = max(self.peak, self.live)
            return tensor
        return empty

    def _freed(self, nbytes: int) -> None:
        with self.lock:
            self.live -= nbytes


class _Model:
    """What the store must hold: expected bytes per key, homes, and the copies the test pinned."""

    def __init__(self, store, rng):
        self.store, self.rng = store, rng
        self.expected: dict[str, torch.Tensor] = {}
        self.homes: dict[str, Tier] = {}
        self.pinned: list[tuple[str, Tier]] = []

    def unevictable_bytes(self, tier: Tier) -> int:
        """Bytes the store may not evict on ``tier``: home copies and pinned copies."""
        cost = self.store.arena.extent_bytes if tier is Tier.HOST else (lambda n: n)
        homes = [k for k, h in self.homes.items() if h is tier]
        pins = {k for k, t in self.pinned if t is tier and self.homes[k] is not tier}
        return sum(cost(self.expected[k].numel() * 4) for k in homes + sorted(pins))

    def step(self, step: int) -> None:
        store, rng, op = self.store, self.rng, self.rng.random()
        keys = sorted(self.expected)
        if op < 0.12 or len(keys) < 4:
            key, numel = f"s{step}", rng.choice([100, 1024, 1500, 2048, 3000])
            # At most 2 HOST homes (never evictable): they cannot fragment the 16-extent arena so
            # much that an unpinned 3-extent copy finds no hole.
            host_homes = sum(h is Tier.HOST for h in self.homes.values())
            home = rng.choice([Tier.NVME, Tier.HOST]) if 2 < len(keys) and host_homes < 2 else Tier.NVME
            initial = random_values(numel, torch.float32, seed=step) if rng.random() < 0.8 else None
            store.register(key, numel, torch.float32, home, initial=initial)
            self.expected[key] = initial if initial is not None else torch.zeros(numel)
            self.homes[key] = home
            return
        key, tier = rng.choice(keys), rng.choice([Tier.DEVICE, Tier.HOST])
        pinned_elsewhere = any(k == key and t is not tier and t is not self.homes[key]
                               for k, t in self.pinned)
        if op < 0.45:  # fetch and check
            got = store.fetch(key, tier, next_use=rng.random()).wait()
            assert same_bytes(got, self.expected[key]), (key, tier)
        elif op < 0.6 and pinned_elsewhere:
            store.fetch(key, tier).wait()
            with pytest.raises(ValueError, match="acquired"):  # would leave a pinned copy stale
                store.mark_dirty(key, tier)
        elif op < 0.6:  # modify a copy
            got = store.fetch(key, tier).wait()
            got.mul_(-1.5).add_(step)
            store.mark_dirty(key, tier)
            self.expected[key] = got.clone()
        elif op < 0.7 and len(self.pinned) < 2:
            store.acquire(key, tier).wait()
            self.pinned.append((key, tier))
        elif op < 0.78 and self.pinned:
            store.release(*self.pinned.pop(rng.randrange(len(self.pinned))))
        elif op < 0.88:
            if tier is not self.homes[key] and (key, tier) not in self.pinned:
                store.evict(key, tier)
        elif op < 0.94:
            store.write_back(key).wait()
        elif not any(k == key for k, _ in self.pinned):
            store.unregister(key)
            del self.expected[key], self.homes[key]


@pytest.mark.parametrize("seed", [0, 1, 2] + ([3, 4, 5, 6, 7] if SLOW else []))
def test_random_workload_against_a_model(tmp_path, monkeypatch, seed):
    device_budget, host_budget, steps = 5 * 12_000, 16 * KB4, (400 if SLOW else 200)
    ledger = _DeviceLedger()
    ledger.budget = device_budget
    monkeypatch.setattr(budget_mod, "_empty_device", ledger.wrap(budget_mod._empty_device))
    refused = 0
    with make_store(tmp_path, device_bytes=device_budget, host_bytes=host_budget) as (store, swapper):
        model = _Model(store, random.Random(seed))
        for step in range(steps):
            try:
                model.step(step)
            except TierCapacityError as err:
                # Only a refusal the model can justify: home + pinned bytes leave no room, or they
                # fragment the arena so that no hole fits (no compaction).
                unevictable = model.unevictable_bytes(Tier[err.tier])
                assert err.requested_bytes + unevictable > err.budget_bytes or (
                    "fragmented" in str(err) and unevictable > 0), (str(err), unevictable)
                refused += 1
            stats = store.stats()
            assert stats["device_used_bytes"] <= device_budget
            assert stats["host_used_bytes"] <= host_budget
        assert refused < steps // 10, f"{refused} of {steps} operations refused: the test lost its teeth"
        for key, tier in model.pinned:
            store.release(key, tier)
        store.flush()
        for key, value in model.expected.items():
            for tier in (Tier.HOST, Tier.DEVICE):
                assert same_bytes(store.fetch(key, tier).wait(), value), (key, tier)
            if model.homes[key] is Tier.NVME and store.state(key, Tier.NVME) is Residency.RESIDENT:
                on_disk = read_swap_file(swapper, key, value.numel() * 4, store.arena.alignment_bytes)
                assert same_bytes(on_disk.view(torch.float32), value), key
        stats = store.stats()
        assert stats["device_peak_bytes"] <= device_budget and stats["host_peak_bytes"] <= host_budget
    assert 0 < ledger.peak <= device_budget, "live DEVICE bytes exceeded the budget"
