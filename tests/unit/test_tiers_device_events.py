"""[Note: device copies complete on the stream] (infinity/tiers/_mover.py), with CUDA faked.

The store runs on a CPU device with its CUDA switch forced on and the copy's event replaced by a
fake that completes only when the test says so, standing in for a GPU still busy with the copy.
What the old store did: the copy thread blocked on the event before resolving the fetch, so the
training thread's ``wait()`` lasted until the GPU drained. Now the fetch resolves once the copy is
issued, the reader's stream waits on the copy's event, and the source copy stays busy until the
copy has run.
"""

from __future__ import annotations

import threading

import pytest
import torch

from infinity.tiers import Residency, Tier
from infinity.tiers._records import host_copy
from tests._support.store import make_store


class FakeEvent:
    """A copy's event: ``synchronize()`` blocks until the test releases the 'GPU'."""

    def __init__(self, gpu_done: threading.Event):
        self.gpu_done = gpu_done
        self.synchronized = False

    def synchronize(self) -> None:
        assert self.gpu_done.wait(10), "the fake GPU never finished"
        self.synchronized = True


class FakeStream:
    def __init__(self):
        self.waited: list = []

    def wait_event(self, event) -> None:
        self.waited.append(event)


@pytest.fixture
def cuda_store(tmp_path, monkeypatch):
    gpu_done = threading.Event()
    stream = FakeStream()
    issued: list[FakeEvent] = []
    with make_store(tmp_path) as (store, _):
        mover = store._mover  # noqa: SLF001 - the store's copies, faked below
        mover._cuda = True  # noqa: SLF001 - the switch the mover takes from its device

        def issue(dst, src, ready):
            host_copy(dst, src)  # the bytes (a CPU stand-in for the GPU's copy)
            issued.append(FakeEvent(gpu_done))
            return issued[-1]

        monkeypatch.setattr(mover, "_issue_copy", issue)
        monkeypatch.setattr(mover, "stream_event", lambda: "compute-event")
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
        try:
            yield store, gpu_done, stream, issued
        finally:
            gpu_done.set()


def test_fetch_resolves_before_the_gpu_drains_and_readers_wait_on_the_stream(cuda_store):
    store, gpu_done, stream, issued = cuda_store
    values = torch.arange(1000, dtype=torch.float32)
    store.register("k", 1000, torch.float32, Tier.HOST, initial=values)
    handle = store.fetch("k", Tier.DEVICE)
    tensor = handle.wait(timeout=5)  # the old store: blocked here until gpu_done (timed out)
    assert torch.equal(tensor, values)
    (event,) = issued
    assert not event.synchronized  # the 'GPU' is still copying
    assert stream.waited == [event]  # ... so the reader's stream waits for it, not the host
    assert store.copy_info("k", Tier.HOST).busy == 1  # the source may not be evicted or
    # changed while the copy runs
    store.get("k", Tier.DEVICE)
    assert stream.waited == [event, event]  # get() waits on the stream too
    gpu_done.set()
    store.flush()
    for _ in range(100):
        if store.copy_info("k", Tier.HOST).busy == 0:
            break
        threading.Event().wait(0.05)
    assert store.copy_info("k", Tier.HOST).busy == 0 and event.synchronized
    assert store.state("k", Tier.DEVICE) is Residency.RESIDENT


def test_host_destination_completes_before_the_fetch_does(cuda_store):
    store, gpu_done, stream, issued = cuda_store
    values = torch.arange(100, dtype=torch.float32)
    store.register("d", 100, torch.float32, Tier.DEVICE, initial=values)
    handle = store.fetch("d", Tier.HOST)
    with pytest.raises(TimeoutError):
        handle.wait(timeout=0.3)  # the CPU reads a HOST copy: it must wait for the copy
    gpu_done.set()
    assert torch.equal(handle.wait(timeout=5), values)
    assert issued[0].synchronized and stream.waited == []  # no stream wait for a HOST reader


def test_cpu_store_has_no_device_reader(tmp_path, monkeypatch):
    def no_stream(device=None):
        raise AssertionError("a CPU store asked for a CUDA stream")

    monkeypatch.setattr(torch.cuda, "current_stream", no_stream)
    with make_store(tmp_path) as (store, _):
        store.register("c", 10, torch.float32, Tier.HOST)
        assert store.acquire("c", Tier.DEVICE).wait().numel() == 10  # no stream to wait on
        store.get("c", Tier.DEVICE)
        store.release("c", Tier.DEVICE)
        assert store._mover.stream_event() is None  # noqa: SLF001 - no event to record either


def test_events_the_host_waits_on_are_blocking(monkeypatch):
    """torch.cuda.Event() spins a core in synchronize(); every event of the store's copies is made
    with blocking=True (the old store used stream.record_event(): a spinning one)."""
    from infinity import _async_copy

    made = []

    class Event:
        def __init__(self, **kwargs):
            made.append(kwargs)

        def record(self, stream):
            self.stream = stream

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream", device))
    event = _async_copy.record_on_current_stream(torch.device("cuda", 3))
    assert made == [{"blocking": True}]
    assert event.stream == ("stream", torch.device("cuda", 3))
