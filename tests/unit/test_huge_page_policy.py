"""When the engine advises transparent huge pages ([Note: when huge pages cost more than they
save] in infinity/io/_huge_pages.py): never where the kernel reports free pages to a hypervisor
(read from the virtio devices in sysfs), unless INFINITY_HUGE_PAGES=on; an unknown mode is named."""

from __future__ import annotations

import mmap
import time
import types

import pytest
import torch

from infinity.io import _huge_pages, advise_huge_pages, aligned_empty
from infinity.optim import cpu_adam
from tests._support.smaps import anon_huge_bytes, vm_flags


def _virtio(root, name: str, *, device: int, features: str, bound: bool = True):
    d = root / name
    d.mkdir()
    (d / "device").write_text(f"0x{device:04x}\n")
    (d / "features").write_text(features + "\n")
    if bound:
        (d / "driver").mkdir()


REPORTING = "0110010" + "0" * 57  # bit 5 set, as a Firecracker guest's balloon shows it
NO_REPORTING = "0110000" + "0" * 57


def test_free_page_reporting_is_read_from_the_balloon_device(tmp_path):
    _virtio(tmp_path, "virtio1", device=2, features=REPORTING)  # a block device: not a balloon
    assert not _huge_pages.free_page_reporting(tmp_path)
    _virtio(tmp_path, "virtio0", device=5, features=NO_REPORTING)
    assert not _huge_pages.free_page_reporting(tmp_path)
    _virtio(tmp_path, "virtio5", device=5, features=REPORTING, bound=False)  # no driver bound
    assert not _huge_pages.free_page_reporting(tmp_path)
    _virtio(tmp_path, "virtio6", device=5, features=REPORTING)
    assert _huge_pages.free_page_reporting(tmp_path)
    assert not _huge_pages.free_page_reporting(tmp_path / "missing")


@pytest.fixture
def policy(monkeypatch):
    """Set the mode and the machine (reporting, THP available) the policies decide on."""
    def set_to(mode: str | None, *, reporting: bool, available: bool = True) -> None:
        monkeypatch.setattr(_huge_pages, "_decision", None)
        monkeypatch.setattr(_huge_pages, "free_page_reporting", lambda: reporting)
        monkeypatch.setattr(_huge_pages, "_available", lambda: available)
        if mode is None:
            monkeypatch.delenv(_huge_pages.MODE_ENV, raising=False)
        else:
            monkeypatch.setenv(_huge_pages.MODE_ENV, mode)
    return set_to


@pytest.fixture
def decide(policy):
    """Re-decide the CPU memory policy under a given mode and reporting state."""
    def run(mode: str | None, *, reporting: bool) -> bool:
        policy(mode, reporting=reporting)
        return _huge_pages.huge_pages_pay_off()
    return run


def test_auto_advises_unless_free_pages_go_to_a_hypervisor(decide):
    assert decide(None, reporting=False) is True
    assert decide(None, reporting=True) is False
    assert decide("auto", reporting=True) is False
    assert decide("on", reporting=True) is True
    assert decide("off", reporting=False) is False


def test_an_unknown_mode_is_named(decide):
    with pytest.raises(ValueError, match="INFINITY_HUGE_PAGES='sometimes'.*'auto'.*'on'.*'off'"):
        decide("sometimes", reporting=False)


class _Recording(mmap.mmap):
    """An anonymous mapping whose madvise calls are recorded in ``calls`` instead of made."""

    calls: list[tuple] = []

    def madvise(self, *args):
        self.calls.append(args)


@pytest.fixture
def madvise_calls(monkeypatch):
    """The madvise calls aligned_empty's mappings make (recorded, not made)."""
    from infinity.io import _aligned
    calls: list[tuple] = []
    monkeypatch.setattr(_Recording, "calls", calls)
    monkeypatch.setattr(_aligned, "_RegisteredMmap", _Recording)
    return calls


