"""Fixtures of the whole-engine tests."""

from __future__ import annotations

import threading

import pytest

from infinity.io import Swapper
from tests._support.slow_io import slow_io

READ_DELAY_S = 0.01


@pytest.fixture
def slow_reads(monkeypatch):
    """Every NVMe read block sleeps first (in the I/O thread); records the keys read and whether
    the read was issued while a backward ran (``in_backward`` is set by the tests)."""
    state = {"in_backward": False, "reads": []}
    lock = threading.Lock()
    swap_in = Swapper.swap_in

    def recording_swap_in(self, key, out):
        with lock:
            state["reads"].append((key, state["in_backward"]))
        return swap_in(self, key, out)

    slow_io(monkeypatch, Swapper, "in", READ_DELAY_S)
    monkeypatch.setattr(Swapper, "swap_in", recording_swap_in)
    return state
