"""How a parameter manager's parts are built from its settings: the set-up helpers
:class:`~infinity.zero._param_manager.ParameterManager` calls once (as
:mod:`._engine_setup` does for the engine), each deciding once whether its part exists; and
:class:`ManagerCalls`, what the manager calls back in the engine.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from infinity.ledger import REDUCE_INFLIGHT_UNITS
from infinity.prefetch import Level
from infinity.tiers import Tier, TieredStore
from infinity.zero._collectives import Collectives
from infinity.zero._collectives import Phase
from infinity.zero._flat_group import FlatGroup, Unit, UnitState
from infinity.zero._gather_lead import GatherLead
from infinity.zero._gather_ahead import GatherAhead
from infinity.zero._grad_reducer import GradientReducer, ReducerConfig
from infinity.zero._hpz import SecondaryPartition
from infinity.zero._manager_config import DEFAULT_LIVE_UNITS, ManagerConfig
from infinity.zero._prefetcher import ParamPrefetcher, PrefetchUnit, prefetch_config
from infinity.zero._step_gathers import StepGathers
from infinity.zero._unit_builder import (BuildProgress, BuildSettings, InitialValues, MasterSink,
                                         UnitBuilder)
from infinity.zero._unit_choice import UnitChoice
from infinity.zero._unit_storage import UnitStorage

logger = logging.getLogger(__name__)

__all__ = ["ManagerCalls", "build_fetcher", "build_gather_ahead", "build_lead", "build_reducer",
           "build_step_gathers", "build_storage", "build_units"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ManagerCalls:
    """What the manager calls back in the engine that owns it (each None: nothing to call)."""

    on_grad_ready: Callable[[str], None] | None = None
    """Called once a trainable group's gradient of a backward is reduced and accumulated
    ([Note: optimizer read-ahead] in infinity/optim/_offloaded.py)."""
    master_sink: MasterSink | None = None
    """Takes each trainable group's master as the group is built, with
    :meth:`ParameterManager.param_partition` known ([Note: masters stream into the optimizer]
    in infinity/zero/_engine_setup.py)."""
    on_build_progress: Callable[[BuildProgress], None] | None = None
    """Called after each unit is built."""
    on_backward_begin: Callable[[], None] | None = None
    """Called when a backward the engine did not start (``loss.backward()``) begins, at its
    first hook ([Note: the end of backward] in infinity/zero/_param_manager.py)."""
    on_backward_end: Callable[[], None] | None = None
    """Called when that backward has ended, from the callback queued on autograd's engine."""


def build_units(config: ManagerConfig, choice: UnitChoice, *, collectives: Collectives,
                store: TieredStore | None, initial_values: InitialValues | None,
                master_sink: MasterSink | None, partition_of: Callable[[FlatGroup], Any],
                on_build_progress: Callable[[BuildProgress], None] | None) -> list[Unit]:
    """The units of ``choice``, built and sharded (:class:`UnitBuilder`); ``partition_of``:
    what the optimizer writes for a group (``ParameterManager.param_partition``)."""
    settings = BuildSettings(stage=config.stage, device=config.device,
                             compute_dtype=config.compute_dtype, param_home=config.param_home,
                             optimizer_offloaded=config.optimizer_offloaded)
    return UnitBuilder(settings, collectives=collectives, store=store,
                       initial_values=initial_values, master_sink=master_sink,
                       partition_of=partition_of).build(choice, on_build_progress)


def build_reducer(config: ManagerConfig, collectives: Collectives, store: TieredStore | None,
                  on_grad_ready: Callable[[str], None] | None) -> GradientReducer:
    """The units' gradient reducer ([Note: gradient ledger] in infinity/zero/_grad_reducer.py):
    its host accumulators in the store where the optimizer is offloaded."""
    return GradientReducer(
        ReducerConfig(stage=config.stage, device=config.device,
                      reduce_dtype=config.reduce_dtype, host_dtype=config.grad_host_dtype,
                      staging_dtype=config.grad_staging_dtype,
                      stored_slice_numel=config.stored_grad_slice_numel,
                      grad_quant=config.quant.gradients),
        collectives=collectives, host_store=store if config.optimizer_offloaded else None,
        on_ready=on_grad_ready)


def build_storage(config: ManagerConfig, collectives: Collectives, store: TieredStore | None,
                  reducer: GradientReducer, hpz: SecondaryPartition | None,
                  on_bytes_changed: Callable[[], None]) -> UnitStorage:
    """Gathers, releases and reductions of the units (:mod:`._unit_storage`); gathers of stored
    groups borrow the pinned copy they read (HOST, or a CPU engine's DEVICE copy when that tier
    holds every shard) instead of copying it ([Note: a gathered unit borrows its HOST copy] in
    infinity/zero/_unit_storage.py)."""
    return UnitStorage(
        config, collectives=collectives, store=store, reducer=reducer, hpz=hpz,
        read_tier=config.reads.tier, borrow_copies=config.reads.borrow,
        # none in flight at one rank: nothing crosses ranks, the accumulation is due at once
        reduce_inflight=REDUCE_INFLIGHT_UNITS if collectives.data_parallel_size > 1 else 0,
        on_bytes_changed=on_bytes_changed)