def test_no_advice_reaches_the_kernel_when_it_does_not_pay_off(monkeypatch, madvise_calls):
    from infinity.io import _aligned
    calls = madvise_calls
    monkeypatch.setattr(cpu_adam, "mmap", types.SimpleNamespace(  # zeros_host's
        **{k: getattr(mmap, k) for k in dir(mmap) if k.isupper()}, mmap=_Recording))
    monkeypatch.setattr(_aligned, "_madvise_looked_up", True)  # advise_huge_pages' libc call
    monkeypatch.setattr(_aligned, "_madvise", lambda *args: calls.append(args) or 0)
    big = 8 * 2**20
    for decision in (False, True):
        monkeypatch.setattr(_huge_pages, "_decision", decision)
        assert advise_huge_pages(torch.empty(big, dtype=torch.uint8)) is decision
        a = aligned_empty(big, torch.uint8)
        z = cpu_adam.zeros_host(big // 4, torch.float32)
        assert a.numel() == big and not z.any()  # the memory asked for, either way
        assert len(calls) == (3 if decision else 0)  # the control: each call advises when on


@pytest.fixture
def direct(policy):
    """The direct-I/O policy under a given mode and reporting state."""
    def run(mode: str | None, *, reporting: bool, available: bool = True) -> bool:
        policy(mode, reporting=reporting, available=available)
        return _huge_pages.huge_pages_for_direct_io()
    return run


def test_direct_io_buffers_are_advised_even_where_free_pages_go_to_a_hypervisor(direct):
    """[Note: direct I/O wants huge pages]: the once-per-buffer fault cost is worth the disk's
    full request size, so reporting does not matter; off and a kernel without THP do."""
    assert direct(None, reporting=True) is True
    assert direct("auto", reporting=False) is True
    assert direct("on", reporting=True) is True
    assert direct("off", reporting=False) is False
    assert direct(None, reporting=False, available=False) is False
    with pytest.raises(ValueError, match="INFINITY_HUGE_PAGES='sometimes'"):
        direct("sometimes", reporting=False)


def test_only_direct_io_memory_is_advised_where_cpu_memory_is_not(monkeypatch, policy,
                                                                 madvise_calls):
    calls = madvise_calls
    policy(None, reporting=True)  # this VM: CPU memory not advised, direct-I/O memory advised
    big = 8 * 2**20
    aligned_empty(big, torch.uint8)
    assert calls == []
    aligned_empty(big, torch.uint8, direct_io=True)
    assert calls == [(mmap.MADV_HUGEPAGE,)]
    aligned_empty(64 * 1024, torch.uint8, direct_io=True)  # below 4 MiB: never
    assert len(calls) == 1
    monkeypatch.setenv(_huge_pages.MODE_ENV, "off")
    aligned_empty(big, torch.uint8, direct_io=True)
    assert len(calls) == 1


_THP = pytest.mark.skipif(not _huge_pages._available(),
                          reason="no transparent huge pages on this kernel")


@pytest.fixture
def cpu_memory_not_advised(policy):
    """This VM's policy: CPU memory not advised, direct-I/O memory advised."""
    policy(None, reporting=True)


@_THP
def test_the_arena_advises_where_transient_extents_reach_not_its_home_copies(cpu_memory_not_advised):
    """[Note: huge pages where the disk moves the arena], read back from the kernel ('hg' in
    smaps VmFlags): the range transient extents reach from the bottom is advised before they are
    written, the long-lived extents at the top are not, nor is an arena the disk does not move."""
    from infinity.tiers._arena import HostArena
    mib = 2**20
    arena = HostArena(32 * mib, alignment_bytes=4096, allocate_fn=aligned_empty, direct_io=True)
    base = arena.buffer.data_ptr()
    first_huge = -(-base // (2 * mib)) * (2 * mib)  # the first 2 MiB boundary inside the arena
    assert "hg" not in vm_flags(first_huge)  # nothing allocated: nothing advised yet
    home = arena.allocate(8 * mib, long_lived=True)
    transient = arena.allocate(6 * mib)
    assert transient.offset_bytes == 0 and home.end_bytes == arena.capacity_bytes
    assert "hg" in vm_flags(first_huge)
    assert "hg" in vm_flags(first_huge + 2 * mib)
    assert "hg" not in vm_flags(base + home.offset_bytes + home.size_bytes // 2)
    later = arena.allocate(6 * mib)  # the advised range grows with the transient extents
    assert "hg" in vm_flags(base + later.offset_bytes + later.size_bytes // 2)
    arena.free(transient)
    arena.free(later)

    cpu_only = HostArena(32 * mib, alignment_bytes=4096, allocate_fn=aligned_empty)
    e = cpu_only.allocate(16 * mib)
    assert "hg" not in vm_flags(cpu_only.buffer.data_ptr() + e.size_bytes // 2)

    # The engine's set-up: not advised while paused; on resume the free pages set-up reached
    # are dropped (read back as zeros), advised anew, and live extents keep their bytes.
    paused = HostArena(32 * mib, alignment_bytes=4096, allocate_fn=aligned_empty, direct_io=True)
    base = paused.buffer.data_ptr()
    paused.pause_direct_io_advice()
    setup = paused.allocate(8 * mib)
    live = paused.allocate(2 * mib)
    paused.raw(setup).fill_(7)
    paused.raw(live).fill_(5)
    assert "hg" not in vm_flags(base + setup.offset_bytes + 4 * mib)
    paused.free(setup)
    paused.resume_direct_io_advice()
    lo = -(-base // (2 * mib)) * (2 * mib)  # the whole 2 MiB pages of the freed range ...
    hi = (base + setup.end_bytes) // (2 * mib) * (2 * mib)
    deadline = time.monotonic() + 10  # ... are faulted in on huge pages by the populate thread
    while anon_huge_bytes(lo, hi - lo) < (hi - lo) // 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert anon_huge_bytes(lo, hi - lo) >= (hi - lo) // 2
    again = paused.allocate(8 * mib)
    assert again.offset_bytes == setup.offset_bytes
    assert "hg" in vm_flags(-(-base // (2 * mib)) * (2 * mib))
    lo, hi = lo - base, hi - base
    assert hi > lo and torch.all(paused.raw(again)[lo:hi] == 0)  # released: their 7s are gone
    assert torch.all(paused.raw(again)[:lo] == 7)  # a partial page is kept as it was
    assert torch.all(paused.raw(live) == 5)


@_THP
def test_a_store_with_a_swapper_advises_its_staging_extents(cpu_memory_not_advised, tmp_path):
    """The store hands the arena its swapper's use: an NVMe shard's HOST copy (a transient
    extent, written to disk) lands in advised memory; in a store without a swapper it does not."""
    from infinity.io import Swapper
    from infinity.tiers import StoreConfig, Tier, TieredStore
    mib = 2**20
    config = StoreConfig(host_budget_bytes=32 * mib, device_budget_bytes=32 * mib)
    initial = torch.ones(6 * mib)
    with Swapper(tmp_path) as swapper:
        for with_disk in (True, False):
            store = TieredStore("cpu", config, swapper=swapper if with_disk else None)
            try:
                store.register("w", initial.numel(), initial.dtype,
                               Tier.NVME if with_disk else Tier.HOST, initial=initial)
                copy = store.acquire("w", Tier.HOST).wait()
                middle = copy.data_ptr() + copy.numel() * copy.element_size() // 2
                assert ("hg" in vm_flags(middle)) is with_disk
                assert torch.equal(copy, initial)
                store.release("w", Tier.HOST)
            finally:
                store.close()
