"""The parameter manager: the units of one model, their hooks, gather and release, and when their
gradients are reduced.

This is the only module that touches module hooks and autograd. Stages 0-3 come from one
mechanism (per-unit flat buffers sharded across ranks):

========  ==========================  ======================  ===============================
stage     parameters (full buffer)    gradients (fp32 acc)    fp32 master + Adam moments
========  ==========================  ======================  ===============================
0         always gathered             all-reduced, full       full, every rank steps all
1         always gathered             all-reduced, full       this rank's shard, then all-gather
2         always gathered             reduce-scattered shard  this rank's shard, then all-gather
3         gathered per unit on use    reduce-scattered shard  this rank's shard; next use gathers
========  ==========================  ======================  ===============================

Collaborators, each owned here: :class:`~infinity.zero._unit_builder.UnitBuilder` makes the units,
:class:`~infinity.zero._unit_storage.UnitStorage` gathers, releases and reduces them,
:class:`~infinity.zero._param_partitions.ParamPartitions` opens this rank's parameter shards,
:class:`~infinity.zero._unit_hooks.UnitHooks` puts the hooks on the model,
:class:`~infinity.zero._grad_handoff.GradHandoff` hands each backward's gradients to the
:class:`~infinity.zero._grad_reducer.GradientReducer` ([Note: gradient ledger]),
:class:`~infinity.zero._prefetcher.ParamPrefetcher` brings offloaded shards up ahead of use,
:class:`~infinity.zero._outside_use.OutsideUseDetector` watches the first forward
([Note: parameters used outside their module]), :class:`~infinity.zero._held_bytes.HeldBytes`
counts the device bytes; :mod:`._manager_setup` builds them. Its settings are a
:class:`~infinity.zero._manager_config.ManagerConfig`; where it is in the training loop, a
:class:`~infinity.zero._training_state.TrainingState` changed only through its table. The
manager decides when a unit is gathered, released or reduced; the unit's storage, how.

[Note: release keeps parameter identity]
Each parameter is, once and for all at set-up, made a view of its unit's full flat buffer
(``param.data = full[offset:offset + numel].view(shape)``; ``set_data`` keeps the parameter's own
version counter). Releasing a unit resizes the buffer's *storage* to 0 bytes; gathering resizes it
back and fills it. The parameter object, its shape, dtype and ``requires_grad`` never change, so
optimizers, activation checkpointing, ``param.shape`` and tied weights keep working (DeepSpeed's
``param.data = empty(0)`` breaks all of these). Tensors autograd saved in forward are views of the
same storage, so they see the re-gathered bytes in backward. Writing into the flat buffer never
bumps a parameter's version counter (views made through ``.data`` have their own), so the
"modified by an inplace operation" check does not fire. A released parameter cannot be read: torch
raises "out of bounds for storage of size 0".

[Note: backward gather and release]
Pre-backward: the post-forward hook registers a tensor hook on each output that requires grad; it
fires when that output's gradient is ready, i.e. before autograd runs the module's own backward
nodes, and gathers the module's units (held for the backward). Release after backward: when all of
a unit's trainable gradients arrived (every node that saved a trainable parameter has run), and,
for units with frozen parameters (LoRA), also when a hook on the module's inputs fired (every node
between inputs and outputs has run). Whatever is still held at the end of backward is released
then. Forward gathers are reference counted, so recomputation under non-reentrant activation
checkpointing (forward hooks firing again inside backward) never frees a held unit, and a module
called twice gathers again on its second call.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from typing import Any, Callable, Iterator

import torch
from torch import nn

from infinity._common import warn_once
from infinity.optim import StoredGrad
from infinity.tiers import TieredStore
from infinity.zero._collectives import Collectives, Phase
from infinity.zero._flat_group import FlatGroup, ParamSlot, Unit, UnitState
from infinity.zero._full_state import full_flat, full_state_dict
from infinity.zero._grad_handoff import BackwardCalls, GradHandoff
from infinity.zero._grad_presence import GradPresence
from infinity.zero._held_bytes import HeldBytes
from infinity.zero._hpz import SecondaryPartition
from infinity.zero._managed import check_not_wrapped, mark_managed
from infinity.zero._manager_config import ManagerConfig
from infinity.zero._manager_setup import (ManagerCalls, build_lead, build_reducer,
                                          build_step_gathers, build_storage, build_units)
from infinity.zero._outside_use import OutsideUseDetector
from infinity.zero._param_partitions import ParamPartitions
from infinity.zero._prefetcher import ParamPrefetcher
from infinity.zero._training_state import TRAINING_TRANSITIONS, ParamWriteback, TrainingState
from infinity.zero._unit_builder import InitialValues
from infinity.zero._unit_choice import UnitChoice
from infinity.zero._unit_hooks import HookCalls, UnitHooks

logger = logging.getLogger(__name__)

__all__ = ["ManagerCalls", "ParameterManager"]


class _ScheduleStep(enum.Enum):
    """[Note: one prefetch step per schedule step]
    A pipeline schedule (``torch.distributed.pipelining``) runs the forwards and backwards of m
    micro-batches in its own order before one optimizer step: 1F1B's first stage runs F0 F1 B0
    F2 B1 ... . Outside a schedule every forward starts a prefetch step and every backward ends
    one, which would cut that order into pieces that are not repeated from step to step. Between
    ``begin_schedule_step`` and ``end_schedule_step`` the whole schedule is one step of the
    prefetcher and of the gather-ahead order: the first forward begins it, the backwards do not
    end it, and every unit use in between is recorded in the schedule's order, which is the same
    at every step; the parameters do not change inside it, so keeping a unit gathered across
    micro-batches is safe."""

    CLOSED = "closed"
    OPEN = "open"
    """Begun; its first forward has not run yet."""
    RUNNING = "running"


class ParameterManager:
    """Owns the units of one model: builds them, installs the hooks, decides when each is
    gathered and released, and when their gradients go to the :class:`GradientReducer`."""

    def __init__(self, module: nn.Module, choice: UnitChoice, config: ManagerConfig, *,
                 collectives: Collectives, store: TieredStore | None = None,
                 initial_values: InitialValues | None = None,
                 calls: ManagerCalls = ManagerCalls()):
        """``choice``: the units to build (:func:`~infinity.zero._unit_choice.choose_units`).
        ``store``: the tiered store when anything is offloaded (parameter shards homed on
        ``config.param_home``, the host gradient accumulators of an offloaded optimizer).
        ``initial_values``: see :data:`~infinity.zero._unit_builder.InitialValues`.
        ``calls``: what the manager calls back in the engine (:class:`ManagerCalls`)."""
        check_not_wrapped(module)
        self.config = config
        self.module = module
        self.stage = config.stage
        self.coll = collectives
        self.world_size = collectives.world_size
        self.rank = collectives.rank
        self.device = config.device
        self.compute_dtype = config.compute_dtype
        self.optimizer_offloaded = config.optimizer_offloaded
        self.store = store
        self.param_names = choice.param_names
        self._calls = calls
        self._init_loop_state()
        self._init_storage(calls.on_grad_ready)
        self.units = build_units(config, choice, collectives=collectives, store=store,
                                 initial_values=initial_values, master_sink=calls.master_sink,
                                 partition_of=self.param_partition,
                                 on_build_progress=calls.on_build_progress)
        self._slot_of: dict[int, tuple[Unit, FlatGroup, ParamSlot]] = {
            id(s.param): (u, g, s) for u in self.units for g in u.groups for s in g.slots}
        """id(parameter) -> (its unit, its flat group, its slot)."""
        self._unit_of_storage: dict[int, Unit] = {
            g.full.untyped_storage()._cdata: u for u in self.units for g in u.groups}
        """A unit's flat buffers' storages -> the unit (the outside-use detector's lookup)."""
        self._bytes = HeldBytes(self.units, self.storage, hpz=self.hpz,
                                optimizer_offloaded=config.optimizer_offloaded)
        """The device bytes held, and their peak (``device_bytes()``, ``peak_device_bytes``)."""
        if config.optimizer_offloaded:
            self.reducer.register_accumulators(self.trainable_groups())
        self._init_hooks(choice)
        mark_managed(module, [s.param for u in self.units for g in u.groups for s in g.slots])
        self._note_peak()
        logger.info("stage %d: %d units over %d ranks: %s", self.stage, len(self.units),
                    self.world_size, ", ".join(f"{u.name}({sum(g.numel for g in u.groups)})"
                                               for u in self.units))

    # ------------------------------------------------------------------ set-up

    def _init_loop_state(self) -> None:
        self.state = TrainingState.IDLE
        """Where the manager is in the training loop (changed only through TRAINING_TRANSITIONS)."""
        self.micro_step = 0
        """Backward passes finished; names the step in agreement checks and errors."""
        self._traced_modes: set[bool] = set()
        """Grad modes (True/False) whose first forward ran with the outside-use detector."""
        self._schedule = _ScheduleStep.CLOSED
        """A pipeline schedule's step: [Note: one prefetch step per schedule step]."""
        self._forward_order: dict[int, None] = {}
        """Unit indices in the order the latest training forward first used them (the order in
        which a deferred optimizer step updates them, see forward_keys)."""

    def _init_storage(self, on_grad_ready: Callable[[str], None] | None) -> None:
        """The parts that hold and move the units' bytes, before the units are built."""
        config, collectives, store = self.config, self.coll, self.store
        self.hpz = (SecondaryPartition(collectives, config.hpz_partition_size)
                    if config.hpz_partition_size > 1 else None)
        """hpZ's secondary shards and group ([Note: hpZ secondary shards] in
        infinity/zero/_hpz.py); None: off."""
        self.reducer = build_reducer(config, collectives, store, on_grad_ready)
        self.storage = build_storage(config, collectives, store, self.reducer, self.hpz,
                                     on_bytes_changed=self._note_peak)
        """Gathers, releases and reductions of the units: how (this manager decides when)."""
        self.partitions = ParamPartitions(config, rank=self.rank, store=store,
                                          storage=self.storage)
        """This rank's parameter partitions, and where stored shards are read and written."""

    def _init_hooks(self, choice: UnitChoice) -> None:
        """The parts the hooks drive, and the hooks on the model."""
        self.grads = GradHandoff(self.module, self.units, self._slot_of, self.config,
                                 collectives=self.coll, reducer=self.reducer,
                                 storage=self.storage, calls=self._backward_calls())
        """A backward's gradients, from the hooks to the reducer (:mod:`._grad_handoff`)."""
        self._step_gathers = build_step_gathers(
            self.config, self.units, choice, self.coll,
            issue=lambda unit: self._issue_gather(unit, Phase.STEP_GATHER, refresh=True),
            wait=self._wait_gather, settle=self.settle_params)
        """[Note: the after-step gather overlaps the next forward] in
        infinity/zero/_step_gathers.py; None: ``after_step`` waits for the gathers."""
        self._hooks = UnitHooks(self.module, self.units, self._slot_of, stage=self.stage,
                                calls=self._hook_calls())
        """The hooks on the model, removed by remove_hooks()."""
        self.grads.install()
        self._hooks.install(choice.hooked, self._step_gathers)
        self._lead = build_lead(
            self.config, self.units, self.store, world_size=self.world_size,
            issue_gather=lambda unit, phase: self._issue_gather(unit, phase),
            gather_phase=self._gather_phase)
        """Which units are gathered ahead of use and kept after it (:mod:`._gather_lead`)."""

    def _backward_calls(self) -> BackwardCalls:
        return BackwardCalls(enter_backward=self._enter_backward,
                             unit_done=self._maybe_drop_hold,
                             micro_step=lambda: self.micro_step,
                             in_backward=lambda: self.state is TrainingState.BACKWARD)

    def _hook_calls(self) -> HookCalls:
        return HookCalls(forward_begins=self._pre_forward, forward_ends=self._post_forward,
                         backward_begins=self._pre_backward, inputs_done=self._post_backward,
                         enter_backward=self._enter_backward, on_grad=self.grads.on_grad)

    def _to(self, new: TrainingState) -> None:
        TRAINING_TRANSITIONS.check(f"micro-step {self.micro_step}", self.state, new)
        self.state = new

    # ------------------------------------------------------------------ shards and partitions

    def trainable_groups(self) -> Iterator[FlatGroup]:
        for u in self.units:
            for g in u.groups:
                if g.requires_grad:
                    yield g

    def tensor_sharded_keys(self) -> set[str]:
        """Keys of the trainable groups sharded over the tensor mesh ([Note: gradient norm
        across tensor ranks] in infinity/zero/_tensor_parallel.py)."""
        return {g.key for g in self.trainable_groups() if g.tensor_sharded}

    def partition_of(self, group: FlatGroup) -> tuple[int, int]:
        """(first flat element, numel) of this rank's partition
        (:meth:`ParamPartitions.partition_of`)."""
        return self.partitions.partition_of(group)

    def param_partition(self, group: FlatGroup) -> Any:
        """What the optimizer writes for ``group`` (:meth:`ParamPartitions.param_partition`)."""
        return self.partitions.param_partition(group)

    def open_param_partition(self, group: FlatGroup, *, overwrite: bool = False
                             ) -> contextlib.AbstractContextManager[torch.Tensor]:
        """This rank's parameter partition of ``group`` for writing
        (:meth:`ParamPartitions.open`)."""
        return self.partitions.open(group, overwrite=overwrite)

    @property
    def updates_cross_to_device(self) -> bool:
        """See :attr:`ParamPartitions.updates_cross_to_device`."""
        return self.partitions.updates_cross_to_device

    def read_shard(self, group: FlatGroup) -> torch.Tensor:
        """A copy-free view (device) or a fresh copy (store) of this rank's parameter shard."""
        return self.partitions.read_shard(group)

    @property
    def param_writeback(self) -> ParamWriteback:
        """When an updated stored shard goes home (:meth:`set_param_writeback`)."""
        return self.partitions.param_writeback

    def set_param_writeback(self, mode: ParamWriteback) -> None:
        """When updated stored shards go home from now on (the engine decides at each step)."""
        self.partitions.param_writeback = mode

    # ------------------------------------------------------------------ hooks

    @contextlib.contextmanager
    def gathered(self, params: Any) -> Iterator[list[nn.Parameter]]:
        """The units holding ``params`` gathered, and kept so (none released) until the block
        ends: each parameter is its full tensor inside (DeepSpeed's ``GatheredParameters``).
        Yields the managed ones among ``params``. A collective: every rank, the same params."""
        self.settle_params()
        managed = [p for p in params if isinstance(p, torch.Tensor) and id(p) in self._slot_of]
        units = list({id(u): u for u in (self._slot_of[id(p)][0] for p in managed)}.values())
        for u in units:
            u.enter_forward()
            if u.state is UnitState.RELEASED:
                self._gather(u, Phase.STATE_DICT)
        try:
            yield managed
        finally:
            for u in units:
                u.leave_forward()
                self._maybe_release(u)

    def settle_params(self) -> None:
        """Every gather in flight lands (after-step gathers overlapped with the next forward:
        [Note: the after-step gather overlaps the next forward])."""
        for unit in self.units:
            self._wait_gather(unit)

    def remove_hooks(self) -> None:
        self.grads.remove()
        self._hooks.remove()

    def _pre_forward(self, units: list[Unit]) -> None:
        for u in units:
            if torch.is_grad_enabled():
                self._forward_order.setdefault(u.index)
            u.enter_forward()
            self._fetch_before_compute(u)

    def _post_forward(self, units: list[Unit]) -> None:
        for u in units:
            u.leave_forward()
            self._maybe_release(u)
            self._after_compute(u)

    def _pre_backward(self, units: list[Unit]) -> None:
        self._enter_backward()
        for u in units:
            if u.hold_for_backward():
                self._fetch_before_compute(u)

    def _post_backward(self, units: list[Unit]) -> None:
        self._enter_backward()
        for u in units:
            u.inputs_done = True
            self._maybe_drop_hold(u)

    def _enter_backward(self) -> None:
        """[Note: the end of backward]
        A backward started by ``loss.backward()`` (a trainer or accelerate calling it, not
        ``engine.backward``) announces itself through the manager's hooks: the first one to fire
        in it (on the model's outputs, which get their gradient first; else a pre-backward, a
        gradient, a module's inputs) moves the manager to BACKWARD and queues
        :meth:`_end_of_backward` on autograd's engine, which runs it once the whole graph has
        run, as FSDP2's root post-backward does. The callback belongs to the graph task that
        queued it: a hook inside a reentrant checkpoint's nested backward would end the backward
        with that nested one, which is why the outputs' hook comes first. ``engine.backward`` enters BACKWARD itself
        (``begin_backward``) and ends it itself, with loss scaling and the accumulation divisor
        applied; a plain ``loss.backward()`` gets neither (the caller scales the loss)."""
        if self.state in (TrainingState.BACKWARD, TrainingState.FORWARD):
            return  # started already; or a backward inside a forward (not a training backward)
        self._to(TrainingState.BACKWARD)
        if self._calls.on_backward_begin is not None:
            self._calls.on_backward_begin()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        try:
            self.finish_backward()
        except BaseException:
            self.abort_backward()
            raise
        if self._calls.on_backward_end is not None:
            self._calls.on_backward_end()

    # ------------------------------------------------------------------ gather / release

    def _gather_phase(self) -> Phase:
        return Phase.BACKWARD_GATHER if self.state is TrainingState.BACKWARD else \
            Phase.FORWARD_GATHER

    def _gather(self, unit: Unit, phase: Phase) -> None:
        self.storage.gather(unit, phase, self.micro_step)

    def _issue_gather(self, unit: Unit, phase: Phase, *, refresh: bool = False) -> None:
        self.storage.issue_gather(unit, phase, self.micro_step, refresh=refresh)

    def _wait_gather(self, unit: Unit) -> None:
        self.storage.wait_gather(unit)

    def _release(self, unit: Unit) -> None:
        self.storage.release(unit)
        self._lead.on_release(unit)

    def _fetch_before_compute(self, unit: Unit) -> None:
        """Gather ``unit`` before its compute: through the prefetcher for offloaded parameters
        (a prefetched unit is ready), else on demand."""
        self._lead.before_gather(unit)
        if unit.state is UnitState.RELEASED:
            self._issue_gather(unit, self._gather_phase())
        self._wait_gather(unit)
        self._lead.after_gather(unit, backward=self.state is TrainingState.BACKWARD)

    def _after_compute(self, unit: Unit) -> None:
        self._lead.after_compute(unit)

    def _maybe_release(self, unit: Unit) -> None:
        if unit.state is not UnitState.RELEASED and unit.releasable \
                and not self._lead.keeps(unit):
            self._release(unit)

    def _maybe_drop_hold(self, unit: Unit) -> None:
        """Release after backward once nothing of the unit's backward can still read it
        (:meth:`Unit.drop_hold`)."""
        if unit.drop_hold():
            self._maybe_release(unit)
            self._after_compute(unit)

    # ------------------------------------------------------------------ the training loop

    @contextlib.contextmanager
    def forward_scope(self) -> Iterator[None]:
        """Wraps one ``engine(...)`` call: the first forward per grad mode runs the outside-use
        detector; an exception (any, a keyboard interrupt too) leaves no unit acquired. An engine
        call nested inside another (a model calling the engine) is part of the outer one."""
        if self.state is TrainingState.FORWARD:
            yield
            return
        mode = torch.is_grad_enabled()
        trace = mode not in self._traced_modes and (
            (self.stage == 3 and any(not u.always_gathered for u in self.units))
            or (self._step_gathers is not None and mode))
        self._to(TrainingState.FORWARD)
        finished = False
        try:
            if self._schedule is not _ScheduleStep.RUNNING:
                if mode:
                    self._forward_order = {}
                self.end_prefetch_step()  # the last step's, if still open
                self._lead.begin_forward(mode, self.module.training)
                if self._schedule is _ScheduleStep.OPEN:
                    self._schedule = _ScheduleStep.RUNNING
            if trace:
                with OutsideUseDetector(self._check_outside_use):
                    yield
                self._traced_modes.add(mode)
            else:
                yield
            finished = True
        except BaseException:
            self._lead.stop()
            for unit in self.units:
                unit.end_step()
                self._maybe_release(unit)
            raise
        finally:
            # A forward with grad leaves a graph for a backward; one without, or one that raised,
            # leaves nothing to wait for.
            self._to(TrainingState.AWAITING_BACKWARD if finished and mode else TrainingState.IDLE)
            if not mode:
                self.end_prefetch_step()  # no backward follows: the step ends with the forward
                self._lead.warm_next_step()  # the next step's (begin_step's ``then``)

    def begin_backward(self) -> None:
        """``engine.backward(loss)`` is about to run autograd: gathers now are backward gathers."""
        self._to(TrainingState.BACKWARD)

    def finish_backward(self) -> None:
        """End of one backward: its gradients reduced, on every rank alike
        (:meth:`GradHandoff.finish`); drop backward holds; release."""
        self.grads.finish()
        if self._schedule is _ScheduleStep.CLOSED:
            self._lead.stop()  # nothing is kept past the step
        self._drop_holds()
        if self.hpz is not None:
            self.hpz.drop()  # every backward gather is done (see self.hpz)
        self.micro_step += 1
        self._to(TrainingState.IDLE)

    def abort_backward(self) -> None:
        """The backward (or its end, :meth:`finish_backward`) raised: back to IDLE, so that the
        engine can go on. Holds and staged gradients are left as they are: the next
        :meth:`finish_backward` reduces what was staged and drops the holds."""
        self.grads.abort()
        if self.state is TrainingState.BACKWARD:
            self._to(TrainingState.IDLE)

    def _drop_holds(self) -> None:
        for unit in self.units:
            unit.end_step()
            self._maybe_release(unit)

    def after_step(self) -> None:
        """The optimizer wrote new parameter partitions: refresh every always-gathered unit
        (stages 1-3; stage 0 stepped the full buffer in place) and drop the gradients."""
        self.zero_grads()
        if self.hpz is not None:
            self.hpz.drop()  # stale: the parameters change (see self.hpz)
        if self.stage == 0:
            return
        if self._lead.gathers_ahead:  # gathered for a backward that never came: stale
            for unit in self.units:
                if not unit.always_gathered and unit.releasable \
                        and unit.state is not UnitState.RELEASED:
                    self._release(unit)
        if self._step_gathers is not None:
            self._step_gathers.issue_rest()
        else:
            for unit in self.units:
                if unit.always_gathered:
                    self._gather(unit, Phase.STEP_GATHER)
        self._lead.warm_next_step()  # the shards are final: the next step's first units

    def on_stepped(self) -> Callable[[str], None] | None:
        """What the optimizer calls with each key as it updates the key's parameter partition
        (:meth:`StepGathers.on_stepped`); None: the gathers wait for the step's end (without
        ``overlap_param_gather``, and at stage 3, whose gathers come at use)."""
        return None if self._step_gathers is None else self._step_gathers.on_stepped()

    def grad_partitions(self) -> dict[str, torch.Tensor | StoredGrad]:
        """Gradient per trainable group over the optimizer's partition (a tensor, or slices in
        the store: :meth:`GradientReducer.partitions`); absent when zero."""
        return self.reducer.partitions(self.trainable_groups())

    def grad_accumulator_bytes(self) -> int:
        """Bytes of the offloaded optimizer's gradient accumulators (host or stored slices)."""
        return self.reducer.accumulator_bytes(self.trainable_groups())

    def zero_grads(self) -> None:
        self.reducer.zero(self.trainable_groups())
        self.presence.clear()

    @property
    def presence(self) -> GradPresence:
        """Which parameters got a gradient in this window (:attr:`GradHandoff.presence`)."""
        return self.grads.presence

    def params_with_grad(self) -> set[int] | None:
        """id() of the trainable parameters with a gradient in this accumulation window on any
        rank, None when every one has ([Note: parameters without a gradient] in
        infinity/zero/_grad_presence.py); a collective when some unit was partial."""
        return self.presence.params_with_grad()

    def forward_keys(self) -> list[str]:
        """Trainable group keys in the order the latest training forward first used their units,
        then the others in unit order: the order the next forward reads the parameter shards."""
        by_index = {u.index: u for u in self.units}
        order = [i for i in self._forward_order if i in by_index]
        order += [u.index for u in self.units if u.index not in self._forward_order]
        return [g.key for i in order for g in by_index[i].groups if g.requires_grad]

    def end_prefetch_step(self) -> None:
        """End of a step (after finish_backward, after a no-grad forward, before a new forward):
        commit the prefetcher's trace and release every unit still gathered on demand
        ([Note: stale gathered units] in infinity/zero/_prefetcher.py). Inside a pipeline
        schedule's step, nothing: the schedule's end ends it."""
        if self._schedule is not _ScheduleStep.CLOSED or not self._lead.end_step():
            return
        for unit in self.units:
            self._maybe_release(unit)  # between steps should_keep() is False

    def begin_schedule_step(self) -> None:
        """A pipeline schedule's step starts: [Note: one prefetch step per schedule step]."""
        if self._schedule is not _ScheduleStep.CLOSED:
            raise RuntimeError("begin_schedule_step: a schedule step is already open")
        self._schedule = _ScheduleStep.OPEN

    def end_schedule_step(self) -> None:
        """The schedule's step ran every micro-batch (or raised): its prefetch step ends."""
        self._schedule = _ScheduleStep.CLOSED
        self._lead.stop()
        self.end_prefetch_step()

    @property
    def prefetcher(self) -> ParamPrefetcher | None:
        """The trace-driven prefetcher of offloaded parameter shards; None: demand fetches only."""
        return self._lead.fetcher

    def prefetch_stats(self) -> dict[str, Any]:
        """Counters of the trace-driven prefetcher (keys in ParamPrefetcher.stats)."""
        return self._lead.stats()

    # ------------------------------------------------------------------ outside uses

    def _check_outside_use(self, tensor: torch.Tensor, func_name: str) -> None:
        if self.storage.busy:
            return
        try:
            unit = self._unit_of_storage.get(tensor.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested)
            return
        if unit is None:
            return
        if self._step_gathers is not None:
            self._step_gathers.read_outside(unit, func_name)
            return
        if unit.state is not UnitState.RELEASED:
            return
        self.promote_always_gathered(unit, f"{func_name} used a parameter of unit {unit.index} "
                                           f"{unit.name!r} outside the modules that hold it")

    def promote_always_gathered(self, unit: Unit, why: str) -> None:
        """Keep ``unit`` gathered from now on (its shard stays the optimizer's partition)."""
        warn_once(f"outside-use:{unit.name}",
                  f"{why}; that unit stays gathered from now on (costs its full size in device "
                  f"memory). Make the module that uses it hold it, or tie it, to avoid this")
        unit.pin()
        self.storage.own_buffers(unit)  # it would pin a borrowed copy for good
        self._gather(unit, Phase.FORWARD_GATHER)

    # ------------------------------------------------------------------ state dict and bytes

    def full_flat(self, group: FlatGroup, master: torch.Tensor | None = None) -> torch.Tensor:
        """The group's values over all ranks: ``master`` (this rank's fp32 partition) where given,
        else the parameters (collective)."""
        src = master if master is not None else self.read_shard(group)
        return full_flat(group, src, self.coll, stage=self.stage, device=self.device)

    def full_state_dict(self, master_of: Any = None, keys: Any = None) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` keys; parameters from ``master_of(group key)`` (fp32 masters)
        where it returns a tensor, else from the parameter shards. ``keys``: only these entries
        (an adapter's: only the flat groups holding them are gathered); a ``ValueError`` names
        one that is not in the state dict. Collective; on every rank, with the same keys."""
        return full_state_dict(self.module, self.units, self.full_flat, master_of, keys)

    def device_bytes(self) -> dict[str, int]:
        """Bytes held now, by kind, counting each storage once (views share their base's)."""
        return self._bytes.now()

    @property
    def peak_device_bytes(self) -> int:
        """Largest sum of device_bytes() seen at a gather or a gradient reduction."""
        return self._bytes.peak_bytes

    @property
    def peak_device_parts(self) -> dict[str, int]:
        """device_bytes() by kind at the moment of ``peak_device_bytes`` (what the peak is
        made of)."""
        return self._bytes.peak_parts

    def _note_peak(self) -> None:
        self._bytes.note_peak()
