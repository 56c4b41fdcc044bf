"""The parameter manager: units, flat buffers, shards, hooks, gather/release, gradient reduction.

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

[Note: gradient ledger] is in infinity/_grad_ledger.py (the gradient half of the manager).

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

[Note: parameters used outside their module]
A unit is gathered while a module that holds one of its parameters runs. Code that reads a
parameter elsewhere (``F.linear(x, other.weight)`` in a parent's forward) would read a released
buffer. The first forward per grad mode runs under a TorchFunctionMode that sees every torch call:
a released unit's parameter passed to one is gathered on the spot, and its unit stays gathered from
then on (a warning names it). No __torch_function__ cost after that first forward; a use that first
appears later raises torch's "storage of size 0" error, which the engine re-raises with the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from infinity._common import warn_once
from infinity._grad_ledger import GradientLedger
from infinity._dist import Collectives, check_env_enabled
from infinity.config import ZeroConfig
from infinity.prefetch import Level
from infinity.prefetch_bridge import ParamPrefetcher, PrefetchUnit, disabled_stats, prefetch_config
from infinity.units import (ParamSlot, UnitSpec, check_not_wrapped, layout_group, mark_managed,
                            plan_units, resolve_persistence_threshold)

logger = logging.getLogger(__name__)



class UnitState(enum.Enum):
    """Where a unit's parameter bytes are (the device tier unless offload moves the shard).

    RELEASED: only this rank's shard holds bytes; the full buffer's storage is 0 bytes.
    GATHERED: the full buffer holds every rank's shard on the device; parameters are its views.
    """

    RELEASED = "released"
    GATHERED = "gathered"


_TRANSITIONS = {UnitState.RELEASED: {UnitState.GATHERED}, UnitState.GATHERED: {UnitState.RELEASED}}


@dataclasses.dataclass(eq=False)
class FlatGroup:
    """One flat buffer of a unit: parameters of one dtype and one ``requires_grad``."""

    key: str
    """Stable name ('u3.bfloat16.train'): the optimizer's key and the checkpoint's."""
    slots: list[ParamSlot]
    numel: int
    padded_numel: int
    shard_numel: int
    requires_grad: bool
    full: torch.Tensor
    """Full flat buffer; parameters are views of it (storage freed while the unit is released)."""
    shard: torch.Tensor | None
    """This rank's parameter shard: a view of ``full`` when the unit is always gathered, else its
    own tensor (the copy that stays when the unit is released); None when the store holds it."""
    master: torch.Tensor | None = None
    """fp32 optimizer partition (the shard; the whole buffer at stage 0); aliases the parameter
    partition when the compute dtype is fp32. None for frozen groups."""
    grad_staging: torch.Tensor | None = None
    """fp32 full-size gradient of the current backward (see [Note: gradient ledger])."""
    grad_acc: torch.Tensor | None = None
    """fp32 gradient summed over micro-batches: shard (stages 2-3) or full (0-1); None when zero."""
    grad_host: torch.Tensor | None = None
    """Offloaded optimizer: the accumulator (fp32, or the compute dtype: estimate.host_grad_dtype)
    over the optimizer's partition in the store's host arena; ``grad_acc`` is it while it holds a
    gradient ([Note: gradient placement])."""
    store_key: str | None = None
    """Key of the parameter shard in the tiered store (parameter offload), else None."""


@dataclasses.dataclass(eq=False)
class Unit:
    index: int
    name: str
    groups: list[FlatGroup]
    always_gathered: bool
    """Stages 0-2, the persistent unit, and units used outside their modules stay gathered."""
    num_trainable: int
    has_frozen: bool
    state: UnitState = UnitState.GATHERED
    refcount: int = 0
    """Forward hooks (and recomputation under activation checkpointing) currently using it."""
    backward_hold: bool = False
    """Gathered for this backward (pre-backward hook) until its gradients are reduced."""
    input_grads_done: bool = False
    """A post-backward hook on the module's inputs fired (its backward finished) in this backward."""
    grads_seen: set[int] = dataclasses.field(default_factory=set)
    """id() of the trainable parameters whose gradient arrived in this backward."""

    def transition(self, new: UnitState) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise RuntimeError(f"unit {self.index} {self.name!r}: illegal transition "
                               f"{self.state.value} -> {new.value}")
        self.state = new


