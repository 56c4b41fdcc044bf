"""[Note: timing asynchronous GPU work] (infinity/_timing.py): which timer a device gets, the wall
clock's intervals, and the event timer's lazy reads with fake events (a fake 'GPU' that completes
when the test says so). That CUDA event times differ from launch times only a GPU can show."""

from __future__ import annotations

import torch

from infinity._timing import (EventTimer, WallTimer, apply_unit_times, fill_unknown_times,
                             timer_for)
from infinity.prefetch._trace import Level, TraceEntry


def test_timer_for_picks_events_only_on_cuda():
    assert isinstance(timer_for("cpu"), WallTimer)
    assert isinstance(timer_for(None), WallTimer)
    assert isinstance(timer_for(torch.device("cuda", 1)), EventTimer)  # constructing records nothing


def test_wall_timer_sums_intervals():
    now = iter([1.0, 1.5, 2.0, 4.0])
    t = WallTimer(clock=lambda: next(now))
    t.start(); t.stop("a")
    t.start(); t.stop("b")
    assert t.total_s() == 2.5 and t.take() == [("a", 0.5), ("b", 2.0)] and t.take() == []


class FakeEvent:
    """A timing event at a fake GPU time; complete once the fake GPU reached it."""

    def __init__(self, gpu):
        self.gpu, self.at_ms = gpu, None

    def record(self, stream):
        self.at_ms = gpu_time_of(self.gpu)

    def query(self):
        return self.gpu["done_upto"] >= self.at_ms

    def synchronize(self):
        self.gpu["synced"] += 1
        self.gpu["done_upto"] = max(self.gpu["done_upto"], self.at_ms)

    def elapsed_time(self, end):
        assert self.query() and end.query(), "read before completion"
        return end.at_ms - self.at_ms


def gpu_time_of(gpu):
    gpu["clock_ms"] += gpu["step_ms"]
    return gpu["clock_ms"]


def test_event_timer_reads_lazily_and_never_syncs_on_its_own():
    gpu = {"clock_ms": 0.0, "step_ms": 250.0, "done_upto": 0.0, "synced": 0}
    t = EventTimer(torch.device("cuda", 0), new_event=lambda: FakeEvent(gpu),
                   current_stream=lambda device: "stream")
    t.start(); t.stop("u0")  # events at 250 and 500 ms of GPU time
    t.start(); t.stop("u1")  # 750 and 1000
    assert t.total_s() == 0.0  # nothing has run yet: not counted, and no host sync
    gpu["done_upto"] = 600.0
    assert t.total_s() == 0.25 and gpu["synced"] == 0  # u0 completed: 250 ms
    assert t.take() == [("u0", 0.25), ("u1", None)]  # u1 still unknown
    t.start(); t.stop("u2")
    assert t.take(wait=True) == [("u2", 0.25)] and gpu["synced"] == 1


def _entry(unit, compute_s):
    return TraceEntry(unit=unit, shard_bytes=1, gathered_bytes=1, home=Level.HOST,
                      compute_s=compute_s)


def test_measured_unit_times_replace_the_clocks():
    entries = [_entry(0, 0.001), _entry(1, 0.001), _entry(0, 0.001), _entry(2, 0.001)]
    measured = [(0, 0.5), (1, None), (0, 0.7)]  # unit 1 not complete yet; unit 2 never timed
    got = apply_unit_times(entries, measured)
    assert [e.compute_s for e in got] == [0.5, 0.001, 0.7, 0.001]
    assert [e.unit for e in got] == [0, 1, 0, 2]


def test_times_unknown_at_the_end_of_a_step_are_carried_into_the_next():
    """[#31 item 3] The trace is committed right after the backward is launched: its units'
    events have not run. Their times are not dropped: the next step's take_carried() has them,
    and they fill that step's unknown times of the same units (not the launch clock's)."""
    gpu = {"clock_ms": 0.0, "step_ms": 100.0, "done_upto": 0.0, "synced": 0}
    t = EventTimer(torch.device("cuda", 0), new_event=lambda: FakeEvent(gpu),
                   current_stream=lambda device: "stream")
    t.start(); t.stop("fwd")   # 100, 200 ms
    gpu["done_upto"] = 250.0
    t.start(); t.stop("bwd")   # 300, 400 ms: launched, not run at the step's end
    first = t.take()
    assert first == [("fwd", 0.1), ("bwd", None)] and t.take_carried() == []
    gpu["done_upto"] = 450.0   # the GPU ran it during the next step
    gpu["step_ms"] = 50.0
    t.start(); t.stop("fwd")   # 450, 500
    t.start(); t.stop("bwd")   # 550, 600: again not run at this step's end
    gpu["done_upto"] = 520.0
    second = fill_unknown_times(t.take(), t.take_carried())
    assert second == [("fwd", 0.05), ("bwd", 0.1)]  # bwd: the previous step's, measured late
    assert t.total_s() == 0.1 + 0.1 + 0.05 and gpu["synced"] == 0
    entries = apply_unit_times([_entry("fwd", 1e-6), _entry("bwd", 1e-6)], second)
    assert [e.compute_s for e in entries] == [0.05, 0.1]
