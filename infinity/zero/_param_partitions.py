"""This rank's parameter partitions: which part of each flat group the rank holds, where a stored
shard is read and written, and how the optimizer, checkpoints and state dicts open it.

Split out of :class:`~infinity.zero._param_manager.ParameterManager` (#35), which keeps the
public methods (``partition_of``, ``param_partition``, ``open_param_partition``, ``read_shard``)
and hands each call here: one place decides where a shard is written and when it goes home.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch

from infinity.tiers import Tier, TieredStore
from infinity.zero._flat_group import FlatGroup
from infinity.zero._manager_config import ManagerConfig
from infinity.zero._training_state import ParamWriteback
from infinity.zero._unit_storage import UnitStorage

logger = logging.getLogger(__name__)

__all__ = ["ParamPartitions"]


class ParamPartitions:
    """Where this rank's parameter partition of each group lives, and the one way to open it."""

    def __init__(self, config: ManagerConfig, *, rank: int, store: TieredStore | None,
                 storage: UnitStorage):
        """``storage``: the units' gathers (a write that fails half way drops a borrowed copy
        through it, see :meth:`_open_stored_shard`)."""
        self.stage = config.stage
        self.rank = rank
        self.store = store
        self.storage = storage
        self.param_home = config.param_home
        """The home tier of stored shards (DEVICE: nothing is stored)."""
        self.read_tier = config.reads.tier
        """Where gathers read offloaded shards ([Note: a CPU engine reads parameter shards from
        HOST] in infinity/zero/_manager_config.py)."""
        self.write_tier = (Tier.HOST if config.optimizer_offloaded
                           and not config.device_holds_params else self.read_tier)
        """Where the optimizer, and checkpoint loads, write offloaded shards: [Note: updated
        shards are written where the optimizer runs]."""
        self.param_writeback = ParamWriteback.EAGER
        """When an updated stored shard goes home; the engine sets it at each optimizer step."""

    def partition_of(self, group: FlatGroup) -> tuple[int, int]:
        """(first flat element, numel) of the optimizer/parameter partition this rank holds: the
        rank's shard at stages 1-3, the whole buffer at stage 0."""
        if self.stage == 0:
            return 0, group.padded_numel
        return self.rank * group.shard_numel, group.shard_numel

    def param_partition(self, group: FlatGroup) -> Any:
        """What the optimizer writes for ``group``: the parameter partition (stage 0: the whole
        buffer), or, when the store holds the shard, a callable opening it for writing
        (:meth:`open`)."""
        if group.store_key is None:
            return group.full if self.stage == 0 else group.shard
        return lambda overwrite=False: self._open_stored_shard(group, overwrite=overwrite)

    @contextlib.contextmanager
    def open(self, group: FlatGroup, *, overwrite: bool = False) -> Iterator[torch.Tensor]:
        """This rank's parameter partition of ``group`` for writing (checkpoints, weights): the
        tensor itself, or the stored shard acquired on the write tier, marked dirty and written
        back to its home on exit. ``overwrite``: the caller writes every element, so an absent
        stored copy is not read first."""
        if group.store_key is None:
            yield group.full if self.stage == 0 else group.shard
            return
        with self._open_stored_shard(group, overwrite=overwrite) as tensor:
            yield tensor

    @property
    def updates_cross_to_device(self) -> bool:
        """Offloaded parameter shards are written on HOST (the write tier) and gathered through
        DEVICE (the read tier): each updated shard crosses to the device between its update and
        its read ([Note: a deferred step overlaps the copies up] in infinity/zero/_engine.py)."""
        return (self.param_home is not Tier.DEVICE and self.write_tier is Tier.HOST
                and self.read_tier is Tier.DEVICE)

    @contextlib.contextmanager
    def _open_stored_shard(self, group: FlatGroup, *, overwrite: bool = False
                           ) -> Iterator[torch.Tensor]:
        """[Note: updated shards are written where the optimizer runs]
        The shard for writing, on the write tier. An offloaded optimizer makes the new values in
        host memory (its fp32 masters live there): writing them into a DEVICE copy crossed the
        host<->device link once for the copy-out and once more for the write-back to the HOST
        or NVMe home, and the DEVICE copy the next forward may find still resident was at most
        the device budget's worth. Written on HOST they cross nothing; the forward's prefetch
        carries each shard to the device once, as DeepSpeed's CPU Adam writing the pinned fp16
        partition does. (The 350m GPT, one rank, half its shards fitting the device budget:
        676 MiB down and 676 MiB up per step beside the reads, now none.) Where every shard
        stays on the device (``device_holds_params``), or the optimizer runs on the device, the
        DEVICE copy is the one written, and the home is written back from it. ``overwrite``: the
        caller writes every element (the optimizer step), so an absent copy is not read first
        (``store.acquire``)."""
        key, tier = group.store_key, self.write_tier
        tensor = self.store.acquire(key, tier, overwrite=overwrite).wait()
        written = False
        try:
            yield tensor
            self.store.mark_dirty(key, tier)
            written = True
        finally:
            self.store.release(key, tier)
            # Partly written. A copy already dirty (lazy write-back) is the only current one: it
            # stays, its updated parts matching their masters, and the error path writes nothing.
            # Any other copy is dropped (not dirty: no write), so its bytes never pass for the shard.
            if not written and self.store.is_dirty(key) is not tier \
                    and tier is not self.param_home:
                if id(group) in self.storage.borrowed:  # pinned by the unit: dropped at release
                    self.storage.stale_borrowed.add(key)
                else:
                    self.store.evict(key, tier)
        if self.param_writeback is ParamWriteback.EAGER:
            self.store.write_back(key)  # async: the updated shard returns to its home

    def read_shard(self, group: FlatGroup) -> torch.Tensor:
        """A copy-free view (device) or a fresh copy (store) of this rank's parameter shard."""
        if group.store_key is None:
            return group.full if self.stage == 0 else group.shard
        tier = self.read_tier
        tensor = self.store.acquire(group.store_key, tier).wait()
        try:
            return tensor.clone()
        finally:
            self.store.release(group.store_key, tier)
