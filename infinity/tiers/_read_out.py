"""Reads of a shard's current bytes into a caller's host buffer, taking no room in any tier.

[Note: a read into the caller's buffer takes no room]
``TieredStore.read_into(key, out)`` serves a reader that needs a shard's bytes when the arena has
no extent to give it: every one pinned by work in flight, as in
[Note: no room to read back is not an error] in infinity/zero/_stored_activations.py.
The bytes go into memory the caller owns: no copy of the shard is allocated, nothing is charged
to a budget, nothing is evicted. The source is where the shard's current bytes are (see
[Note: dirty copy] in infinity/tiers/_records.py): a HOST copy that holds them (RESIDENT, or
WRITING: a write-back reads it, its bytes do not change), else a DEVICE copy that holds them,
else the NVMe file when it is current (RESIDENT with no dirty copy, so no write of it is in
flight; ZEROS: the caller's buffer is zeroed, no read). The copy read from is marked busy until
its bytes are out, as for any move reading it: it is not evicted, and no write-back,
``mark_dirty`` or ``unregister`` of the shard starts meanwhile (each waits for a settled shard),
so a write of the file is ordered after the read (the swapper also keeps one key's operations in
issue order). Where only moves in flight hold the bytes the read waits for them.
The file holds the shard's whole extent ([Note: one host arena] in infinity/tiers/_arena.py),
and the swapper reads exactly what was written: a caller's buffer of exactly the extent's bytes
is read into directly, at any address (the swapper stages an unaligned one:
[Note: direct I/O alignment] in infinity/io/_swapper.py), any other through an aligned buffer of
the extent's size allocated for this read. A file read counts as any NVMe read
(``bytes_nvme_to_host``, ``nvme_bytes_by_kind``); the store runs the read gate first
([Note: the read gate] in infinity/tiers/_read_gate.py).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable

import torch

from infinity.io import Swapper, aligned_empty
from infinity.tiers._arena import HostArena
from infinity.tiers._mover import Mover
from infinity.tiers._records import Counters, _Shard, done_future, host_copy
from infinity.tiers._shard_table import ShardTable
from infinity.tiers.residency import Residency, Tier

_I, _R, _W, _Z = Residency.INFLIGHT, Residency.RESIDENT, Residency.WRITING, Residency.ZEROS


class ReadOuts:
    """Reads of shards into callers' buffers, outside the budgets (the module's Note).
    :meth:`start` runs with the table's lock held; what it returns runs without it."""

    def __init__(self, *, table: ShardTable, mover: Mover, counters: Counters, arena: HostArena,
                 swapper: Swapper | None):
        self._table = table
        self._mover = mover
        self._counters = counters
        self._arena = arena
        self._swapper = swapper

    def start(self, shard: _Shard, out: torch.Tensor) -> Callable[[], Future]:
        """Choose the copy to read ``shard`` from (waiting for moves in flight where none holds
        the current bytes) and mark it busy. Returns the read, which the caller runs once it has
        let the lock go: it returns a future that completes with ``out`` filled."""
        _check_out(shard, out)
        source = self._wait_for_source(shard)
        flat = out.view(-1)
        if shard.copies[source].state is _Z:  # never written: zeros, no file
            return lambda: _zeros(flat, out)
        shard.copies[source].busy += 1
        if source is Tier.NVME:
            return lambda: self._read_file(shard, flat, out)
        return lambda: self._copy_out(shard, source, flat, out)

    def _wait_for_source(self, shard: _Shard) -> Tier:
        while True:
            source = current_source(shard)
            if source is not None:
                return source
            if not any(c.state is _I for c in shard.copies.values()):
                raise RuntimeError(
                    f"read_into({shard.key!r}): no copy holds the shard's current bytes "
                    f"({ {t.name: c.state.name for t, c in shard.copies.items()} }, dirty="
                    f"{shard.dirty}); an earlier write of it failed (see the warning logged "
                    "then): register the shard again")
            self._table.wait()
            if not self._table.holds(shard):
                raise KeyError(f"read_into({shard.key!r}): unregistered while waiting for a "
                               "move in flight")

    def _copy_out(self, shard: _Shard, source: Tier, flat: torch.Tensor,
                  out: torch.Tensor) -> Future:
        """Copy a busy DEVICE or HOST copy into the caller's buffer on the caller's thread."""
        future: Future = Future()
        error = None
        try:
            # [Note: device copies complete on the stream] in infinity/tiers/_mover.py
            reader = self._mover.device_reader(shard, source)
            if reader is not None:
                reader()
            host_copy(flat, shard.copies[source].tensor)
        except BaseException as e:  # noqa: BLE001 - delivered through the handle
            error = e
        self._finish(shard, source, future, out, error)
        return future

    def _read_file(self, shard: _Shard, flat: torch.Tensor, out: torch.Tensor) -> Future:
        """Read the shard's file (the NVME copy busy) into ``flat``, through an extent-sized
        buffer unless ``flat`` is one; completes on the store's copy threads."""
        future: Future = Future()
        size = self._arena.extent_bytes(shard.nbytes)
        direct = flat.numel() * flat.element_size() == size
        try:
            buffer = flat.view(torch.uint8) if direct else aligned_empty(size, torch.uint8)
            handle = self._swapper.swap_in(shard.key, buffer)
        except BaseException as e:  # noqa: BLE001 - refused at issue: fail through the handle
            self._finish(shard, Tier.NVME, future, out, e)
            return future
        handle.future.add_done_callback(lambda f: self._mover.submit(
            self._file_read, shard, flat, None if direct else buffer, future, out, f.exception()))
        return future

    def _file_read(self, shard: _Shard, flat: torch.Tensor, staging: torch.Tensor | None,
                   future: Future, out: torch.Tensor, error: BaseException | None) -> None:
        if error is None and staging is not None:
            try:
                host_copy(flat, staging[:shard.nbytes].view(shard.dtype))
            except BaseException as e:  # noqa: BLE001 - delivered through the handle
                error = e
        if error is None:
            self._counters.add_moved(Tier.NVME, Tier.HOST, shard.nbytes, shard.key)
        self._finish(shard, Tier.NVME, future, out, error)

    def _finish(self, shard: _Shard, source: Tier, future: Future, out: torch.Tensor,
                error: BaseException | None) -> None:
        """The copy read from is no longer busy; then the reader learns the outcome."""
        with self._table:
            shard.copies[source].busy -= 1
            self._table.notify()
        if error is None:
            future.set_result(out)
        else:
            future.set_exception(error)


