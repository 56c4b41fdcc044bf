"""Building the parameter manager's units: each chosen unit's parameters laid out in flat buffers
(one per ``requires_grad``), made views of them, broadcast from rank 0, sharded, and, with
offload, registered in the tiered store; fp32 masters built where the optimizer will take them.

A model built under ``infinity.init`` has no values yet: each parameter's values are computed on
demand (``initial_values``), one unit ahead of the unit being built ([Note: the next unit's values
are drawn ahead]), and copied into its unit's buffer, so peak host memory stays near two units
plus the rank's shards.

[Note: the next unit's values are drawn ahead] Replaying a unit's random initialisation is serial
CPU work (one generator), and so is most of what follows it for the unit before: the fp32 to
compute-dtype conversion, the copies into the store, the masters into the optimizer, while the
NVMe writes go on in the store's threads. On a 2-core machine a worker thread replays unit i+1
while unit i is built. Measured on the 2-core VM (1B GPT, width 2560, 4 GiB host budget): the
replay was 13.2 s of a 28.6 s set-up. The worker touches no random stream the caller sees
(``Recording.value`` restores the generator it sets) and nothing of the store.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Protocol

import torch
from torch import nn

from infinity._dtypes import torch_name
from infinity.tiers import Tier, TieredStore
from infinity.zero._collectives import Collectives
from infinity.zero._flat_group import FlatGroup, Unit, UnitState, UnitUse, layout_group
from infinity.zero._tensor_parallel import is_tensor_sharded, local_tensor, set_local_view
from infinity.zero._unit_choice import ChosenUnit, UnitChoice


class MasterSink(Protocol):
    """Takes each trainable group's fp32 master as soon as its group is built
    ([Note: masters stream into the optimizer] in infinity/zero/_engine_setup.py)."""

    def take(self, group: FlatGroup, partition: Any) -> None:
        """Take ``group.master``; ``partition`` is what the optimizer writes the updated
        parameters into (``ParameterManager.param_partition``). The builder then drops its
        reference to the master."""

    def drop_setup_copies(self) -> None:
        """Evict the transient HOST copies that taking masters left in the arena."""


@dataclasses.dataclass(frozen=True)
class BuildProgress:
    """Where building the units stands, reported after each unit and once more when the set-up
    writes are done (``infinity.initialize``'s ``progress`` callback: ``infinity train`` draws it
    as a bar with an ETA)."""

    units_done: int
    num_units: int
    nvme_written_bytes: int
    """Bytes the store has written to NVMe so far (parameter shards, optimizer sub-groups)."""


InitialValues = Callable[[torch.Tensor], "torch.Tensor | None"]
"""``initial_values(param)``: the values of a parameter whose storage holds none yet (built under
``infinity.init``), or None to read the parameter itself."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuildSettings:
    """What the builder needs to know of the engine (resolved once by it)."""

    stage: int
    device: torch.device
    compute_dtype: torch.dtype
    param_home: Tier
    """Home of the shards of units gathered on demand: DEVICE (kept on the device), HOST, NVME."""
    optimizer_offloaded: bool
    """fp32 masters are built in host memory for an off-device optimizer to take."""


def check_units(choice: UnitChoice) -> None:
    """Raise before the first parameter is touched: only real floating-point parameters can be
    managed."""
    for unit in choice.units:
        for name, p in unit.params:
            if not p.is_floating_point():
                raise ValueError(f"parameter {name!r} has dtype {p.dtype}: only floating-point "
                                 f"parameters can be managed; register it as a buffer instead")
            if p.is_meta:
                raise ValueError(f"parameter {name!r} is on the meta device (no values); "
                                 f"materialise the model first (to_empty() and initialise)")


