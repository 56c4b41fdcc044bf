"""Saved activations as shards of the tiered store: host arena or NVMe, read back ahead of the backward.

[Note: saved activations are shards of the store]
With activation checkpointing the tensors autograd keeps across the forward are the checkpointed
regions' inputs (2sbh bytes per transformer layer; Korthikanti et al. 2022): at long context they
are most of the memory, and torch keeps them on the device (or, with ``save_on_cpu``, in its own
host cache, which no budget counts). :class:`StoredActivations` is the saved-tensor hooks around
every checkpointed region (``activation_checkpointing.offload``): each saved floating-point
tensor of at least ``MIN_STORED_BYTES`` becomes shards ``act/<n>/<chunk>`` of the engine's
:class:`~infinity.tiers.TieredStore` ([Note: chunks]), homed

- on HOST ('host'): a copy in the store's arena, inside ``memory.host_budget_bytes``;
- on NVME ('nvme'): written behind, as it is saved: the store copies it into the arena and starts
  the write-back at once (the forward goes on); the arena copy stays as a clean cache that the
  store evicts like any other when it needs the room, so a write-back in flight bounds what the
  forward may run ahead of the disk (a full arena waits for one), and what the arena still holds
  at the backward is read from memory;
- 'auto': on the DEVICE (kept where torch keeps it) while the device has room (``device_room``:
  on a GPU, free memory beyond DEVICE_FREE_RESERVE_FRACTION of it, [Note: the device's room]),
  then HOST while the arena's reclaimable room, less this tensor, stays above what the model's
  states want there for overlap (``host_reserve_bytes``, from the offload budgets) and two chunks
  (the arena copies an NVMe home is written from and read back into), then NVME.

The backward unpacks them in the reverse order of the forward (each checkpointed region's
recompute reads its inputs, last region first), so on every unpack the chunks of the next
``read_ahead`` tensors of that order that live on NVMe are acquired into the arena ahead (``acquire(..., ahead=True)``:
[Note: a read ahead never waits for room on its caller] in infinity/tiers/store.py), within
``read_ahead_bytes``. An unpacked tensor is copied to the compute device and its shards
unregistered (their arena copies and files go): each saved byte is written once and read at most once.
Where the arena has no extent for a chunk at its unpack, even once these reads ahead are let go
(the model states' work in flight pins every one), the chunk is read outside the arena instead of
failing the step ([Note: no room to read back is not an error]). A saved tensor
whose graph is dropped unused (a forward without backward) is unregistered at the next pack or
unpack, or at :meth:`StoredActivations.drain`, never from a finalizer, which may run while this
thread holds the store's lock.

Small tensors (masks, position ids, a norm's statistics) and non-float tensors stay where torch
keeps them: a shard per 4-byte tensor would cost more in bookkeeping than it saves.

[Note: activations are checked when read back] A swap file's header is checked on every read (a
truncated, stale or foreign file is an error: [Note: swap file layout] in
infinity/io/_swap_format.py), its payload is not. A corrupted payload would give a wrong gradient
without a word, so each chunk's 32-bit word sum (int64) is taken when it is saved and compared when
it is read back: one more read of the bytes each way, at memory bandwidth (tens of milliseconds
for the 192 MiB of the deep preset's step), and on a mismatch, or any error of the read, the
backward stops with a :class:`~infinity.errors.SwapIOError` naming the checkpointed module, the
micro-step and the file. A sum does not see words swapped with each other; garbage, zeroed or
flipped bits it does.

On a GPU the copy into the arena is a blocking device->host copy on the training thread (the
store's ``register``); :class:`~infinity.zero._activations.HostActivations` (``offload_to_host``
without a store) copies asynchronously. Not yet asynchronous here.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import weakref
from typing import Any, Callable, Literal

import torch

from infinity.errors import DiskSpaceError, SwapIOError, TierCapacityError
from infinity.ledger import ACTIVATION_CHUNK_BYTES
from infinity.tiers import Tier, TieredStore, TierHandle

logger = logging.getLogger(__name__)

MIN_STORED_BYTES = 64 * 1024
"""Saved tensors smaller than this stay where torch keeps them."""
CHUNK_BYTES = ACTIVATION_CHUNK_BYTES
"""Largest shard of one saved tensor; a larger tensor is several (see [Note: chunks])."""
DISK_MARGIN_BYTES = 256 * 1024 * 1024
"""Free space an activation written to NVMe must leave on its file system."""

DEVICE_FREE_RESERVE_FRACTION = 0.1
"""'auto' keeps a saved tensor on a GPU only while this share of its memory stays free after it."""

Mode = Literal["host", "nvme", "auto"]


def cuda_activation_room(device: torch.device) -> Callable[[], int]:
    """[Note: the device's room] What 'auto' may still keep on a GPU: its free memory (the
    driver's count, so other processes and the caching allocator's reserve are in it) less
    DEVICE_FREE_RESERVE_FRACTION of its total, which the recompute's working set and the
    allocator's fragmentation need. A CPU engine has none: its "device" is the host RAM, and the
    arena is where host memory is counted."""
    def room() -> int:
        free, total = torch.cuda.mem_get_info(device)
        return max(0, free - int(total * DEVICE_FREE_RESERVE_FRACTION))
    return room


class _OnDevice:
    """A saved tensor 'auto' kept on the device; its bytes leave the count when it is freed
    (nothing here touches the store, so a finalizer may run anywhere)."""

    __slots__ = ("tensor", "_owner", "_nbytes", "__weakref__")

    def __init__(self, tensor: torch.Tensor, owner: "StoredActivations", nbytes: int):
        self.tensor, self._owner, self._nbytes = tensor, owner, nbytes
        owner._count(Tier.DEVICE, nbytes)

    def __del__(self) -> None:
        self._owner.live_bytes[Tier.DEVICE] -= self._nbytes


# [Note: chunks] A saved tensor is stored as shards of at most CHUNK_BYTES (and at most 1/16 of the
# arena): an arena shared with the states is fragmented by their pinned copies (an NVMe optimizer's
# sub-groups in a deferred step's forward, parameter shards in flight), and one 12 MiB extent may
# not be found in a 44 MiB arena with 28 MiB free (the demo GPT at 2048 x 6 tokens, states on
# NVMe). Chunks also let a tensor's write start while its next part is copied in, and its read
# back be issued piece by piece.


@dataclasses.dataclass(eq=False)
class _Saved:
    """One saved tensor held as shards of the store (``keys``, one per chunk of ``bounds``), until
    it is unpacked."""

    owner: "StoredActivations"
    keys: tuple[str, ...]
    bounds: tuple[tuple[int, int], ...]
    """Element range of the flat tensor each key holds."""
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    home: Tier
    nbytes: int
    region: str = ""
    """The checkpointed module that saved it (errors name it)."""
    micro_step: int = 0
    """The engine's micro-step of the forward that saved it (errors name it)."""
    sums: tuple[int, ...] = ()
    """Each chunk's word sum at save time ([Note: activations are checked when read back])."""
    ahead: list[TierHandle | None] | None = None
    """Reads issued ahead of the unpack (NVME home), one per chunk (None: not issued), each
    holding a pin on its HOST copy."""
    value: torch.Tensor | None = None
    """The unpacked tensor (a second unpack returns it)."""

    def __del__(self) -> None:
        if self.value is None and self.owner is not None:
            # Dropped unused: unregistered by the owner's thread later (see the module Note).
            self.owner._dropped.append((self.keys, self.home, self.nbytes, self.ahead))


