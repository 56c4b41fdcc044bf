"""[Note: activations stay in the heap] (infinity/io/_host_malloc.py): with the threshold managed,
a new 1 MiB buffer allocated inside ``activations_in_heap`` grows the heap (and is reused from
there, without page faults), one allocated inside ``engine_buffers`` (even nested in it) or
outside both gets its own ``mmap`` (returned to the system on free). Checked against the
kernel's own map of the process: the main thread's heap is the ``[heap]`` mapping of
/proc/self/maps."""

from __future__ import annotations

import os
import sys

import pytest

from tests._support.fresh import call_in_fresh_process

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")


def _in_heap(ptr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith("[heap]"):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= ptr < hi:
                    return True
    return False


def _where_buffers_land() -> dict:
    """In a fresh process: where a 1 MiB tensor lands outside, in the compute window, and in an
    engine window nested in it ({"managed": False} when the threshold could not be managed)."""
    import torch

    from infinity.io import activations_in_heap, engine_buffers, manage_mmap_threshold

    held = []  # every buffer stays alive: a free heap chunk would serve the next one at any
    # threshold (the threshold decides only how the process grows)

    def one() -> bool:
        held.append(torch.empty(1 << 18, dtype=torch.float32))  # 1 MiB: > 128 KiB, < 32 MiB
        return _in_heap(held[-1].data_ptr())

    if not manage_mmap_threshold():
        return {"managed": False}
    out = {"managed": True, "outside": one()}
    with activations_in_heap():
        out["compute"] = one()
        with engine_buffers():
            out["engine_in_compute"] = one()
        out["compute_again"] = one()
    out["after"] = one()
    return out


def test_activations_come_from_the_heap_and_engine_buffers_from_mmap():
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        pytest.skip("the user's MALLOC_MMAP_THRESHOLD_ wins")
    got = call_in_fresh_process(__name__, "_where_buffers_land")
    if not got["managed"]:
        pytest.skip("not glibc")
    assert got == {"managed": True, "outside": False, "compute": True,
                   "engine_in_compute": False, "compute_again": True, "after": False}
