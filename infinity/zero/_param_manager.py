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
:class:`~infinity.zero._grad_reducer.GradientReducer` reduces and accumulates their gradients
([Note: gradient ledger]), :class:`~infinity.zero._prefetcher.ParamPrefetcher` brings offloaded
shards up ahead of use, :class:`~infinity.zero._outside_use.OutsideUseDetector` watches the first
forward ([Note: parameters used outside their module]). Its settings are a
:class:`~infinity.zero._manager_config.ManagerConfig`; where it is in the training loop, a
:class:`~infinity.zero._training_state.TrainingState` changed only through its table.

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
import logging
from typing import Any, Callable, Iterator

import torch
from torch import nn

from infinity._common import warn_once
from infinity.ledger import REDUCE_INFLIGHT_UNITS
from infinity.optim import StoredGrad
from infinity.prefetch import Level
from infinity.tiers import Tier, TieredStore
from infinity.zero._collectives import Collectives, Phase
from infinity.zero._embedding_rows import EmbeddingRows, RowsPayload
from infinity.zero._flat_group import FlatGroup, ParamSlot, Unit, UnitState
from infinity.zero._gather_ahead import GatherAhead
from infinity.zero._grad_presence import GradPresence
from infinity.zero._grad_reducer import GradientReducer, ReducerConfig
from infinity.zero._head_grad import (HeadPlan, HeadTaps, head_candidates, plan_head,
                                     weight_rows_grad)
from infinity.zero._hpz import SecondaryPartition
from infinity.zero._managed import check_not_wrapped, mark_managed
from infinity.zero._manager_config import DEFAULT_LIVE_UNITS, ManagerConfig
from infinity.zero._outside_use import OutsideUseDetector, tensors_in
from infinity.zero._prefetcher import (ParamPrefetcher, PrefetchUnit, disabled_stats,
                                       prefetch_config)
from infinity.zero._reduce_order import ReduceOrder, backward_order, spread_pieces
from infinity.zero._step_gathers import StepGathers
from infinity.zero._tensor_parallel import full_value, local_grad
from infinity.zero._training_state import TRAINING_TRANSITIONS, ParamWriteback, TrainingState
from infinity.zero._unit_builder import (BuildProgress, BuildSettings, InitialValues, MasterSink,
                                         UnitBuilder)
from infinity.zero._unit_choice import UnitChoice
from infinity.zero._unit_storage import UnitStorage

logger = logging.getLogger(__name__)


