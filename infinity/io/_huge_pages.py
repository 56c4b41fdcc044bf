"""Whether advising transparent huge pages pays off on this machine: decided once per process.

``huge_pages_pay_off() -> bool`` is asked before every ``madvise(MADV_HUGEPAGE)`` the engine
makes for memory the CPU works in (:func:`infinity.io.aligned_empty`,
:func:`infinity.io.advise_huge_pages`, ``infinity.optim.cpu_adam.zeros_host``);
``huge_pages_for_direct_io() -> bool`` for memory the disk reads into and writes from
(``aligned_empty(..., direct_io=True)``: the tiered store's arena when it has a swapper, the
raw disk probes; [Note: direct I/O wants huge pages]). ``INFINITY_HUGE_PAGES`` = ``auto`` (the
default), ``on`` or ``off`` overrides both; an unknown value is a ``ValueError`` naming it.

[Note: when huge pages cost more than they save] Huge pages make the first write of a buffer
faster (one fault per 2 MiB instead of 512) and the CPU Adam's streams cheaper (no TLB misses;
[Note: state memory layout] in infinity/optim/cpu_adam.py), on a machine that hands out fresh
memory cheaply. A virtual machine with free page reporting (a virtio-balloon device with
VIRTIO_BALLOON_F_REPORTING: the 2-core VM this project is measured on is such a Firecracker guest)
gives freed high-order blocks back to the hypervisor a few seconds after they are freed, and the
next fault into such a block is served by the host. Huge pages come only from those blocks; 4 KiB
pages come from the small fragments first. Measured there (fresh mappings, first write): 4 KiB
pages 2.6-4.1 GB/s; huge pages 0.15 GB/s in a new process and whenever more than ~2 s passed since
the memory was freed, 6-12 GB/s only when a buffer of the same size was freed just before. A 4 GiB
host arena then took 27 s to fill during ``initialize`` instead of 1.5 s (a 0.32B GPT
initialised in 47.7 s with the advice and 14.5 s without), and a 400 MB buffer freed and
allocated again every 3 s took 2.5 s to write each time. So 'auto' gives no advice where the
kernel reports free pages to a hypervisor. A timing probe does not decide it: a short one finds
the huge pages a process freed a moment before (the previous test, the previous run) and says
"fast" (in 10 fresh processes, 4 probes of 16 MiB out of 10 did).

[Note: direct I/O wants huge pages] Memory the disk moves with ``O_DIRECT`` is another matter.
The kernel maps a direct-I/O request's user pages into the device's scatter-gather list, one
segment per physically contiguous run, and a request holds at most ``max_segments`` of them
(254 on this VM's virtio disk, ``/sys/block/vda/queue``): on 4 KiB pages every request is cut
at ~1 MiB, on 2 MiB pages at ``max_sectors_kb`` (4 MiB here). Measured on the same VM (8 threads
of 16 MiB ``preadv`` into one 406 MB buffer, /tmp benchmark in the #16 note): 1.5-1.9 GB/s into
4 KiB pages, 3.0-3.1 GB/s into huge pages, and while those reads ran, one 7B Llama layer's
forward + backward on the two cores took 17 % and 24 % longer with 4 KiB pages, 5 % with huge
pages (the hypervisor's work per segment is taken from the guest's vCPUs). The 7B LoRA step,
which reads 22 GB a step, went from 12.5 s to 10.4 s. The slow fault-in above is paid once per
buffer, and the store's arena is allocated once per engine and reused for every transfer: so
direct-I/O buffers are advised wherever transparent huge pages are available, reporting or not.
"""

from __future__ import annotations

import logging
import mmap
import os
import pathlib

logger = logging.getLogger(__name__)

__all__ = ["MODE_ENV", "free_page_reporting", "huge_pages_for_direct_io", "huge_pages_pay_off"]

MODE_ENV = "INFINITY_HUGE_PAGES"
_THP_ENABLED = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
_ON, _OFF = ("on", "1", "true", "yes"), ("off", "0", "false", "no")

_decision: bool | None = None
"""The process's answer, once asked (tests set it directly)."""


def huge_pages_pay_off() -> bool:
    """True when the engine should advise huge pages for its large host buffers (see the module
    doc); decided on the first call and kept for the process."""
    global _decision
    if _decision is None:
        _decision = _decide()
    return _decision


def huge_pages_for_direct_io() -> bool:
    """True when the engine should advise huge pages for long-lived buffers that the disk reads
    into or writes from with direct I/O ([Note: direct I/O wants huge pages]): whenever the
    kernel offers transparent huge pages, unless ``INFINITY_HUGE_PAGES=off``."""
    return _mode() not in _OFF and _available()


def _mode() -> str:
    raw = os.environ.get(MODE_ENV, "auto")
    mode = raw.strip().lower()
    if mode not in ("auto", *_ON, *_OFF):
        raise ValueError(f"{MODE_ENV}={raw!r}: expected 'auto' (advised unless the kernel reports "
                         "free pages to a hypervisor; direct-I/O buffers always), 'on' or 'off'")
    return mode


def _decide() -> bool:
    mode = _mode()
    if mode in _OFF or not _available():
        return False
    if mode in _ON:
        return True
    if free_page_reporting():
        logger.info("transparent huge pages not advised: this kernel reports free pages to a "
                    "hypervisor, which makes fresh huge pages slow to fault in ([Note: when huge "
                    "pages cost more than they save]; %s=on overrides)", MODE_ENV)
        return False
    return True


_VIRTIO_ID_BALLOON = 5
_VIRTIO_BALLOON_F_REPORTING = 5
_VIRTIO_DEVICES = pathlib.Path("/sys/bus/virtio/devices")


def free_page_reporting(devices: pathlib.Path = _VIRTIO_DEVICES) -> bool:
    """True when a virtio-balloon device with free page reporting has its driver bound: the
    kernel hands freed high-order blocks to the hypervisor."""
    try:
        entries = list(devices.iterdir())
    except OSError:
        return False
    for dev in entries:
        try:
            if int((dev / "device").read_text(), 16) != _VIRTIO_ID_BALLOON:
                continue
            features = (dev / "features").read_text().strip()  # bit i is character i
        except (OSError, ValueError):
            continue
        if (dev / "driver").exists() and len(features) > _VIRTIO_BALLOON_F_REPORTING \
                and features[_VIRTIO_BALLOON_F_REPORTING] == "1":
            return True
    return False


def _available() -> bool:
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in _THP_ENABLED.read_text()
    except OSError:  # no sysfs (a container without it): the advice may still work
        return True

