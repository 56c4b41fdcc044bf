"""What the kernel records about this process's mappings (/proc/self/smaps): the tests of huge-page
advice read the effect back from there instead of trusting the madvise calls."""

from __future__ import annotations

import pathlib
from typing import Iterator

_SMAPS = pathlib.Path("/proc/self/smaps")


def _mappings() -> Iterator[tuple[int, int, dict[str, str]]]:
    """(start, end, fields) of every mapping; fields by name ('AnonHugePages', 'VmFlags', ...)."""
    lo = hi = None
    fields: dict[str, str] = {}
    for line in _SMAPS.read_text().splitlines():
        head = line.split()[0] if line.strip() else ""
        if "-" in head and ":" not in head:
            if lo is not None:
                yield lo, hi, fields
            lo, hi = (int(x, 16) for x in head.split("-"))
            fields = {}
        elif ":" in head:
            fields[head.rstrip(":")] = line.split(":", 1)[1].strip()
    if lo is not None:
        yield lo, hi, fields


def anon_huge_bytes(ptr: int, nbytes: int) -> int:
    """AnonHugePages of the mappings overlapping [ptr, ptr + nbytes), in bytes: advice splits a
    buffer's mapping at the 2 MiB boundaries, so there may be several."""
    return sum(int(f["AnonHugePages"].split()[0]) * 1024 for lo, hi, f in _mappings()
               if lo < ptr + nbytes and ptr < hi and "AnonHugePages" in f)


def vm_flags(ptr: int) -> set[str]:
    """The VmFlags of the mapping that holds ``ptr`` ('hg': advised huge pages)."""
    for lo, hi, f in _mappings():
        if lo <= ptr < hi:
            return set(f.get("VmFlags", "").split())
    raise AssertionError(f"no mapping holds {ptr:#x}")
