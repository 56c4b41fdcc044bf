"""Per-shard records, handles, the store's settings and its counters (no policy here)."""

from __future__ import annotations

import ctypes
import dataclasses
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable

import torch

from infinity.errors import IllegalTransitionError
from infinity.tiers._arena import Extent
from infinity.tiers.residency import TRANSITIONS, Residency, Tier

if TYPE_CHECKING:
    from infinity.config import MemoryConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Settings of one :class:`~infinity.tiers.TieredStore` (resolved numbers, no 'auto')."""

    device_budget_bytes: int
    """Bytes of shard copies on the compute device at once (every DEVICE allocation is checked)."""
    host_budget_bytes: int
    """Size of the host arena, allocated once; HOST copies are carved from it (multiples of the
    alignment, so a copy of ``n`` bytes costs ``align_up(n, alignment)``)."""
    num_copy_threads: int = 2
    """Threads that finish moves (host<->device copies, completions of swaps); I/O itself runs on the
    swapper's threads."""

    def __post_init__(self) -> None:
        for name in ("device_budget_bytes", "host_budget_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"StoreConfig.{name}: expected an integer >= 0 (bytes), got "
                                 f"{value!r}; resolve 'auto' before building the store")
        if isinstance(self.num_copy_threads, bool) or not isinstance(self.num_copy_threads, int) \
                or self.num_copy_threads < 1:
            raise ValueError(f"StoreConfig.num_copy_threads: expected an integer >= 1, got "
                             f"{self.num_copy_threads!r}")

    @classmethod
    def from_memory(cls, memory: "MemoryConfig", **extra: Any) -> "StoreConfig":
        """From ``config.memory``; its budgets must already be numbers (the engine resolves 'auto')."""
        for name in ("device_budget_bytes", "host_budget_bytes"):
            if getattr(memory, name) == "auto":
                raise ValueError(f"memory.{name} is 'auto': resolve it to bytes (infinity plan / the "
                                 "engine does) before building a TieredStore")
        return cls(device_budget_bytes=memory.device_budget_bytes,
                   host_budget_bytes=memory.host_budget_bytes, **extra)


class _Copy:
    """One copy of a shard in one tier."""

    __slots__ = ("state", "tensor", "extent", "charged_bytes", "pins", "busy", "future", "last_use",
                 "ready_event")

    def __init__(self) -> None:
        self.state = Residency.ABSENT
        self.tensor: torch.Tensor | None = None
        """DEVICE: its own allocation; HOST: a view of the arena extent; NVME: None."""
        self.extent: Extent | None = None
        """HOST only: the arena extent behind ``tensor``."""
        self.charged_bytes = 0
        """Bytes counted against the tier's budget while the copy holds bytes."""
        self.pins = 0
        """``acquire`` count: a pinned copy is in use by compute and is never evicted."""
        self.busy = 0
        """Moves reading this copy right now: it may not be evicted or overwritten meanwhile."""
        self.future: Future | None = None
        """Completes (with the tensor) when the move INTO this copy ends; None when settled."""
        self.last_use = 0
        """Store clock at the last fetch/get: the LRU order."""
        self.ready_event = None
        """DEVICE on CUDA: the event after the copy that filled it; readers' streams wait on it
        ([Note: device copies complete on the stream] in _mover.py). None: nothing pending."""


