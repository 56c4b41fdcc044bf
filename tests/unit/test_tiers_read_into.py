"""``TieredStore.read_into``: a shard's current bytes into a caller's buffer, no room taken
([Note: a read into the caller's buffer takes no room] in infinity/tiers/_read_out.py).

References: the tensors registered or written by the test, the swap file's bytes read by a
fresh swap-in (not through the store), and the payload bytes the test moved, against the
store's counters.
"""

from __future__ import annotations

import threading

import pytest
import torch

from infinity.errors import SwapIOError, TierCapacityError
from infinity.tiers import Residency, Tier
from infinity.io import aligned_empty
from tests._support.slow_io import slow_io
from tests._support.store import KB4, make_store, read_swap_file
from tests._support.tensors import random_values, same_bytes


def _on_disk_only(store, key, values):
    """Register ``values`` homed on NVMe, wait for the write, drop the arena's copy."""
    store.register(key, values.numel(), values.dtype, Tier.NVME, initial=values)
    store.flush()
    store.evict(key, Tier.HOST)


@pytest.mark.parametrize("numel, offset", [(KB4 // 4, 0), (KB4 // 4, 1), (3001, 0)],
                         ids=["extent-sized", "extent-sized-unaligned", "staged"])
def test_the_file_is_read_into_the_callers_buffer_and_counted(tmp_path, numel, offset):
    """A shard on disk only: the bytes equal what was written and what the file holds; the
    arena is not touched; the bytes count as an NVMe read of the key's kind."""
    with make_store(tmp_path) as (store, swapper):
        values = random_values(numel, torch.float32, seed=3)
        _on_disk_only(store, "act/0/0", values)
        before = store.stats()
        # offset 1: an address the swapper must stage (not a multiple of the alignment)
        out = (aligned_empty(numel, torch.float32) if not offset
               else torch.empty(numel + offset)[offset:]).fill_(-1.0)
        assert store.read_into("act/0/0", out).wait() is out
        assert same_bytes(out, values)
        on_disk = read_swap_file(swapper, "act/0/0", numel * 4, store.arena.alignment_bytes)
        assert same_bytes(out, on_disk.view(torch.float32))
        after = store.stats()
        assert after["bytes_nvme_to_host"] - before["bytes_nvme_to_host"] == numel * 4
        assert store.nvme_bytes_by_kind()["act"]["read"] == numel * 4
        assert after["host_used_bytes"] == 0 and after["fetch_misses"] == before["fetch_misses"]
        assert store.state("act/0/0", Tier.HOST) is Residency.ABSENT
        assert store.copy_info("act/0/0", Tier.NVME).busy == 0
        store.unregister("act/0/0")  # nothing left busy or pinned


def test_a_current_host_copy_is_read_instead_of_the_file(tmp_path):
    """The arena's clean copy is the source: a file damaged behind the store's back is not
    read, and no NVMe byte is counted."""
    with make_store(tmp_path) as (store, swapper):
        values = random_values(2000, torch.float32, seed=4)
        store.register("s", 2000, torch.float32, Tier.NVME, initial=values)
        store.flush()
        assert store.state("s", Tier.HOST) is Residency.RESIDENT
        with open(swapper.path_of("s"), "r+b") as f:
            f.seek(swapper.header_bytes)
            f.write(bytes(256))
        read_before = store.moved_bytes(Tier.NVME, Tier.HOST)
        out = torch.empty(2000)
        store.read_into("s", out).wait()
        assert same_bytes(out, values)
        assert store.moved_bytes(Tier.NVME, Tier.HOST) == read_before
        info = store.copy_info("s", Tier.HOST)
        assert (info.state, info.pins, info.busy) == (Residency.RESIDENT, 0, 0)


def test_a_dirty_device_copy_is_the_current_bytes(tmp_path):
    with make_store(tmp_path) as (store, _):
        store.register("s", 500, torch.float32, Tier.NVME, initial=torch.ones(500))
        store.flush()
        store.fetch("s", Tier.DEVICE).wait().fill_(5.0)
        store.mark_dirty("s", Tier.DEVICE)  # the HOST copy and the file are stale now
        out = torch.empty(500)
        store.read_into("s", out).wait()
        assert out.eq(5.0).all()


def test_a_never_written_home_reads_as_zeros(tmp_path):
    with make_store(tmp_path) as (store, _):
        store.register("z", 700, torch.float32, Tier.NVME)
        out = torch.full((700,), 3.0)
        store.read_into("z", out).wait()
        assert out.eq(0).all() and store.moved_bytes(Tier.NVME, Tier.HOST) == 0


def test_a_write_in_flight_is_read_as_its_new_bytes(tmp_path, monkeypatch):
    """New bytes being written back slowly over old ones on disk: the read returns the new
    bytes (a read of the file now would return the old ones), and the file then holds them."""
    with make_store(tmp_path) as (store, swapper):
        old, new = (random_values(KB4, torch.float32, seed=s) for s in (5, 6))
        store.register("w", KB4, torch.float32, Tier.NVME, initial=old)
        store.flush()
        store.acquire("w", Tier.HOST).wait().copy_(new)
        store.mark_dirty("w", Tier.HOST)
        store.release("w", Tier.HOST)
        slow_io(monkeypatch, swapper, "out", seconds=0.3)
        handle = store.write_back("w")
        out = torch.empty(KB4)
        store.read_into("w", out).wait()
        # Control: the write was still in flight, the file's payload still the old bytes.
        assert not handle.done() and store.state("w", Tier.NVME) is Residency.INFLIGHT
        with open(swapper.path_of("w"), "rb") as f:
            f.seek(swapper.header_bytes)
            payload = torch.frombuffer(bytearray(f.read(KB4 * 4)), dtype=torch.float32)
        assert same_bytes(payload, old)
        assert same_bytes(out, new)
        handle.wait()
        store.evict("w", Tier.HOST)
        store.read_into("w", out.zero_()).wait()
        assert same_bytes(out, new)


def test_a_write_waits_for_a_file_read_in_flight(tmp_path, monkeypatch):
    """While the file is being read (slowly), a new write of the shard does not start: the read
    returns the bytes of the file as they were, then the write lands."""
    with make_store(tmp_path) as (store, swapper):
        old = random_values(KB4, torch.float32, seed=7)
        _on_disk_only(store, "r", old)
        slow_io(monkeypatch, swapper, "in", seconds=0.5)
        out = torch.empty(KB4)
        handle = store.read_into("r", out)
        assert store.copy_info("r", Tier.NVME).busy == 1

        def write_new():
            store.acquire("r", Tier.HOST, overwrite=True).wait().fill_(9.0)
            store.mark_dirty("r", Tier.HOST)  # waits for a settled shard: after the read
            store.release("r", Tier.HOST)
            store.write_back("r").wait()

        writer = threading.Thread(target=write_new)
        writer.start()
        writer.join(0.1)
        assert not handle.done() and store.is_dirty("r") is None  # mark_dirty is waiting
        assert same_bytes(handle.wait(timeout=60), old)
        writer.join(60)
        assert not writer.is_alive()
        store.evict("r", Tier.HOST)
        store.read_into("r", out).wait()
        assert out.eq(9.0).all()


def test_a_full_arena_does_not_stop_the_read(tmp_path):
    """Every extent pinned: an acquire finds no room, read_into reads all the same and leaves
    the arena as it was."""
    with make_store(tmp_path, host_bytes=2 * KB4) as (store, _):
        values = random_values(KB4 // 4, torch.float32, seed=8)
        _on_disk_only(store, "act/1/0", values)
        for key in ("p0", "p1"):
            store.register(key, KB4 // 4, torch.float32, Tier.HOST)
            store.acquire(key, Tier.HOST).wait()
        with pytest.raises(TierCapacityError):
            store.acquire("act/1/0", Tier.HOST).wait()
        used = store.used_bytes(Tier.HOST)
        out = torch.empty(KB4 // 4)
        store.read_into("act/1/0", out).wait()
        assert same_bytes(out, values) and store.used_bytes(Tier.HOST) == used


def test_the_read_gate_runs_first(tmp_path):
    """A writer that owes the shard bytes writes them before the read (the read gate)."""
    class Owed:
        calls: list[str] = []

        def apply_before_read(self, key):
            self.calls.append(key)
            store.acquire(key, Tier.HOST, overwrite=True).wait().fill_(7.0)
            store.mark_dirty(key, Tier.HOST)
            store.release(key, Tier.HOST)

    with make_store(tmp_path) as (store, _):
        store.register("owed", 256, torch.float32, Tier.NVME)
        store.set_read_gate(Owed())
        out = torch.empty(256)
        store.read_into("owed", out).wait()
        assert out.eq(7.0).all() and Owed.calls == ["owed"]


def test_errors_name_the_key_and_the_fix(tmp_path):
    with make_store(tmp_path) as (store, swapper):
        _on_disk_only(store, "e", torch.ones(1000))
        for bad in (torch.empty(999), torch.empty(1000, dtype=torch.float64),
                    torch.empty(2000)[::2], "not a tensor"):
            with pytest.raises(ValueError, match=r"read_into\('e'\).*contiguous CPU tensor"):
                store.read_into("e", bad)
        with pytest.raises(KeyError, match="not registered"):
            store.read_into("nope", torch.empty(1000))
        with open(swapper.path_of("e"), "r+b") as f:
            f.truncate(swapper.header_bytes + 100)
        handle = store.read_into("e", torch.empty(1000))
        with pytest.raises(SwapIOError, match="truncated"):
            handle.wait()
        assert store.copy_info("e", Tier.NVME).busy == 0
        store.unregister("e")
    with pytest.raises(RuntimeError, match="closed"):
        store.read_into("e", torch.empty(1000))
