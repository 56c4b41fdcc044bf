"""The engine threads' CPU time (bench step's io_threads_cpu_s): named threads are counted per
group, from the kernel's per-thread run time; other threads, and the main thread, are not."""

from __future__ import annotations

import threading
import time

import pytest

from infinity.bench.thread_cpu import cpu_between, thread_cpu_s

BURN_S = 0.05


def _burn(stop: threading.Event, go: threading.Event) -> None:
    go.wait()
    t0 = time.thread_time()
    while time.thread_time() - t0 < BURN_S:  # CPU time, not wall: the cores are shared
        pass
    stop.wait()


def test_named_threads_cpu_is_counted_per_group():
    stop, go = threading.Event(), threading.Event()
    threads = [threading.Thread(target=_burn, args=(stop, go), name=name, daemon=True)
               for name in ("infinity-test-0", "infinity-test-1", "other-0")]
    for t in threads:
        t.start()
    try:
        before = thread_cpu_s()
        assert {name for name, _ in before.values()} >= {"infinity-test-0", "infinity-test-1"}
        assert "other-0" not in {name for name, _ in before.values()}
        go.set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until both have burnt their share
            groups = cpu_between(before, thread_cpu_s())
            if groups.get("infinity-test", 0.0) >= 2 * BURN_S * 0.9:
                break
            time.sleep(0.01)
        assert groups["infinity-test"] == pytest.approx(2 * BURN_S, rel=0.5)
        assert set(groups) <= {"infinity-test", "infinity-io", "infinity-tiers"}
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_a_thread_started_between_samples_counts_from_zero_and_exited_ones_drop_out():
    before = {1: ("infinity-io-0", 2.0), 2: ("infinity-io-1", 5.0)}
    after = {1: ("infinity-io-0", 2.5), 3: ("infinity-tiers_0", 0.25)}
    assert cpu_between(before, after) == {"infinity-io": 0.5, "infinity-tiers": 0.25}
    # a reused thread id under another name is a new thread
    assert cpu_between({1: ("infinity-io-0", 2.0)}, {1: ("infinity-tiers_3", 0.5)}) == {
        "infinity-tiers": 0.5}
