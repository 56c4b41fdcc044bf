"""Aligned host memory for direct I/O: page-aligned tensors and aligned extents carved from them.

[Note: direct I/O alignment] (in :mod:`infinity.io`) says why: a block whose memory is aligned
goes straight from/to the tensor, anything else through a staging copy. :func:`aligned_empty` and
:func:`aligned_view` give tensors that never need staging except for a tail shorter than the
alignment. The tiered store's arena: allocate it with ``aligned_empty`` (pinned for a CUDA engine:
``pin_device=pin_device_for(device)``), carve extents at offsets that are multiples of
``swapper.alignment_bytes``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import torch

from infinity._async_copy import StagingRing
from infinity._common import align_up, format_bytes
from infinity.io._huge_pages import huge_pages_for_direct_io, huge_pages_pay_off

DEFAULT_ALIGNMENT_BYTES = 4096
"""Direct-I/O alignment assumed when the file system does not say (and the page size we map)."""


_HUGEPAGE_MIN_BYTES = 4 * 1024 * 1024
"""Mappings from this size up are advised to use transparent huge pages."""


class _RegisteredMmap(mmap.mmap):
    """An anonymous mapping pinned with ``cudaHostRegister``; unpinned before it is unmapped."""

    cuda_registered_ptr: int = 0

    def __del__(self) -> None:
        if self.cuda_registered_ptr:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.cuda_registered_ptr)
            except Exception:  # noqa: BLE001 - interpreter shutdown; the mapping goes anyway
                pass


def pin_device_for(device: torch.device | str) -> torch.device | None:
    """The device whose copies read host memory of an engine on ``device``: itself when it is a
    CUDA device (with its index filled in), None otherwise.

    [Note: pin only what a GPU copy touches] Pinning (``cudaHostRegister``) is for host memory a
    GPU copy reads or writes: the store's arena, the optimizer's and the gradient reducer's
    staging. It creates a CUDA context on the current device the first time (~0.5 GB of GPU
    memory), so it happens on the rank's own device and never for memory only the CPU or the
    disk touches (the swapper's I/O staging, benchmark buffers), nor with ``device: cpu``
    even where CUDA exists. Callers decide from the engine's device and pass the result on.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def aligned_empty(numel: int, dtype: torch.dtype, *, pin_device: torch.device | None = None,
                  direct_io: bool = False) -> torch.Tensor:
    """A 1-D CPU tensor of ``numel`` elements on fresh page-aligned memory (an anonymous ``mmap``).

    Page alignment (4096) satisfies every file system's direct-I/O alignment we know of.
    ``pin_device``: a CUDA device whose copies read or write this memory (see
    :func:`pin_device_for`): the pages are then pinned in place (``cudaHostRegister``, under that
    device so that no other device gets a context), at exactly this size: no allocator rounding.
    None (the default): not pinned ([Note: pin only what a GPU copy touches]). ``direct_io``: the
    disk will read into and write from this memory for as long as it lives (the store's arena
    with a swapper, a disk probe): from 4 MiB up it is advised to use huge pages wherever the
    kernel has them ([Note: direct I/O wants huge pages] in infinity/io/_huge_pages.py);
    otherwise only where huge pages pay off for the CPU. The memory lives as long as the tensor
    or any view of it.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"aligned_empty: numel must be an integer >= 0, got {numel!r}")
    if pin_device is not None and torch.device(pin_device).type != "cuda":
        raise ValueError(f"aligned_empty: pin_device must be a CUDA device or None, got "
                         f"{pin_device!r}; pass pin_device_for(engine_device)")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    size = align_up(nbytes, mmap.PAGESIZE)
    buf = _RegisteredMmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise = huge_pages_for_direct_io() if direct_io else huge_pages_pay_off()
    if size >= _HUGEPAGE_MIN_BYTES and hasattr(mmap, "MADV_HUGEPAGE") and advise:
        # Direct I/O: a disk request holds ~1 MiB of 4 KiB pages, 4 MiB of huge pages ([Note:
        # direct I/O wants huge pages]). Otherwise the host arena holds optimizer state that Adam
        # streams through: on 4 KiB pages that stream is TLB-bound (see [Note: state memory
        # layout] in infinity/optim/cpu_adam.py), where huge pages are cheap to fault in ([Note:
        # when huge pages cost more than they save] in infinity/io/_huge_pages.py).
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # transparent huge pages disabled: still correct on 4 KiB pages
            pass
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)  # keeps ``buf`` alive
    if pin_device is not None:
        _register(buf, flat.data_ptr(), size, torch.device(pin_device))
    return flat.view(dtype)


HUGE_PAGE_BYTES = 2 * 1024 * 1024
"""The transparent huge page size on x86-64 and most arm64 kernels: madvise ranges are cut to it."""
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_madvise = None  # libc's madvise, resolved on first use (None after a failed lookup: never retried)
_madvise_looked_up = False


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask the kernel to back ``tensor``'s (fresh, not yet touched) CPU storage with transparent
    huge pages; True if it was advised. A no-op for small, non-CPU or already-touched memory
    (where it would only affect later faults) and where the kernel or libc lacks it.

    [Note: first touch of large host buffers] torch's CPU allocator serves every buffer of a
    unit's size (hundreds of MiB at 7B) with a fresh ``mmap`` that is returned on free ([Note:
    freed buffers leave the process] in infinity/io/_host_malloc.py), so each gathered unit and
    each DEVICE-tier copy on a CPU engine is faulted in page by page on its first write. On the
    2-core VM that first write ran at 2.1 GB/s on 4 KiB pages and 5.5-6 GB/s with this advice
    (a 400 MiB bf16 copy into a freshly resized storage, /tmp benchmark in the #16 note): a 7B
    model streams ~25 GB of such buffers per step, so this is seconds per step. The kernel's
    ``transparent_hugepage/enabled`` is ``madvise`` on common distributions: without the advice
    nothing gets huge pages. Only the 2 MiB-aligned interior is advised. Not advised at all
    where huge pages are slow to fault in ([Note: when huge pages cost more than they save] in
    infinity/io/_huge_pages.py: on that same VM, once the freed memory had gone back to the
    hypervisor, the advised write ran at 0.15 GB/s)."""
    if tensor.device.type != "cpu":
        return False
    storage = tensor.untyped_storage()
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    if nbytes < _HUGEPAGE_MIN_BYTES or not huge_pages_pay_off():
        return False
    return _advise_range(ptr, nbytes)


