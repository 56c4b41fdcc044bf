"""Fixtures of the whole-engine tests."""

from __future__ import annotations

import threading
import time

import pytest

from infinity.io import Swapper

READ_DELAY_S = 0.01


@pytest.fixture
def slow_reads(monkeypatch):
    """Every NVMe read block sleeps first (in the I/O thread); records the keys read and whether
    the read was issued while a backward ran (``in_backward`` is set by the tests)."""
    state = {"in_backward": False, "reads": []}
    lock = threading.Lock()
    move, swap_in = Swapper._move, Swapper.swap_in

    def slow_move(self, op, file_offset, addr, length):
        if op.kind != "out":
            time.sleep(READ_DELAY_S)
        return move(self, op, file_offset, addr, length)

    def recording_swap_in(self, key, out):
        with lock:
            state["reads"].append((key, state["in_backward"]))
        return swap_in(self, key, out)

    monkeypatch.setattr(Swapper, "_move", slow_move)
    monkeypatch.setattr(Swapper, "swap_in", recording_swap_in)
    return state
