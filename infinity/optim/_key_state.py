"""One key's optimizer state read and written outside the step, sub-group by sub-group: CPU copies
of its master or moments (checkpoints, full state dicts), and overwrites of them (checkpoint
loading, weights). Each sub-group is acquired on HOST, and what was written goes back to its
home. The caller finishes any step under way first."""

from __future__ import annotations

import contextlib
from typing import ContextManager, Iterator, Sequence

import torch

from infinity.optim._sub_group import SubGroup
from infinity.tiers import Tier, TieredStore, TierHandle

MASTER, EXP_AVG, EXP_AVG_SQ = 0, 1, 2
"""The parts of a sub-group's shard ``[master | exp_avg | exp_avg_sq]``, in order."""


def read_part(store: TieredStore, records: Sequence[SubGroup], numel: int,
              part: int) -> torch.Tensor:
    """A CPU copy of one part (:data:`MASTER`, :data:`EXP_AVG`, :data:`EXP_AVG_SQ`) of a key of
    ``numel`` elements whose sub-groups are ``records``."""
    out = torch.empty(numel, dtype=torch.float32)
    for sg in records:
        n = sg.numel
        buf = store.acquire(sg.store_key, Tier.HOST).wait()
        try:
            out[sg.lo:sg.hi].copy_(buf[part * n:(part + 1) * n])
        finally:
            store.release(sg.store_key, Tier.HOST)
    return out


def write_parts(store: TieredStore, records: Sequence[SubGroup],
                parts: Sequence[torch.Tensor]) -> None:
    """Overwrite every part of each sub-group in ``records`` with its slice of ``parts`` (flat
    fp32 CPU tensors of the key, in shard order), then wait for the write-backs to NVME."""
    handles = []
    for sg in records:
        with _open_host(store, sg) as buf:
            n = sg.numel
            for i, part in enumerate(parts):
                buf[i * n:(i + 1) * n].copy_(part[sg.lo:sg.hi])
        if sg.home is Tier.NVME:
            handles.append(store.write_back(sg.store_key))
    for handle in handles:
        handle.wait()


@contextlib.contextmanager
def master_windows(store: TieredStore, records: Sequence[SubGroup]
                   ) -> Iterator[list[tuple[int, int, ContextManager[torch.Tensor]]]]:
    """See :meth:`OffloadedShardOptimizer.open_master`."""
    handles: list[TierHandle] = []
    yield [(sg.lo, sg.hi, _open_master(store, sg, handles)) for sg in records]
    for handle in handles:
        handle.wait()


@contextlib.contextmanager
def _open_master(store: TieredStore, sg: SubGroup,
                 handles: list[TierHandle]) -> Iterator[torch.Tensor]:
    with _open_host(store, sg) as buf:
        yield buf[:sg.numel]
    if sg.home is Tier.NVME:
        handles.append(store.write_back(sg.store_key))


@contextlib.contextmanager
def _open_host(store: TieredStore, sg: SubGroup) -> Iterator[torch.Tensor]:
    """The sub-group's shard acquired on HOST for writing; marked dirty unless the body raised."""
    buf = store.acquire(sg.store_key, Tier.HOST).wait()
    try:
        yield buf
        store.mark_dirty(sg.store_key, Tier.HOST)
    finally:
        store.release(sg.store_key, Tier.HOST)