class StoredActivations:
    """[Note: saved activations are shards of the store]: saved-tensor hooks that keep saved
    tensors as shards of ``store``. ``host_reserve_bytes`` ('auto'): arena room kept for the
    model's states. Counts bytes per tier (``live_bytes``, ``peak_bytes``)."""

    def __init__(self, store: TieredStore, mode: Mode, *, host_reserve_bytes: int = 0,
                 read_ahead: int = 2, read_ahead_bytes: int | None = None,
                 min_bytes: int | None = None, chunk_bytes: int | None = None,
                 device_room: Callable[[], int] | None = None):
        if mode not in ("host", "nvme", "auto"):
            raise ValueError(f"StoredActivations: mode must be 'host', 'nvme' or 'auto', got {mode!r}")
        if mode == "nvme" and store.swapper is None:
            raise ValueError("activation_checkpointing.offload 'nvme': the store has no swap "
                             "directory; set activation_checkpointing.nvme_path")
        self.store = store
        self.mode = mode
        self.host_reserve_bytes = host_reserve_bytes
        self.device_room = device_room
        """'auto': bytes the device may still take (None: keep nothing there)."""
        self.read_ahead = read_ahead
        capacity = store.arena.capacity_bytes
        self.read_ahead_bytes = capacity // 4 if read_ahead_bytes is None else read_ahead_bytes
        self.min_bytes = MIN_STORED_BYTES if min_bytes is None else min_bytes
        self.chunk_bytes = (min(CHUNK_BYTES, max(64 * 1024, capacity // 16)) if chunk_bytes is None
                            else chunk_bytes)
        self._next = 0
        self._order: list[weakref.ref[_Saved]] = []
        """Packed and not yet unpacked, in pack order (the backward reads from the end); weak, so
        that a saved tensor whose graph is dropped is collected and reaches ``_dropped``."""
        self._dropped: list[tuple[tuple[str, ...], Tier, int, list[TierHandle | None] | None]] = []
        tiers = (Tier.DEVICE, Tier.HOST, Tier.NVME)
        self.live_bytes = dict.fromkeys(tiers, 0)
        """Bytes of saved tensors held now, per tier ('auto' keeps some on the DEVICE)."""
        self.peak_bytes = dict.fromkeys(tiers, 0)
        self.saved_bytes = dict.fromkeys(tiers, 0)
        """Bytes saved so far, per home tier (a step's share: the difference across it)."""
        self.kept_bytes = 0
        """Bytes of saved tensors too small to store, passed through (so far)."""
        self.micro_step = 0
        """The engine's micro-step now (set by its forward): recorded with each saved tensor."""
        self._region = ""
        self.no_room_bytes = 0
        """Bytes of saved tensors kept where torch keeps them because the arena had no room to
        stage them on their way to NVMe (so far; [Note: no room is not an error])."""
        self.over_budget_read_bytes = 0
        """Bytes of saved chunks read back outside the arena because it had no room for them
        (so far; [Note: no room to read back is not an error])."""

    # -- hooks -----------------------------------------------------------------------------------

    def hooks(self, owner: str = "") -> Any:
        """Saved-tensor hooks for one checkpointed region (``owner``: its module's name)."""
        self._region = owner
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor) -> Any:
        nbytes = tensor.numel() * tensor.element_size()
        if not tensor.is_floating_point() or nbytes < self.min_bytes or tensor.layout != torch.strided:
            self.kept_bytes += nbytes
            return tensor
        self.drain()
        if self.mode == "auto" and self.device_room is not None and nbytes <= self.device_room():
            return _OnDevice(tensor, self, nbytes)
        home = self._home_for(nbytes)
        flat = tensor.detach().reshape(-1)
        step = max(1, self.chunk_bytes // flat.element_size())
        bounds = tuple((lo, min(flat.numel(), lo + step)) for lo in range(0, flat.numel(), step))
        name = f"act/{self._next}"
        self._next += 1
        keys = tuple(f"{name}/{i}" for i in range(len(bounds)))
        sums = [_word_sum(flat[lo:hi]) for lo, hi in bounds]
        try:
            try:
                self._register(keys, bounds, flat, home)
            except TierCapacityError:
                if not (home is Tier.HOST and self.mode == "auto" and self.store.swapper):
                    raise
                home = Tier.NVME  # 'auto' found the arena's room in pieces: NVMe after all
                self._check_disk(nbytes)
                self._register(keys, bounds, flat, home)
        except TierCapacityError as e:
            if home is Tier.NVME:
                return self._no_room(tensor, nbytes, e)
            raise TierCapacityError(
                f"activation_checkpointing.offload {self.mode!r}: a saved activation of {nbytes} "
                f"bytes does not fit the host arena ({e.message}); set offload to 'nvme' or "
                f"'auto', or raise memory.host_budget_bytes",
                tier=e.tier, requested_bytes=e.requested_bytes, used_bytes=e.used_bytes,
                budget_bytes=e.budget_bytes) from e
        saved = _Saved(self, keys, bounds, tensor.shape, tensor.dtype, tensor.device, home, nbytes,
                       region=self._region, micro_step=self.micro_step, sums=tuple(sums))
        self._order.append(weakref.ref(saved))
        self._count(home, nbytes)
        return saved

    def _count(self, tier: Tier, nbytes: int) -> None:
        self.live_bytes[tier] += nbytes
        self.saved_bytes[tier] += nbytes
        self.peak_bytes[tier] = max(self.peak_bytes[tier], self.live_bytes[tier])

    def _register(self, keys: tuple[str, ...], bounds: tuple[tuple[int, int], ...],
                  flat: torch.Tensor, home: Tier) -> None:
        """Register every chunk homed on ``home``, or none: on an error the chunks registered
        before it are unregistered and the error raised."""
        done: list[str] = []
        try:
            for key, (lo, hi) in zip(keys, bounds):
                self.store.register(key, hi - lo, flat.dtype, home, initial=flat[lo:hi])
                done.append(key)
        except BaseException:
            for key in done:
                self.store.unregister(key)
            raise

    def _no_room(self, tensor: torch.Tensor, nbytes: int, error: TierCapacityError) -> torch.Tensor:
        """[Note: no room is not an error] An NVMe home is written from an arena copy; where the
        arena has no room for one even after evicting every clean copy (the rest pinned by the
        states' work in flight), the tensor stays where torch keeps it, counted
        (``no_room_bytes``) and warned about once: the step goes on, as it would without
        offload, rather than failing on a transient shortage."""
        if not self.no_room_bytes:
            logger.warning("activation_checkpointing.offload %r: a saved activation of %d bytes "
                           "found no room in the host arena to stage it (%s); kept in memory. "
                           "A larger memory.host_budget_bytes avoids it", self.mode, nbytes,
                           error.message)
        self.no_room_bytes += nbytes
        return tensor

    def unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        if isinstance(saved, _OnDevice):
            return saved.tensor
        if saved.value is not None:
            return saved.value
        self.drain()
        position = self._position(saved)
        out = torch.empty(saved.shape, dtype=saved.dtype, device=saved.device)
        flat = out.view(-1)
        handles, saved.ahead = saved.ahead or [None] * len(saved.keys), None
        for i, (key, (lo, hi)) in enumerate(zip(saved.keys, saved.bounds)):
            try:
                host, pinned = self._read(key, handles[i], flat[lo:hi])
            except BaseException as e:
                _release_ahead(self.store, saved.keys[i + 1:], handles[i + 1:])
                if isinstance(e, SwapIOError):
                    raise self._read_error(saved, key, e.message) from e
                raise
            try:
                if _word_sum(host) != saved.sums[i]:
                    raise self._read_error(saved, key, "its bytes changed since it was saved (the "
                                           "word sum differs): the file was corrupted")
                if host.data_ptr() != flat[lo:hi].data_ptr():
                    flat[lo:hi].copy_(host)
            finally:
                if pinned:
                    self.store.release(key, Tier.HOST)
        saved.value = out
        self._forget(saved, position)
        self._read_ahead_from(position)
        return out

    def _read_error(self, saved: _Saved, key: str, why: str) -> SwapIOError:
        """[Note: activations are checked when read back] The error of a saved tensor that
        cannot be read back as it was saved: it names the module, the micro-step and the file."""
        path = self.store.swapper.path_of(key) if self.store.swapper is not None else "(host)"
        return SwapIOError(
            f"the saved input of checkpointed module {saved.region!r} (micro-step "
            f"{saved.micro_step}, shard {key!r}, file {path!r}) cannot be read back: {why}; the "
            f"backward stops here rather than compute a wrong gradient. Check the disk under "
            f"{str(self.store.swapper.directory if self.store.swapper else '')!r}, then rerun "
            f"the step", path=str(path))

    # -- placement ---------------------------------------------------------------------------------

    def _home_for(self, nbytes: int) -> Tier:
        if self.mode == "host":
            return Tier.HOST
        # 'auto' keeps room for two chunks beside the reserve: an NVMe home is written from, and
        # read back into, arena copies.
        staging = 2 * min(nbytes, self.chunk_bytes)
        if self.mode == "auto" and (self.store.swapper is None or self.store.reclaimable_bytes(
                Tier.HOST) - nbytes >= self.host_reserve_bytes + staging):
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
        raise RuntimeError(f"saved activation {saved.keys[0]!r} was already released")

    def _read(self, key: str, handle: TierHandle | None,
              dst: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The chunk's bytes and whether they are the shard's pinned HOST copy (released by the
        caller); else they were read outside the arena, into ``dst`` on a CPU device, into a
        host buffer of their own on a GPU ([Note: no room to read back is not an error])."""
        if handle is not None:
            try:
                return handle.wait(), True
            except TierCapacityError:  # no room ahead: read it now, the window let go
                self._let_window_go()
        try:
            return self.store.acquire(key, Tier.HOST).wait(), True
        except TierCapacityError:
            # Every arena extent pinned: this store's own reads ahead may be what holds them.
            # Let them go and read once more.
            self._let_window_go()
        try:
            return self.store.acquire(key, Tier.HOST).wait(), True
        except TierCapacityError as e:
            return self._read_over_budget(key, dst, e), False

    def _read_over_budget(self, key: str, dst: torch.Tensor,
                          error: TierCapacityError) -> torch.Tensor:
        """[Note: no room to read back is not an error] The arena has no extent for a saved
        chunk even with this store's reads ahead let go: the model states' work in flight pins
        every one. Failing would lose the whole step after its forward, for a shortage that
        passes; instead the chunk is read outside the arena by ``TieredStore.read_into``, see
        [Note: a read into the caller's buffer takes no room] in infinity/tiers/_read_out.py:
        straight into the unpacked tensor on a CPU device, through a host buffer of the chunk's
        size on a GPU (memory beyond ``memory.host_budget_bytes`` for as long as the copy
        takes). Its word sum is checked as any read's. Counted (``over_budget_read_bytes``) and
        warned about once, as [Note: no room is not an error] does on the save side."""
        host = dst if dst.device.type == "cpu" else torch.empty(dst.shape, dtype=dst.dtype)
        self.store.read_into(key, host).wait()
        if not self.over_budget_read_bytes:
            logger.warning("activation_checkpointing.offload %r: the host arena had no room to "
                           "read back a saved activation (%s); read it outside the arena "
                           "instead. A larger memory.host_budget_bytes avoids it", self.mode,
                           error.message)
        self.over_budget_read_bytes += host.numel() * host.element_size()
        return host

    def _let_window_go(self) -> None:
        for ref in self._order:
            other = ref()
            if other is None:
                continue
            handles, other.ahead = other.ahead, None
            _release_ahead(self.store, other.keys, handles)

    def _read_ahead_from(self, position: int) -> None:
        """Issue reads of the shards the backward unpacks next (the ``read_ahead`` tensors before
        ``position``), chunk by chunk while ``read_ahead_bytes`` are in flight (at least one
        chunk); a chunk the arena has no room for now stops the issue (it is read at its use)."""
        in_flight, tensors = 0, 0
        for ref in reversed(self._order[:position]):
            other = ref()
            if other is None:
                continue
            if tensors == self.read_ahead:
                return
            tensors += 1
            if other.home is not Tier.NVME:
                continue
            if other.ahead is None:
                other.ahead = [None] * len(other.keys)
            for i, (key, (lo, hi)) in enumerate(zip(other.keys, other.bounds)):
                nbytes = (hi - lo) * other.dtype.itemsize
                if other.ahead[i] is None:
                    if in_flight and in_flight + nbytes > self.read_ahead_bytes:
                        return
                    try:
                        other.ahead[i] = self.store.acquire(key, Tier.HOST, ahead=True)
                    except TierCapacityError:
                        return
                in_flight += nbytes

    # -- freeing -----------------------------------------------------------------------------------

    def _forget(self, saved: _Saved, position: int) -> None:
        del self._order[position]
        for key in saved.keys:
            self.store.unregister(key)
        self.live_bytes[saved.home] -= saved.nbytes

    def drain(self) -> None:
        """Unregister the saved tensors whose graphs were dropped unused."""
        while self._dropped:
            keys, home, nbytes, handles = self._dropped.pop()
            _release_ahead(self.store, keys, handles)
            for key in keys:
                self.store.unregister(key)
            self.live_bytes[home] -= nbytes
        if any(ref() is None for ref in self._order):
            self._order = [ref for ref in self._order if ref() is not None]

    def stats(self) -> dict[str, Any]:
        """Bytes per home tier (current, peak, saved so far) and the NVMe bytes they moved."""
        moved = self.store.nvme_bytes_by_kind().get("act", {})
        return {tier.name: {"current": self.live_bytes[tier], "peak": self.peak_bytes[tier],
                            "saved": self.saved_bytes[tier]} for tier in self.live_bytes} | {
            "nvme_read_bytes": moved.get("read", 0), "nvme_written_bytes": moved.get("write", 0),
            "kept_bytes": self.kept_bytes, "no_room_bytes": self.no_room_bytes,
            "over_budget_read_bytes": self.over_budget_read_bytes, "mode": self.mode}

    def reset_peak(self) -> None:
        self.peak_bytes = dict(self.live_bytes)


def _word_sum(chunk: torch.Tensor) -> int:
    """[Note: activations are checked when read back] The sum, in int64, of a contiguous chunk's
    32-bit words (16-bit or bytes where its length is not a multiple of 4)."""
    raw = chunk.reshape(-1).view(torch.uint8)
    n = raw.numel()
    words = raw.view(torch.int32) if n % 4 == 0 else raw.view(torch.int16) if n % 2 == 0 else raw
    return int(words.sum(dtype=torch.int64))


def _release_ahead(store: TieredStore, keys: tuple[str, ...],
                   handles: list[TierHandle | None] | None) -> None:
    """Undo reads issued ahead: each that got its copy pinned is released."""
    for key, handle in zip(keys, handles or ()):
        if handle is None:
            continue
        try:
            handle.wait()
        except TierCapacityError:
            continue
        store.release(key, Tier.HOST)


__all__ = ["CHUNK_BYTES", "DEVICE_FREE_RESERVE_FRACTION", "MIN_STORED_BYTES", "StoredActivations",
           "cuda_activation_room"]
