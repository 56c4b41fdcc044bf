"""Saved activations as shards of the tiered store: host arena or NVMe, read back ahead of the backward.

[Note: saved activations are shards of the store]
With activation checkpointing the tensors autograd keeps across the forward are the checkpointed
regions' inputs (2sbh bytes per transformer layer; Korthikanti et al. 2022): at long context they
are most of the memory, and torch keeps them on the device (or, with ``save_on_cpu``, in its own
host cache, which no budget counts). :class:`StoredActivations` is the saved-tensor hooks around
every checkpointed region (``activation_checkpointing.offload``): each saved floating-point
tensor of at least ``MIN_STORED_BYTES`` becomes one shard ``act/<n>`` of the engine's
:class:`~infinity.tiers.TieredStore`, homed

- on HOST ('host'): a copy in the store's arena, inside ``memory.host_budget_bytes``;
- on NVME ('nvme'): written behind, as it is saved: the store copies it into the arena and starts
  the write-back at once (the forward goes on); the arena copy stays as a clean cache that the
  store evicts like any other when it needs the room, so a write-back in flight bounds what the
  forward may run ahead of the disk (a full arena waits for one), and what the arena still holds
  at the backward is read from memory;
- 'auto': HOST while the arena's reclaimable room, less this tensor, stays above what the model's
  states want there for overlap (``host_reserve_bytes``, from the offload budgets) and two more
  such tensors (the arena copies an NVMe home is written from and read back into), then NVME.

The backward unpacks them in the reverse order of the forward (each checkpointed region's
recompute reads its inputs, last region first), so on every unpack the next ``read_ahead`` shards
of that order that live on NVMe are acquired into the arena ahead (``acquire(..., ahead=True)``:
[Note: a read ahead never waits for room on its caller] in infinity/tiers/store.py), within
``read_ahead_bytes``. An unpacked shard is copied to the compute device and unregistered (its
arena copy and its file go): each saved byte is written once and read at most once. A saved tensor
whose graph is dropped unused (a forward without backward) is unregistered at the next pack or
unpack, or at :meth:`StoredActivations.drain`, never from a finalizer, which may run while this
thread holds the store's lock.

Small tensors (masks, position ids, a norm's statistics) and non-float tensors stay where torch
keeps them: a shard per 4-byte tensor would cost more in bookkeeping than it saves.

On a GPU the copy into the arena is a blocking device->host copy on the training thread (the
store's ``register``); :class:`~infinity.zero._activations.HostActivations` (``offload_to_host``
without a store) copies asynchronously. Not yet asynchronous here.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import weakref
from typing import Any, Literal

import torch

from infinity.errors import DiskSpaceError, TierCapacityError
from infinity.tiers import Tier, TieredStore, TierHandle

logger = logging.getLogger(__name__)

MIN_STORED_BYTES = 64 * 1024
"""Saved tensors smaller than this stay where torch keeps them."""
DISK_MARGIN_BYTES = 256 * 1024 * 1024
"""Free space an activation written to NVMe must leave on its file system."""

Mode = Literal["host", "nvme", "auto"]


@dataclasses.dataclass(eq=False)
class _Saved:
    """One saved tensor held as a shard (``key``) of the store, until it is unpacked."""

    owner: "StoredActivations"
    key: str
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    home: Tier
    nbytes: int
    ahead: TierHandle | None = None
    """A read issued ahead of the unpack (NVME home), holding a pin on the HOST copy."""
    value: torch.Tensor | None = None
    """The unpacked tensor (a second unpack returns it)."""

    def __del__(self) -> None:
        if self.value is None and self.owner is not None:
            # Dropped unused: unregistered by the owner's thread later (see the module Note).
            self.owner._dropped.append((self.key, self.home, self.nbytes, self.ahead))


class StoredActivations:
    """[Note: saved activations are shards of the store]: saved-tensor hooks that keep saved
    tensors as shards of ``store``. ``host_reserve_bytes`` ('auto'): arena room kept for the
    model's states. Counts bytes per tier (``live_bytes``, ``peak_bytes``)."""

    def __init__(self, store: TieredStore, mode: Mode, *, host_reserve_bytes: int = 0,
                 read_ahead: int = 2, read_ahead_bytes: int | None = None,
                 min_bytes: int | None = None):
        if mode not in ("host", "nvme", "auto"):
            raise ValueError(f"StoredActivations: mode must be 'host', 'nvme' or 'auto', got {mode!r}")
        if mode == "nvme" and store.swapper is None:
            raise ValueError("activation_checkpointing.offload 'nvme': the store has no swap "
                             "directory; set activation_checkpointing.nvme_path")
        self.store = store
        self.mode = mode
        self.host_reserve_bytes = host_reserve_bytes
        self.read_ahead = read_ahead
        self.read_ahead_bytes = (store.arena.capacity_bytes // 4 if read_ahead_bytes is None
                                 else read_ahead_bytes)
        self.min_bytes = MIN_STORED_BYTES if min_bytes is None else min_bytes
        self._next = 0
        self._order: list[weakref.ref[_Saved]] = []
        """Packed and not yet unpacked, in pack order (the backward reads from the end); weak, so
        that a saved tensor whose graph is dropped is collected and reaches ``_dropped``."""
        self._dropped: list[tuple[str, Tier, int, TierHandle | None]] = []
        self.live_bytes = {Tier.HOST: 0, Tier.NVME: 0}
        """Bytes of saved tensors held now, per home tier."""
        self.peak_bytes = {Tier.HOST: 0, Tier.NVME: 0}
        self.saved_bytes = {Tier.HOST: 0, Tier.NVME: 0}
        """Bytes saved so far, per home tier (a step's share: the difference across it)."""
        self.kept_bytes = 0
        """Bytes of saved tensors too small to store, passed through (so far)."""

    # -- hooks -----------------------------------------------------------------------------------

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor) -> Any:
        nbytes = tensor.numel() * tensor.element_size()
        if not tensor.is_floating_point() or nbytes < self.min_bytes or tensor.layout != torch.strided:
            self.kept_bytes += nbytes
            return tensor
        self.drain()
        home = self._home_for(nbytes)
        key = f"act/{self._next}"
        self._next += 1
        flat = tensor.detach().reshape(-1)
        try:
            self.store.register(key, flat.numel(), flat.dtype, home, initial=flat)
        except TierCapacityError as e:
            raise TierCapacityError(
                f"activation_checkpointing.offload {self.mode!r}: a saved activation of {nbytes} "
                f"bytes does not fit the host arena ({e.message}); set offload to 'nvme' or "
                f"'auto', or raise memory.host_budget_bytes",
                tier=e.tier, requested_bytes=e.requested_bytes, used_bytes=e.used_bytes,
                budget_bytes=e.budget_bytes) from e
        saved = _Saved(self, key, tensor.shape, tensor.dtype, tensor.device, home, nbytes)
        self._order.append(weakref.ref(saved))
        self.live_bytes[home] += nbytes
        self.saved_bytes[home] += nbytes
        self.peak_bytes[home] = max(self.peak_bytes[home], self.live_bytes[home])
        return saved

    def unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        if saved.value is not None:
            return saved.value
        self.drain()
        position = self._position(saved)
        host = self._read(saved)
        try:
            value = host.view(saved.shape)
            value = (value.to(saved.device, copy=True) if saved.device.type != "cpu"
                     else value.clone())
        finally:
            self.store.release(saved.key, Tier.HOST)
        saved.value = value
        self._forget(saved, position)
        self._read_ahead_from(position)
        return value

    # -- placement ---------------------------------------------------------------------------------

    def _home_for(self, nbytes: int) -> Tier:
        if self.mode == "host":
            return Tier.HOST
        # 'auto' keeps room for two such tensors beside the reserve: an NVMe home is written
        # from, and read back into, an arena copy.
        if self.mode == "auto" and (self.store.swapper is None or self.store.reclaimable_bytes(
                Tier.HOST) - nbytes >= self.host_reserve_bytes + 2 * nbytes):
            return Tier.HOST
        self._check_disk(nbytes)
        return Tier.NVME

    def _check_disk(self, nbytes: int) -> None:
        """Refuse a write the swap directory's file system cannot take, before it starts."""
        path = self.store.swapper.directory
        free = shutil.disk_usage(path).free
        if free < nbytes + DISK_MARGIN_BYTES:
            raise DiskSpaceError(
                f"activation_checkpointing.offload {self.mode!r}: a saved activation of {nbytes} "
                f"bytes would leave less than {DISK_MARGIN_BYTES} bytes free on the file system "
                f"of {str(path)!r} ({free} bytes free; {self.live_bytes[Tier.NVME]} bytes of "
                f"activations are there now); nothing was written. Free space there, point "
                f"activation_checkpointing.nvme_path at a larger disk, or shorten the sequence",
                path=str(path), needed_bytes=nbytes + DISK_MARGIN_BYTES, free_bytes=free)

    # -- reading back ------------------------------------------------------------------------------

    def _position(self, saved: _Saved) -> int:
        for i in range(len(self._order) - 1, -1, -1):  # usually the last
            if self._order[i]() is saved:
                return i
        raise RuntimeError(f"saved activation {saved.key!r} was already released")

    def _read(self, saved: _Saved) -> torch.Tensor:
        """The shard's HOST copy, pinned (released by the caller)."""
        handle, saved.ahead = saved.ahead, None
        if handle is not None:
            try:
                return handle.wait()
            except TierCapacityError:  # no room ahead: read it now, the window let go
                self._let_window_go()
        return self.store.acquire(saved.key, Tier.HOST).wait()

    def _let_window_go(self) -> None:
        for ref in self._order:
            other = ref()
            if other is None:
                continue
            handle, other.ahead = other.ahead, None
            if handle is not None:
                try:
                    handle.wait()
                    self.store.release(other.key, Tier.HOST)
                except TierCapacityError:
                    pass

    def _read_ahead_from(self, position: int) -> None:
        """Issue reads of the shards the backward unpacks next (before ``position``)."""
        issued, in_flight = 0, 0
        for ref in reversed(self._order[:position]):
            other = ref()
            if other is None:
                continue
            if issued == self.read_ahead:
                break
            issued += 1
            if other.home is not Tier.NVME:
                continue
            in_flight += other.nbytes
            if other.ahead is None:
                if in_flight > self.read_ahead_bytes and issued > 1:
                    break
                other.ahead = self.store.acquire(other.key, Tier.HOST, ahead=True)

    # -- freeing -----------------------------------------------------------------------------------

    def _forget(self, saved: _Saved, position: int) -> None:
        del self._order[position]
        self.store.unregister(saved.key)
        self.live_bytes[saved.home] -= saved.nbytes

    def drain(self) -> None:
        """Unregister the saved tensors whose graphs were dropped unused."""
        while self._dropped:
            key, home, nbytes, ahead = self._dropped.pop()
            if ahead is not None:
                try:
                    ahead.wait()
                    self.store.release(key, Tier.HOST)
                except TierCapacityError:
                    pass
            self.store.unregister(key)
            self.live_bytes[home] -= nbytes
        if any(ref() is None for ref in self._order):
            self._order = [ref for ref in self._order if ref() is not None]

    def stats(self) -> dict[str, Any]:
        """Bytes per home tier (current, peak, saved so far) and the NVMe bytes they moved."""
        moved = self.store.nvme_bytes_by_kind().get("act", {})
        return {tier.name: {"current": self.live_bytes[tier], "peak": self.peak_bytes[tier],
                            "saved": self.saved_bytes[tier]} for tier in (Tier.HOST, Tier.NVME)} | {
            "nvme_read_bytes": moved.get("read", 0), "nvme_written_bytes": moved.get("write", 0),
            "kept_bytes": self.kept_bytes, "mode": self.mode}

    def reset_peak(self) -> None:
        self.peak_bytes = dict(self.live_bytes)


__all__ = ["MIN_STORED_BYTES", "StoredActivations"]
