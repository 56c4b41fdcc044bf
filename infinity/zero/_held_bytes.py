"""The device bytes the parameter manager's units hold, by kind, and their peak.

Split out of :class:`~infinity.zero._param_manager.ParameterManager` (#35): the manager's
``device_bytes()``, ``peak_device_bytes`` and ``peak_device_parts`` read this record.
"""

from __future__ import annotations

import logging
from typing import Iterator

import torch

from infinity.zero._flat_group import Unit
from infinity.zero._hpz import SecondaryPartition
from infinity.zero._unit_storage import UnitStorage

logger = logging.getLogger(__name__)

__all__ = ["HeldBytes"]


class HeldBytes:
    """What the units hold now, by kind ("param", "master", "grad", "hpz_secondary"), counting
    each storage once, and the largest sum seen at a gather or a gradient reduction."""

    def __init__(self, units: list[Unit], storage: UnitStorage, *,
                 hpz: SecondaryPartition | None, optimizer_offloaded: bool):
        self.units = units
        self.storage = storage
        self.hpz = hpz
        self.optimizer_offloaded = optimizer_offloaded
        self.peak_bytes = 0
        """Largest sum of :meth:`now` seen at a gather or a gradient reduction."""
        self.peak_parts: dict[str, int] = {}
        """:meth:`now` by kind at the moment of ``peak_bytes`` (what the peak is made of)."""

    def _held_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for u in self.units:
            for g in u.groups:
                if id(g) not in self.storage.borrowed:  # else counted in the store's tier bytes
                    yield "param", g.full
                if g.shard is not None:
                    yield "param", g.shard
                if g.master is not None and not self.optimizer_offloaded:  # else host-side
                    yield "master", g.master
                if g.grad_staging is not None and g.grad_staging is not g.grad_host:
                    yield "grad", g.grad_staging
                if g.grad_acc is not None and g.grad_acc is not g.grad_host:
                    yield "grad", g.grad_acc
        for t in self.storage.tensors_in_flight():  # reductions issued, not yet waited
            yield "grad", t

    def now(self) -> dict[str, int]:
        """Bytes held now, by kind, counting each storage once (views share their base's)."""
        seen: set[int] = set()
        out = {"param": 0, "master": 0, "grad": 0,
               "hpz_secondary": self.hpz.bytes() if self.hpz is not None else 0}
        for kind, t in self._held_tensors():
            storage = t.untyped_storage()
            if storage._cdata in seen:
                continue
            seen.add(storage._cdata)
            out[kind] += storage.nbytes()
        return out

    def note_peak(self) -> None:
        held = self.now()
        total = sum(held.values())
        if total > self.peak_bytes:
            self.peak_bytes, self.peak_parts = total, held