def _int_or_none(value: Any) -> int | None:
    """A knob that may be 'auto': the number, or None for 'auto'."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _tensors_in(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors inside a module output: tensors, sequences, dicts, dataclasses (HF ModelOutput)."""
    if depth > 8:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors_in(getattr(obj, f.name, None), depth + 1)


_METADATA_FUNCS = frozenset({
    "dtype", "shape", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "ndim", "layout",
    "is_cuda", "is_sparse", "is_quantized", "is_meta", "names", "_version", "data", "size", "dim",
    "numel", "nelement", "element_size", "is_floating_point", "is_complex", "stride",
    "is_contiguous", "storage_offset", "untyped_storage", "data_ptr", "__hash__", "__eq__",
    "_base", "is_nested", "itemsize", "nbytes", "get_device", "__repr__", "__format__",
    "register_hook", "register_post_accumulate_grad_hook", "requires_grad_", "__reduce_ex__",
})


class _OutsideUseDetector(TorchFunctionMode):
    """During traced forwards: a released unit's parameter used by a torch function (a module
    using another module's weight, ``F.linear(x, other.weight)``) is gathered on the spot and its
    unit is kept gathered from then on (see ParameterManager.promote_always_gathered)."""

    def __init__(self, manager: "ParameterManager"):
        super().__init__()
        self.manager = manager

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__
        if name == "__get__":
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name not in _METADATA_FUNCS:
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor):
                    self.manager._check_outside_use(leaf, name)
        return func(*args, **kwargs)


