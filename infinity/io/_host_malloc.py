"""glibc's mmap threshold, set per kind of buffer: the engine's unit-sized buffers from their own
``mmap`` (returned to the system on free), torch's activations from the heap (reused, no faults).

[Note: freed buffers leave the process]
glibc serves an allocation of at least ``M_MMAP_THRESHOLD`` bytes (128 KiB at start) with its own
``mmap`` and returns it to the system on free. But by default the threshold is dynamic: each free
of such a block raises it to that block's size (up to 32 MiB), so after the first unit buffer
is freed, every later unit buffer, staging copy and gathered gradient below that size comes
from the heap, and freed heap memory mostly stays in the process. On the 2-core VM (a GPT of
1.8M-parameter fp32 blocks, parameters and optimizer on NVMe, fixed budgets; the peak RSS of
the training steps as tests/engine/test_grads_on_nvme.py measures it) that made the process grow
with the model: 16 blocks peaked 217 MB above 5 blocks, although every budget was the same.

[Note: activations stay in the heap]
Fixing the threshold at 128 KiB for the whole process (as the engine did until 2026-12-04) ended
that growth (5 vs 16 blocks: 13 MB apart) but also sent every activation of 128 KiB or more to a
fresh ``mmap``, faulted in page by page on each allocation ([Note: first touch of large host
buffers] in infinity/io/_aligned.py). A LoRA step over 8 of Llama-7B's layers with every weight in
memory took 3.02 s against plain peft's 2.58 s (cProfile: backward +0.26 s a step, RMSNorm, rotary,
cat, SiLU 2-5x slower), and 2.71 s with the threshold at 32 MiB; at 7B with the whole base cached,
11.67 s against 10.07 s. So the threshold is 128 KiB as before, except while the model's forward
or backward runs (:func:`activations_in_heap`), when it is 32 MiB (the ceiling of glibc's own
dynamic threshold, where plain PyTorch settles after its first large free: activations reuse heap
memory as they do there); and inside that, the engine's own allocations go back to 128 KiB
(:func:`engine_buffers`: a gathered unit, a DEVICE-tier copy on a CPU engine, a unit's gradient
staging, a deferred optimizer update run in the forward). The same LoRA step: 2.73 s (1.06x
plain); the test model's 16 blocks peaked 9-13 MB above 5 blocks (128 KiB throughout: 13 MB; a
32 MiB threshold without the engine's windows: 12-30 MB, with the unit buffers alone inside them).

The threshold decides how the process grows, not where every request goes: one that fits a free
chunk of the heap is served from it at any threshold (an engine buffer may reuse a hole that an
activation left: the heap does not grow for it), so the heap never grows past the activations'
own peak and the small allocations.

Done only with offload (where host memory is budgeted), only on glibc, and never over a user's own
``MALLOC_MMAP_THRESHOLD_``. The threshold is process-wide: windows are counted over every thread,
and an engine window open on any thread wins (an activation allocated meanwhile goes to ``mmap``:
slower, never wrong).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import threading
from typing import Iterator

logger = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number for the mmap threshold."""
ENGINE_BUFFER_THRESHOLD_BYTES = 128 * 1024
"""Outside :func:`activations_in_heap`, and inside :func:`engine_buffers`: glibc's own initial
threshold, so a unit's buffer is its own ``mmap``, returned to the system on free."""
COMPUTE_THRESHOLD_BYTES = 32 * 1024 * 1024
"""Inside :func:`activations_in_heap` with no engine window open: glibc's
``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit, where its dynamic threshold ends up."""

_mallopt = None  # set by manage_mmap_threshold() on glibc
_lock = threading.Lock()
_open = {"compute": 0, "engine": 0}
"""Windows open now, over every thread."""
_current = ENGINE_BUFFER_THRESHOLD_BYTES


def _threshold() -> int:
    return (COMPUTE_THRESHOLD_BYTES if _open["compute"] and not _open["engine"]
            else ENGINE_BUFFER_THRESHOLD_BYTES)


def manage_mmap_threshold() -> bool:
    """Take glibc's mmap threshold over (once per process; [Note: activations stay in the
    heap]): ENGINE_BUFFER_THRESHOLD_BYTES, COMPUTE_THRESHOLD_BYTES inside
    :func:`activations_in_heap` unless an :func:`engine_buffers` window is open too. False where
    it is not glibc, or the user set ``MALLOC_MMAP_THRESHOLD_`` (the windows then change
    nothing)."""
    global _mallopt, _current
    if _mallopt is not None:
        return True
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to manage
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    with _lock:
        if mallopt(_M_MMAP_THRESHOLD, _threshold()) != 1:
            return False
        _mallopt, _current = mallopt, _threshold()
    logger.debug("glibc mmap threshold managed: %d bytes, %d while activations are allocated "
                 "([Note: activations stay in the heap])", ENGINE_BUFFER_THRESHOLD_BYTES,
                 COMPUTE_THRESHOLD_BYTES)
    return True


@contextlib.contextmanager
def _window(kind: str) -> Iterator[None]:
    if _mallopt is None:
        yield
        return
    with _lock:
        _open[kind] += 1
        _apply_locked()
    try:
        yield
    finally:
        with _lock:
            _open[kind] -= 1
            _apply_locked()


def _apply_locked() -> None:
    """Set the threshold the open windows call for, if it changed (``_lock`` held)."""
    global _current
    if _threshold() != _current:
        _current = _threshold()
        _mallopt(_M_MMAP_THRESHOLD, _current)


def activations_in_heap() -> contextlib.AbstractContextManager[None]:
    """The model's forward or backward runs inside this: its activations come from the heap
    and are reused ([Note: activations stay in the heap]). A no-op until
    :func:`manage_mmap_threshold` has taken the threshold over."""
    return _window("compute")


def engine_buffers() -> contextlib.AbstractContextManager[None]:
    """The engine allocates its unit- and sub-group-sized CPU buffers inside this, also inside
    :func:`activations_in_heap`: each gets its own ``mmap`` and leaves the process when freed
    ([Note: freed buffers leave the process]). A no-op until :func:`manage_mmap_threshold` has
    taken the threshold over."""
    return _window("engine")
