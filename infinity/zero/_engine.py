"""``infinity.initialize(model, config)``: the training engine.

Usage (the same calls as a DeepSpeed engine)::

    engine = infinity.initialize(model, config)   # dict, JSON path, native or DeepSpeed-style
    loss = engine(batch)                           # forwards to the model (inputs moved to
                                                   # engine.device: [Note: the engine moves inputs])
    engine.backward(loss)                          # scales by 1/gradient_accumulation_steps
    engine.step()                                  # optimizer step at accumulation boundaries
    engine.stats(); engine.full_state_dict(); engine.module; engine.close()
    engine.optimizer                               # a torch.optim.Optimizer: param_groups, ...
    sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, f)   # sched.step() after step()

``initialize(model, config, model_parameters=groups)`` takes torch-style parameter groups
(DeepSpeed's argument name), each with its own ``lr``, ``betas``, ``eps``, ``weight_decay``
(:func:`~infinity.optim.resolve_param_groups`). ``engine.optimizer`` is an
:class:`~infinity.optim.EngineOptimizer` ([Note: the optimizer seen from outside] in
infinity/optim/_engine_optimizer.py); the update runs over the flat shards of
``engine.shard_optimizer`` with each group's current values, read at every step.

Every ``engine.step()`` call counts one micro-batch; the optimizer runs on every
``gradient_accumulation_steps``-th call (DeepSpeed semantics). Gradients are averaged over ranks and
summed over micro-batches (the loss is divided by the number of micro-batches in ``backward``).
Buffers are replicated: rank 0's are broadcast at set-up and before each training forward (DDP's
default).
The step: unscale (fp16), check for overflow (fp16: skip the step and lower the scale, DeepSpeed's
dynamic loss scaling), clip to ``gradient_clipping`` by the exact global norm over all shards and
ranks, Adam(W) on the fp32 master shards, write the new low-precision parameters back.

Composition: the config is resolved once here, and each part gets the typed values it uses:
:class:`~infinity.zero._param_manager.ParameterManager` (units, hooks, gradient shards; a
:class:`~infinity.zero._manager_config.ManagerConfig`) and a shard optimizer from
:mod:`infinity.optim`: in memory on the compute device, or, with ``offload_optimizer``, over the
tiered store (HOST or NVME home, pipelined by sub-group). With ``offload_param`` (stage 3) the
manager keeps each unit's parameter shard in the same store. Budgets are resolved and checked by
:func:`~infinity.zero._offload.resolve_offload` before any state is built. Without
``torch.distributed`` initialised the engine runs as world size 1; under ``torchrun`` it uses (or
creates) the default process group.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import weakref
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from infinity._dtypes import torch_dtype
from infinity._modeled_link import DuplexLink, LinkModel, ModeledLink
from infinity._timing import timer_for
from infinity.checkpoint import check_save_name, load_checkpoint, load_weights, save_checkpoint
from infinity.config import InfinityConfig
from infinity.io import activations_in_heap, manage_mmap_threshold
from infinity.optim import EngineOptimizer, InMemoryShardOptimizer, OffloadedShardOptimizer
from infinity.optim.schedulers import build_scheduler
from infinity.tiers import Tier
from infinity.zero._activations import HostActivations, apply_activation_checkpointing
from infinity.zero._buffers import broadcast_buffers, move_buffers
from infinity.zero._checkpoint_view import EngineCheckpointView
from infinity.zero._collectives import init_from_env_if_launched
from infinity.zero._device import resolve_device
from infinity.zero._grad_norm import global_norm_sq
from infinity.zero._inputs import move_to_device
from infinity.zero._loss_scale import LossScaler
from infinity.zero._managed import register_engine
from infinity.zero._engine_setup import (MasterStream, check_copy_link, checked_param_groups,
                                         close_offload, manager_config, materialise, parallelism)
from infinity.zero._engine_step_state import (check_step_state_dict, load_step_state_dict,
                                              step_state_dict)
from infinity.zero._engine_stats import engine_stats
from infinity.zero._offload import (activation_nvme_path, activations_need_store,
                                    build_activation_store, build_store, check_nvme_space_for,
                                    offload_inputs, resolve_offload)
from infinity.zero._param_manager import ManagerCalls, ParameterManager
from infinity.zero._step_plan import StepPlan
from infinity.zero._step_window import StepWindow
from infinity.zero._stored_activations import StoredActivations, cuda_activation_room
from infinity.zero._tensor_parallel import tensor_rank_dir
from infinity.zero._training_state import ParamWriteback
from infinity.zero._unit_builder import BuildProgress
from infinity.zero._unit_choice import UnitChoice, units_of

logger = logging.getLogger(__name__)


class InfinityEngine:
    """The training engine returned by :func:`initialize`; see the module docstring."""

    def __init__(self, model: nn.Module, config: InfinityConfig, *,
                 model_parameters: Any = None,
                 progress: Callable[[BuildProgress], None] | None = None, mesh: Any = None,
                 data_parallel_group: Any = None, comm_link: LinkModel | None = None,
                 copy_link: LinkModel | None = None):
        # Before anything is built: a bad group leaves the model untouched.
        groups, defaults = checked_param_groups(model, config, model_parameters)
        self.config = config
        self.device = resolve_device(config.device)  # [Note: one rank per device]
        self.compute_dtype = torch_dtype(config.precision.dtype)
        init_from_env_if_launched(self.device)  # binds the device first, then the group
        # [Note: collectives over a mesh] in infinity/zero/_collectives.py and [Note:
        # tensor-parallel parameters] in infinity/zero/_tensor_parallel.py
        self.tensor_parallel, self.collectives = parallelism(model, config, mesh,
                                                              data_parallel_group)
        if comm_link is not None:  # [Note: the modeled link] in infinity/_modeled_link.py
            self.collectives.attach_link(ModeledLink(comm_link))
        self.module = model
        self.optimizer_home: Tier = config.offload_optimizer.home_tier
        """Where the optimizer's state lives: DEVICE (in memory beside the parameters), HOST or
        NVME (``offload_optimizer.device``); the engine asks this, not the config."""
        choice = self._build_store(model, copy_link)
        groups, initial_values = materialise(model, groups)
        if initial_values is not None:  # new parameters: the units are chosen again over them
            choice = units_of(model, config.zero)
        move_buffers(model, self.device, self.compute_dtype)
        # [Note: masters stream into the optimizer] in infinity/zero/_engine_setup.py
        streaming = self._new_shard_optimizer() if self.optimizer_home is Tier.NVME else None
        if streaming is not None:
            streaming.hold_host_resident()
        self.manager = self._build_manager(model, choice, initial_values, streaming, progress,
                                           copy_link)
        # After the manager: its hooks stay outside the checkpointed regions
        # ([Note: checkpoint inside the module's hooks] in infinity/zero/_activations.py).
        if self.collectives.data_parallel_size > 1:
            broadcast_buffers(model, self.collectives)
        self.stored_activations = self._stored_activations()
        """[Note: saved activations are shards of the store]; None: not offloaded to the store."""
        self.activations = apply_activation_checkpointing(
            model, config.activation_checkpointing,
            unit_module_names=[u.name for u in self.manager.units],
            place=self.stored_activations)
        self._build_training_state(model, groups, defaults, streaming)
        if self.store is not None:
            self.store.end_setup()  # set-up is over: the steps' reads next
        logger.info("engine: stage %d, %s on %s, world size %d", config.zero.stage,
                    config.precision.dtype, self.device, self.collectives.world_size)

    def _build_store(self, model: nn.Module, copy_link: LinkModel | None) -> UnitChoice:
        """The offload plan (budgets checked on the parameters as they are: a budget error
        leaves a recorded model untouched), the tiered store and its swapper, the NVMe space
        check: before any state is written. Returns the units the sizes were read from."""
        config = self.config
        world = self.collectives.world_size  # the shard degree: what sizes divide by
        data_parallel = self.collectives.data_parallel_size
        self.offload = None
        if copy_link is not None:
            check_copy_link(config, self.device)
        # The units as the parameters are now: the sizes the budgets and the space check read
        # (a recorded model's materialisation replaces its parameters: chosen again then).
        choice = units_of(model, config.zero)
        inputs = offload_inputs(config, world_size=world, device=self.device,
                                data_parallel_size=data_parallel)
        if inputs.request.offloaded:
            self.offload = resolve_offload(choice, inputs, device=self.device)
        self.store, self._swapper = None, None
        if self.offload is not None:
            # [Note: activations stay in the heap] in infinity/io/_host_malloc.py
            manage_mmap_threshold()
            self.store, self._swapper = build_store(self.device, self.offload,
                                                    swapper_config=config.swapper,
                                                    rank=self.collectives.rank,
                                                    nvme_path=activation_nvme_path(config),
                                                    copy_link=(None if copy_link is None
                                                               else DuplexLink(copy_link)))
        elif activations_need_store(config):
            # [Note: saved activations are shards of the store] in
            # infinity/zero/_stored_activations.py: a store of their own
            manage_mmap_threshold()
            self.store, self._swapper = build_activation_store(self.device, config,
                                                               rank=self.collectives.rank)
        if self.store is not None:
            self.store.begin_setup()  # its writes: not on huge pages
        self._finalizer = weakref.finalize(self, close_offload, self.store, self._swapper)
        # Before any state is written ([Note: NVMe space check] in infinity/tiers/_nvme_space.py).
        if self._swapper is not None and self.offload is not None:
            check_nvme_space_for(choice, inputs, self.offload, store=self.store)
        return choice

    def _build_manager(self, model: nn.Module, choice: UnitChoice, initial_values: Any,
                       streaming: OffloadedShardOptimizer | None,
                       progress: Callable[[BuildProgress], None] | None,
                       copy_link: LinkModel | None) -> ParameterManager:
        """The parameter manager over the materialised model, its parameters registered for
        ``GatheredParameters``, its gradients down the modeled copy link where one is given."""
        config, nvme_optimizer = self.config, self.optimizer_home is Tier.NVME
        manager = ParameterManager(
            model, choice,
            manager_config(config, self.device, self.collectives.data_parallel_size,
                           self.offload, shard_world_size=self.collectives.world_size),
            collectives=self.collectives, store=self.store, initial_values=initial_values,
            calls=ManagerCalls(
                on_grad_ready=self._on_grad_ready if nvme_optimizer else None,  # [Note: optimizer read-ahead]
                master_sink=None if streaming is None else MasterStream(streaming),
                on_build_progress=progress,
                # [Note: the end of backward] in infinity/zero/_param_manager.py
                on_backward_begin=self._before_backward, on_backward_end=self._after_backward))
        register_engine(self, [s.param for u in manager.units for g in u.groups
                               for s in g.slots])  # infinity.deepspeed.zero.GatheredParameters
        if copy_link is not None and self.device.type == "cpu":  # a GPU's copies are real
            # [Note: gradients down a modeled link] in infinity/zero/_grad_reducer.py
            manager.reducer.attach_down_link(self.store.copy_link.to_host,
                                             self.store.counters.add_wait)
        return manager

    def _build_training_state(self, model: nn.Module, groups: Any, defaults: dict[str, Any],
                              streaming: OffloadedShardOptimizer | None) -> None:
        """What the training loop drives: the optimizer seen from outside, the shard optimizer,
        the step plan, the scheduler, the loss scaler and the accumulation window."""
        self.optimizer = EngineOptimizer(groups, defaults)
        """What code outside the engine drives: a torch.optim.Optimizer over the model's
        parameters ([Note: the optimizer seen from outside] in infinity/optim/_engine_optimizer.py)."""
        self.shard_optimizer = self._build_optimizer(streaming)
        """Adam over the flat fp32 shards (in memory or offloaded): the state and the update."""
        self._plan = StepPlan(self.manager, self.optimizer)
        """Which slices each step updates, with which hyperparameters and step numbers."""
        self._param_names = {id(p): n for n, p in model.named_parameters()}
        """id(parameter) -> its first qualified name (checkpoints keep step counts by name)."""
        self.lr_scheduler = build_scheduler(self.optimizer, self.config.scheduler)
        """The config's ``scheduler`` over ``engine.optimizer`` (None without one), stepped after
        every optimizer step that is not skipped, as DeepSpeed's engine does."""
        self.scaler = LossScaler(self.config.precision)
        self._window = StepWindow(self.config.gradient_accumulation_steps)
        """The accumulation window and the step counters: the one owner of "where the loop is"
        between ``step()`` calls."""
        self.last_grad_norm: float | None = None
        """Global gradient norm before clipping at the last optimizer step."""
        self._step_timer = timer_for(self.device)
        """Times the optimizer steps: event pairs on a GPU, the wall clock on a CPU ([Note:
        timing asynchronous GPU work] in infinity/_timing.py)."""
        home = self.optimizer_home
        self._can_defer = home is Tier.NVME or (home is Tier.HOST
                                                and self._updates_cross_to_device)
        """The optimizer step may be deferred into the next forward (resolved once: the
        optimizer's home and the manager's tiers do not change): see :attr:`_deferring`."""
        self.defer_optimizer_step = True
        """NVMe optimizer: the updates of a step run in the next forward, each just before its
        parameter shard is read ([Note: deferred optimizer step]); False runs them in step()."""

    def _stored_activations(self) -> StoredActivations | None:
        """The checkpointed inputs' place in the store, with 'auto' keeping the room the states
        want for overlap ([Note: saved activations are shards of the store]); None where the
        config keeps them elsewhere."""
        tier = self.config.activation_checkpointing.offload_tier
        if tier == "none" or self.store is None:
            return None
        reserve = self.offload.states_host_room_bytes if self.offload is not None else 0
        return StoredActivations(self.store, tier, host_reserve_bytes=reserve,
                                 device_room=(cuda_activation_room(self.device)
                                              if self.device.type == "cuda" else None))

    def _new_shard_optimizer(self) -> InMemoryShardOptimizer | OffloadedShardOptimizer:
        """The shard optimizer of the config, holding no key yet."""
        config = self.config
        if self.optimizer_home is Tier.DEVICE:
            return InMemoryShardOptimizer(config.optimizer)
        optimizer = OffloadedShardOptimizer(
            config.optimizer, self.store, home=self.optimizer_home,
            sub_group_numel=self.offload.sub_group_numel,
            window_sub_groups=self.offload.optimizer_window_sub_groups,
            host_resident_bytes=self.offload.optimizer_host_resident_bytes)
        # [Note: deferred optimizer step] in infinity/optim/_offloaded.py (a no-op while no step
        # is deferred)
        self.store.set_read_gate(optimizer)
        return optimizer

    def _build_optimizer(self, streaming: OffloadedShardOptimizer | None
                         ) -> InMemoryShardOptimizer | OffloadedShardOptimizer:
        """The shard optimizer with every trainable group's master: ``streaming`` already took
        them as the units were built ([Note: masters stream into the optimizer]) but for the
        host-resident ones it held back; otherwise a new one takes them now."""
        if streaming is not None:
            streaming.release_held()
            return streaming
        optimizer = self._new_shard_optimizer()
        for g in self.manager.trainable_groups():
            part = self.manager.param_partition(g)
            if optimizer.offloaded:
                optimizer.add(g.key, g.master, part, param_key=g.store_key)
                g.master = None  # the store holds the master now; the parameters stay here
            else:
                optimizer.add(g.key, g.master, part if g.master is not part else None)
        return optimizer

    @property
    def _deferring(self) -> bool:
        """The optimizer step is deferred into the next forward ([Note: deferred optimizer step]
        in infinity/optim/_offloaded.py): with the optimizer's state on NVMe, and with it in host
        memory where the updated shards cross to the device every step ([Note: a deferred step
        overlaps the copies up]); ``defer_optimizer_step`` False turns it off."""
        return self.defer_optimizer_step and self._can_defer

    @property
    def _updates_cross_to_device(self) -> bool:
        """[Note: a deferred step overlaps the copies up]
        With parameters offloaded and read through the DEVICE tier (a GPU; a CPU engine with a
        device budget) that cannot keep every shard, each updated shard is copied up between its
        update and the forward's read of it ([Note: updated shards are written where the optimizer
        runs] in infinity/zero/_param_partitions.py). Run in ``step()``, every update comes first and
        the copies only after: the forward then waits for the link, whose work the step could
        have started. Deferred into the next forward, each shard's update runs as its read is
        issued, so the copy of unit k runs while the updates of the units after it compute, and the
        step's compute and the copies up overlap. (The 350m GPT, one rank, the modeled copy link
        at 0.189 GB/s: 8.6-8.8 s a step deferred, 8.7-9.0 s in place, three steps each; small,
        because its forward already waited on the link for the updated shards' bytes and the
        optimizer's 0.4 s is what there was to hide.)"""
        return self.manager.updates_cross_to_device

    def _on_grad_ready(self, key: str) -> None:
        if not self._deferring:  # deferred: the read-ahead runs in the next forward's order
            self.shard_optimizer.prefetch(key)

    # ------------------------------------------------------------------ the public calls

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.module.training and self.collectives.data_parallel_size > 1:
            broadcast_buffers(self.module, self.collectives)
        # [Note: the engine moves inputs] in infinity/zero/_inputs.py
        args, kwargs = move_to_device(args, self.device), move_to_device(kwargs, self.device)
        if self.stored_activations is not None:  # what it saves now is named by this micro-step
            self.stored_activations.micro_step = self.micro_steps
        # [Note: activations stay in the heap] in infinity/io/_host_malloc.py
        with self.manager.forward_scope(), activations_in_heap():
            try:
                return self.module(*args, **kwargs)
            except RuntimeError as e:
                if "for storage of size 0" in str(e):
                    raise RuntimeError(
                        f"a parameter of a released unit was read ({e}). A module used another "
                        f"module's parameter on a code path the first step did not take; make "
                        f"the module that uses it own it, or raise "
                        f"zero.persistence_threshold_numel / use zero.unit_class_names so both "
                        f"end up in one unit") from e
                raise

    @contextlib.contextmanager
    def schedule_step(self) -> Iterator[None]:
        """Wraps a pipeline schedule's forwards and backwards of one step
        (:mod:`infinity.pipeline`): the prefetcher records them as one step, in the schedule's
        order ([Note: one prefetch step per schedule step] in infinity/zero/_param_manager.py)."""
        self.manager.begin_schedule_step()
        try:
            yield
        finally:
            self.manager.end_schedule_step()

    @property
    def is_gradient_accumulation_boundary(self) -> bool:
        return self._window.is_boundary

    @property
    def between_steps(self) -> bool:
        """No micro-batch of an accumulation window is pending: the last ``engine.step()`` ran the
        optimizer (or none ran yet) and no backward came since. Checkpoints and weights are
        saved and loaded only here (partial gradients belong to no saved state)."""
        return self._window.between_steps

    @property
    def gradient_accumulation_steps(self) -> int:
        return self._window.gradient_accumulation_steps

    @property
    def micro_steps(self) -> int:
        """``engine.step()`` calls so far (micro-batches)."""
        return self._window.micro_steps

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken (skipped fp16 overflow steps count too, as in DeepSpeed)."""
        return self._window.global_steps

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for an fp16 overflow."""
        return self._window.skipped_steps

    @property
    def lr(self) -> float:
        """The learning rate of the first parameter group; setting it sets every group's."""
        return float(self.optimizer.param_groups[0]["lr"])

    @lr.setter
    def lr(self, value: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = float(value)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def backward(self, loss: torch.Tensor, *, scale_wrt_gas: bool = True) -> None:
        """Backward of one micro-batch's loss, gradients accumulated into the shards.
        ``scale_wrt_gas`` (DeepSpeed's name): divide the loss by ``gradient_accumulation_steps``;
        False for a caller whose loss is already normalised over the window (the Trainer's
        ``num_items_in_batch`` losses, accelerate's own division)."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"engine.backward: expected a scalar loss tensor, got "
                             f"{type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}")
        if not loss.requires_grad:
            raise ValueError("engine.backward: the loss does not require grad (was the forward "
                             "run under torch.no_grad(), or are all parameters frozen?)")
        scale = self.scaler.scale / (self.gradient_accumulation_steps if scale_wrt_gas else 1)
        self._before_backward()
        self.manager.begin_backward()
        try:
            with activations_in_heap():  # [Note: activations stay in the heap] (io)
                (loss * scale if scale != 1.0 else loss).backward()
            self.manager.finish_backward()
        except BaseException:
            self.manager.abort_backward()
            raise
        self._after_backward()

    def _before_backward(self) -> None:
        """A backward starts (``engine.backward``, or the first hook of a ``loss.backward()``:
        [Note: the end of backward] in infinity/zero/_param_manager.py)."""
        self.shard_optimizer.drain()  # the gradients are about to change: the last step is done
        reducer = self.manager.reducer  # [Note: one all-reduce per window at stages 0-1]
        reducer.sums_locally = reducer.may_sum_locally and not self._window.is_boundary
        if self._deferring:  # the state the next step updates first, read while backward runs
            self.shard_optimizer.read_ahead(self.manager.forward_keys())

    def _after_backward(self) -> None:
        """A backward ended and its gradients are reduced."""
        self.manager.end_prefetch_step()  # before the optimizer step changes the parameters
        self._window.backward_done()

    def step(self, *, boundary: bool | None = None, gradient_clipping: float | None = None
             ) -> None:
        """Count one micro-batch; at an accumulation boundary, run the optimizer.

        ``boundary``: None runs it on every ``gradient_accumulation_steps``-th call (DeepSpeed's
        rule); True or False is the caller's decision (a trainer whose last window of an epoch
        is short: DeepSpeed's ``set_gradient_accumulation_boundary``). A window never outgrows
        ``gradient_accumulation_steps``; an early boundary restarts the count, so the engine is
        ``between_steps`` after it as after any other step. ``gradient_clipping``: this step's
        clip norm instead of the config's (0 or inf: no clipping; accelerate's
        ``clip_grad_norm_(parameters, max_norm)`` passes its ``max_norm``)."""
        self._window.require_backward()
        clip = self.config.gradient_clipping if gradient_clipping is None else gradient_clipping
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip >= 0:
            raise ValueError(f"engine.step: gradient_clipping must be a number >= 0 (0 or inf: "
                             f"no clipping), got {gradient_clipping!r}")
        if not self._window.count(boundary):
            return
        self.optimizer.mark_stepped()  # torch's LR schedulers check it
        self._step_timer.start()
        self._optimizer_step(float(clip))
        self._step_timer.stop()

    def discard_window(self) -> None:
        """Drop the gradients accumulated since the last optimizer step and restart the window:
        a step that raised midway (a pipeline schedule's, :mod:`infinity.pipeline`) must not
        leave its finished micro-batches' gradients to the next one."""
        self._settle()
        self.manager.zero_grads()
        self.shard_optimizer.cancel_prefetch()  # no step uses the state read ahead
        self._window.discard()

    def _host_activation_bytes(self) -> dict[str, int]:
        """Saved activations in host memory outside the arena ([Note: activations on the host]
        in infinity/zero/_activations.py), beside the arena's bytes; empty otherwise (the
        store's are in the arena's count, and in ``stats()['activations']``)."""
        host = self.activations.host
        if not isinstance(host, HostActivations):
            return {}
        return {"activations_current": host.live_bytes, "activations_peak": host.peak_bytes}

    def _optimizer_step(self, clip: float) -> None:
        self.manager.settle_params()  # a unit the last forward did not use: its gather is in flight
        grads = self.manager.grad_partitions()
        inv_scale = 1.0 / self.scaler.scale
        norm_sq, overflow = global_norm_sq(
            grads, sharded_keys=self.manager.tensor_sharded_keys(), device=self.device,
            collectives=self.collectives if self.manager.stage > 0 else None,
            tensor_collectives=(None if self.tensor_parallel is None
                                else self.tensor_parallel.collectives),
            pipeline_collectives=self.collectives.pipeline)
        fp16 = self.scaler.dynamic or self.compute_dtype == torch.float16
        self._window.optimizer_step(skipped=fp16 and overflow)
        if fp16:
            if overflow:
                self.scaler.update(True)
                logger.info("fp16 overflow: step %d skipped, loss scale now %g",
                            self.global_steps, self.scaler.scale)
                self.manager.zero_grads()
                self.shard_optimizer.cancel_prefetch()  # no step uses the state read ahead
                return
            self.scaler.update(False)
        norm = math.sqrt(norm_sq) * inv_scale
        self.last_grad_norm = norm
        coef = 1.0
        if 0 < clip < math.inf and norm > clip:
            coef = clip / (norm + 1e-6)
        # Lazy only for a deferred step: a step run in place flushes every shard home right
        # after it, and there eager write-backs overlap the updates of the later keys.
        lazy = self._deferring and self.offload.device_holds_params
        self.manager.set_param_writeback(ParamWriteback.LAZY if lazy else ParamWriteback.EAGER)
        # [Note: parameters without a gradient] in infinity/zero/_grad_presence.py
        updated = self.manager.params_with_grad()
        runs = self._plan.runs(updated)
        if self._deferring:
            self.shard_optimizer.step(grads, grad_scale=inv_scale * coef, runs=runs, defer=True,
                                      order=self.manager.forward_keys())
        elif self.shard_optimizer.offloaded:
            self.shard_optimizer.step(grads, grad_scale=inv_scale * coef, runs=runs)
            self.flush_offload()
        else:  # each unit's after-step gather may start as its keys are updated
            self.shard_optimizer.step(grads, grad_scale=inv_scale * coef, runs=runs,
                                      on_stepped=self.manager.on_stepped())
            self.flush_offload()
        self._plan.commit(updated)
        self.manager.after_step()
        if self.lr_scheduler is not None:  # not after a skipped step (the return above)
            self.lr_scheduler.step()

    def stats(self) -> dict[str, Any]:
        """Bytes per tier (current and peak), bytes moved per tier pair, stall seconds, counters.

        DEVICE counts what the parameter manager holds (gathered units, shards, masters, gradient
        buffers: each storage once), the in-memory optimizer's moments and the store's DEVICE
        copies; its peak adds the parts' high-water marks (an upper bound). HOST is the store's
        arena use (with an offloaded optimizer it holds the gradient accumulators too,
        [Note: gradient placement] in infinity/ledger/_estimate.py); NVME the bytes of the shards
        whose home is a swap file.
        """
        return engine_stats(self, host_activation_bytes=self._host_activation_bytes(),
                            optimizer_step_s=self._step_timer.total_s())

    def full_state_dict(self, keys: Any = None) -> dict[str, torch.Tensor]:
        """The model's full state dict (fp32 masters for trained parameters), keyed like
        ``model.state_dict()``; ``keys``: only those entries (e.g. a LoRA adapter's, without
        gathering the frozen base). A collective: call it on every rank with the same keys."""
        self._settle()  # a deferred step's updates and after-step gathers land first
        if self.collectives.data_parallel_size > 1:
            broadcast_buffers(self.module, self.collectives)
        return self.manager.full_state_dict(master_of=self.shard_optimizer.master_values,
                                            keys=keys)

    def load_weights(self, path: str, *, strict: bool = True,
                     key_map: Mapping[str, str] | None = None,
                     optional_keys: Any = ()) -> dict[str, list[str]]:
        """Load model weights from a safetensors file, a directory, or a Hugging Face sharded
        index straight into the shards (each rank reads only its ranges; optimizer moments are
        left as they are; ``key_map`` / ``optional_keys``: a wrapped model's names, see
        :func:`infinity.checkpoint.load_weights`). A collective: call it on every rank."""
        if self.tensor_parallel is not None:  # [Note: full state dict under tensor parallelism]
            raise ValueError("engine.load_weights: loading weights files into the shards is not "
                             "supported with tensor parallelism yet (the files hold full "
                             "tensors, each tensor rank a slice); load them into the model "
                             "before parallelize_module and initialize")
        self._settle()  # a deferred step's updates and after-step gathers land first
        return load_weights(self, path, strict=strict, key_map=key_map,
                            optional_keys=optional_keys)

    def save_checkpoint(self, directory: str, *, tag: str | None = None,
                        client_state: Any = None) -> str:
        """Save the full training state under ``directory`` (see :mod:`infinity.checkpoint`);
        a collective: call it on every rank. Returns the new save's directory. ``tag``: its
        name instead of ``step-N`` (never an existing one); ``client_state``: rank 0's object,
        saved with it (DeepSpeed's two arguments)."""
        self._settle()  # a deferred step's updates and after-step gathers land first
        return save_checkpoint(self, self._tensor_rank_dir(directory), name=tag,
                               client_state=client_state)

    def load_checkpoint(self, directory: str, *, tag: str | None = None) -> dict[str, Any]:
        """Restore from a checkpoint root (its newest save, or the save named ``tag``) or one
        save's folder, at any world size; everything is validated on every rank before any
        state changes."""
        self._settle()  # a deferred step's updates and after-step gathers land first
        root = self._tensor_rank_dir(directory)
        if tag is not None:
            check_save_name(tag)
            root = os.path.join(os.fspath(root), tag)
        return load_checkpoint(self, root)

    def _tensor_rank_dir(self, directory: Any) -> str:
        """[Note: checkpoints under tensor parallelism] in infinity/zero/_tensor_parallel.py"""
        if self.tensor_parallel is None:
            return directory
        return tensor_rank_dir(self.tensor_parallel, os.fspath(directory))

    def finish_step(self) -> None:
        """Run the optimizer updates still deferred into the next forward ([Note: deferred
        optimizer step]) and wait for their write-backs, and for after-step gathers in flight
        ([Note: the after-step gather overlaps the next forward] in
        infinity/zero/_step_gathers.py): a timed loop's last step then ends with its own update,
        not the work of a forward that never comes. A no-op when nothing waits."""
        self._settle()

    def _settle(self) -> None:
        if self.stored_activations is not None:
            self.stored_activations.drain()  # graphs dropped without a backward
        self.shard_optimizer.drain()
        self.manager.settle_params()

    def checkpoint_view(self) -> EngineCheckpointView:
        """What checkpointing reads and writes of this engine ([Note: what a checkpoint touches]
        in infinity/checkpoint/_target.py)."""
        return EngineCheckpointView(self)

    def flush_offload(self) -> None:
        """Every shard the store holds is current in its home tier (a no-op without offload)."""
        if self.store is not None:
            self.store.flush()

    def step_state_dict(self) -> dict[str, Any]:
        """What a checkpoint's manifest keeps as ``engine`` (:func:`step_state_dict`)."""
        return step_state_dict(self)

    def check_step_state_dict(self, state: Mapping[str, Any]) -> None:
        """ValueError when :meth:`load_step_state_dict` could not take ``state`` (checked before
        a checkpoint changes anything)."""
        check_step_state_dict(self, state)

    def load_step_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`step_state_dict` returned (between steps)."""
        load_step_state_dict(self, state)

    def close(self) -> None:
        """Stop the store's threads and delete swap files (also done when the engine is
        garbage-collected or the interpreter exits)."""
        try:
            self._settle()  # write-backs and gathers in flight end before the store closes
        finally:
            self.manager.reducer.close()
            self._finalizer()
        self.store, self._swapper = None, None
