"""CPU seconds spent by the engine's own threads (the swapper's I/O threads, the store's copy
threads), sampled around a benchmark's steps.

On a machine with few cores every CPU second those threads spend (copies, checksums, page-cache
work, syscalls) is one the forward, backward and optimizer do not get, so a benchmark reports it
beside the step time (issue #16). The threads are found by name through :mod:`threading`: CPython
3.11 does not hand a thread's name to the kernel (every thread's ``comm`` reads ``python``), and
torch's own compute threads (OpenMP) are not Python threads, so they are never counted here.

Per thread, the kernel's run time in ``/proc/self/task/<tid>/schedstat`` (nanoseconds), or
``utime + stime`` of ``.../stat`` (clock ticks, 10 ms) where schedstat is missing.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Mapping

ENGINE_THREAD_PREFIX = "infinity-"
"""The engine names its threads ``infinity-io-<i>`` (swapper) and ``infinity-tiers_<i>`` (store)."""

_INDEX = re.compile(r"[-_]\d+$")
"""A thread's index in its pool, dropped to name its group."""


def _task_cpu_s(tid: int) -> float | None:
    """CPU seconds of thread ``tid`` of this process; None when it has exited."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/self/task/{tid}/stat", encoding="ascii") as f:
            # Fields after the parenthesised command name (which may hold spaces): utime is the
            # 14th field of the line, stime the 15th, the 12th and 13th after the ')'.
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def thread_cpu_s(prefix: str = ENGINE_THREAD_PREFIX) -> dict[int, tuple[str, float]]:
    """Native thread id -> (name, CPU seconds so far) of this process's live Python threads whose
    name starts with ``prefix``."""
    out: dict[int, tuple[str, float]] = {}
    for thread in threading.enumerate():
        if not thread.name.startswith(prefix) or thread.native_id is None:
            continue
        seconds = _task_cpu_s(thread.native_id)
        if seconds is not None:
            out[thread.native_id] = (thread.name, seconds)
    return out


def cpu_between(before: Mapping[int, tuple[str, float]],
                after: Mapping[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per thread group (the name less its pool index: ``infinity-io``) between two
    :func:`thread_cpu_s` samples. A thread started in between counts from zero; one that exited in
    between is lost (the engine's threads live as long as the engine)."""
    groups: dict[str, float] = {}
    for tid, (name, seconds) in after.items():
        was = before.get(tid)
        delta = seconds - (was[1] if was is not None and was[0] == name else 0.0)
        group = _INDEX.sub("", name)
        groups[group] = groups.get(group, 0.0) + max(delta, 0.0)
    return groups


__all__ = ["ENGINE_THREAD_PREFIX", "cpu_between", "thread_cpu_s"]
