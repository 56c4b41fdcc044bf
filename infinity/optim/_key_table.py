"""The keys of the offloaded optimizer and their sub-groups: each key's records, what its new
parameters are written into, its parameter shard's store key, and which of its sub-groups are
homed on HOST although the optimizer's home is NVME ([Note: host-resident sub-groups] in
infinity/tiers/_offload_budgets.py), also while masters stream in at set-up
([Note: masters stream into the optimizer] in infinity/zero/_engine_setup.py). Registering a
sub-group registers its store shard; nothing here reads or writes one after that (the step is
:class:`~infinity.optim.OffloadedShardOptimizer`'s).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from infinity.optim._sub_group import SubGroup
from infinity.tiers import SUB_GROUP_BYTES_PER_NUMEL, Tier, TieredStore


class KeyTable:
    """Key -> its sub-groups (in add order, the step's tie-break), with where each is homed."""

    def __init__(self, store: TieredStore, *, home: Tier, sub_group_numel: int,
                 host_resident_bytes: int):
        """``host_resident_bytes``: NVME home, host room in which sub-groups are homed on HOST
        instead (0 otherwise)."""
        self.store = store
        self.home = home
        self.sub_group_numel = int(sub_group_numel)
        self._resident_room_bytes = int(host_resident_bytes)
        """Host room not yet taken by host-resident sub-groups, in arena extents; :meth:`add`
        takes it in add order (a prefix)."""
        self.host_resident_bytes = 0
        """Bytes of optimizer state homed on HOST although the optimizer's home is NVME."""
        self.sub_groups: dict[str, list[SubGroup]] = {}
        """Key -> its sub-groups in order (the records of every sub-group's state)."""
        self.outs: dict[str, Any] = {}
        """Key -> what the new parameters are written into (see :func:`open_param_out`)."""
        self.param_keys: dict[str, str] = {}
        """Key -> store key of its parameter shard, when the store holds it (see :meth:`add`)."""
        self.state_bytes = 0
        """Bytes of Adam moments registered (8 per element)."""
        self._held: dict[str, tuple[torch.Tensor, Any, str | None]] | None = None
        """While masters stream in (:meth:`hold_host_resident`): the keys whose
        first sub-group will be homed on HOST, held back until :meth:`release_held`; None
        otherwise."""
        self._held_room_bytes = 0
        """While streaming: host room not yet promised to a held key."""
        self._add_order: list[str] = []
        """While streaming: every key in the order it was offered (held or added)."""

    def numel(self, key: str) -> int:
        records = self.sub_groups[key]
        return records[-1].hi if records else 0

    def hold_host_resident(self) -> None:
        """See :meth:`OffloadedShardOptimizer.hold_host_resident`."""
        if self.sub_groups or self._held is not None:
            raise RuntimeError("shard optimizer: hold_host_resident() before the first add()")
        self._held, self._held_room_bytes, self._add_order = {}, self._resident_room_bytes, []

    def release_held(self) -> None:
        """See :meth:`OffloadedShardOptimizer.release_held`."""
        if self._held is None:
            return
        held, self._held = self._held, None
        for key, (master, param_out, param_key) in held.items():
            self.add(key, master, param_out, param_key=param_key)
        self.sub_groups = {key: self.sub_groups[key] for key in self._add_order}
        self._add_order = []

    def drop_setup_copies(self) -> None:
        """See :meth:`OffloadedShardOptimizer.drop_setup_copies`."""
        for records in self.sub_groups.values():
            for sg in records:
                if sg.home is Tier.NVME:
                    self.store.evict(sg.store_key, Tier.HOST)

    def _resident_prefix(self, n_total: int, room_bytes: int) -> tuple[int, int]:
        """[Note: host-resident sub-groups] for a key of ``n_total`` elements given
        ``room_bytes`` of host room: how many of its leading sub-groups are homed on HOST, and
        the room left. A prefix only (no later, smaller sub-group lands between cached copies):
        the first sub-group that does not fit leaves no room. Each takes the arena's own extent
        (its alignment may exceed the plan's 4 KiB), so that the resident sub-groups never take
        more host room than the plan left them."""
        resident = 0
        for lo in range(0, n_total, self.sub_group_numel):
            n = min(n_total, lo + self.sub_group_numel) - lo
            extent = self.store.arena.extent_bytes(SUB_GROUP_BYTES_PER_NUMEL * n)
            if extent > room_bytes:
                return resident, 0
            room_bytes -= extent
            resident += 1
        return resident, room_bytes

    def _holds_back(self, key: str, master: torch.Tensor, param_out: Any,
                    param_key: str | None) -> bool:
        """While streaming: whether ``key`` is held back because its first sub-group will be
        homed on HOST (:meth:`_resident_prefix` on the room not yet promised, so the held keys
        are exactly those that :meth:`add` in the offered order would make resident)."""
        if self._held is None:
            return False
        self._add_order.append(key)
        resident, self._held_room_bytes = self._resident_prefix(master.numel(),
                                                                self._held_room_bytes)
        if not resident:
            return False
        self._held[key] = (master, param_out, param_key)
        return True

    def add(self, key: str, master: torch.Tensor, param_out: Any, *,
            param_key: str | None = None) -> None:
        """See :meth:`OffloadedShardOptimizer.add`."""
        if key in self.sub_groups or (self._held is not None and key in self._held):
            raise ValueError(f"shard optimizer: key {key!r} added twice")
        if master.dtype != torch.float32 or master.dim() != 1:
            raise ValueError(f"shard optimizer: master for {key!r} must be a flat fp32 tensor")
        if self._holds_back(key, master, param_out, param_key):
            return
        self.outs[key] = param_out
        if param_key is not None:
            self.param_keys[key] = param_key
        n_total, sub = master.numel(), self.sub_group_numel
        resident = 0  # streaming: a key that takes host room is held, added at release_held
        if self._held is None:
            resident, self._resident_room_bytes = self._resident_prefix(
                n_total, self._resident_room_bytes)
        records = []
        for i, lo in enumerate(range(0, n_total, sub)):
            hi = min(n_total, lo + sub)
            n = hi - lo
            home = Tier.HOST if i < resident else self.home
            if i < resident:
                self.host_resident_bytes += SUB_GROUP_BYTES_PER_NUMEL * n
            sg = SubGroup(key=key, lo=lo, hi=hi, store_key=f"opt/{key}/{i}", home=home)
            # Dropped once written ([Note: set-up copies are dropped once written] in
            # infinity/tiers/store.py): drop_setup_copies would evict it before the first step.
            self.store.register(sg.store_key, 3 * n, torch.float32, home,
                                fill=functools.partial(_fill_sub_group, master[lo:hi]),
                                keep_host_copy=False)
            self.state_bytes += 8 * n
            records.append(sg)
        self.sub_groups[key] = records


def _fill_sub_group(master: torch.Tensor, out: torch.Tensor) -> None:
    """A new sub-group's [master | exp_avg | exp_avg_sq], written straight into its store copy
    ([Note: set-up writes in place] in infinity/optim/_offloaded.py)."""
    n = master.numel()
    out[:n].copy_(master)
    out[n:].zero_()