class UnitBuilder:
    """Builds the :class:`Unit` records of one model (see the module docstring)."""

    def __init__(self, settings: BuildSettings, *, collectives: Collectives,
                 store: TieredStore | None, initial_values: InitialValues | None,
                 master_sink: MasterSink | None = None,
                 partition_of: Callable[[FlatGroup], Any] | None = None):
        self.settings = settings
        self.coll = collectives
        self.store = store
        """Holds the parameter shards when ``settings.param_home`` is not DEVICE."""
        self._initial_values = initial_values
        self._master_sink = master_sink
        """Takes each master as its group is built; None: masters stay on their groups."""
        self._partition_of = partition_of
        """The partition the optimizer writes for a group (given with ``master_sink``)."""

    def build(self, choice: UnitChoice,
              on_progress: Callable[[BuildProgress], None] | None = None) -> list[Unit]:
        check_units(choice)
        units: list[Unit] = []

        def report() -> None:  # writes complete asynchronously: the figure trails the units
            if on_progress is not None:
                written = self.store.moved_bytes(Tier.HOST, Tier.NVME) if self.store else 0
                on_progress(BuildProgress(units_done=len(units), num_units=len(choice.units),
                                          nvme_written_bytes=written))

        ahead = _ValuesAhead(self._initial_values)
        try:
            for i, chosen in enumerate(choice.units):
                values_of = ahead.take(chosen)
                if i + 1 < len(choice.units):
                    ahead.start(choice.units[i + 1])
                units.append(self._build_unit(chosen, values_of))
                report()
        finally:
            ahead.close()
        self._drop_setup_copies(units)
        if self._master_sink is not None:
            self._master_sink.drop_setup_copies()
        report()  # once more: dropping the set-up copies waited for their writes
        return units

    def _drop_setup_copies(self, units: list[Unit]) -> None:
        """Evict the HOST copies that registering NVMe-homed parameter shards left behind (once
        written), before an offloaded optimizer's long-lived HOST extents (gradient accumulators,
        masters and moments) are carved.

        [Note: set-up copies strew the home extents] Those copies are a cache in the arena; the
        long-lived extents registered after them go into the holes evicting some of them opens
        ([Note: long-lived extents from the top] in infinity/tiers/_arena.py holds only while
        nothing transient sits above them), and once the rest is evicted the free room is split
        between them. With frozen parameters the sizes differ most: a LoRA unit's frozen shard is
        ~20x its adapters', whose optimizer state and gradient are homed on HOST. Measured on a
        4-layer Llama with LoRA r 8, bf16, norms persistent, optimizer on 'cpu', at the least host
        budget: the first frozen shard read failed with "fragmented: 160 KiB free but the largest
        hole is 40 KiB" (tests/engine/test_peft.py). The price: the first forward reads from NVMe
        what the cache would have held, once."""
        s = self.settings
        if self.store is None or s.param_home is not Tier.NVME or not s.optimizer_offloaded:
            return
        for u in units:
            for g in u.groups:
                if g.store_key is not None:
                    self.store.evict(g.store_key, Tier.HOST)  # waits for its write when needed

    def _build_unit(self, chosen: ChosenUnit, values_of: InitialValues | None) -> Unit:
        s = self.settings
        always = s.stage < 3 or chosen.persistent
        by_kind: dict[tuple[torch.dtype, bool, bool], list[tuple[str, nn.Parameter]]] = {}
        for name, p in chosen.params:  # [Note: gradient norm across tensor ranks]
            kind = (s.compute_dtype, p.requires_grad, is_tensor_sharded(p))
            by_kind.setdefault(kind, []).append((name, p))
        groups = [self._build_group(chosen, dtype, rg, params, always, values_of,
                                    tensor_sharded=ts)
                  for (dtype, rg, ts), params in by_kind.items()]
        unit = Unit(index=chosen.index, name=chosen.name, groups=groups,
                    use=UnitUse.PINNED if always else UnitUse.IDLE,
                    num_trainable=sum(len(g.slots) for g in groups if g.requires_grad),
                    has_frozen=any(not g.requires_grad for g in groups))
        if not always:  # [Note: release keeps parameter identity]
            for g in unit.groups:
                g.full.untyped_storage().resize_(0)
            unit.transition(UnitState.RELEASED)
        return unit

    def _build_group(self, chosen: ChosenUnit, dtype: torch.dtype, requires_grad: bool,
                     params: list[tuple[str, nn.Parameter]], always: bool,
                     values_of: InitialValues | None, *, tensor_sharded: bool = False
                     ) -> FlatGroup:
        s = self.settings
        world, rank = self.coll.world_size, self.coll.rank
        slots, numel, padded = layout_group(params, world, dtype)
        shard_numel = padded // world
        key = (f"u{chosen.index}.{torch_name(dtype)}."
               f"{'train' if requires_grad else 'frozen'}{'.tp' if tensor_sharded else ''}")
        init = torch.zeros(padded, dtype=torch.float32, device=s.device)
        with torch.no_grad():
            for slot in slots:
                values = values_of(slot.param) if values_of is not None else None
                init[slot.offset:slot.offset + slot.numel].copy_(
                    (local_tensor(slot.param).detach() if values is None
                     else values).reshape(-1))
        self.coll.broadcast(init, src=0, context=f"initial broadcast of {key}")
        full = init if dtype == torch.float32 else init.to(dtype)
        for slot in slots:  # [Note: release keeps parameter identity]
            set_local_view(slot.param, full[slot.offset:slot.offset + slot.numel].view(slot.shape))
        lo, hi = rank * shard_numel, (rank + 1) * shard_numel
        stored = s.param_home is not Tier.DEVICE and not always
        # [Note: set-up writes in place] in infinity/optim/_offloaded.py: a shard the store
        # takes is copied into it at register, so it needs no copy of its own first, unless an
        # fp32 master is that same tensor and outlives ``full``'s release.
        own_copy = not always and not (stored and dtype != torch.float32)
        shard = full[lo:hi].clone() if own_copy else full[lo:hi]
        part = full if s.stage == 0 else shard  # the optimizer's partition of the parameters
        master = None
        if requires_grad:
            whole = init if s.stage == 0 else init[lo:hi]
            sole = whole.numel() == init.numel()  # ``init`` is not used past here: no copy
            if dtype == torch.float32:
                master = part
            elif s.optimizer_offloaded:  # the optimizer copies it into its tier at once
                master = whole.to("cpu", copy=not sole)
            else:
                master = whole if sole else whole.clone()
        group = FlatGroup(key=key, slots=slots, numel=numel, padded_numel=padded,
                          shard_numel=shard_numel, requires_grad=requires_grad, full=full,
                          shard=shard, master=master, tensor_sharded=tensor_sharded)
        if s.param_home is not Tier.DEVICE and not always:
            group.store_key = f"param/{key}"
            initial = shard.cpu()
            # Dropped once written ([Note: set-up copies are dropped once written] in
            # infinity/tiers/store.py): set-up then touches only the arena's bottom.
            self.store.register(group.store_key, shard_numel, dtype, s.param_home,
                                initial=initial, keep_host_copy=False)
            group.shard = None
            if master is part:  # fp32: the master starts as a copy, the shard lives in the store
                group.master = initial if s.optimizer_offloaded else shard
        if requires_grad and self._master_sink is not None:
            self._master_sink.take(group, self._partition_of(group))
            group.master = None
        return group


