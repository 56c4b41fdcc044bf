"""The NVMe bytes one model's offload will write, and the free-space check made before the first.

[Note: NVMe space check] ``infinity.initialize`` writes every NVMe-homed shard as it builds the
state (parameter shards and optimizer sub-groups at once, gradient slices in the first step), and
a full disk would surface minutes later as ENOSPC halfway through. So, once the budgets are
resolved and the store exists (its arena extent and the swapper's header size are then known) but
before anything is registered, :func:`nvme_bytes` counts what will be written (from the same
:class:`StateSizes` and :class:`OffloadBudgets` the store is built from) and :func:`check_nvme_space`
compares it with the free space of each file system, raising :class:`~infinity.errors.DiskSpaceError`
naming the path, the bytes needed and free, and how to fix it. The figure is exact, not an estimate:
``state_bytes`` equals the engine's ``stats()["bytes"]["NVME"]`` after set-up (a test holds it to
that), and ``file_bytes`` adds what the files take beyond their payload (each swap file is a header
plus its payload rounded up to whole arena extents, [Note: swap file layout] in
infinity/io/_swap_format.py). Ranks on one machine write to the same file systems at once, so the
need is multiplied by their number before it is compared.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Iterable

from infinity.errors import DiskSpaceError
from infinity.io import free_disk_bytes
from infinity.tiers._offload_budgets import (SUB_GROUP_BYTES_PER_NUMEL, OffloadBudgets,
                                             OffloadRequest, StateSizes)
from infinity.tiers.residency import Tier


@dataclasses.dataclass(frozen=True, kw_only=True)
class NvmeBytes:
    """What one rank's store writes to NVMe for one model (payload bytes, then on disk)."""

    param_bytes: int
    """Parameter shards homed on NVMe (stage 3, units not always gathered), compute dtype."""
    optimizer_bytes: int
    """fp32 master and moments of the optimizer sub-groups homed on NVMe (not the host-resident
    ones, [Note: host-resident sub-groups] in infinity/tiers/_offload_budgets.py)."""
    gradient_bytes: int
    """Gradient accumulator slices on NVMe ([Note: gradients on NVMe] in
    infinity/zero/_grad_reducer.py); 0 when they stay in host memory."""
    num_files: int
    file_bytes: int
    """Bytes the swap files take on disk: headers and payloads rounded up to whole extents."""

    @property
    def state_bytes(self) -> int:
        """The payload: what ``engine.stats()["bytes"]["NVME"]`` reports."""
        return self.param_bytes + self.optimizer_bytes + self.gradient_bytes

    def describe(self) -> str:
        """What the bytes are, for an error message."""
        kinds = [(self.param_bytes, "parameter shards"), (self.optimizer_bytes, "optimizer state"),
                 (self.gradient_bytes, "gradient slices")]
        return (", ".join(f"{what} {n}" for n, what in kinds if n)
                + f" bytes in {self.num_files} swap files")


def nvme_bytes(sizes: StateSizes, request: OffloadRequest, budgets: OffloadBudgets, *,
               extent_bytes: Callable[[int], int], header_bytes: int) -> NvmeBytes:
    """The bytes the store built from ``budgets`` writes to NVMe for ``sizes``.

    ``extent_bytes``: the arena's rounding of a payload (``store.arena.extent_bytes``: a swap file
    holds its shard's whole extent); ``header_bytes``: the swapper's header per file. Host-resident
    optimizer sub-groups are taken as the optimizer takes them: a prefix, in add order (unit
    order), while each one's extent fits the room left."""
    files: list[int] = []  # payload bytes of each swap file
    params = opt = grads = 0
    if request.param_home is Tier.NVME:
        files += sizes.param_shard_bytes
        params = sum(sizes.param_shard_bytes)
    sub = budgets.sub_group_numel
    if request.optimizer_home is Tier.NVME:
        room = budgets.optimizer_host_resident_bytes
        for part in sizes.optimizer_partition_numel:
            for lo in range(0, part, sub):
                nbytes = SUB_GROUP_BYTES_PER_NUMEL * min(sub, part - lo)
                extent = extent_bytes(nbytes) if room else 0
                if 0 < extent <= room:  # homed on HOST: never written to NVMe
                    room -= extent
                    continue
                room = 0  # a prefix only (as the optimizer takes them)
                files.append(nbytes)
                opt += nbytes
    if budgets.grads_on_nvme:
        for part in sizes.optimizer_partition_numel:
            for lo in range(0, part, sub):
                nbytes = request.grad_accumulator_bytes * min(sub, part - lo)
                files.append(nbytes)
                grads += nbytes
    return NvmeBytes(param_bytes=params, optimizer_bytes=opt, gradient_bytes=grads,
                     num_files=len(files),
                     file_bytes=sum(header_bytes + extent_bytes(n) for n in files))


@dataclasses.dataclass(frozen=True)
class NvmeDemand:
    """Bytes about to be written under one directory, and what they are (for the message)."""

    path: str
    nbytes: int
    what: str
    """e.g. "offload_param.nvme_path (parameter shards)"."""


def check_nvme_space(demands: Iterable[NvmeDemand], *, local_ranks: int = 1,
                     fix: str = "") -> None:
    """Raise :class:`~infinity.errors.DiskSpaceError` when a file system has less free space
    than ``local_ranks`` times the bytes of every demand on it (directories on one file system
    are summed: they share its free space). ``fix``: what else the user can change, appended."""
    by_fs: dict[int, list[NvmeDemand]] = {}
    for d in demands:
        if d.nbytes > 0:
            by_fs.setdefault(os.stat(d.path).st_dev, []).append(d)  # the path exists by now
    for group in by_fs.values():
        path = group[0].path
        needed = local_ranks * sum(d.nbytes for d in group)
        free = free_disk_bytes(path)
        if needed <= free:
            continue
        parts = ", ".join(f"{d.nbytes} for {d.what} under {d.path!r}" for d in group)
        ranks = f" x {local_ranks} ranks on this machine" if local_ranks > 1 else ""
        raise DiskSpaceError(
            f"not enough free disk space for the NVMe offload: {needed} bytes "
            f"({needed / 2**30:.2f} GiB: {parts}{ranks}) are to be written, but the file system "
            f"of {path!r} has {free} bytes ({free / 2**30:.2f} GiB) free; nothing was written. "
            f"Free space there, point nvme_path at a larger disk{fix}",
            path=path, needed_bytes=needed, free_bytes=free)


__all__ = ["NvmeBytes", "NvmeDemand", "check_nvme_space", "nvme_bytes"]
