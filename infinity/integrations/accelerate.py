"""``infinity.integrations.accelerate.Accelerator``: accelerate's ``Accelerator``, training through
the engine. Changing the import line switches a script::

    from infinity.integrations.accelerate import Accelerator   # was: from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=2, infinity_config="ds_config.json")
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader,
                                                                  scheduler)
    for batch in dataloader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
    accelerator.save_state("ckpt")

It is a subclass of ``accelerate.Accelerator`` (1.x, tested with 1.16): dataloaders, ``gather``,
``is_main_process``, ``device``, ``accumulate``, ``autocast``, ``wait_for_everyone`` and the rest
are accelerate's own. What changes, where the model is concerned:

- ``prepare(model, optimizer, ...)`` builds the engine (``infinity.initialize``) with
  ``infinity_config`` (a DeepSpeed-style or native dict, a JSON path, an InfinityConfig or None)
  completed by what the script already says ([Note: values the trainer drives] in
  infinity/integrations/_config.py): the optimizer's type and defaults, ``gradient_accumulation_steps``,
  ``mixed_precision`` (the engine's compute dtype; no autocast, no GradScaler: the engine keeps
  fp32 masters and scales fp16 losses itself), the device, the dataloader's batch size. The
  optimizer must be ``torch.optim.AdamW`` or ``Adam``; its ``param_groups`` (and their
  hyperparameters) become the engine's groups. One model (and one optimizer) per Accelerator,
  as with DeepSpeed; pass them to the same ``prepare`` call. A scheduler built on the optimizer
  is re-bound to ``engine.optimizer`` and then wrapped by accelerate as usual.
- ``backward(loss)`` runs ``engine.backward``; ``clip_grad_norm_`` (L2 only) and
  ``optimizer.step()`` run the engine's optimizer step at a sync step ([Note: the sync step]).
- ``unwrap_model``, ``get_state_dict`` (the full state dict: a collective, call it on every
  process), ``save_state`` / ``load_state`` (accelerate's files plus an engine checkpoint under
  ``<dir>/infinity``).

Unsupported accelerate features raise at construction: DeepSpeed / FSDP / Megatron plugins (the
engine replaces them), XLA, fp8, tensor and context parallelism.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
from typing import Any, Iterator

import torch
from torch import nn

from infinity._common import warn_once
from infinity.config import load_config
from infinity.integrations._config import device_name, resolve_config
from infinity.integrations._require import require
from infinity.zero import initialize

_accelerate = require("accelerate", "infinity.integrations.accelerate")
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402 (after the check above)
from accelerate.utils import DistributedType  # noqa: E402

logger = logging.getLogger(__name__)

ENGINE_DIR = "infinity"
"""Subfolder of a ``save_state`` folder (and of a Trainer's ``checkpoint-N``) holding the engine
checkpoint: parameters, fp32 masters and Adam moments of every rank, step counters."""

_TORCH_SWITCHES = frozenset({"foreach", "fused", "capturable", "differentiable", "maximize",
                             "amsgrad", "decoupled_weight_decay"})
"""torch.optim Adam(W) group keys that choose torch's kernel or variant, not hyperparameters: not
handed to the engine (``amsgrad`` and ``maximize`` are refused when true)."""


class PreparedModel(nn.Module):
    """What ``prepare`` returns for the model: calls go through the engine (its forward scope:
    gathers, prefetch trace, buffer broadcast); ``train()``/``eval()`` and ``parameters()`` reach
    the model, which is ``.module`` (like DistributedDataParallel's)."""

    def __init__(self, engine: Any):
        super().__init__()
        self.module = engine.module
        self.engine = engine
        self._is_accelerate_prepared = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)


class _SyncStep:
    """[Note: the sync step] The engine's accumulation window as accelerate drives it. Gradients
    accumulate in the engine's shards, so accelerate's calls change meaning:
    ``backward(loss)`` divides by ``gradient_accumulation_steps`` (as accelerate does) and runs
    ``engine.backward``; off a sync step it also counts the micro-batch (``engine.step`` without
    an update). On a sync step the update is left pending for the first of
    ``clip_grad_norm_(parameters, max_norm)`` (which runs it clipping to ``max_norm``, by the
    exact global norm over every shard and rank, and returns that norm) or ``optimizer.step()``
    (which runs it with the config's ``gradient_clipping``). The window ends where accelerate
    says (``sync_gradients``: every ``gradient_accumulation_steps`` micro-batches, and at the end
    of a dataloader), which ``engine.step(boundary=True)`` follows. ``zero_grad`` has nothing to
    do: the engine clears its gradients after each update."""

    def __init__(self, engine: Any, *, gradient_clipping: float):
        self.engine = engine
        self.gradient_clipping = float(gradient_clipping)
        """The config's clip norm (0: none), handed here with the config the engine was built
        from: ``clip_grad_norm_`` checks its ``max_norm`` against it, without reaching into the
        engine's config."""
        self.pending = False
        """A sync step's backward ran and its update has not (see the note)."""
        self.skipped = False
        """The last update was skipped for an fp16 overflow (accelerate's ``step_was_skipped``)."""
        self.last_norm: float | None = None
        """Global gradient norm before clipping at the last update (inf when it overflowed)."""

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        if self.pending:
            raise RuntimeError("accelerator.backward: the last sync step's optimizer step has not "
                               "run; call optimizer.step() after accelerator.backward(loss) on "
                               "every sync step (accelerator.sync_gradients)")
        self.engine.backward(loss, scale_wrt_gas=False)
        if sync:
            self.pending = True
        else:
            self.engine.step(boundary=False)

    def update(self, clip: float | None) -> None:
        """Run the pending update, if any (clip: this step's clip norm, None: the config's)."""
        if not self.pending:
            return
        self.pending = False
        skipped_before = self.engine.skipped_steps
        self.engine.step(boundary=True, gradient_clipping=clip)
        self.skipped = self.engine.skipped_steps > skipped_before
        self.last_norm = math.inf if self.skipped else self.engine.last_grad_norm


class PreparedOptimizer(AcceleratedOptimizer):
    """What ``prepare`` returns for the optimizer: accelerate's wrapper around ``engine.optimizer``
    (a ``torch.optim.Optimizer``: ``param_groups`` and ``state_dict`` are the engine's). ``step()``
    runs the sync step's update ([Note: the sync step]); ``zero_grad()`` is a no-op."""

    def __init__(self, sync_step: _SyncStep):
        super().__init__(sync_step.engine.optimizer, device_placement=False, scaler=None)
        self._sync_step = sync_step
        self._is_accelerate_prepared = True

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        pass  # the engine clears its gradient shards after each update

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("optimizer.step(closure): closures are not supported by the engine "
                             "(it steps once per accumulation window)")
        if self.gradient_state.sync_gradients:
            self._sync_step.update(clip=None)
            self.optimizer.step()  # the engine optimizer's no-op: LR schedulers see a step

    @property
    def step_was_skipped(self) -> bool:
        return self._sync_step.skipped


def _optimizer_type(optimizer: torch.optim.Optimizer) -> str:
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise ValueError(
            f"accelerator.prepare: the engine runs Adam/AdamW over its shards; got "
            f"{type(optimizer).__module__}.{type(optimizer).__qualname__}. Pass a "
            f"torch.optim.AdamW (or Adam) built with the parameter groups and hyperparameters "
            f"you want")
    for i, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ValueError(f"accelerator.prepare: optimizer param_groups[{i}] sets "
                                 f"{flag}=True, which the engine's Adam does not implement")
    decoupled = (isinstance(optimizer, torch.optim.AdamW)
                 or bool(optimizer.defaults.get("decoupled_weight_decay", False)))
    return "adamw" if decoupled else "adam"


def _float(value: Any) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _groups_of(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The engine's ``model_parameters``: the optimizer's groups, hyperparameters as numbers,
    torch's kernel switches dropped, extra keys (``initial_lr``, names) kept."""
    groups = []
    for group in optimizer.param_groups:
        out = {k: v for k, v in group.items() if k not in _TORCH_SWITCHES and k != "params"}
        out["params"] = list(group["params"])
        out["lr"], out["eps"] = _float(group["lr"]), _float(group["eps"])
        out["weight_decay"] = _float(group["weight_decay"])
        out["betas"] = tuple(_float(b) for b in group["betas"])
        groups.append(out)
    return groups


def rebind_scheduler(scheduler: Any, old: torch.optim.Optimizer, new: torch.optim.Optimizer
                     ) -> None:
    """Point ``scheduler`` (and the schedulers it chains) from ``old`` to ``new``, whose groups
    are ``old``'s in the same order with the same values, so its schedule carries on."""
    for s in [scheduler, *getattr(scheduler, "_schedulers", [])]:
        if getattr(s, "optimizer", None) is old:
            s.optimizer = new
    # torch's LRScheduler warns on its first step() unless optimizer.step carries the marker its
    # constructor puts there (patch_track_step_called); it put it on ``old``'s step only.
    if not hasattr(new.step, "_wrapped_by_lr_sched"):
        step = new.step

        def tracked(*args: Any, **kwargs: Any) -> Any:
            new._opt_called = True
            return step(*args, **kwargs)

        tracked._wrapped_by_lr_sched = True
        new.step = tracked


class Accelerator(_accelerate.Accelerator):
    """accelerate's ``Accelerator`` with the model trained by the engine; see the module
    docstring. ``infinity_config``: the engine's config (as ``infinity.initialize`` takes it)."""

    def __init__(self, *args: Any, infinity_config: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._init_engine_state(infinity_config)

    @classmethod
    def adopt(cls, accelerator: Any, *, infinity_config: Any = None) -> "Accelerator":
        """Make the stock ``accelerator`` this class, in place, and return it. The Trainer builds
        its Accelerator itself (``Trainer.create_accelerator_and_postprocess`` has no factory to
        override) and keeps bound methods of it (``gather_function``); a second instance beside
        it would split that state, so the Trainer integration converts the one it made."""
        if type(accelerator) is not _accelerate.Accelerator:
            raise TypeError(f"Accelerator.adopt: expected an accelerate.Accelerator, got "
                            f"{type(accelerator).__qualname__} (a subclass may override what the "
                            f"engine needs; build infinity's Accelerator instead)")
        accelerator.__class__ = cls
        accelerator._init_engine_state(infinity_config)
        return accelerator

    def _init_engine_state(self, infinity_config: Any) -> None:
        kind = self.distributed_type
        if kind in (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM,
                    DistributedType.XLA):
            raise ValueError(f"infinity's Accelerator: distributed type {kind} is not supported; "
                             f"the engine replaces DeepSpeed and FSDP (drop the plugin or the "
                             f"`accelerate config` choice, and pass a DeepSpeed config as "
                             f"infinity_config instead)")
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise ValueError(f"infinity's Accelerator: mixed_precision={self.mixed_precision!r} "
                             f"is not supported; use 'no', 'bf16' or 'fp16'")
        pc = getattr(self, "parallelism_config", None)
        if pc is not None and (pc.tp_enabled or pc.cp_enabled):
            raise ValueError("infinity's Accelerator: tensor and context parallelism are not "
                             "supported (the engine shards data-parallel only)")
        # The engine computes in the mixed-precision dtype with fp32 masters and its own fp16
        # loss scaling: no autocast on top (autocast() becomes a no-op), no GradScaler.
        self.native_amp = False
        self.scaler = None
        self.infinity_config = infinity_config
        """The engine's config source (see the module docstring)."""
        self.engine_config_values: dict[str, tuple[Any, str]] = {}
        """Driven config values a trainer adds (``Values`` of infinity/integrations/_config.py);
        they win over the ones derived from the optimizer and this Accelerator."""
        self.engine_deepspeed_values: dict[str, Any] = {}
        """DeepSpeed-only values a trainer adds for "auto" (``scheduler.params.*``...)."""
        self.engine: Any = None
        """The InfinityEngine behind the prepared model (None before ``prepare``)."""
        self._prepared: tuple[PreparedModel, PreparedOptimizer | None] | None = None
        self._sync_step: _SyncStep | None = None

    # ------------------------------------------------------------------ prepare

    def _config_values(self, optimizer: torch.optim.Optimizer | None,
                       batch_size: int | None) -> dict[str, tuple[Any, str]]:
        values: dict[str, tuple[Any, str]] = {
            "gradient_accumulation_steps": (self.gradient_accumulation_steps,
                                            "Accelerator(gradient_accumulation_steps=)"),
            "device": (device_name(self.device), "Accelerator.device")}
        if self.mixed_precision != "no":
            values["precision.dtype"] = (self.mixed_precision, "Accelerator(mixed_precision=)")
        if batch_size is not None:
            values["train_micro_batch_size_per_gpu"] = (batch_size, "the DataLoader's batch_size")
        if optimizer is not None:
            name = f"the optimizer given to prepare ({type(optimizer).__qualname__})"
            values["optimizer.type"] = (_optimizer_type(optimizer), name)
            d = optimizer.defaults
            values["optimizer.lr"] = (_float(d["lr"]), f"{name}'s lr")
            values["optimizer.betas"] = (tuple(_float(b) for b in d["betas"]), f"{name}'s betas")
            values["optimizer.eps"] = (_float(d["eps"]), f"{name}'s eps")
            values["optimizer.weight_decay"] = (_float(d["weight_decay"]),
                                                f"{name}'s weight_decay")
        return {**values, **self.engine_config_values}

    def _build_engine(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                      batch_size: int | None) -> tuple[PreparedModel, PreparedOptimizer | None]:
        if self._prepared is not None:
            prepared_model, prepared_optimizer = self._prepared
            if model is prepared_model or model is self.engine.module:
                if optimizer not in (None, prepared_optimizer, self.engine.optimizer):
                    raise ValueError("accelerator.prepare: this model's engine was built with "
                                     "another optimizer; its optimizer is the one prepare "
                                     "returned then")
                return self._prepared
            raise ValueError("infinity's Accelerator trains one model (as with DeepSpeed); use "
                             "another Accelerator for another model")
        if isinstance(model, PreparedModel):
            raise ValueError("accelerator.prepare: this model was prepared by another "
                             "Accelerator")
        # Resolved here (its 'auto' values a trainer would fill take their defaults), so that the
        # engine and the sync step below see the same gradient_clipping.
        config = load_config(resolve_config(self.infinity_config,
                                            self._config_values(optimizer, batch_size),
                                            deepspeed_only=self.engine_deepspeed_values))
        groups = _groups_of(optimizer) if optimizer is not None else None
        self.engine = initialize(model, config, model_parameters=groups)
        self._sync_step = _SyncStep(self.engine, gradient_clipping=config.gradient_clipping)
        prepared_optimizer = PreparedOptimizer(self._sync_step) if optimizer is not None else None
        self._prepared = (PreparedModel(self.engine), prepared_optimizer)
        logger.info("engine built: %d parameter group(s), gradient_accumulation_steps %d",
                    len(self.engine.optimizer.param_groups), self.engine.gradient_accumulation_steps)
        return self._prepared

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """accelerate's ``prepare``, with the model (and its optimizer) handed to the engine."""
        models = [a for a in args if isinstance(a, nn.Module)]
        if not models:
            stray = [a for a in args if isinstance(a, torch.optim.Optimizer)
                     and not isinstance(a, PreparedOptimizer)]
            if stray and self.engine is None:
                raise ValueError("accelerator.prepare: pass the model and its optimizer to the "
                                 "same prepare() call (the engine builds its optimizer from the "
                                 "optimizer's parameter groups)")
            return super().prepare(*args, device_placement=device_placement)
        if len(models) > 1:
            raise ValueError(f"accelerator.prepare: got {len(models)} models; infinity's "
                             f"Accelerator trains one model (as with DeepSpeed)")
        optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
        if len(optimizers) > 1:
            raise ValueError(f"accelerator.prepare: got {len(optimizers)} optimizers; the engine "
                             f"runs one (use parameter groups for per-group hyperparameters)")
        optimizer = optimizers[0] if optimizers else None
        loaders = [a for a in args if isinstance(a, torch.utils.data.DataLoader)]
        batch_size = loaders[0].batch_size if loaders else None
        prepared_model, prepared_optimizer = self._build_engine(models[0], optimizer, batch_size)
        swap = {id(models[0]): prepared_model}
        if optimizer is not None:
            swap[id(optimizer)] = prepared_optimizer
            for a in args:
                if isinstance(a, torch.optim.lr_scheduler.LRScheduler):
                    rebind_scheduler(a, optimizer, self.engine.optimizer)
        args = tuple(swap.get(id(a), a) for a in args)
        return super().prepare(*args, device_placement=device_placement)

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> nn.Module:
        if isinstance(model, PreparedModel) or (self.engine is not None
                                               and model is self.engine.module):
            prepared = self._prepared[0]
            if prepared not in self._models:
                self._models.append(prepared)
            return prepared
        if evaluation_mode:
            # Before any engine exists (a Trainer evaluating before train()) the model runs as
            # it is; moving it would defeat the offload the engine is configured for.
            return model
        raise ValueError("accelerator.prepare_model: pass the model and its optimizer to one "
                         "accelerator.prepare(model, optimizer, ...) call (the engine builds its "
                         "optimizer from the optimizer's parameter groups)")

    # ------------------------------------------------------------------ the step

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self._sync_step is None:
            return super().backward(loss, **kwargs)
        if kwargs:
            raise ValueError(f"accelerator.backward: {sorted(kwargs)} are not supported with "
                             f"the engine")
        self._sync_step.backward(loss / self.gradient_accumulation_steps,
                                 sync=self.sync_gradients)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        """The engine's update of this sync step, clipped to ``max_norm`` by the exact global L2
        norm; returns that norm (before clipping) as a tensor ([Note: the sync step])."""
        if self._sync_step is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_: norm_type={norm_type} is not supported; the "
                             f"engine clips by the global L2 norm (norm_type=2)")
        trainable = {id(p) for p in self.engine.module.parameters() if p.requires_grad}
        given = {id(p) for p in parameters}
        if not trainable <= given:
            raise ValueError("clip_grad_norm_: the engine clips all of its model's gradients "
                             "together; pass model.parameters()")
        clip = 0.0 if math.isinf(max_norm) else float(max_norm)
        configured = self._sync_step.gradient_clipping
        if configured > 0 and clip != configured:
            raise ValueError(f"clip_grad_norm_(max_norm={max_norm}) disagrees with the config's "
                             f"gradient_clipping={configured}; remove one of them")
        if not self.sync_gradients:
            warn_once("infinity.accelerate.clip-mid-window",
                      "clip_grad_norm_ off a sync step does nothing under the engine: it clips "
                      "the accumulated gradient at the sync step (call it when "
                      "accelerator.sync_gradients is True)")
            return None
        self._sync_step.update(clip=clip)
        if self._sync_step.last_norm is None:
            return None
        return torch.tensor(self._sync_step.last_norm, dtype=torch.float32, device=self.device)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        if self._sync_step is None:
            return super().clip_grad_value_(parameters, clip_value)
        raise ValueError("clip_grad_value_ is not supported by the engine (its gradients live "
                         "in shards); use clip_grad_norm_")

    # ------------------------------------------------------------------ state

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool | None = None) -> nn.Module:
        if isinstance(model, PreparedModel):
            return model.module
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper,
                                    keep_torch_compile=keep_torch_compile)

    def _is_engine_model(self, model: nn.Module) -> bool:
        return self.engine is not None and (isinstance(model, PreparedModel)
                                            or model is self.engine.module)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """For the engine's model: ``engine.full_state_dict()`` (fp32 masters for trained
        parameters, keyed like ``model.state_dict()``), a collective: call it on every process."""
        if self._is_engine_model(model):
            return self.engine.full_state_dict()
        return super().get_state_dict(model, unwrap=unwrap)

    @contextlib.contextmanager
    def _engine_objects_hidden(self) -> Iterator[None]:
        """accelerate's save/load_state without the engine's model and optimizer: their state is
        the engine checkpoint's (accelerate would write a full state dict and the optimizer's
        torch-shaped dict, which holds no moments)."""
        model, optimizer = self._prepared
        kept_models, kept_optimizers = list(self._models), list(self._optimizers)
        self._models[:] = [m for m in self._models if m is not model]
        self._optimizers[:] = [o for o in self._optimizers if o is not optimizer]
        try:
            yield
        finally:
            self._models[:], self._optimizers[:] = kept_models, kept_optimizers

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> str:
        """accelerate's ``save_state`` (schedulers, samplers, RNG, registered objects) plus the
        engine checkpoint under ``<dir>/infinity``; a collective: call it on every process."""
        if self.engine is None:
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        if save_model_func_kwargs:
            raise ValueError(f"save_state: {sorted(save_model_func_kwargs)} are not supported "
                             f"with the engine")
        with self._engine_objects_hidden():
            location = super().save_state(output_dir, safe_serialization)
        self.engine.save_checkpoint(os.path.join(location, ENGINE_DIR))
        return location

    def _latest_state_dir(self) -> str:
        """accelerate's pick when ``load_state`` gets no folder: the newest automatic one."""
        if not self.project_configuration.automatic_checkpoint_naming:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        root = os.path.join(self.project_dir, "checkpoints")
        folders = [os.path.join(root, f) for f in os.listdir(root)]
        return max(folders, key=lambda f: int(re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", f)[0]))

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs: Any) -> None:
        """accelerate's ``load_state`` plus the engine checkpoint under ``<dir>/infinity`` (any
        world size); a collective: call it on every process, between steps."""
        if self.engine is None:
            return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        input_dir = os.path.expanduser(input_dir) if input_dir else self._latest_state_dir()
        engine_dir = os.path.join(input_dir, ENGINE_DIR)
        if not os.path.isdir(engine_dir):
            raise ValueError(f"load_state: {input_dir!r} has no engine checkpoint ({ENGINE_DIR}/); "
                             f"was it written by infinity's Accelerator.save_state?")
        with self._engine_objects_hidden():
            super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        self.engine.load_checkpoint(engine_dir)
