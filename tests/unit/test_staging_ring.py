"""[Note: event-guarded staging] (infinity/_async_copy.py): the staging ring's reuse rule, with fake
events standing in for CUDA's so that the order of records, waits and completion work is visible
on a CPU-only machine."""

from __future__ import annotations

import pytest
import torch

from infinity._async_copy import StagingRing


class FakeEvent:
    """Logs ``record`` and ``synchronize`` into a shared list, by a serial number."""

    serial = 0

    def __init__(self, log: list):
        FakeEvent.serial += 1
        self.name, self.log = f"e{FakeEvent.serial}", log

    def record(self, stream) -> None:
        self.log.append(("record", self.name, stream))

    def synchronize(self) -> None:
        self.log.append(("wait", self.name))


def _ring(log: list, slots: int = 2) -> StagingRing:
    FakeEvent.serial = 0
    return StagingRing(slots, device="cpu", new_event=lambda: FakeEvent(log),
                       current_stream=lambda device: "compute-stream")


def test_reuse_waits_on_the_event_of_that_slots_last_copy():
    log: list = []
    ring = _ring(log)
    a, buf_a = ring.take(4, torch.float32)
    ring.done(a, lambda: log.append(("complete", "a")))
    b, buf_b = ring.take(4, torch.float32)
    ring.done(b, lambda: log.append(("complete", "b")))
    assert a != b and buf_a.data_ptr() != buf_b.data_ptr()
    # Both copies issued, nothing waited for yet: the host never blocked.
    assert log == [("record", "e1", "compute-stream"), ("record", "e2", "compute-stream")]
    log.clear()
    c, buf_c = ring.take(4, torch.float32)  # slot a again: its copy (e1) first, then its work
    assert c == a and buf_c.data_ptr() == buf_a.data_ptr()
    assert log == [("wait", "e1"), ("complete", "a")]
    ring.done(c)
    log.clear()
    ring.drain()  # oldest first: b's copy (e2), then c's (e3)
    assert log == [("wait", "e2"), ("complete", "b"), ("wait", "e3")]
    log.clear()
    ring.drain()
    assert log == []  # each wait and each completion happens once


def test_buffers_grow_to_the_largest_request_and_keep_their_views_apart():
    log: list = []
    ring = _ring(log, slots=1)
    i, small = ring.take(3, torch.bfloat16)
    small.copy_(torch.tensor([1.0, 2.0, 3.0]))
    ring.done(i)
    i, big = ring.take(1000, torch.float32)
    assert log[-1] == ("wait", "e1")  # the old buffer is dropped only after its copy finished
    assert big.numel() == 1000 and big.dtype == torch.float32 and ring.nbytes >= 4000


def test_cpu_ring_runs_completion_work_at_once():
    ring = StagingRing(2, device="cpu")
    done = []
    i, buf = ring.take(5, torch.float32)
    buf.fill_(7)
    ring.done(i, lambda: done.append(buf.sum().item()))
    assert done == [35.0]  # no events on a CPU device: the copy was synchronous
    with pytest.raises(ValueError, match="num_slots"):
        StagingRing(0, device="cpu")


def test_reducer_adds_a_device_gradient_after_its_copy_landed():
    """GradientReducer._add_from_device through a fake-event ring: the addition into the host
    accumulator waits for the copy's event, and partitions()/zero() drain it (never later)."""
    from infinity.zero._grad_reducer import GradientReducer

    log: list = []
    reducer = GradientReducer.__new__(GradientReducer)
    reducer._ring = _ring(log)
    acc = torch.zeros(6)
    part = torch.arange(6, dtype=torch.float32)
    reducer._add_from_device(acc, part)
    reducer._add_from_device(acc, part)
    assert torch.equal(acc, torch.zeros(6))  # not yet: the copies may still be running
    reducer._add_from_device(acc, part)  # slot 0 again: the first addition ran after e1
    assert log[-2:] == [("wait", "e1"), ("record", "e3", "compute-stream")]
    assert torch.equal(acc, part)
    reducer._drain_ring()
    assert torch.equal(acc, 3 * part)
