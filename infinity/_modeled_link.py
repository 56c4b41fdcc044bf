"""A modeled link: a bandwidth and a latency under the collectives or the host<->device copies, so
that on a machine without a GPU or a network their overlap with compute (or its absence) shows
as time.

[Note: the modeled link]
On this project's CPU machines a gloo all-gather between two processes and a "device" copy are
memcpys: they take next to no time, so code that waits for them where they are issued looks as
fast as code that overlaps them. A :class:`ModeledLink` gives each transfer the time a real link
would: a transfer issued at ``t`` starts when the link is free (transfers on one link are
queued, first issued first served), lasts ``latency_s + bytes / bandwidth``, and its handle's
``wait()`` returns no earlier than its end (a real sleep, which releases the GIL, so compute on
the training thread and the I/O threads go on meanwhile). Issuing early and waiting late then
hides the link time behind compute, as it would on the hardware; issuing and waiting at once
costs the whole transfer on the training thread ("exposed" seconds).

The model is per process: each rank has its own link (a GPU's NIC or PCIe lanes), and a
collective's time is the bytes this rank puts on the wire for it ([Note: wire bytes of a
collective] in infinity/zero/_collectives.py). It models bandwidth and queueing, not the
skew between ranks: the real collective also waits for the slowest rank, which gloo's own
completion still enforces under the model.

The link counts ``busy_s`` (the seconds it was transferring: L in "step <= 1.25 x max(T0, L)")
and its transfers; the waits' exposed seconds are counted by whoever waits (the collectives,
the store), since only they know whether the training thread waited.
"""

from __future__ import annotations

import dataclasses
import threading
import time

GB = 1e9


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkModel:
    """The settings of one modeled link (see [Note: the modeled link])."""

    bandwidth_gbytes_per_s: float
    """Bytes per second / 1e9 (GB/s, as ``infinity bench comm``'s ``--inter-node-gbps``)."""
    latency_us: float = 0.0
    """Added to every transfer, in microseconds."""
    poison_until_wait: bool = False
    """Tests: a transfer's destination holds NaN from its issue until its wait, and its bytes
    land only at the wait, so that a read before the wait gives a wrong number, not luck
    (STYLE: "build tests that would catch a missing wait")."""

    def __post_init__(self) -> None:
        bw = self.bandwidth_gbytes_per_s
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not bw > 0:
            raise ValueError(f"modeled link: bandwidth_gbytes_per_s must be a number > 0 "
                             f"(GB/s), got {bw!r}")
        lat = self.latency_us
        if isinstance(lat, bool) or not isinstance(lat, (int, float)) or lat < 0:
            raise ValueError(f"modeled link: latency_us must be a number >= 0 (microseconds), "
                             f"got {lat!r}")


class ModeledLink:
    """One link: a queue of transfers at a bandwidth. Thread-safe (collectives are issued on the
    training thread, copies on the store's copy threads)."""

    def __init__(self, model: LinkModel, *, clock=time.perf_counter):
        self.model = model
        self._bytes_per_s = model.bandwidth_gbytes_per_s * GB
        self._latency_s = model.latency_us * 1e-6
        self._clock = clock
        self._lock = threading.Lock()
        self._free_at = 0.0
        """Clock time when the last queued transfer ends."""
        self.busy_s = 0.0
        """Seconds the link has spent transferring, over its life."""
        self.transfers = 0
        """Transfers queued on it, over its life."""
        self.bytes = 0
        """Bytes queued on it, over its life."""
        self.busy_s_by_tag: dict[str, float] = {}
        """``busy_s`` by what the transfers were for (a collective's phase, a copy's direction)."""
        self._log: list[tuple[str, str | None, float]] | None = None
        """With :meth:`record`: (tag, what, seconds) of each transfer since the last
        :meth:`take_log`, in issue order."""

    def reserve(self, nbytes: int, tag: str = "other", what: str | None = None) -> float:
        """Queue a transfer of ``nbytes`` issued now; returns the clock time it ends. ``what``:
        the transfer's name (a collective's context) for the log."""
        duration = self._latency_s + max(0, int(nbytes)) / self._bytes_per_s
        with self._lock:
            start = max(self._clock(), self._free_at)
            self._free_at = start + duration
            self.busy_s += duration
            self.busy_s_by_tag[tag] = self.busy_s_by_tag.get(tag, 0.0) + duration
            self.transfers += 1
            self.bytes += max(0, int(nbytes))
            if self._log is not None:
                self._log.append((tag, what, duration))
            return self._free_at

    def record(self) -> None:
        """Keep a log of the transfers from now on (a benchmark reads it per step)."""
        with self._lock:
            if self._log is None:
                self._log = []

    def take_log(self) -> list[tuple[str, str | None, float]]:
        """The transfers logged since the last call (empty without :meth:`record`)."""
        with self._lock:
            log, self._log = (self._log or []), ([] if self._log is not None else None)
            return log

    def wait_until(self, done_at: float) -> None:
        """Sleep until the clock reaches ``done_at`` (a transfer's end from :meth:`reserve`)."""
        delay = done_at - self._clock()
        if delay > 0:
            time.sleep(delay)

    def stats(self) -> dict[str, float]:
        return {"bandwidth_gbytes_per_s": self.model.bandwidth_gbytes_per_s,
                "latency_us": self.model.latency_us, "busy_s": self.busy_s,
                "transfers": self.transfers, "bytes": self.bytes}


class DuplexLink:
    """A host<->device link (a GPU's PCIe lanes, which carry both directions at once): a
    :class:`ModeledLink` per direction, each its own queue at the model's bandwidth. Under it go
    every copy between HOST and DEVICE: the store's moves and write-backs, and the gradients
    copied down to an offloaded optimizer's host accumulators. Its busy seconds (L) and bytes are
    the busier direction's; ``stats()`` has both."""

    def __init__(self, model: LinkModel, *, clock=time.perf_counter):
        self.model = model
        self.to_device = ModeledLink(model, clock=clock)
        self.to_host = ModeledLink(model, clock=clock)

    def toward(self, *, device: bool) -> ModeledLink:
        """The direction whose queue a copy into the device (``device=True``) or out of it uses."""
        return self.to_device if device else self.to_host

    def _busier(self) -> ModeledLink:
        return max(self.to_device, self.to_host, key=lambda link: link.busy_s)

    @property
    def busy_s(self) -> float:
        return self._busier().busy_s

    @property
    def bytes(self) -> int:
        return self._busier().bytes

    def stats(self) -> dict[str, float]:
        return {"bandwidth_gbytes_per_s": self.model.bandwidth_gbytes_per_s,
                "latency_us": self.model.latency_us, "busy_s": self.busy_s, "bytes": self.bytes,
                "busy_s_to_device": self.to_device.busy_s, "busy_s_to_host": self.to_host.busy_s,
                "bytes_to_device": self.to_device.bytes, "bytes_to_host": self.to_host.bytes}