def _check_out(shard: _Shard, out: torch.Tensor) -> None:
    """``read_into``'s buffer: host memory the swapper and a memmove fill, exactly the shard."""
    if not (isinstance(out, torch.Tensor) and out.device.type == "cpu" and out.is_contiguous()
            and out.dtype == shard.dtype and out.numel() == shard.numel):
        got = (f"{out.dtype} x {out.numel()} on {out.device}, contiguous={out.is_contiguous()}"
               if isinstance(out, torch.Tensor) else type(out).__name__)
        raise ValueError(f"read_into({shard.key!r}): out must be a contiguous CPU tensor of "
                         f"{shard.numel} x {shard.dtype}, got {got}; read a device tensor's "
                         "bytes into a host buffer, then copy them")


def current_source(shard: _Shard) -> Tier | None:
    """Where ``shard``'s current bytes can be read now (the module's Note); None: only moves
    in flight hold them."""
    for tier in (Tier.HOST, Tier.DEVICE):
        stale = shard.dirty is not None and tier is shard.home
        if shard.copies[tier].state in (_R, _W) and not stale:
            return tier
    if shard.dirty is None and shard.copies[Tier.NVME].state in (_R, _Z):
        return Tier.NVME
    return None


def _zeros(flat: torch.Tensor, out: torch.Tensor) -> Future:
    """A never-written NVME home's bytes: zeros, no file to read."""
    flat.zero_()
    return done_future(out)