def advise_direct_io_range(ptr: int, nbytes: int) -> bool:
    """Advise huge pages for ``[ptr, ptr + nbytes)`` (its 2 MiB-aligned interior), memory the
    disk will read into and write from ([Note: direct I/O wants huge pages] in
    infinity/io/_huge_pages.py); True if advised. Only pages faulted in afterwards change."""
    return huge_pages_for_direct_io() and _advise_range(ptr, nbytes)


def release_pages(ptr: int, nbytes: int) -> bool:
    """``MADV_DONTNEED`` the whole pages of ``[ptr, ptr + nbytes)`` (2 MiB-aligned interior) of a
    private anonymous mapping: their bytes are dropped, the next touch faults in zeroed pages
    under the mapping's current advice. True if released. Never on memory anything still holds:
    the caller owns that range and keeps nothing in it."""
    return _advise_range(ptr, nbytes, _MADV_DONTNEED)


def populate_pages(ptr: int, nbytes: int) -> bool:
    """Fault in the whole pages of ``[ptr, ptr + nbytes)`` (2 MiB-aligned interior) as a write
    would, without writing (``MADV_POPULATE_WRITE``, Linux 5.14): the bytes stay as they are, so
    it is safe beside threads using the range. True if populated; False where the kernel has no
    such advice."""
    return _advise_range(ptr, nbytes, _MADV_POPULATE_WRITE)


def _advise_range(ptr: int, nbytes: int, advice: int = _MADV_HUGEPAGE) -> bool:
    global _madvise, _madvise_looked_up
    if not _madvise_looked_up:
        _madvise_looked_up = True
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            _madvise = libc.madvise
            _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _madvise.restype = ctypes.c_int
        except (OSError, AttributeError):  # not a libc with madvise: 4 KiB pages, still correct
            _madvise = None
    if _madvise is None:
        return False
    lo = align_up(ptr, HUGE_PAGE_BYTES)
    hi = (ptr + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if hi <= lo:
        return False
    return _madvise(lo, hi - lo, advice) == 0


def _register(buf: _RegisteredMmap, ptr: int, size: int, device: torch.device) -> None:
    """Pin ``size`` bytes at ``ptr`` (the mapping ``buf``) for copies by ``device``."""
    with torch.cuda.device(device):
        rc = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister of {format_bytes(size)} failed (error {int(rc)}); "
                           "raise RLIMIT_MEMLOCK (ulimit -l) or lower the host budget")
    buf.cuda_registered_ptr = ptr


def aligned_view(arena: torch.Tensor, offset_bytes: int, numel: int, dtype: torch.dtype,
                 *, alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES) -> torch.Tensor:
    """A ``numel``-element tensor of ``dtype`` carved from a 1-D uint8 ``arena`` at ``offset_bytes``.

    ``offset_bytes`` must be a multiple of ``alignment_bytes`` (pass ``swapper.alignment_bytes``) so
    that swap-ins land in the extent with direct I/O and no staging copy.
    """
    if arena.dtype != torch.uint8 or arena.dim() != 1 or not arena.is_contiguous():
        raise ValueError("aligned_view: arena must be a contiguous 1-D uint8 tensor (aligned_empty)")
    if offset_bytes % alignment_bytes or arena.data_ptr() % alignment_bytes:
        raise ValueError(f"aligned_view: offset_bytes={offset_bytes} and the arena address must be "
                         f"multiples of alignment_bytes={alignment_bytes}; round the offset up")
    itemsize = torch.empty((), dtype=dtype).element_size()
    end = offset_bytes + numel * itemsize
    if end > arena.numel():
        raise ValueError(f"aligned_view: extent [{offset_bytes}, {end}) exceeds the arena's "
                         f"{arena.numel()} bytes")
    return arena[offset_bytes:end].view(dtype)


def memory_at(addr: int, nbytes: int) -> memoryview:
    """A writable memoryview of ``nbytes`` at ``addr`` (no copy); the caller keeps the owner alive."""
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


def address_of(mem: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mem))


def pinned_staging_ring(device: torch.device, num_slots: int = 2) -> StagingRing:
    """A :class:`~infinity._async_copy.StagingRing` of host slots for copies to or from
    ``device``, pinned on it when it is a GPU ([Note: pin only what a GPU copy touches]); two
    slots: one filled while the other's copy runs."""
    pin = pin_device_for(device)
    return StagingRing(num_slots, device=device,
                       allocate=lambda nbytes: aligned_empty(nbytes, torch.uint8, pin_device=pin))
