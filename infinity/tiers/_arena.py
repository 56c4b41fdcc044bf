"""The host arena: one aligned buffer allocated once at the HOST budget, carved into extents.

[Note: one host arena] The HOST tier never asks torch's allocator for memory after start-up: the
arena is one ``swapper.aligned_empty`` buffer of exactly the budget (pinned in place for a GPU engine;
page-aligned always), so there is no per-tensor pinning, no power-of-two rounding, and NVMe reads
land in extents with direct I/O and no staging copy. Extents start at and span multiples of the
alignment; the free list is kept sorted by offset and coalesced on every free. Best fit limits
fragmentation; when no single hole is large enough the store evicts to make one (see ``store.py``).

[Note: long-lived extents from the top]
Home copies (shards homed on the HOST tier, the gradient accumulators) live as long as the store;
cache and staging copies come and go. Allocated from the same end, the home copies end up strewn
between the transient ones, and once every transient copy is evicted the free bytes are split into
holes no larger than the gaps between home copies: a budget the planner accepted then failed with
"fragmented" (small preset, parameters on NVMe, host budgets of 0.1-0.75 of the model). So
long-lived extents are carved from the top of the highest hole that fits and transient ones by
best fit from the bottom: the home copies pack at the top, and evicting the transient copies always
leaves one hole.

[Note: huge pages where the disk moves the arena] With a swapper, the transient extents are where
the disk reads and writes, and want huge pages ([Note: direct I/O wants huge pages] in
infinity/io/_huge_pages.py); the long-lived ones (shards homed on the host: optimizer state, the
gradient accumulators) are the CPU's, and follow the CPU's policy: on a VM that reports free pages
to its hypervisor a fresh huge page faults in at ~0.2 GB/s, a 4 KiB page at ~4 GB/s, and set-up
writes every home copy once (a 1B GPT at a 4 GiB budget, 2.2 GB of it homed on the host: set-up
took 42.7 s with the whole arena advised, 22.3 s with none of it). So the arena advises huge
pages lazily, for the range transient allocations reach from the bottom (up to the 2 MiB
boundary past the highest transient extent so far), before anything is written there; the home
copies at the top keep the default.

The engine's set-up writes each shard once through a bounded window at the bottom ([Note:
set-up copies are dropped once written] in store.py): faulted in on huge pages, that window cost
2.5-4 s of a 1B GPT's 22 s set-up, for writes that do not need it. So set-up pauses the advice
(``pause_direct_io_advice``), and ``resume_direct_io_advice`` prepares every hole for the steps:
its whole pages go back to the kernel (``MADV_DONTNEED``; left on 4 KiB pages, set-up's window
made the 7B LoRA step 1.09x plain's instead of 0.98x), are advised, and a low-priority thread
faults them in (``MADV_POPULATE_WRITE``, which never changes bytes, so the steps may use the
range meanwhile). Faulted in lazily instead, by the reads that first land there, the I/O
threads stalled on it in the first steps (135M GPT at half its state: prefetch reads at 0.1-0.6
GB/s in the warm-up and the first timed steps).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
import threading
from typing import Callable

import torch

from infinity._common import align_up
from infinity.io import HUGE_PAGE_BYTES, advise_direct_io_range, populate_pages, release_pages

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Extent:
    """``[offset_bytes, offset_bytes + size_bytes)`` of the arena; both multiples of the alignment."""

    offset_bytes: int
    size_bytes: int

    @property
    def end_bytes(self) -> int:
        return self.offset_bytes + self.size_bytes


class HostArena:
    """A fixed buffer and a coalescing free-list allocator over it. Thread-safe.

    ``allocate_fn(numel, dtype)`` makes the buffer (``infinity.io.aligned_empty`` in the store;
    tests pass their own). ``capacity_bytes`` is rounded DOWN to the alignment so that every extent
    is whole.
    """

    def __init__(self, capacity_bytes: int, *, alignment_bytes: int,
                 allocate_fn: Callable[[int, torch.dtype], torch.Tensor], direct_io: bool = False):
        if alignment_bytes <= 0 or alignment_bytes & (alignment_bytes - 1):
            raise ValueError(f"HostArena: alignment_bytes must be a power of two, got "
                             f"{alignment_bytes}")
        self.alignment_bytes = alignment_bytes
        self.capacity_bytes = capacity_bytes // alignment_bytes * alignment_bytes
        self.buffer = allocate_fn(self.capacity_bytes, torch.uint8)
        """The one allocation of the HOST tier; every extent is a view of it."""
        if self.capacity_bytes and self.buffer.data_ptr() % alignment_bytes:
            raise RuntimeError(f"host arena at {self.buffer.data_ptr():#x} is not aligned to "
                               f"{alignment_bytes} bytes; allocate it with swapper.aligned_empty")
        self._lock = threading.Lock()
        self._free_offsets: list[int] = [0] if self.capacity_bytes else []
        """Start of each free hole, sorted (for coalescing with neighbours by bisect)."""
        self._free_sizes: dict[int, int] = {0: self.capacity_bytes} if self.capacity_bytes else {}
        """Hole start -> hole size."""
        self._live: dict[int, int] = {}
        """Allocated extent start -> size (detects double frees and foreign extents)."""
        self._direct_io = direct_io
        """The disk moves the transient extents: advise huge pages where they reach ([Note: huge
        pages where the disk moves the arena])."""
        self._paused = False
        """Set-up: the range transient extents reach is not advised (see the note)."""
        self._advised_bytes = 0
        """The arena's bytes from the bottom up to which huge pages are advised."""

    def extent_bytes(self, nbytes: int) -> int:
        """Bytes an extent for ``nbytes`` of payload occupies (rounded up to the alignment)."""
        return max(align_up(nbytes, self.alignment_bytes), self.alignment_bytes)

    def allocate(self, nbytes: int, *, long_lived: bool = False) -> Extent | None:
        """An extent for ``nbytes``; None when no single hole is large enough. Transient: best
        fit, from the bottom of the hole; ``long_lived``: from the top of the highest hole that
        fits ([Note: long-lived extents from the top])."""
        size = self.extent_bytes(nbytes)
        with self._lock:
            best = None
            if long_lived:
                best = next((off for off in reversed(self._free_offsets)
                             if self._free_sizes[off] >= size), None)
            else:
                for off in self._free_offsets:
                    hole = self._free_sizes[off]
                    if hole >= size and (best is None or hole < self._free_sizes[best]):
                        best = off
                        if hole == size:
                            break
            if best is None:
                return None
            hole = self._free_sizes[best]
            if hole == size:
                del self._free_sizes[best]
                del self._free_offsets[bisect.bisect_left(self._free_offsets, best)]
                start = best
            elif long_lived:  # the hole keeps its start, and shrinks
                self._free_sizes[best] = hole - size
                start = best + hole - size
            else:  # the hole moves up past the extent
                del self._free_sizes[best]
                i = bisect.bisect_left(self._free_offsets, best)
                self._free_offsets[i] = best + size
                self._free_sizes[best + size] = hole - size
                start = best
            self._live[start] = size
            if self._direct_io and not long_lived and not self._paused \
                    and start + size > self._advised_bytes:
                self._advise_up_to(start + size)
            return Extent(start, size)

    def pause_direct_io_advice(self) -> None:
        """Set-up begins: transient extents stop being advised huge pages (see the note)."""
        self._paused = True

    def resume_direct_io_advice(self) -> None:
        """Set-up is over: every hole's whole pages are released, advised and faulted in again in
        the background, live extents keep their pages and bytes (see the note)."""
        with self._lock:
            self._paused = False
            if not self._direct_io:
                return
            # The holes: what the steps' transient extents will take (each call acts on a hole's
            # whole 2 MiB pages only, so a live extent's bytes are never touched).
            base = self.buffer.data_ptr()
            ranges = [(base + off, self._free_sizes[off]) for off in self._free_offsets]
            for lo, nbytes in ranges:
                release_pages(lo, nbytes)
                advise_direct_io_range(lo, nbytes)
            self._advised_bytes = self.capacity_bytes  # no lazy advice from here on
        if ranges:
            threading.Thread(target=_populate, args=(self.buffer, ranges), daemon=True,
                             name="infinity-arena-populate").start()

    def _advise_up_to(self, end_bytes: int) -> None:
        """[Note: huge pages where the disk moves the arena] (lock held)."""
        base = self.buffer.data_ptr()
        hi = min(align_up(base + end_bytes, HUGE_PAGE_BYTES), base + self.capacity_bytes)
        lo = base + self._advised_bytes
        if hi > lo:
            advise_direct_io_range(lo, hi - lo)  # only the 2 MiB-aligned interior is advised
        self._advised_bytes = hi - base

    def free(self, extent: Extent) -> None:
        with self._lock:
            if self._live.get(extent.offset_bytes) != extent.size_bytes:
                raise RuntimeError(f"internal error: freeing extent {extent} that is not allocated")
            del self._live[extent.offset_bytes]
            off, size = extent.offset_bytes, extent.size_bytes
            i = bisect.bisect_left(self._free_offsets, off)
            if i < len(self._free_offsets) and self._free_offsets[i] == off + size:  # next hole
                size += self._free_sizes.pop(self._free_offsets[i])
                del self._free_offsets[i]
            if i > 0:
                prev = self._free_offsets[i - 1]
                if prev + self._free_sizes[prev] == off:  # previous hole
                    self._free_sizes[prev] += size
                    return
            self._free_offsets.insert(i, off)
            self._free_sizes[off] = size

    def view(self, extent: Extent, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The first ``numel`` elements of ``dtype`` in ``extent`` (shares the arena's memory)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes > extent.size_bytes:
            raise RuntimeError(f"internal error: {nbytes} B do not fit extent {extent}")
        return self.buffer[extent.offset_bytes:extent.offset_bytes + nbytes].view(dtype)

    def raw(self, extent: Extent) -> torch.Tensor:
        """The whole extent as uint8 (aligned address and length: what the swapper reads/writes)."""
        return self.buffer[extent.offset_bytes:extent.end_bytes]

    def free_bytes(self) -> int:
        with self._lock:
            return sum(self._free_sizes.values())

    def largest_free_bytes(self) -> int:
        with self._lock:
            return max(self._free_sizes.values(), default=0)

    def extents(self) -> list[Extent]:
        """Allocated extents, by offset (tests check alignment and overlap against this)."""
        with self._lock:
            return [Extent(o, s) for o, s in sorted(self._live.items())]

    def holes(self) -> list[Extent]:
        with self._lock:
            return [Extent(o, self._free_sizes[o]) for o in self._free_offsets]


_POPULATE_CHUNK_BYTES = 64 * 1024 * 1024


def _populate(buffer: torch.Tensor, ranges: list[tuple[int, int]]) -> None:
    """Fault ``ranges`` of ``buffer``'s memory in, a chunk at a time, at the lowest CPU priority
    (the thread holds ``buffer``: the mapping outlives it)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux: the default priority
        pass
    for lo, nbytes in ranges:  # whole 2 MiB pages, in chunks of whole pages
        start = align_up(lo, HUGE_PAGE_BYTES)
        end = (lo + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        for chunk in range(start, end, _POPULATE_CHUNK_BYTES):
            if not populate_pages(chunk, min(_POPULATE_CHUNK_BYTES, end - chunk)):
                return  # a kernel without MADV_POPULATE_WRITE: the reads fault them in