class _Shard:
    """The record of one registered shard: its copies, where the newest bytes are, its next use."""

    def __init__(self, key: str, numel: int, dtype: torch.dtype, home: Tier):
        self.key = key
        self.numel = numel
        self.dtype = dtype
        self.nbytes = numel * dtype.itemsize
        self.home = home
        self.copies = {tier: _Copy() for tier in Tier}
        self.dirty: Tier | None = None
        """[Note: dirty copy] The tier whose copy is newer than the home copy (None: home is current).
        Every other existing non-home copy then holds the same newest bytes; the home copy is stale
        until a write-back completes. Evicting the dirty copy writes it back first."""
        self.has_swap_file = False
        """A swap-out was issued for this key (the swapper holds a record to remove). A fact about
        the swapper, not a state of a copy: it stays true after a failed write (the NVME copy
        ABSENT), so that unregister and close remove what the swapper holds."""
        self.writeback: Future | None = None
        """The write-back in flight (one at a time per shard): its handle; the copies it moves
        say so in their residency (the source WRITING, the home INFLIGHT)."""
        self.next_use: float | None = None
        """Caller's next-use distance for Belady eviction (None: unknown, LRU decides)."""

    def set_state(self, tier: Tier, new: Residency) -> None:
        copy = self.copies[tier]
        TRANSITIONS.check(self.key, copy.state, new, tier=tier)
        if new is Residency.ZEROS and tier is not Tier.NVME:  # only a file can be "zeros, unwritten"
            raise IllegalTransitionError(kind=TRANSITIONS.kind, key=self.key, old=copy.state,
                                         new=new, allowed=[], tier=tier)
        copy.state = new

    def settled(self) -> bool:
        """No move in or out of any copy (the only time a caller may change which copies exist)."""
        return self.writeback is None and all(
            c.state in (Residency.ABSENT, Residency.RESIDENT, Residency.ZEROS) and c.busy == 0
            for c in self.copies.values())


@dataclasses.dataclass(frozen=True, kw_only=True)
class CopyInfo:
    """A read-only snapshot of one copy of a shard (:meth:`TieredStore.copy_info`)."""

    state: Residency
    pins: int
    """``acquire`` count: a pinned copy is never evicted."""
    busy: int
    """Moves reading the copy when the snapshot was taken."""
    tensor: torch.Tensor | None
    """The copy's memory (DEVICE/HOST; valid bytes only when RESIDENT or WRITING); None: no bytes
    or NVME."""

    @classmethod
    def of(cls, shard: "_Shard", tier: Tier) -> "CopyInfo":
        copy = shard.copies[tier]
        return cls(state=copy.state, pins=copy.pins, busy=copy.busy, tensor=copy.tensor)


class TierHandle:
    """Completion of one fetch/acquire (``wait()`` -> the tensor) or write-back (``wait()`` -> None).

    ``wait()`` re-raises the move's error (``SwapIOError``...). The time spent blocked in ``wait()``
    is added to the store's ``wait_s`` counter.
    """

    def __init__(self, future: Future, key: str, tier: Tier | None, on_wait: Any,
                 before_use: Callable[[], None] | None = None):
        self._future = future
        self.key = key
        self.tier = tier
        self._on_wait = on_wait
        self._before_use = before_use
        """Run in the waiting thread once the tensor is there: a DEVICE copy on CUDA makes the
        caller's stream wait for the copy ([Note: device copies complete on the stream])."""

    def wait(self, timeout: float | None = None) -> Any:
        if self._future.done():
            return self._ready(self._future.result())
        start = time.perf_counter()
        try:
            result = self._future.result(timeout)
        finally:
            self._on_wait(time.perf_counter() - start)
        return self._ready(result)

    def settle(self, timeout: float | None = None) -> None:
        """Wait for the move to finish (re-raising its error) without making the caller's stream
        wait for a device copy: for a caller that only tracks the move (the prefetch executor);
        whoever reads the copy gets that wait from its own ``acquire`` or ``get``, where it reads
        ([Note: device copies complete on the stream] in infinity/tiers/_mover.py)."""
        if self._future.done():
            self._future.result()
            return
        start = time.perf_counter()
        try:
            self._future.result(timeout)
        finally:
            self._on_wait(time.perf_counter() - start)

    def _ready(self, result: Any) -> Any:
        if self._before_use is not None:
            self._before_use()
        return result

    def done(self) -> bool:
        return self._future.done()

    def __repr__(self) -> str:
        where = self.tier.name if self.tier is not None else "home"
        return f"TierHandle({self.key!r} -> {where}, done={self.done()})"


