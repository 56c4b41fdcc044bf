"""When the engine advises transparent huge pages ([Note: when huge pages cost more than they
save] in infinity/io/_huge_pages.py): never where the kernel reports free pages to a hypervisor
(read from the virtio devices in sysfs), unless INFINITY_HUGE_PAGES=on; an unknown mode is named."""

from __future__ import annotations

import mmap
import types

import pytest
import torch

from infinity.io import _huge_pages, advise_huge_pages, aligned_empty
from infinity.optim import cpu_adam


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
def decide(monkeypatch):
    """Re-decide under a given mode and reporting state."""
    def run(mode: str | None, *, reporting: bool) -> bool:
        monkeypatch.setattr(_huge_pages, "_decision", None)
        monkeypatch.setattr(_huge_pages, "free_page_reporting", lambda: reporting)
        monkeypatch.setattr(_huge_pages, "_available", lambda: True)
        if mode is None:
            monkeypatch.delenv(_huge_pages.MODE_ENV, raising=False)
        else:
            monkeypatch.setenv(_huge_pages.MODE_ENV, mode)
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


def test_no_advice_reaches_the_kernel_when_it_does_not_pay_off(monkeypatch):
    from infinity.io import _aligned
    calls = []

    class Recording(mmap.mmap):
        def madvise(self, *args):
            calls.append(args)

    monkeypatch.setattr(_aligned, "_RegisteredMmap", Recording)  # aligned_empty's mapping
    monkeypatch.setattr(cpu_adam, "mmap", types.SimpleNamespace(  # zeros_host's
        **{k: getattr(mmap, k) for k in dir(mmap) if k.isupper()}, mmap=Recording))
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
def direct(monkeypatch):
    """The direct-I/O policy under a given mode and reporting state."""
    def run(mode: str | None, *, reporting: bool, available: bool = True) -> bool:
        monkeypatch.setattr(_huge_pages, "free_page_reporting", lambda: reporting)
        monkeypatch.setattr(_huge_pages, "_available", lambda: available)
        if mode is None:
            monkeypatch.delenv(_huge_pages.MODE_ENV, raising=False)
        else:
            monkeypatch.setenv(_huge_pages.MODE_ENV, mode)
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


def test_only_direct_io_memory_is_advised_where_cpu_memory_is_not(monkeypatch):
    from infinity.io import _aligned
    calls = []

    class Recording(mmap.mmap):
        def madvise(self, *args):
            calls.append(args)

    monkeypatch.setattr(_aligned, "_RegisteredMmap", Recording)
    monkeypatch.setattr(_huge_pages, "_decision", False)  # CPU memory: not advised (this VM)
    monkeypatch.setattr(_huge_pages, "_available", lambda: True)
    monkeypatch.delenv(_huge_pages.MODE_ENV, raising=False)
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


def _vm_flags(ptr: int) -> set[str]:
    """The kernel's VmFlags of the mapping that holds ``ptr`` (/proc/self/smaps)."""
    import pathlib
    inside = False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line.strip() else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {ptr:#x}")


@pytest.mark.skipif(not _huge_pages._available(), reason="no transparent huge pages on this kernel")
def test_the_store_arena_is_advised_when_the_disk_moves_it(monkeypatch, tmp_path):
    """The kernel's own record of the advice ('hg' in smaps) on the arena of a store with a
    swapper, none on one without, where CPU memory is not advised."""
    from infinity.io import Swapper
    from infinity.tiers import StoreConfig, TieredStore
    monkeypatch.setattr(_huge_pages, "_decision", False)
    monkeypatch.delenv(_huge_pages.MODE_ENV, raising=False)
    config = StoreConfig(host_budget_bytes=16 * 2**20, device_budget_bytes=16 * 2**20)
    with Swapper(tmp_path) as swapper:
        with_disk = TieredStore("cpu", config, swapper=swapper)
        host_only = TieredStore("cpu", config)
        try:
            assert "hg" in _vm_flags(with_disk.arena.buffer.data_ptr())
            assert "hg" not in _vm_flags(host_only.arena.buffer.data_ptr())
        finally:
            with_disk.close()
            host_only.close()
