"""Device-generic helpers for copies between host memory and a GPU that must not stall the host.

[Note: event-guarded staging] A copy from host memory to a GPU (or back) is asynchronous only from
pinned memory and with ``non_blocking=True``; it then reads (or writes) the host buffer after the
call returns, so the buffer may be reused only once the copy has run. :class:`StagingRing` keeps a
few pinned buffers and an event per buffer, recorded on the stream right after the copies that use
it; taking a buffer again first waits on its event (a blocking event: the thread sleeps, no core
spins) and runs the work that was waiting for those copies (a CPU-side addition of the copied
values). With two or more buffers the host waits only for a copy issued a full turn of the ring
ago, so copies overlap the host's work instead of draining the GPU at every call.

On a CPU device there is nothing to wait for: copies are synchronous, buffers are plain memory, and
the completion work runs at once, so the CPU path does exactly what a plain copy did.

:func:`blocking_event` makes every CUDA event the engine waits on from the host: the default event
busy-waits a core in ``synchronize()``.

[Note: copies on a side stream] A copy between a GPU and pinned host memory issued on the compute
stream runs in order with the kernels: it queues behind the backward's (or, under a deferred
optimizer step, the next forward's) kernels, and every kernel queued after it waits for it. On a
:class:`SideStream` it runs on the copy engine beside them: the side stream first waits for the
work queued so far on the compute stream (what the copy reads), the tensors it reads are recorded
on it (the caching allocator does not hand their memory to other work before it ran), and whoever
reads what it wrote waits for it there: the host with :meth:`SideStream.synchronize` (the
gradient accumulators the CPU optimizer reads), the compute stream with :meth:`SideStream.join`
(a wait on the GPU, the host goes on) before a shard it filled is read. FSDP2 runs its
reduce-scatters and all-gathers on streams of their own the same way. On a CPU device every
method is a no-op and the copies are plain copies.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import torch


def is_cuda(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def blocking_event() -> Any:
    """A CUDA event whose ``synchronize()`` sleeps instead of spinning a core (timing disabled)."""
    return torch.cuda.Event(blocking=True)


def record_on_current_stream(device: torch.device) -> Any:
    """A :func:`blocking_event` recorded now on ``device``'s current stream (after the work queued
    there so far)."""
    event = blocking_event()
    event.record(torch.cuda.current_stream(device))
    return event


@dataclasses.dataclass
class _Slot:
    buffer: torch.Tensor | None = None
    """Raw bytes (uint8), grown to the largest request; pinned on CUDA."""
    event: Any = None
    """Recorded after the last copies that used the buffer; None when they are known done."""
    on_complete: Callable[[], None] | None = None
    """Work that needs those copies done (runs before the buffer is handed out again)."""


class StagingRing:
    """[Note: event-guarded staging]: ``num_slots`` reusable host buffers for copies to or from
    ``device``.

    ``take(numel, dtype) -> (slot, tensor)``, issue the copies with ``non_blocking=True``, then
    ``done(slot, on_complete)``; ``drain()`` waits for everything (before the host reads what
    the copies wrote). ``allocate(nbytes)`` makes a buffer (pinned, on the device's behalf, for a
    CUDA device: the caller decides, see [Note: pin only what a GPU copy touches] in
    infinity/io/_aligned.py); ``new_event`` and ``current_stream`` are CUDA's unless a test fakes
    them. Not thread-safe: one owner thread.
    """

    def __init__(self, num_slots: int, *, device: torch.device | str,
                 allocate: Callable[[int], torch.Tensor] | None = None,
                 new_event: Callable[[], Any] | None = None,
                 current_stream: Callable[[torch.device], Any] | None = None):
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"StagingRing: num_slots must be an integer >= 1, got {num_slots!r}")
        self.device = torch.device(device)
        self.cuda = is_cuda(self.device) or new_event is not None
        """Copies are asynchronous: events guard reuse (a CUDA device, or a test's fake events)."""
        self._allocate = allocate or (lambda n: torch.empty(n, dtype=torch.uint8))
        self._new_event = new_event or blocking_event
        self._current_stream = current_stream or torch.cuda.current_stream
        self._slots = [_Slot() for _ in range(num_slots)]
        self._next = 0
        """The slot handed out next (round robin: the oldest copies are waited for first)."""

    @property
    def nbytes(self) -> int:
        """Host bytes the ring holds now (outside the store's arena)."""
        return sum(s.buffer.numel() for s in self._slots if s.buffer is not None)

    def take(self, numel: int, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        """The next slot, its earlier copies finished and their completion work run, as a
        ``numel``-element tensor of ``dtype``."""
        index = self._next
        self._next = (index + 1) % len(self._slots)
        slot = self._slots[index]
        self._settle(slot)
        nbytes = numel * dtype.itemsize
        if slot.buffer is None or slot.buffer.numel() < nbytes:
            slot.buffer = None  # the old buffer goes before the new one comes: one at a time
            slot.buffer = self._allocate(max(nbytes, 1))
        return index, slot.buffer[:nbytes].view(dtype)

    def done(self, index: int, on_complete: Callable[[], None] | None = None) -> None:
        """The copies using slot ``index`` are issued on the current stream: record the event that
        guards its reuse; ``on_complete`` runs once they finished (at once without a GPU)."""
        slot = self._slots[index]
        if not self.cuda:
            if on_complete is not None:
                on_complete()
            return
        event = self._new_event()
        event.record(self._current_stream(self.device))
        slot.event, slot.on_complete = event, on_complete

    def drain(self) -> None:
        """Wait for every copy issued and run the completion work, oldest first."""
        n = len(self._slots)
        for k in range(n):
            self._settle(self._slots[(self._next + k) % n])

    @staticmethod
    def _settle(slot: _Slot) -> None:
        event, work = slot.event, slot.on_complete
        slot.event, slot.on_complete = None, None
        if event is not None:
            event.synchronize()
        if work is not None:
            work()


class SideStream:
    """[Note: copies on a side stream]: a CUDA stream for the copies of one owner (none on a CPU
    device); made on the device the first copy targets."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device) if is_cuda(self.device) else None

    @contextlib.contextmanager
    def issue(self, *reads: torch.Tensor) -> Iterator[None]:
        """Copies issued inside run on the side stream, after the work queued so far on the
        caller's stream; ``reads``: tensors they read that the caller's stream made."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield
        for t in reads:
            if t.is_cuda:
                t.record_stream(self.stream)

    def join(self) -> None:
        """The caller's stream waits (on the GPU) for every copy issued so far."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def synchronize(self) -> None:
        """The host waits for every copy issued so far."""
        if self.stream is not None:
            self.stream.synchronize()