class _ValuesAhead:
    """[Note: the next unit's values are drawn ahead]: ``start(unit)`` replays the values of
    ``unit``'s parameters on a worker thread; ``take(unit)`` gives the ``InitialValues`` to build
    it with (those values once ready; computed on the spot for any not started); ``close()``."""

    def __init__(self, values_of: InitialValues | None):
        self._values_of = values_of
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="infinity-init")
                      if values_of is not None else None)
        self._pending: dict[int, Future] = {}

    def start(self, chosen: ChosenUnit) -> None:
        if self._pool is not None:
            self._pending[chosen.index] = self._pool.submit(self._replay, chosen)

    def _replay(self, chosen: ChosenUnit) -> dict[int, torch.Tensor | None]:
        with torch.no_grad():
            return {id(p): self._values_of(p) for _, p in chosen.params}

    def take(self, chosen: ChosenUnit) -> InitialValues | None:
        if self._values_of is None:
            return None
        future = self._pending.pop(chosen.index, None)
        ready = future.result() if future is not None else {}  # re-raises the replay's error
        fallback = self._values_of

        def values_of(param: torch.Tensor) -> torch.Tensor | None:
            key = id(param)
            return ready.pop(key) if key in ready else fallback(param)

        return values_of

    def close(self) -> None:
        if self._pool is not None:
            for future in self._pending.values():
                future.cancel()
            self._pool.shutdown(wait=True)
            self._pending.clear()