def build_fetcher(config: ManagerConfig, units: list[Unit], store: TieredStore | None, *,
                  world_size: int, gather: Callable[[int], None]) -> ParamPrefetcher | None:
    """Parameter offload: the trace-driven prefetcher over the store's parameter shards
    (:mod:`._prefetcher`). It records each step's units, then reads the next units' shards
    from NVMe and copies them to the device ahead of use, within in-flight bounds shared with
    demand fetches; the store evicts by the trace's next use. ``gather(index)`` issues the
    unit's gather. None: demand fetches only (nothing offloaded, or prefetch off)."""
    if config.param_home is Tier.DEVICE or not config.prefetch:
        return None
    item = config.compute_dtype.itemsize
    home = Level[config.param_home.name]
    prefetched = [PrefetchUnit(unit=u.index, keys=tuple(g.store_key for g in u.groups),
                               shard_bytes=sum(g.shard_numel for g in u.groups) * item,
                               gathered_bytes=sum(g.padded_numel for g in u.groups) * item,
                               home=home)
                  for u in units
                  if not u.always_gathered and all(g.store_key is not None for g in u.groups)]
    if not prefetched:
        return None
    largest_gathered = max(u.gathered_bytes for u in prefetched)
    prefetch = prefetch_config(
        host_budget_bytes=store.budget_bytes(Tier.HOST),
        device_budget_bytes=store.budget_bytes(Tier.DEVICE),
        largest_shard_bytes=max(u.shard_bytes for u in prefetched),
        largest_gathered_bytes=largest_gathered,
        world_size=world_size, lookahead_bytes=config.prefetch_lookahead_bytes,
        max_reuse_distance_bytes=config.max_reuse_distance_bytes)
    live = config.max_live_bytes
    if live is None and config.reads.tier is Tier.HOST:  # the DEVICE level no longer bounds it
        live = DEFAULT_LIVE_UNITS * largest_gathered
    return ParamPrefetcher(store, prefetched, config=prefetch, device_tier=config.reads.tier,
                           gather=gather,
                           is_gathered=lambda i: units[i].state is not UnitState.RELEASED,
                           gathered_budget_bytes=live)


def build_gather_ahead(config: ManagerConfig, units: list[Unit], *, world_size: int,
                       fetcher: ParamPrefetcher | None) -> GatherAhead | None:
    """[Note: gathers issued ahead] in infinity/zero/_gather_ahead.py for units on the device;
    None: the prefetcher leads the gathers (offloaded shards), or they are local copies (one
    rank), or nothing is gathered per use (stages 0-2)."""
    if fetcher is not None or config.stage != 3 or world_size <= 1:
        return None
    return GatherAhead({u.index: sum(g.padded_numel * g.full.element_size() for g in u.groups)
                        for u in units if not u.always_gathered})


def build_step_gathers(config: ManagerConfig, units: list[Unit], choice: UnitChoice,
                       collectives: Collectives, *, issue: Callable[[Unit], None],
                       wait: Callable[[Unit], None], settle: Callable[[], None]
                       ) -> StepGathers | None:
    """[Note: the after-step gather overlaps the next forward] in
    infinity/zero/_step_gathers.py, where asked for (stages 1-2, several data-parallel ranks);
    None: ``after_step`` waits for the gathers."""
    if not (config.overlap_param_gather and config.stage in (1, 2)
            and collectives.data_parallel_size > 1):
        return None
    return StepGathers(units, {i for _, _, indices in choice.hooked for i in indices},
                       issue=issue, wait=wait, settle=settle)


def build_lead(config: ManagerConfig, units: list[Unit], store: TieredStore | None, *,
               world_size: int, issue_gather: Callable[[Unit, Phase], None],
               gather_phase: Callable[[], Phase]) -> GatherLead:
    """Who gathers ahead of use: the prefetcher (offloaded shards), the gather-ahead order
    (shards on the device, several ranks), or neither. ``gather_phase()``: the phase of a
    gather the prefetcher issues now."""
    fetcher = build_fetcher(config, units, store, world_size=world_size,
                            gather=lambda i: issue_gather(units[i], gather_phase()))
    ahead = build_gather_ahead(config, units, world_size=world_size, fetcher=fetcher)
    return GatherLead(units, fetcher=fetcher, gather_ahead=ahead, issue_gather=issue_gather)
