"""ZeRO++ hpZ: secondary shards of each unit inside a node-sized group of ranks, so that the
backward's all-gathers never leave the node.

[Note: hpZ secondary shards]
With ``zero.hpz_partition_size`` H > 1 (DeepSpeed's ``zero_hpz_partition_size``), the W ranks of
the data-parallel group form W / H secondary groups of consecutive ranks, ``[k*H, ..., k*H+H-1]``
(:func:`secondary_group_ranks`; a node's ranks when H is the GPUs per node, as torchrun numbers
them). The primary partition is unchanged: each rank owns its 1/W shard, the optimizer steps it,
checkpoints save it.

* Forward: each unit is all-gathered over all W ranks as without hpZ (``forward-gather``). Right
  after that gather, with grad enabled (a backward may follow), each rank copies its *secondary
  shard* out of the gathered buffer: the slice ``[j*P, (j+1)*P)`` of the unit's padded flat buffer,
  where ``j`` is its index inside its secondary group and ``P = padded numel / H`` (a whole number
  of 16-byte aligned primary shards, since H divides W). Always-gathered units keep none.
* Backward: a unit gathered again (its pre-backward hook, or a recompute under activation
  checkpointing: a unit may be gathered twice) is all-gathered inside the secondary group from the
  secondary shards (``secondary-gather``; a unit without them, e.g. first used in backward, falls
  back to the W-way gather, counted as ``backward-gather``). The gathered bytes are the same values
  the W-way gather would bring: training is bit-for-bit the same as without hpZ.
* The secondary shards are dropped at the end of each backward (every unit's backward gathers are
  done; the next forward copies them again) and after every optimizer step (they are stale once the
  parameters change). Not right after a unit's backward gather: under activation checkpointing
  a unit may be gathered again later in the same backward. A forward gather always overwrites
  the unit's, so two forwards before one backward (or a forward without a backward) leave
  current ones. (The weights change only at the step, so the shards could also serve the
  forwards of later micro-batches of an accumulation window, inside the node; not done: every
  forward gathers over all W ranks, and the shards live only from forward to backward.)

Bytes (``engine.stats()["collective_bytes_sent"]``, the input each rank contributes): per gathered
unit of padded numel U and element size e, ``forward-gather`` U*e/W, ``secondary-gather`` U*e/H
(on the wire a ring sends (W-1)/W and (H-1)/H of the unit's bytes, the latter inside the node).
Device memory: the secondary shards of every unit gathered in a forward live until its backward
ends, 1/H of the model's parameter bytes per rank, ``hpz_secondary`` in ``engine.stats()`` and in
the ledger ([Note: the hpZ term] in infinity/ledger/_estimate.py). With parameter offload the
secondary shard would be a device copy outside the store's budgets: rejected for now (config).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from infinity._common import warn_once
from infinity.zero._collectives import CommHandle, Collectives, Phase
from infinity.zero._flat_group import FlatGroup

logger = logging.getLogger(__name__)


def check_partition_size(partition_size: int, world_size: int) -> None:
    """``ValueError`` naming ``zero.hpz_partition_size`` unless it divides ``world_size``."""
    if partition_size > world_size or world_size % partition_size:
        raise ValueError(
            f"zero.hpz_partition_size: expected a divisor of the data-parallel world size "
            f"{world_size}, got {partition_size}; set it to the ranks per node (e.g. the GPUs "
            f"per node) or 1 to turn hpZ off")


def secondary_group_ranks(world_size: int, partition_size: int) -> list[list[int]]:
    """The secondary groups of hpZ as lists of ranks of the data-parallel group: consecutive
    blocks of ``partition_size`` ranks, in order ([Note: hpZ secondary shards])."""
    check_partition_size(partition_size, world_size)
    return [list(range(k * partition_size, (k + 1) * partition_size))
            for k in range(world_size // partition_size)]


def _new_groups(collectives: Collectives, rank_lists: list[list[int]]) -> list[Any]:
    """``dist.new_group`` for every list, on every rank in the same order (torch requires every
    rank of the default group to take part in creating each group, members or not)."""
    def global_rank(r: int) -> int:
        return r if collectives.group is None else dist.get_global_rank(collectives.group, r)

    return [dist.new_group(ranks=[global_rank(r) for r in ranks]) for ranks in rank_lists]


class SecondaryPartition:
    """This rank's hpZ secondary shards and the collectives of its secondary group."""

    def __init__(self, collectives: Collectives, partition_size: int):
        """``collectives``: the data-parallel group's (W ranks); ``partition_size``: H."""
        if collectives.world.world_size != collectives.world_size or collectives.tensor_size > 1:
            # Secondary groups would be needed inside every shard group, created on every rank
            # in one order; HSDP already keeps the gathers inside a node, which is hpZ's point.
            raise ValueError(
                f"zero.hpz_partition_size = {partition_size} with a mesh of "
                f"{collectives.replicate_size} replicas x {collectives.world_size} shards x "
                f"{collectives.tensor_size} tensor ranks: hpZ runs on a flat data-parallel group "
                f"only; use the mesh's shard dimension (HSDP) or set hpz_partition_size 1")
        groups = secondary_group_ranks(collectives.world_size, partition_size)
        if partition_size == collectives.world_size:
            warn_once("hpz:whole-world",
                      f"zero.hpz_partition_size = {partition_size} is the whole data-parallel "
                      f"group: the backward gathers over the same ranks as without hpZ, at the "
                      f"cost of 1/{partition_size} of the model in device memory; set it to the "
                      f"ranks per node (a divisor of {partition_size}) or 1")
        handles = _new_groups(collectives, groups)
        mine = collectives.rank // partition_size
        self.partition_size = partition_size
        self.ranks = groups[mine]
        """Ranks (of the data-parallel group) of this rank's secondary group."""
        self.coll = collectives.over(handles[mine])
        """Collectives inside the secondary group; their bytes count in the parent's totals."""
        self.index = collectives.rank - self.ranks[0]
        """This rank's place in its secondary group: which 1/H slice of a unit it keeps."""
        if self.coll.rank != self.index:  # new_group numbers members in the order given
            raise RuntimeError(f"hpZ: rank {collectives.rank} is member {self.coll.rank} of its "
                               f"secondary group {self.ranks}, expected {self.index}")
        self._shards: dict[str, torch.Tensor] = {}
        """Flat group key -> its secondary shard (held from a forward gather to the backward's end)."""
        self.peak_bytes = 0
        """Largest sum of secondary shard bytes held at once."""
        logger.info("hpZ: secondary group %s (partition size %d of %d ranks)", self.ranks,
                    partition_size, collectives.world_size)

    def _bounds(self, group: FlatGroup) -> tuple[int, int]:
        numel = group.padded_numel // self.partition_size
        return self.index * numel, numel

    def keep(self, group: FlatGroup) -> None:
        """Copy this rank's secondary slice out of ``group``'s freshly gathered full buffer."""
        first, numel = self._bounds(group)
        shard = self._shards.get(group.key)
        if shard is None:
            shard = torch.empty(numel, dtype=group.full.dtype, device=group.full.device)
            self._shards[group.key] = shard
        shard.copy_(group.full[first:first + numel])
        self.peak_bytes = max(self.peak_bytes, self.bytes())

    def holds(self, groups: list[FlatGroup]) -> bool:
        return all(g.key in self._shards for g in groups)

    def gather(self, group: FlatGroup, *, context: str) -> CommHandle:
        """All-gather ``group``'s full buffer inside the secondary group (its storage allocated),
        issued: the buffer holds it after the handle's wait."""
        return self.coll.all_gather_async(group.full, self._shards[group.key], context=context,
                                          phase=Phase.SECONDARY_GATHER)

    def drop(self) -> None:
        """Free every secondary shard (end of a backward, after an optimizer step)."""
        self._shards.clear()

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._shards.values())

    def stats(self) -> dict[str, Any]:
        return {"partition_size": self.partition_size, "group_ranks": list(self.ranks),
                "secondary_bytes": self.bytes(), "secondary_peak_bytes": self.peak_bytes}