class ParameterManager(GradientLedger):
    """Owns the units of one model: builds, shards, hooks, gathers, releases; reduces gradients
    through :class:`~infinity._grad_ledger.GradientLedger`."""

    lazy_param_writeback = False
    """The device tier holds every stored parameter shard (``OffloadPlan.device_holds_params``)
    and the optimizer step is deferred (set by the engine at each step): a shard the optimizer
    updated stays dirty on the device and goes home when the store evicts it or flushes
    (checkpoints, weights), not after every update."""
    on_grad_ready: "Callable[[str], None] | None" = None
    """Called with a trainable group's key once its gradient of this backward is reduced and
    accumulated (the engine starts reading that group's NVMe optimizer state then; [Note:
    optimizer read-ahead] in infinity/shard_optimizer.py). Set by the owner; None: nobody."""

    def __init__(self, module: nn.Module, zero: ZeroConfig, *, collectives: Collectives,
                 device: torch.device, compute_dtype: torch.dtype, store: Any = None,
                 param_home: Any = None, prefetch: bool = True, grad_store: Any = None,
                 initial_values: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
                 reduce_dtype: torch.dtype = torch.float32,
                 grad_host_dtype: torch.dtype = torch.float32):
        """``store``/``param_home``: the tiered store and the home tier (HOST or NVME) of the
        parameter shards of gathered-on-demand units (stage 3 parameter offload); None: the
        shards stay on the device. ``prefetch``: read the next unit's shard ahead (only when the
        host budget has room for it beside the demand fetches). ``grad_store``: the optimizer
        lives off the device (None: on it), so fp32 masters are built in host memory for it to
        take, and each unit's reduced gradient partition moves right after its reduction into an
        accumulator homed in this store's host arena ([Note: gradient placement] in
        infinity/estimate.py). ``initial_values(param)``: the values of a parameter whose storage
        holds none yet (built under ``infinity.init``: computed on demand, one at a time), or None
        to read the parameter itself. ``reduce_dtype``: what gradients cross ranks in (fp32, or
        the compute dtype: precision.reduce_dtype). ``grad_host_dtype``: the dtype of those host
        accumulators (estimate.host_grad_dtype)."""
        check_not_wrapped(module)
        self.grad_host_dtype = grad_host_dtype
        self._initial_values = initial_values
        self.reduce_dtype = reduce_dtype
        self.store = store
        self.param_home = param_home
        self.prefetch = prefetch
        self.grad_store = grad_store
        self.optimizer_offloaded = grad_store is not None
        self.module = module
        self.stage = zero.stage
        self.coll = collectives
        self.world_size = collectives.world_size
        self.rank = collectives.rank
        self.device = device
        self.compute_dtype = compute_dtype
        self.micro_step = 0
        """Backward passes finished; names the step in agreement checks and errors."""
        self.num_gathers = 0
        """Unit gathers performed (forward, backward and after-step), for stats()."""
        self.peak_device_bytes = 0
        """Largest sum of device_bytes() seen at a gather or a gradient reduction."""
        self._busy = 0
        """Nonzero while the manager itself copies into unit buffers (the detector ignores it)."""
        self._handles: list[Any] = []
        self._traced_modes: set[bool] = set()
        """Grad modes (True/False) whose first forward ran with the outside-use detector."""
        self._last_gathered: int | None = None
        """Unused since the trace-driven prefetcher replaced the one-unit hint; kept for
        finish_backward, which resets it."""
        self._fetcher: ParamPrefetcher | None = None
        """Trace-driven prefetch of offloaded parameter shards (see _build_fetcher); None: demand."""
        self._gather_phase = "forward-gather"
        """Phase named by gathers the fetcher issues (agreement checks and error context)."""
        self._forward_order: dict[int, None] = {}
        """Unit indices in the order the latest training forward first used them (the order in
        which a deferred optimizer step updates them, see forward_keys)."""
        plan = plan_units(module, unit_class_names=zero.unit_class_names,
                          unit_min_numel=zero.unit_min_numel,
                          persistence_threshold_numel=resolve_persistence_threshold(
                              zero.persistence_threshold_numel))
        for spec in plan.units:  # validate everything before the first parameter is touched
            for name, p in spec.params:
                if not p.is_floating_point():
                    raise ValueError(f"parameter {name!r} has dtype {p.dtype}: only floating-point "
                                     f"parameters can be managed; register it as a buffer instead")
                if p.is_meta:
                    raise ValueError(f"parameter {name!r} is on the meta device (no values); "
                                     f"materialise the model first (to_empty() and initialise)")
        self.param_names = plan.param_names
        self.units = [self._build_unit(spec) for spec in plan.units]
        self._slot_of: dict[int, tuple[Unit, FlatGroup, ParamSlot]] = {
            id(s.param): (u, g, s) for u in self.units for g in u.groups for s in g.slots}
        self._unit_of_storage: dict[int, Unit] = {
            g.full.untyped_storage()._cdata: u for u in self.units for g in u.groups}
        if grad_store is not None:
            self._register_grad_accumulators()
        self._install_hooks(plan.hooked)
        self._fetcher = self._build_fetcher(zero)
        mark_managed(module, [s.param for u in self.units for g in u.groups for s in g.slots])
        self._note_peak()
        logger.info("stage %d: %d units over %d ranks: %s", self.stage, len(self.units),
                    self.world_size, ", ".join(f"{u.name}({sum(g.numel for g in u.groups)})"
                                               for u in self.units))

    # ------------------------------------------------------------------ building

    def _build_unit(self, spec: UnitSpec) -> Unit:
        always = self.stage < 3 or spec.persistent
        by_kind: dict[tuple[torch.dtype, bool], list[tuple[str, nn.Parameter]]] = {}
        for name, p in spec.params:
            by_kind.setdefault((self.compute_dtype, p.requires_grad), []).append((name, p))
        groups = [self._build_group(spec, dtype, rg, params, always)
                  for (dtype, rg), params in by_kind.items()]
        unit = Unit(index=spec.index, name=spec.name, groups=groups, always_gathered=always,
                    num_trainable=sum(len(g.slots) for g in groups if g.requires_grad),
                    has_frozen=any(not g.requires_grad for g in groups))
        if not always:
            self._release(unit)
        return unit

    def _build_group(self, spec: UnitSpec, dtype: torch.dtype, requires_grad: bool,
                     params: list[tuple[str, nn.Parameter]], always: bool) -> FlatGroup:
        slots, numel, padded = layout_group(params, self.world_size)
        shard_numel = padded // self.world_size
        key = f"u{spec.index}.{str(dtype).removeprefix('torch.')}.{'train' if requires_grad else 'frozen'}"
        init = torch.zeros(padded, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for s in slots:
                values = self._initial_values(s.param) if self._initial_values else None
                init[s.offset:s.offset + s.numel].copy_(
                    (s.param.detach() if values is None else values).reshape(-1))
        self.coll.broadcast(init, src=0, context=f"initial broadcast of {key}")
        full = init if dtype == torch.float32 else init.to(dtype)
        for s in slots:  # [Note: release keeps parameter identity]
            s.param.data = full[s.offset:s.offset + s.numel].view(s.shape)
        lo, hi = self.rank * shard_numel, (self.rank + 1) * shard_numel
        shard = full[lo:hi] if always else full[lo:hi].clone()
        part = full if self.stage == 0 else shard  # the optimizer's partition of the parameters
        master = None
        if requires_grad:
            if dtype == torch.float32:
                master = part
            elif self.optimizer_offloaded:  # the optimizer copies it into its tier at once
                master = (init if self.stage == 0 else init[lo:hi]).to("cpu", copy=True)
            else:
                master = (init if self.stage == 0 else init[lo:hi]).clone()
        group = FlatGroup(key=key, slots=slots, numel=numel, padded_numel=padded,
                          shard_numel=shard_numel, requires_grad=requires_grad, full=full,
                          shard=shard, master=master)
        if self.store is not None and not always:
            group.store_key = f"param/{key}"
            initial = shard.cpu()
            self.store.register(group.store_key, shard_numel, dtype, self.param_home,
                                initial=initial)
            group.shard = None
            if master is part:  # fp32: the master starts as a copy, the shard lives in the store
                group.master = initial if self.optimizer_offloaded else shard
        return group

    def param_partition(self, group: FlatGroup) -> Any:
        """What the optimizer writes for ``group``: the parameter partition (stage 0: the whole
        buffer), or, when the store holds the shard, a callable opening it for writing (acquire on
        the device, mark dirty, release, write back to its home tier unless
        ``lazy_param_writeback``)."""
        if group.store_key is None:
            return group.full if self.stage == 0 else group.shard
        return lambda overwrite=False: self._open_stored_shard(group, overwrite=overwrite)

    @contextlib.contextmanager
    def _open_stored_shard(self, group: FlatGroup, *, overwrite: bool = False
                           ) -> Iterator[torch.Tensor]:
        """The shard on the device for writing. ``overwrite``: the caller writes every element
        (the optimizer step), so an absent copy is not read first (``store.acquire``)."""
        from infinity.tiers import Tier

        key = group.store_key
        tensor = self.store.acquire(key, Tier.DEVICE, overwrite=overwrite).wait()
        written = False
        try:
            yield tensor
            self.store.mark_dirty(key, Tier.DEVICE)
            written = True
        finally:
            self.store.release(key, Tier.DEVICE)
            # Partly written. A copy already dirty (lazy write-back) is the only current one: it
            # stays, its updated parts matching their masters, and the error path writes nothing.
            # Any other copy is dropped (not dirty: no write), so its bytes never pass for the shard.
            if not written and self.store.is_dirty(key) is not Tier.DEVICE:
                self.store.evict(key, Tier.DEVICE)
        if not self.lazy_param_writeback:
            self.store.write_back(key)  # async: the updated shard returns to its home

    def read_shard(self, group: FlatGroup) -> torch.Tensor:
        """A copy-free view (device) or a fresh copy (store) of this rank's parameter shard."""
        if group.store_key is None:
            return group.full if self.stage == 0 else group.shard
        with self._open_stored_shard_read(group) as tensor:
            return tensor.clone()

    @contextlib.contextmanager
    def _open_stored_shard_read(self, group: FlatGroup) -> Iterator[torch.Tensor]:
        from infinity.tiers import Tier

        tensor = self.store.acquire(group.store_key, Tier.DEVICE).wait()
        try:
            yield tensor
        finally:
            self.store.release(group.store_key, Tier.DEVICE)

    def trainable_groups(self) -> Iterator[FlatGroup]:
        for u in self.units:
            for g in u.groups:
                if g.requires_grad:
                    yield g

    def _install_hooks(self, hooked: list[tuple[nn.Module, str, list[int]]]) -> None:
        for u in self.units:
            for g in u.groups:
                if g.requires_grad:
                    for s in g.slots:
                        self._handles.append(
                            s.param.register_post_accumulate_grad_hook(self._on_grad))
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
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ gather / release

    def _check_now(self) -> bool:
        return self.world_size > 1 and (self.micro_step == 0 or check_env_enabled())

    def _gather(self, unit: Unit, phase: str) -> None:
        if self._check_now():
            self.coll.check_agreement(step=self.micro_step, phase=phase, unit_index=unit.index,
                                      unit_name=unit.name, device=self.device)
        self._busy += 1  # our own copies must not look like outside uses to the detector
        try:
            self._gather_groups(unit, phase)
        finally:
            self._busy -= 1
        if unit.state is UnitState.RELEASED:
            unit.transition(UnitState.GATHERED)
        self.num_gathers += 1
        self._note_peak()

    def _build_fetcher(self, zero: ZeroConfig) -> ParamPrefetcher | None:
        """Parameter offload: the trace-driven prefetcher over the store's parameter shards
        (:mod:`infinity.prefetch_bridge`). It records each step's units, then reads the next units'
        shards from NVMe and copies them to the device ahead of use, within in-flight bounds shared
        with demand fetches; the store evicts by the trace's next use."""
        if self.store is None or not self.prefetch:
            return None
        item = self.compute_dtype.itemsize
        home = Level[self.param_home.name]
        units = [PrefetchUnit(unit=u.index, keys=tuple(g.store_key for g in u.groups),
                              shard_bytes=sum(g.shard_numel for g in u.groups) * item,
                              gathered_bytes=sum(g.padded_numel for g in u.groups) * item, home=home)
                 for u in self.units
                 if not u.always_gathered and all(g.store_key is not None for g in u.groups)]
        if not units:
            return None
        budgets = self.store.config
        config = prefetch_config(
            host_budget_bytes=budgets.host_budget_bytes, device_budget_bytes=budgets.device_budget_bytes,
            largest_shard_bytes=max(u.shard_bytes for u in units),
            largest_gathered_bytes=max(u.gathered_bytes for u in units), world_size=self.world_size,
            lookahead_bytes=_int_or_none(zero.prefetch_lookahead_bytes),
            max_reuse_distance_bytes=None if zero.max_reuse_distance_numel == "auto"
            else zero.max_reuse_distance_numel * item)
        return ParamPrefetcher(self.store, units, config=config,
                               gather=lambda i: self._gather(self.units[i], self._gather_phase),
                               is_gathered=lambda i: self.units[i].state is UnitState.GATHERED,
                               gathered_budget_bytes=_int_or_none(zero.max_live_bytes))

    def _gather_groups(self, unit: Unit, phase: str) -> None:
        with torch.profiler.record_function(f"infinity::gather ({unit.name})"):
            for g in unit.groups:
                g.full.untyped_storage().resize_(g.padded_numel * g.full.element_size())
                context = f"{phase} of unit {unit.index} {unit.name!r} (micro-step {self.micro_step})"
                if g.store_key is None:
                    self.coll.all_gather(g.full, g.shard, context=context)
                else:
                    with self._open_stored_shard_read(g) as shard:
                        self.coll.all_gather(g.full, shard, context=context)

    def _release(self, unit: Unit) -> None:
        # [Note: release keeps parameter identity]
        for g in unit.groups:
            g.full.untyped_storage().resize_(0)
        unit.transition(UnitState.RELEASED)
        if self._fetcher is not None:
            self._fetcher.on_release(unit.index)

    def _fetch_before_compute(self, unit: Unit, phase: str) -> None:
        """Offloaded parameters: gather through the prefetcher (a prefetched unit is ready)."""
        if self._fetcher is not None and not unit.always_gathered:
            self._gather_phase = phase
            self._fetcher.before_compute(unit.index)
        if unit.state is UnitState.RELEASED:
            self._gather(unit, phase)

    def _after_compute(self, unit: Unit) -> None:
        if self._fetcher is not None and not unit.always_gathered:
            self._fetcher.after_compute(unit.index)

    def _acquire(self, unit: Unit, phase: str) -> None:
        unit.refcount += 1
        self._fetch_before_compute(unit, phase)

    def _maybe_release(self, unit: Unit) -> None:
        if (unit.state is UnitState.GATHERED and not unit.always_gathered and unit.refcount == 0
                and not unit.backward_hold):
            if self._fetcher is not None and self._fetcher.should_keep(unit.index):
                return  # the trace says it is used again soon (released at the step's end at last)
            self._release(unit)

    def _make_pre_forward(self, units: list[Unit]):
        def pre_forward(module, args, kwargs):
            for u in units:
                if torch.is_grad_enabled():
                    self._forward_order.setdefault(u.index)
                self._acquire(u, "forward-gather")
            if torch.is_grad_enabled() and any(u.has_frozen for u in units):
                for t in _tensors_in((args, kwargs)):
                    if t.requires_grad:
                        t.register_hook(lambda grad: self._post_backward(units))
            return None
        return pre_forward

    def _make_post_forward(self, units: list[Unit]):
        def post_forward(module, args, output):
            for u in units:
                u.refcount -= 1
                self._maybe_release(u)
                self._after_compute(u)
            if torch.is_grad_enabled():
                for t in _tensors_in(output):
                    if t.requires_grad:
                        t.register_hook(lambda grad: self._pre_backward(units))
            return None
        return post_forward

    def _pre_backward(self, units: list[Unit]) -> None:
        for u in units:
            if not u.backward_hold:
                u.backward_hold = True
                self._fetch_before_compute(u, "backward-gather")

    def _post_backward(self, units: list[Unit]) -> None:
        for u in units:
            u.input_grads_done = True
            self._maybe_drop_hold(u)

    def _maybe_drop_hold(self, unit: Unit) -> None:
        """Release after backward once nothing of the unit's backward can still read it: every
        trainable gradient arrived (autograd has run every node that saved a trainable parameter),
        and, for units with frozen parameters, the hook on the module's inputs fired."""
        grads_done = unit.num_trainable == 0 or (
            len(unit.grads_seen) == unit.num_trainable)
        if unit.backward_hold and grads_done and (not unit.has_frozen or unit.input_grads_done):
            unit.backward_hold = False
            self._maybe_release(unit)
            self._after_compute(unit)

    # ------------------------------------------------------------------ end of a backward

    def finish_backward(self) -> None:
        """End of one backward: reduce units whose gradients are incomplete (unused parameters),
        in unit order, on every rank that has any; drop backward holds; release."""
        flags = [int(any(g.grad_staging is not None for g in u.groups)) for u in self.units]
        if self.world_size > 1:
            pending = torch.tensor(flags, dtype=torch.int32, device=self.device)
            self.coll.all_reduce_max(pending,
                                     context=f"end of backward (micro-step {self.micro_step})")
            flags = pending.tolist()
        for unit, flag in zip(self.units, flags):
            if flag:
                self._reduce_unit(unit, "flush")
        self._last_gathered = None  # no prefetch hint across the step boundary
        for unit in self.units:
            unit.grads_seen = set()
            unit.backward_hold = False
            unit.input_grads_done = False
            unit.refcount = 0
            self._maybe_release(unit)
        self.micro_step += 1

    def after_step(self) -> None:
        """The optimizer wrote new parameter partitions: refresh every always-gathered unit
        (stages 1-3; stage 0 stepped the full buffer in place) and drop the gradients."""
        self.zero_grads()
        if self.stage == 0:
            return
        for unit in self.units:
            if unit.always_gathered:
                self._gather(unit, "step-gather")
        if self._fetcher is not None:
            self._fetcher.warm_next_step()  # the shards are final: the next step's first units

    # ------------------------------------------------------------------ tracing, state, stats

    @contextlib.contextmanager
    def forward_scope(self) -> Iterator[None]:
        """Wraps one ``engine(...)`` call: the first forward per grad mode runs the outside-use
        detector; an exception leaves no unit acquired."""
        mode = torch.is_grad_enabled()
        trace = self.stage == 3 and mode not in self._traced_modes and any(
            not u.always_gathered for u in self.units)
        if mode:
            self._forward_order = {}
        if self._fetcher is not None:
            # Separate traces per phase: an evaluation forward must not replace the training trace.
            self.end_prefetch_step()
            self._fetcher.begin_step(("train" if self.module.training else "eval-grad") if mode
                                     else "eval")
        try:
            if trace:
                with _OutsideUseDetector(self):
                    yield
                self._traced_modes.add(mode)
            else:
                yield
        except Exception:
            for unit in self.units:
                unit.refcount = 0
                self._maybe_release(unit)
            raise
        finally:
            if not mode:
                self.end_prefetch_step()  # no backward follows: the step ends with the forward
                if self._fetcher is not None:
                    self._fetcher.warm_next_step()

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
        ([Note: stale gathered units] in prefetch_bridge.py)."""
        if self._fetcher is None or not self._fetcher.in_step:
            return
        self._fetcher.end_step()
        for unit in self.units:
            if unit.refcount == 0 and not unit.backward_hold:
                self._maybe_release(unit)  # between steps should_keep() is False

    def prefetch_stats(self) -> dict[str, Any]:
        """Counters of the trace-driven prefetcher (keys in ParamPrefetcher.stats)."""
        return self._fetcher.stats() if self._fetcher is not None else disabled_stats()

    def _check_outside_use(self, tensor: torch.Tensor, func_name: str) -> None:
        if self._busy:
            return
        try:
            unit = self._unit_of_storage.get(tensor.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested)
            return
        if unit is None or unit.state is not UnitState.RELEASED:
            return
        self.promote_always_gathered(unit, f"{func_name} used a parameter of unit {unit.index} "
                                           f"{unit.name!r} outside the modules that hold it")

    def promote_always_gathered(self, unit: Unit, why: str) -> None:
        """Keep ``unit`` gathered from now on (its shard stays the optimizer's partition)."""
        warn_once(f"outside-use:{unit.name}",
                  f"{why}; that unit stays gathered from now on (costs its full size in device "
                  f"memory). Make the module that uses it hold it, or tie it, to avoid this")
        unit.always_gathered = True
        self._gather(unit, "forward-gather")

    def full_flat(self, group: FlatGroup, master: torch.Tensor | None = None) -> torch.Tensor:
        """The group's values over all ranks: ``master`` (this rank's fp32 partition) where given,
        else the parameters (collective)."""
        src = master if master is not None else self.read_shard(group)
        src = src.to(self.device)
        if self.stage == 0 or src.numel() == group.padded_numel:
            return src.float().clone()
        out = torch.empty(group.padded_numel, dtype=src.dtype, device=self.device)
        self.coll.all_gather(out, src, context=f"state-dict gather of {group.key}")
        return out.float()

    def full_state_dict(self, master_of: Any = None) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` keys; parameters from ``master_of(group key)`` (fp32 masters)
        where it returns a tensor, else from the parameter shards. Collective; on every rank."""
        values: dict[int, torch.Tensor] = {}
        for unit in self.units:
            for g in unit.groups:
                master = master_of(g.key) if (master_of is not None and g.requires_grad) else None
                flat = self.full_flat(g, master)
                for s in g.slots:
                    values[id(s.param)] = flat[s.offset:s.offset + s.numel].view(s.shape)
        out = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            if id(value) in values:
                out[key] = values[id(value)]
            else:
                out[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
        return out

    def _held_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for u in self.units:
            for g in u.groups:
                yield "param", g.full
                if g.shard is not None:
                    yield "param", g.shard
                if g.master is not None and not self.optimizer_offloaded:  # else host-side
                    yield "master", g.master
                if g.grad_staging is not None and g.grad_staging is not g.grad_host:
                    yield "grad", g.grad_staging
                if g.grad_acc is not None and g.grad_acc is not g.grad_host:
                    yield "grad", g.grad_acc

    def device_bytes(self) -> dict[str, int]:
        """Bytes held now, by kind, counting each storage once (views share their base's)."""
        seen: set[int] = set()
        out = {"param": 0, "master": 0, "grad": 0}
        for kind, t in self._held_tensors():
            storage = t.untyped_storage()
            if storage._cdata in seen:
                continue
            seen.add(storage._cdata)
            out[kind] += storage.nbytes()
        return out

    def _note_peak(self) -> None:
        self.peak_device_bytes = max(self.peak_device_bytes, sum(self.device_bytes().values()))
