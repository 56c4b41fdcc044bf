"""Which host memory gets pinned ([Note: pin only what a GPU copy touches] in infinity/io/_aligned.py).

CUDA is faked: ``torch.cuda.is_available`` says True and ``cudaHostRegister`` is a recorder, so the
decision (which buffers, on which device) is checked on a CPU-only machine. The old code pinned
every ``aligned_empty`` buffer whenever CUDA existed: the swapper's I/O staging, and the arena of a
``device: cpu`` store.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from infinity.io import Swapper, aligned_empty, pin_device_for
from infinity.tiers import StoreConfig, TieredStore


class _FakeCudart:
    def __init__(self, devices: list):
        self.registered: list[tuple[int, int, object]] = []
        self._devices = devices

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.registered.append((ptr, size, self._devices[-1] if self._devices else None))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        return 0


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA 'exists': every cudaHostRegister is recorded with the device current at the time."""
    current: list = []

    @contextlib.contextmanager
    def device(d):
        current.append(torch.device(d))
        try:
            yield
        finally:
            current.pop()

    cudart = _FakeCudart(current)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return cudart


def test_pin_device_for_fills_the_index_and_skips_cpu(fake_cuda):
    assert pin_device_for("cpu") is None
    assert pin_device_for(torch.device("cpu")) is None
    assert pin_device_for("cuda:1") == torch.device("cuda", 1)
    assert pin_device_for("cuda") == torch.device("cuda", 0)  # the current device, never index None


def test_aligned_empty_pins_only_when_asked(fake_cuda):
    aligned_empty(10_000, torch.float32)
    assert fake_cuda.registered == []
    t = aligned_empty(10_000, torch.float32, pin_device=torch.device("cuda", 1))
    ((ptr, size, dev),) = fake_cuda.registered
    assert ptr == t.data_ptr() and size >= 40_000
    assert dev == torch.device("cuda", 1)  # registered under the rank's device, not GPU 0
    with pytest.raises(ValueError, match="pin_device"):
        aligned_empty(10, torch.float32, pin_device=torch.device("cpu"))


def test_swapper_staging_is_never_pinned(fake_cuda, tmp_path):
    with Swapper(tmp_path / "swap") as sw:
        src = torch.arange(300_001, dtype=torch.float32)  # not aligned to a page: goes via staging
        sw.swap_out("k", src).wait()
        out = torch.empty_like(src)
        sw.swap_in("k", out).wait()
    assert torch.equal(out, src)
    assert fake_cuda.registered == []


def test_store_arena_pinned_only_for_a_cuda_device(fake_cuda, monkeypatch):
    store = TieredStore("cpu", StoreConfig(device_budget_bytes=1 << 20, host_budget_bytes=1 << 20))
    store.close()
    assert fake_cuda.registered == []  # device: cpu on a machine with CUDA: nothing pinned

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())
    store = TieredStore("cuda:1", StoreConfig(device_budget_bytes=1 << 20,
                                              host_budget_bytes=1 << 20))
    try:
        ((ptr, size, dev),) = fake_cuda.registered
        assert ptr == store.arena.buffer.data_ptr() and size == 1 << 20
        assert dev == torch.device("cuda", 1)
    finally:
        store._closed = True  # noqa: SLF001 - the fake stream cannot be synchronised by close()
        store._mover._pool.shutdown()  # noqa: SLF001