class ParameterManager:
    """Owns the units of one model: builds them, installs the hooks, gathers and releases them,
    and hands their gradients to the :class:`GradientReducer` when they are complete."""

    def __init__(self, module: nn.Module, choice: UnitChoice, config: ManagerConfig, *,
                 collectives: Collectives, store: TieredStore | None = None,
                 initial_values: InitialValues | None = None,
                 on_grad_ready: Callable[[str], None] | None = None,
                 master_sink: MasterSink | None = None,
                 on_build_progress: Callable[[BuildProgress], None] | None = None,
                 on_backward_begin: Callable[[], None] | None = None,
                 on_backward_end: Callable[[], None] | None = None):
        """``choice``: the units to build (:func:`~infinity.zero._unit_choice.choose_units`).
        ``store``: the tiered store when anything is offloaded (parameter shards homed on
        ``config.param_home``, the host gradient accumulators of an offloaded optimizer).
        ``initial_values``: see :data:`~infinity.zero._unit_builder.InitialValues`.
        ``on_grad_ready(key)``: called once a trainable group's gradient of a backward is reduced
        and accumulated ([Note: optimizer read-ahead] in infinity/optim/_offloaded.py).
        ``master_sink``: takes each trainable group's master as the group is built, with
        :meth:`param_partition` known ([Note: masters stream into the optimizer]).
        ``on_build_progress``: called after each unit is built.
        ``on_backward_begin`` / ``on_backward_end``: called when a backward that the engine did not
        start (``loss.backward()``) begins, at its first hook, and when it has ended, from the
        callback queued on autograd's engine ([Note: the end of backward])."""
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
        self.state = TrainingState.IDLE
        """Where the manager is in the training loop (changed only through TRAINING_TRANSITIONS)."""
        self.param_writeback = ParamWriteback.EAGER
        """When an updated stored shard goes home; the engine sets it at each optimizer step."""
        self.micro_step = 0
        """Backward passes finished; names the step in agreement checks and errors."""
        self.peak_device_bytes = 0
        """Largest sum of device_bytes() seen at a gather or a gradient reduction."""
        self.peak_device_parts: dict[str, int] = {}
        """device_bytes() by kind at the moment of ``peak_device_bytes`` (what the peak is made of)."""
        self._handles: list[Any] = []
        """Hook handles, removed by remove_hooks()."""
        self._traced_modes: set[bool] = set()
        """Grad modes (True/False) whose first forward ran with the outside-use detector."""
        self._forward_order: dict[int, None] = {}
        """Unit indices in the order the latest training forward first used them (the order in
        which a deferred optimizer step updates them, see forward_keys)."""
        self.param_names = choice.param_names
        self._read_tier = config.reads.tier
        """Where gathers read offloaded shards ([Note: a CPU engine reads parameter shards from
        HOST] in infinity/zero/_manager_config.py)."""
        self._write_tier = (Tier.HOST if config.optimizer_offloaded
                            and not config.device_holds_params else self._read_tier)
        """Where the optimizer, and checkpoint loads, write offloaded shards: [Note: updated
        shards are written where the optimizer runs]."""
        self.hpz = (SecondaryPartition(collectives, config.hpz_partition_size)
                    if config.hpz_partition_size > 1 else None)
        """hpZ's secondary shards and group ([Note: hpZ secondary shards] in
        infinity/zero/_hpz.py); None: off."""
        settings = BuildSettings(stage=config.stage, device=config.device,
                                 compute_dtype=config.compute_dtype, param_home=config.param_home,
                                 optimizer_offloaded=config.optimizer_offloaded)
        self.units = UnitBuilder(settings, collectives=collectives, store=store,
                                 initial_values=initial_values,
                                 master_sink=master_sink,
                                 partition_of=self.param_partition
                                 ).build(choice, on_build_progress)
        self._slot_of: dict[int, tuple[Unit, FlatGroup, ParamSlot]] = {
            id(s.param): (u, g, s) for u in self.units for g in u.groups for s in g.slots}
        self._unit_of_storage: dict[int, Unit] = {
            g.full.untyped_storage()._cdata: u for u in self.units for g in u.groups}
        self.reducer = GradientReducer(
            ReducerConfig(stage=config.stage, device=config.device,
                          reduce_dtype=config.reduce_dtype, host_dtype=config.grad_host_dtype,
                          staging_dtype=config.grad_staging_dtype,
                          stored_slice_numel=config.stored_grad_slice_numel,
                          grad_quant=config.quant.gradients),
            collectives=collectives, host_store=store if config.optimizer_offloaded else None,
            on_ready=on_grad_ready)
        if config.optimizer_offloaded:
            self.reducer.register_accumulators(self.trainable_groups())
        self.presence = GradPresence(self.units, collectives, config.device)
        """Which parameters got a gradient in this window ([Note: parameters without a
        gradient] in infinity/zero/_grad_presence.py)."""
        trainable = {id(s.param) for g in self.trainable_groups() for s in g.slots}
        self._rows = (EmbeddingRows(module, trainable, self._on_rows,
                                    unit_of=lambda p: self._slot_of[id(p)][0].index)
                      if collectives.data_parallel_size > 1 else None)
        """[Note: embedding rows cross ranks as rows] in infinity/zero/_embedding_rows.py; None
        at one rank, where nothing crosses ranks."""
        if self._rows is not None and not self._rows.modules:
            self._rows = None
        self._row_slots: dict[int, tuple[int, ParamSlot]] = {}
        """id(weight) of a tapped embedding -> (its group's number in ``_row_groups``, slot)."""
        self._row_groups: list[FlatGroup] = []
        """The groups holding a tapped weight, in one fixed order (the rows' group numbers)."""
        if self._rows is not None:
            for m in self._rows.modules:
                unit, group, slot = self._slot_of[id(m.weight)]
                if group not in self._row_groups:
                    self._row_groups.append(group)
                self._row_slots[id(m.weight)] = (self._row_groups.index(group), slot)
                if id(m.weight) in self._rows.rows_only:
                    unit.rows_only = unit.rows_only | {id(m.weight)}
        self._row_entries: list[tuple[int, ParamSlot, torch.Tensor, torch.Tensor]] = []
        """This backward's rows: (group number, slot, unique ids, rows)."""
        heads = (head_candidates(module, trainable,
                                 self._rows.tapped_modules if self._rows is not None else set())
                 if collectives.data_parallel_size > 1 and config.stage >= 2
                 and config.quant.gradients is None else [])
        self._heads: HeadTaps | None = HeadTaps(heads, self._on_head) if heads else None
        """[Note: the head's gradient reduced as it is made] in infinity/zero/_head_grad.py;
        None: no head is tapped (kept by :meth:`_order_reductions` only where its unit is
        reduced in pieces that it alone fills)."""
        self._head_plans: dict[int, HeadPlan] = {}
        """id(tapped head) -> the pieces its backward issues."""
        self._reduce_order: ReduceOrder | None = None
        """[Note: every rank reduces every unit in one order]; None at one rank."""
        self._pieces: dict[int, int] = {}
        """Units whose reductions go in pieces, and how many ([Note: a large reduction spread
        over the backward] in infinity/zero/_grad_reducer.py)."""
        if collectives.data_parallel_size > 1:
            self._order_reductions()
        self.storage = UnitStorage(
            config, collectives=collectives, store=store, reducer=self.reducer, hpz=self.hpz,
            read_tier=self._read_tier, borrow_copies=config.reads.borrow,
            # none in flight at one rank: nothing crosses ranks, the accumulation is due at once
            reduce_inflight=REDUCE_INFLIGHT_UNITS if collectives.data_parallel_size > 1 else 0,
            on_bytes_changed=self._note_peak)
        """Gathers, releases and reductions of the units (:mod:`._unit_storage`); gathers of
        stored groups borrow the pinned copy they read (HOST, or a CPU engine's DEVICE copy when
        that tier holds every shard) instead of copying it ([Note: a gathered unit borrows its
        HOST copy] in infinity/zero/_unit_storage.py)."""
        self._on_backward_begin = on_backward_begin
        self._on_backward_end = on_backward_end
        self._step_gathers: StepGathers | None = None
        """[Note: the after-step gather overlaps the next forward] in
        infinity/zero/_step_gathers.py; None: ``after_step`` waits for the gathers."""
        if config.overlap_param_gather and self.stage in (1, 2) \
                and collectives.data_parallel_size > 1:
            self._step_gathers = StepGathers(
                self.units, {i for _, _, indices in choice.hooked for i in indices},
                issue=lambda unit: self._issue_gather(unit, Phase.STEP_GATHER, refresh=True),
                wait=self._wait_gather, settle=self.settle_params)
        self._install_hooks(choice.hooked)
        self._fetcher = self._build_fetcher()
        """Trace-driven prefetch of offloaded parameter shards; None: demand fetches only."""
        self._gather_ahead = (
            GatherAhead({u.index: sum(g.padded_numel * g.full.element_size() for g in u.groups)
                         for u in self.units if not u.always_gathered})
            if self._fetcher is None and self.stage == 3 and self.world_size > 1 else None)
        """[Note: gathers issued ahead] for units on the device; None: the prefetcher
        leads the gathers (offloaded shards), or they are local copies (one rank)."""
        self._ahead_on = False
        """A training step is being recorded and predicted by ``_gather_ahead``."""
        mark_managed(module, [s.param for u in self.units for g in u.groups for s in g.slots])
        self._note_peak()
        logger.info("stage %d: %d units over %d ranks: %s", self.stage, len(self.units),
                    self.world_size, ", ".join(f"{u.name}({sum(g.numel for g in u.groups)})"
                                               for u in self.units))

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
        """(first flat element, numel) of the optimizer/parameter partition this rank holds: the
        rank's shard at stages 1-3, the whole buffer at stage 0."""
        if self.stage == 0:
            return 0, group.padded_numel
        return self.rank * group.shard_numel, group.shard_numel

    def param_partition(self, group: FlatGroup) -> Any:
        """What the optimizer writes for ``group``: the parameter partition (stage 0: the whole
        buffer), or, when the store holds the shard, a callable opening it for writing
        (:meth:`open_param_partition`)."""
        if group.store_key is None:
            return group.full if self.stage == 0 else group.shard
        return lambda overwrite=False: self._open_stored_shard(group, overwrite=overwrite)

    @contextlib.contextmanager
    def open_param_partition(self, group: FlatGroup, *, overwrite: bool = False
                             ) -> Iterator[torch.Tensor]:
        """This rank's parameter partition of ``group`` for writing (checkpoints, weights): the
        tensor itself, or the stored shard acquired on the device, marked dirty and written back
        to its home on exit. ``overwrite``: the caller writes every element, so an absent stored
        copy is not read first."""
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
        return (self.config.param_home is not Tier.DEVICE and self._write_tier is Tier.HOST
                and self._read_tier is Tier.DEVICE)

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
        key, tier = group.store_key, self._write_tier
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
                    and tier is not self.config.param_home:
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
        with self._open_stored_shard_read(group) as tensor:
            return tensor.clone()

    @contextlib.contextmanager
    def _open_stored_shard_read(self, group: FlatGroup) -> Iterator[torch.Tensor]:
        tier = self._read_tier
        tensor = self.store.acquire(group.store_key, tier).wait()
        try:
            yield tensor
        finally:
            self.store.release(group.store_key, tier)

    # ------------------------------------------------------------------ hooks

    def _install_hooks(self, hooked: list[tuple[nn.Module, str, list[int]]]) -> None:
        if self._rows is not None:
            self._rows.install()
        if self._heads is not None:
            self._heads.install()
        for u in self.units:
            for g in u.groups:
                if g.requires_grad:
                    for s in g.slots:
                        self._handles.append(
                            s.param.register_post_accumulate_grad_hook(self._on_grad))
        # [Note: the end of backward]: the model's outputs get their gradient first, in the
        # outermost backward (a parameter's, inside a reentrant checkpoint, may come in a nested
        # one, whose end is not the backward's).
        self._handles.append(self.module.register_forward_hook(self._mark_outputs))
        if self._step_gathers is not None:
            self._handles.extend(self._step_gathers.install(self.module, hooked))
        if self.stage < 3:
            return
        for module, _name, indices in hooked:
            units = [self.units[i] for i in indices if not self.units[i].always_gathered]
            if not units:
                continue
            self._handles.append(module.register_forward_pre_hook(
                self._make_pre_forward(units), with_kwargs=True))
            self._handles.append(module.register_forward_hook(
                self._make_post_forward(units), always_call=True))
        for module in self.module.modules():
            if any(p is not None and id(p) in self._slot_of
                   and not self._slot_of[id(p)][0].always_gathered
                   for p in module._parameters.values()):
                self._handles.append(module.register_state_dict_pre_hook(
                    self._refuse_released_state_dict))

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

    def _refuse_released_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        """``module.state_dict()`` between steps would hand out views of released storage (0
        bytes, [Note: release keeps parameter identity]): whoever reads one crashes the process.
        Raise instead, naming what to call. ``keep_vars=True`` returns the Parameter objects
        themselves (the engine's own key lookups) and is allowed."""
        if keep_vars:
            return
        for name, p in module._parameters.items():
            entry = self._slot_of.get(id(p)) if p is not None else None
            if entry is not None and entry[0].state is UnitState.RELEASED:
                raise RuntimeError(
                    f"state_dict(): parameter {prefix}{name} belongs to unit {entry[0].name!r}, "
                    f"which stage 3 keeps sharded across ranks (released here); its values are "
                    f"not in the module. Call engine.full_state_dict() on every rank for the full "
                    f"values, or engine.save_checkpoint(dir) and `infinity consolidate`")

    def remove_hooks(self) -> None:
        if self._rows is not None:
            self._rows.remove()
        if self._heads is not None:
            self._heads.remove()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _make_pre_forward(self, units: list[Unit]):
        def pre_forward(module, args, kwargs):
            for u in units:
                if torch.is_grad_enabled():
                    self._forward_order.setdefault(u.index)
                u.enter_forward()
                self._fetch_before_compute(u)
            if torch.is_grad_enabled() and any(u.has_frozen for u in units):
                for t in tensors_in((args, kwargs)):
                    if t.requires_grad:
                        t.register_hook(lambda grad: self._post_backward(units))
            return None
        return pre_forward

    def _make_post_forward(self, units: list[Unit]):
        def post_forward(module, args, output):
            for u in units:
                u.leave_forward()
                self._maybe_release(u)
                self._after_compute(u)
            if torch.is_grad_enabled():
                for t in tensors_in(output):
                    if t.requires_grad:
                        t.register_hook(lambda grad: self._pre_backward(units))
            return None
        return post_forward

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

    def _on_grad(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: stage the gradient ([Note: gradient ledger]); reduce the
        unit once every trainable parameter of it has one."""
        unit, group, slot = self._slot_of[id(param)]
        if param.grad is None:
            return
        self._enter_backward()
        self.reducer.stage(group, slot, local_grad(param, param.grad))
        param.grad = None
        if self._heads is None or not self._heads.first_part(param):
            self._grad_staged(unit, param)

    def _grad_staged(self, unit: Unit, param: torch.Tensor) -> None:
        """``param``'s gradient of this backward is staged: reduce its unit if that completed
        it (in the reduction order over several ranks)."""
        self.presence.note(param)
        complete, late = unit.grad_arrived(id(param))  # complete until the backward ends
        if complete:
            order = self._reduce_order
            if order is None:  # one rank: at once (a late gradient too: nothing to agree on)
                self._reduce(unit, Phase.REDUCE_GRAD)
            elif not late:  # several: in the order ([Note: every rank reduces every unit ...])
                for index in order.complete(unit.index):
                    self._reduce(self.units[index], Phase.REDUCE_GRAD)
            # else a late one stays staged: the end of backward reduces it on every rank
            self._maybe_drop_hold(unit)

    def _on_head(self, module: nn.Linear, x: torch.Tensor, grad_out: torch.Tensor
                 ) -> torch.Tensor:
        """A tapped head's backward ([Note: the head's gradient reduced as it is made] in
        infinity/zero/_head_grad.py): its weight's gradient staged, the pieces of the unit's
        reduction it alone fills issued as their rows are made; returns the input's gradient."""
        weight = module.weight
        unit, group, slot = self._slot_of[id(weight)]
        self._enter_backward()
        rows, width = weight.shape
        # In the output gradient's dtype: under autocast the forward ran in another dtype than
        # the saved input's and the weight's (autograd's own linear has the casts in its graph).
        grads = grad_out.reshape(-1, rows)
        inputs = x.reshape(-1, width).to(grads.dtype)
        plan = self._head_plans.get(id(module))
        reduction = None
        if (plan is not None and self._heads is not None
                and self._heads.calls.get(id(module)) == 1
                and self.state is TrainingState.BACKWARD
                and self._reduce_order is not None and self._reduce_order.pending(unit.index)
                and not (group.grad_staging is not None and id(slot) in group.grad_staged)):
            reduction = self.reducer.begin_pieces(
                group, plan.pieces, f"{Phase.REDUCE_GRAD.value} of unit {unit.index} "
                                    f"{unit.name!r} (micro-step {self.micro_step})")
        if reduction is None:  # called again, or reduced already: staged whole, as autograd's
            self.reducer.stage(group, slot, grads.t() @ inputs)
        else:
            staging = group.grad_staging
            table = staging[slot.offset:slot.offset + slot.numel].view(rows, width)
            with torch.profiler.record_function(f"infinity::head pieces ({unit.name})"):
                for number, row_ranges, zeros in plan.early:
                    for lo, hi in row_ranges:
                        table[lo:hi].copy_(weight_rows_grad(grads, inputs, lo, hi))
                    for lo, hi in zeros:  # rows' and padding elements: zeros, as at its turn
                        staging[lo:hi].zero_()
                    reduction.issue_piece(number)
                for lo, hi in plan.rest:
                    table[lo:hi].copy_(weight_rows_grad(grads, inputs, lo, hi))
            group.grad_staged.add(id(slot))
        # Before the unit may be released:
        grad_x = (grads @ weight.to(grads.dtype)).view(x.shape).to(x.dtype)
        # (untapped since its forward, by a backward that ran in between: staged whole above)
        if self._heads is None or not self._heads.first_part(weight):
            self._grad_staged(unit, weight)  # its unit's turn may be now
        return grad_x

    def _on_rows(self, param: nn.Parameter, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """A tapped embedding's backward: this rank's rows of ``param``'s gradient, reduced at
        the end of backward ([Note: embedding rows cross ranks as rows])."""
        unit = self._slot_of[id(param)][0]
        self._enter_backward()
        number, slot = self._row_slots[id(param)]
        self._row_entries.append((number, slot, ids, rows))
        self.presence.note(param)
        unit.rows_arrived.add(id(param))

    def _mark_outputs(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(lambda grad: self._enter_backward())

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
        if self._on_backward_begin is not None:
            self._on_backward_begin()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        try:
            self.finish_backward()
        except BaseException:
            self.abort_backward()
            raise
        if self._on_backward_end is not None:
            self._on_backward_end()

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
        if self._fetcher is not None:
            self._fetcher.on_release(unit.index)

    def _build_fetcher(self) -> ParamPrefetcher | None:
        """Parameter offload: the trace-driven prefetcher over the store's parameter shards
        (:mod:`._prefetcher`). It records each step's units, then reads the next units' shards
        from NVMe and copies them to the device ahead of use, within in-flight bounds shared with
        demand fetches; the store evicts by the trace's next use."""
        config = self.config
        if config.param_home is Tier.DEVICE or not config.prefetch:
            return None
        item = self.compute_dtype.itemsize
        home = Level[config.param_home.name]
        units = [PrefetchUnit(unit=u.index, keys=tuple(g.store_key for g in u.groups),
                              shard_bytes=sum(g.shard_numel for g in u.groups) * item,
                              gathered_bytes=sum(g.padded_numel for g in u.groups) * item, home=home)
                 for u in self.units
                 if not u.always_gathered and all(g.store_key is not None for g in u.groups)]
        if not units:
            return None
        prefetch = prefetch_config(
            host_budget_bytes=self.store.budget_bytes(Tier.HOST),
            device_budget_bytes=self.store.budget_bytes(Tier.DEVICE),
            largest_shard_bytes=max(u.shard_bytes for u in units),
            largest_gathered_bytes=max(u.gathered_bytes for u in units),
            world_size=self.world_size, lookahead_bytes=config.prefetch_lookahead_bytes,
            max_reuse_distance_bytes=config.max_reuse_distance_bytes)
        live = config.max_live_bytes
        if live is None and config.reads.tier is Tier.HOST:  # the DEVICE level no longer bounds it
            live = DEFAULT_LIVE_UNITS * max(u.gathered_bytes for u in units)
        return ParamPrefetcher(self.store, units, config=prefetch,
                               device_tier=self._read_tier,
                               gather=lambda i: self._issue_gather(self.units[i],
                                                                   self._gather_phase()),
                               is_gathered=lambda i: self.units[i].state is not UnitState.RELEASED,
                               gathered_budget_bytes=live)

    def _fetch_before_compute(self, unit: Unit) -> None:
        """Gather ``unit`` before its compute: through the prefetcher for offloaded parameters
        (a prefetched unit is ready), else on demand."""
        if self._fetcher is not None and not unit.always_gathered:
            self._fetcher.before_compute(unit.index)
        if unit.state is UnitState.RELEASED:
            self._issue_gather(unit, self._gather_phase())
        self._wait_gather(unit)
        ahead = self._gather_ahead
        if ahead is not None and self._ahead_on and not unit.always_gathered:
            backward = self.state is TrainingState.BACKWARD
            ahead.use(unit.index, backward)  # [Note: gathers issued ahead]
            for index, later in ahead.ahead(unit.index, backward, self._in_use()):
                if self.units[index].state is UnitState.RELEASED:
                    self._issue_gather(self.units[index], Phase.BACKWARD_GATHER if later
                                       else Phase.FORWARD_GATHER)

    def _after_compute(self, unit: Unit) -> None:
        if self._fetcher is not None and not unit.always_gathered:
            self._fetcher.after_compute(unit.index)

    def _maybe_release(self, unit: Unit) -> None:
        if unit.state is not UnitState.RELEASED and unit.releasable:
            if self._fetcher is not None and self._fetcher.should_keep(unit.index):
                return  # the trace says it is used again soon (released at the step's end at last)
            if self._ahead_on and self._gather_ahead.used_next(unit.index, self._in_use()):
                return  # used again next: [Note: gathers issued ahead]
            self._release(unit)

    def _in_use(self) -> set[int]:
        """The units computing now (forward, or held for their backward)."""
        return {u.index for u in self.units if u.in_use}

    def _maybe_drop_hold(self, unit: Unit) -> None:
        """Release after backward once nothing of the unit's backward can still read it
        (:meth:`Unit.drop_hold`)."""
        if unit.drop_hold():
            self._maybe_release(unit)
            self._after_compute(unit)

    def _order_reductions(self) -> None:
        """The order of the units' reductions, the units reduced in pieces, and the tapped
        heads' plans, from the units and the taps (several data-parallel ranks). A head whose
        unit is not reduced in pieces, or in none that the head alone fills, is untapped."""
        heads = self._heads.modules if self._heads is not None else []
        # A tapped head's weight counts as autograd's: its gradient completes its unit, at the
        # head's backward (the manager is handed it there).
        order = backward_order(
            self.module, self.units,
            skip_modules=self._rows.tapped_modules if self._rows is not None else set())
        self._reduce_order = ReduceOrder(order)
        numel = {u.index: sum(g.padded_numel for g in u.groups if g.requires_grad)
                 for u in self.units}
        self._pieces = spread_pieces(order, numel) if self.stage >= 2 else {}
        self._head_plans, untap = {}, []
        for m in heads:
            unit, group, slot = self._slot_of[id(m.weight)]
            pieces = self._pieces.get(unit.index, 1)
            late = [(s.offset, s.offset + s.numel) for s in group.slots
                    if s.numel and s is not slot and id(s.param) not in unit.rows_only]
            plan = plan_head(world=self.world_size, shard_numel=group.shard_numel,
                             pieces=pieces, offset=slot.offset, rows=m.weight.shape[0],
                             width=m.weight.shape[1], late=late) \
                if pieces > 1 and self.world_size > 1 else None
            if plan is not None and plan.early:
                self._head_plans[id(m)] = plan
            else:
                untap.append(m)
        if untap:
            self._untap_heads(untap)
            self._order_reductions()

    def _untap_heads(self, heads: list[nn.Linear]) -> None:
        """Their gradients go through autograd from now on."""
        self._heads.remove(heads)
        for m in heads:
            self._head_plans.pop(id(m), None)
        if not self._heads.modules:
            self._heads = None

    def _reduce(self, unit: Unit, phase: Phase) -> None:
        pieces = self._pieces.get(unit.index, 1) if phase is Phase.REDUCE_GRAD else 1
        self.storage.issue_reduce(unit, phase, self.micro_step, pieces=pieces)

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
            if mode:
                self._forward_order = {}
            if self._fetcher is not None:
                # Separate traces per phase: an evaluation forward must not replace the training
                # trace.
                self.end_prefetch_step()
                phase = ("train" if self.module.training else "eval-grad") if mode else "eval"
                # A forward without grad leaves the parameters as they are, and most likely runs
                # between training steps: the prefetcher moves the training step's first shards
                # up during its last units ([Note: predicting past an evaluation step] in
                # infinity/prefetch/_trace.py).
                then = None if mode else ("train" if self._fetcher.has_trace("train") else phase)
                self._fetcher.begin_step(phase, then=then)
            self._ahead_on = mode and self._gather_ahead is not None
            if self._ahead_on:  # a training step: predict its gathers from the last one's
                self._gather_ahead.begin_step()
                first = self._gather_ahead.first()
                if first is not None:
                    self._issue_gather(self.units[first], Phase.FORWARD_GATHER)
            if trace:
                with OutsideUseDetector(self._check_outside_use):
                    yield
                self._traced_modes.add(mode)
            else:
                yield
            finished = True
        except BaseException:
            self._ahead_on = False
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
                if self._fetcher is not None:
                    self._fetcher.warm_next_step()  # the next step's (begin_step's ``then``)

    def begin_backward(self) -> None:
        """``engine.backward(loss)`` is about to run autograd: gathers now are backward gathers."""
        self._to(TrainingState.BACKWARD)

    def finish_backward(self) -> None:
        """End of one backward: with several ranks, reduce the units not reduced yet in the fixed
        order ([Note: every rank reduces every unit in one order]); wait for every reduction;
        reduce again, on every rank, the units some rank staged gradients for after their
        reduction (at one rank: the incomplete units); drop backward holds; release."""
        if self._reduce_order is not None:
            for index in self._reduce_order.rest():  # incomplete here: zeros where no gradient
                self._reduce(self.units[index], Phase.REDUCE_GRAD)
        self.storage.wait_reductions()
        # Gradients staged again after their unit's reduction (one rank: units never complete),
        # and units some parameter of which got no gradient here ([Note: parameters without a
        # gradient]): one all-reduce, so that every rank reduces the same units again.
        n = len(self.units)
        flags = [int(any(g.grad_staging is not None for g in u.groups)) for u in self.units]
        flags += [int(u.num_trainable > 0 and not u.every_grad_arrived) for u in self.units]
        payload, sizes = None, None
        if self._rows is not None:  # [Note: embedding rows cross ranks as rows]
            entries, self._row_entries = self._row_entries, []
            scale = 1.0 / self.coll.data_parallel_size
            packed = [(number, slot.offset, ids, rows) for number, slot, ids, rows in entries]
            if self.reducer.routes_rows:  # the bytes this rank sends
                payload, sizes = RowsPayload.pack(
                    packed, scale, self.device, world=self.world_size,
                    shard_numel=[g.shard_numel for g in self._row_groups])
                flags.append(payload.numel() - sizes[self.rank])
            else:  # every rank's, padded to the largest rank's
                payload, _ = RowsPayload.pack(
                    packed, scale, self.device, world=1,
                    shard_numel=[g.padded_numel for g in self._row_groups])
                flags.append(payload.numel())
        if self.coll.data_parallel_size > 1:  # replicas must agree too: they reduce together
            pending = torch.tensor(flags, dtype=torch.int64, device=self.device)
            self.coll.all_reduce_max(pending,
                                     context=f"end of backward (micro-step {self.micro_step})")
            flags = pending.tolist()
        for unit, flag in zip(self.units, flags[:n]):
            if flag:
                self._reduce(unit, Phase.FLUSH)
        self.storage.wait_reductions()
        if payload is not None:
            self._reduce_rows(entries, payload, sizes, flags[2 * n])
        self.presence.end_backward({u.index for u, f in zip(self.units, flags[n:2 * n]) if f})
        if self._heads is not None:
            again = self._heads.end_backward()
            if again:  # [Note: the head's gradient reduced as it is made]: called twice
                logger.info("LM head %s was called more than once between backwards: its "
                            "weight's gradient goes through autograd from now on",
                            ", ".join(type(m).__name__ for m in again))
                self._untap_heads(again)
                self._order_reductions()
        self._ahead_on = False  # nothing is kept past the step
        self._drop_holds()
        if self.hpz is not None:
            self.hpz.drop()  # every backward gather is done (see self.hpz)
        self.micro_step += 1
        self._to(TrainingState.IDLE)

    def _reduce_rows(self, entries: list[tuple[int, ParamSlot, torch.Tensor, torch.Tensor]],
                     payload: torch.Tensor, sizes: list[int] | None, max_bytes: int) -> None:
        """The end of backward's rows, on every rank: sent as rows (to the rank holding each,
        ``sizes`` per rank, or to every rank) while that moves fewer bytes than reducing their
        groups densely, else added into the staging buffers and reduced with their units (every
        rank takes the same branch: ``max_bytes``, what the largest rank sends or pads to, is
        the same everywhere)."""
        ranks = self.coll.data_parallel_size
        dense_bytes = sum(g.padded_numel for g in self._row_groups) * 4
        names = ", ".join(f"unit {u.index} {u.name!r}" for u in self.units
                          if any(g in self._row_groups for g in u.groups))
        context = f"reduce of the embedding rows of {names} (micro-step {self.micro_step})"
        if sizes is not None:  # a reduce-scatter sends (W - 1) / W of the buffer
            if max_bytes < dense_bytes * (ranks - 1) / ranks:
                self.reducer.route_rows(payload, sizes, self._row_groups, context=context)
                return
        elif max_bytes <= RowsPayload.HEADER * 8:
            return  # no rank has rows
        elif ranks * max_bytes < dense_bytes:
            self.reducer.gather_rows(payload, max_bytes, self._row_groups, context=context)
            return
        for number, slot, ids, rows in entries:
            group = self._row_groups[number]
            grad = torch.zeros(slot.numel, dtype=torch.float32, device=self.device)
            grad.view(-1, rows.shape[1]).index_add_(0, ids.to(self.device), rows.to(self.device))
            self.reducer.stage(group, slot, grad)
        for unit in self.units:  # in index order on every rank
            if any(g in self._row_groups for g in unit.groups):
                self._reduce(unit, Phase.FLUSH)
        self.storage.wait_reductions()
        # That reduced the rows' units twice in this backward (their dense part in the hooks):
        # from now on their embeddings' gradients go through autograd, as without rows.
        self._rows.remove()
        self._rows, self._row_groups, self._row_slots = None, [], {}
        if self._heads is not None:  # a tied head's weight is the table's: dense too
            self._untap_heads(list(self._heads.modules))
        for unit in self.units:
            unit.rows_only = frozenset()
        self._order_reductions()
        logger.info("embedding gradients: the rows of a backward (%d B on the largest rank) "
                    "were not fewer bytes than their tables; reduced densely from now on",
                    max_bytes)

    def abort_backward(self) -> None:
        """The backward (or its end, :meth:`finish_backward`) raised: back to IDLE, so that the
        engine can go on. Holds and staged gradients are left as they are: the next
        :meth:`finish_backward` reduces what was staged and drops the holds."""
        self.reducer.drop_early()
        if self._heads is not None:
            self._heads.end_backward()
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
        if self._gather_ahead is not None:  # gathered for a backward that never came: stale
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
        if self._fetcher is not None:
            self._fetcher.warm_next_step()  # the shards are final: the next step's first units

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

    def params_with_grad(self) -> set[int] | None:
        """id() of the trainable parameters with a gradient in this accumulation window on any
        rank, None when every one has ([Note: parameters without a gradient] in
        infinity/zero/_grad_presence.py); a collective when some unit was partial."""
        return self.presence.params_with_grad()

    def set_param_writeback(self, mode: ParamWriteback) -> None:
        """When updated stored shards go home from now on (the engine decides at each step)."""
        self.param_writeback = mode

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
        ([Note: stale gathered units] in infinity/zero/_prefetcher.py)."""
        if self._fetcher is None or not self._fetcher.in_step:
            return
        self._fetcher.end_step()
        for unit in self.units:
            self._maybe_release(unit)  # between steps should_keep() is False

    def prefetch_stats(self) -> dict[str, Any]:
        """Counters of the trace-driven prefetcher (keys in ParamPrefetcher.stats)."""
        return self._fetcher.stats() if self._fetcher is not None else disabled_stats()

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
        src = src.to(self.device)
        if self.stage == 0 or src.numel() == group.padded_numel:
            return src.float().clone()
        out = torch.empty(group.padded_numel, dtype=src.dtype, device=self.device)
        self.coll.all_gather(out, src, context=f"state-dict gather of {group.key}",
                             phase=Phase.STATE_DICT)
        return out.float()

    def full_state_dict(self, master_of: Any = None, keys: Any = None) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` keys; parameters from ``master_of(group key)`` (fp32 masters)
        where it returns a tensor, else from the parameter shards. ``keys``: only these entries
        (an adapter's: only the flat groups holding them are gathered); a ``ValueError`` names
        one that is not in the state dict. Collective; on every rank, with the same keys."""
        state = self.module.state_dict(keep_vars=True)
        if keys is not None:
            keys = list(keys)
            unknown = [k for k in keys if k not in state]
            if unknown:
                raise ValueError(f"full_state_dict(keys=...): {unknown[:5]} not in the model's "
                                 f"state_dict ({len(state)} keys, e.g. {list(state)[:3]}); pass "
                                 f"keys of engine.module.state_dict()")
            state = {k: state[k] for k in keys}
        wanted = {id(v) for v in state.values()}
        values: dict[int, torch.Tensor] = {}
        for unit in self.units:
            for g in unit.groups:
                if not any(id(s.param) in wanted for s in g.slots):
                    continue
                master = master_of(g.key) if (master_of is not None and g.requires_grad) else None
                flat = self.full_flat(g, master)
                for s in g.slots:
                    values[id(s.param)] = full_value(  # a DTensor's: over the tensor ranks too
                        s.param, flat[s.offset:s.offset + s.numel].view(s.shape))
        out = {}
        for key, value in state.items():
            if id(value) in values:
                out[key] = values[id(value)]
            else:
                out[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
        return out

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

    def device_bytes(self) -> dict[str, int]:
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

    def _note_peak(self) -> None:
        held = self.device_bytes()
        total = sum(held.values())
        if total > self.peak_device_bytes:
            self.peak_device_bytes, self.peak_device_parts = total, held
