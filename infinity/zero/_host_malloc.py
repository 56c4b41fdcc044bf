"""Keep freed host buffers from staying in the process: glibc's mmap threshold, fixed once.

[Note: freed buffers leave the process]
glibc serves an allocation of at least ``M_MMAP_THRESHOLD`` bytes (128 KiB at start) with its own
``mmap`` and returns it to the system on free. But by default the threshold is dynamic: each free
of such a block raises it to that block's size (up to 32 MiB), so after the first unit buffer
is freed, every later unit buffer, staging copy and gathered gradient below that size comes
from the heap, and freed heap memory mostly stays in the process. On the 2-core VM (a GPT of
1.8M-parameter fp32 blocks, parameters and optimizer on NVMe, fixed budgets; the peak RSS of
the training steps as tests/engine/test_grads_on_nvme.py measures it) that made the process grow
with the model: 16 blocks peaked 163 MB above 5 blocks, ~8 B per parameter more, although every
budget was the same. With the threshold fixed at 128 KiB (which turns the dynamic adjustment
off) the two peaks were 13 MB apart. Done only with
offload (where host memory is budgeted), only on glibc, and never over a user's own
``MALLOC_MMAP_THRESHOLD_``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number for the mmap threshold."""
MMAP_THRESHOLD_BYTES = 128 * 1024
"""glibc's own initial threshold: blocks this large and larger go back to the system on free."""
_done = False


def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD_BYTES (once per process); False where it
    is not glibc, or the user set ``MALLOC_MMAP_THRESHOLD_``."""
    global _done
    if _done:
        return True
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to fix
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        return False
    _done = True
    logger.debug("glibc mmap threshold fixed at %d bytes ([Note: freed buffers leave the "
                 "process])", MMAP_THRESHOLD_BYTES)
    return True