def done_future(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


STATS_KEYS = (
    "bytes_nvme_to_host", "bytes_host_to_device", "bytes_device_to_host", "bytes_host_to_nvme",
    "fetch_hits", "fetch_late", "fetch_misses", "fetch_overwrites", "wait_s", "num_waits",
    "evictions_device", "evictions_host", "writebacks",
    "device_used_bytes", "device_peak_bytes", "device_budget_bytes",
    "host_used_bytes", "host_peak_bytes", "host_budget_bytes", "host_largest_free_bytes",
    "host_homed_bytes", "num_shards",
)


class Counters:
    """The store's counters; :meth:`TieredStore.stats` documents the keys."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.moved = {("nvme", "host"): 0, ("host", "device"): 0, ("device", "host"): 0,
                      ("host", "nvme"): 0}
        self.fetch = {"hit": 0, "late": 0, "miss": 0, "overwrite": 0}
        self.wait_s = 0.0
        self.num_waits = 0
        self.evictions = {Tier.DEVICE: 0, Tier.HOST: 0}
        self.writebacks = 0
        self.nvme_by_kind: dict[tuple[str, str], int] = {}
        """(kind, 'read' | 'write') -> NVMe payload bytes; the kind is a key's first path
        component ('param', 'opt', 'grad', ...)."""

    def add_moved(self, src: Tier, dst: Tier, nbytes: int, key: str | None = None) -> None:
        with self._lock:
            self.moved[(src.label, dst.label)] += nbytes
            if key is not None and Tier.NVME in (src, dst):
                slot = (key.split("/", 1)[0], "read" if src is Tier.NVME else "write")
                self.nvme_by_kind[slot] = self.nvme_by_kind.get(slot, 0) + nbytes

    def nvme_bytes_by_kind(self) -> dict[str, dict[str, int]]:
        """{kind: {'read': bytes, 'write': bytes}} moved to and from NVMe so far."""
        with self._lock:
            out: dict[str, dict[str, int]] = {}
            for (kind, way), n in sorted(self.nvme_by_kind.items()):
                out.setdefault(kind, {"read": 0, "write": 0})[way] = n
            return out

    def add_wait(self, seconds: float) -> None:
        with self._lock:
            self.wait_s += seconds
            self.num_waits += 1

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = {f"bytes_{s}_to_{d}": v for (s, d), v in self.moved.items()}
            out.update(fetch_hits=self.fetch["hit"], fetch_late=self.fetch["late"],
                       fetch_misses=self.fetch["miss"],
                       fetch_overwrites=self.fetch["overwrite"], wait_s=self.wait_s,
                       num_waits=self.num_waits, evictions_device=self.evictions[Tier.DEVICE],
                       evictions_host=self.evictions[Tier.HOST], writebacks=self.writebacks)
            return out


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy between two CPU tensors on a store copy thread without OpenMP.

    [Note: no OpenMP on copy threads] A large ``Tensor.copy_`` runs an OpenMP parallel region, and
    the first one on a thread creates that thread's own OpenMP team. libgomp then manages more
    threads than there are CPUs and throttles every team's spin-wait: the training thread's
    workers go to sleep between nearly every op and each op pays a futex wake-up. Measured on the
    2-core CPU machine (135m, bf16, CPU offload): ~400 (forward) and ~900 (backward) voluntary
    context switches per step, none without offload, and the forward and backward 10-30% slower.
    A plain ``memmove`` (ctypes drops the GIL) moves the same bytes on one core, no team.
    """
    if (dst.dtype == src.dtype and dst.numel() == src.numel() and dst.is_contiguous()
            and src.is_contiguous() and dst.device.type == "cpu" and src.device.type == "cpu"):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    else:  # not a plain byte copy (never in the store today): torch's copy, OpenMP and all
        dst.copy_(src)
