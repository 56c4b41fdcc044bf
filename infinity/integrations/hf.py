"""``transformers.Trainer`` on the engine: :class:`InfinityTrainer`, and :class:`InfinityTrainerMixin`
for other Trainer subclasses (``class SFT(InfinityTrainerMixin, trl.SFTTrainer)``)::

    from infinity.integrations.hf import InfinityTrainer
    trainer = InfinityTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                              infinity_config="ds_config.json")
    trainer.train(); trainer.save_model("out")

TrainingArguments drive it as they drive DeepSpeed in Hugging Face: the micro-batch size,
gradient accumulation, ``max_grad_norm`` (the engine clips by the exact global norm; nothing clips
twice), bf16/fp16 (the engine's compute dtype), the device, and the optimizer's hyperparameters,
fill the ``infinity_config``'s "auto" or missing values and must agree with its explicit ones
([Note: values the trainer drives] in infinity/integrations/_config.py). The optimizer is the one
the Trainer builds (AdamW with its no-decay groups: biases and norm weights, from
``get_decay_parameter_names``), handed to the engine as its parameter groups; the LR schedule is
the Trainer's own (``get_scheduler`` on the engine's optimizer), or the engine's when the config
has a DeepSpeed ``scheduler`` section (stepped by the engine after each update it takes, so the
Trainer logs the next step's lr, as with DeepSpeed's). Logging (loss, lr, grad_norm) is the
Trainer's.

Checkpoints: ``checkpoint-N`` holds what the Trainer writes (``model.safetensors`` that
``from_pretrained`` loads, or the adapter files of a peft model; ``scheduler.pt``, RNG states,
``trainer_state.json``) plus the engine checkpoint under ``checkpoint-N/infinity`` (masters, Adam
moments, step counters of every rank); ``resume_from_checkpoint`` restores from it at any world
size. ``save_model`` writes the HF-format weights from ``engine.full_state_dict()``.

Built on :class:`infinity.integrations.accelerate.Accelerator`: the Trainer's accelerator becomes
one (``Accelerator.adopt``), so its ``backward``, ``clip_grad_norm_`` and ``prepare`` calls reach the
engine and the training loop stays the Trainer's. Supports transformers 5.x (tested with 5.24);
other versions fail at import. The Trainer's activation checkpointing (``activation_checkpointing``
/ ``gradient_checkpointing``, TRL's default) works as it does without the engine. Refused, with an
error naming the argument: ``deepspeed``, ``fsdp``, ``torch_compile``, ``auto_find_batch_size``,
``load_best_model_at_end``, full fp16/bf16 evaluation, optimizers other than AdamW, several GPUs in
one process (use torchrun).
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch

from infinity.integrations._config import device_name
from infinity.integrations._require import require

transformers = require("transformers", "infinity.integrations.hf")  # first: its error names it
from transformers import Trainer  # noqa: E402 (after the check above)

from infinity.integrations.accelerate import (ENGINE_DIR, Accelerator,  # noqa: E402
                                              rebind_scheduler)

logger = logging.getLogger(__name__)

SCHEDULER_NAME = "scheduler.pt"
"""The Trainer's scheduler state file in ``checkpoint-N`` (transformers.trainer.SCHEDULER_NAME)."""

_ADAMW_OPTIMS = frozenset({"adamw_torch", "adamw_torch_fused"})
"""TrainingArguments.optim values whose optimizer the engine runs (torch's AdamW)."""


def _check_args(args: Any) -> None:
    """TrainingArguments the engine cannot honour: one ValueError naming each and the fix."""
    problems = []
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in _ADAMW_OPTIMS:
        problems.append(f"optim={optim!r}: the engine runs AdamW (use 'adamw_torch')")
    refused = {
        "deepspeed": "InfinityTrainer replaces DeepSpeed; pass the DeepSpeed config as "
                     "infinity_config",
        "fsdp": "the engine shards the model itself",
        "torch_compile": "compiling a model under the engine's hooks is not supported",
        "auto_find_batch_size": "not supported with the engine",
        "load_best_model_at_end": "not supported with the engine",
        "fp16_full_eval": "the engine keeps the model's dtype; evaluation runs in it",
        "bf16_full_eval": "the engine keeps the model's dtype; evaluation runs in it",
        "parallelism_config": "tensor/context parallelism is not supported",
    }
    for name, why in refused.items():
        if getattr(args, name, None):
            problems.append(f"{name}={getattr(args, name)!r}: {why}")
    if args.n_gpu > 1:
        problems.append(f"{args.n_gpu} GPUs in one process (DataParallel): launch one process "
                        f"per GPU with torchrun")
    if problems:
        raise ValueError("TrainingArguments not supported by InfinityTrainer: "
                         + "; ".join(problems))


def trainer_config_values(args: Any) -> dict[str, tuple[Any, str]]:
    """The config values TrainingArguments drive ([Note: values the trainer drives] in
    infinity/integrations/_config.py), each with the argument it comes from."""
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    return {
        "gradient_accumulation_steps": (args.gradient_accumulation_steps,
                                        "TrainingArguments.gradient_accumulation_steps"),
        "train_micro_batch_size_per_gpu": (args.per_device_train_batch_size,
                                           "TrainingArguments.per_device_train_batch_size"),
        "gradient_clipping": (float(args.max_grad_norm), "TrainingArguments.max_grad_norm"),
        "precision.dtype": (dtype, "TrainingArguments.bf16/fp16"),
        "optimizer.type": ("adamw", "TrainingArguments.optim"),
        "optimizer.lr": (float(args.learning_rate), "TrainingArguments.learning_rate"),
        "optimizer.betas": ((float(args.adam_beta1), float(args.adam_beta2)),
                            "TrainingArguments.adam_beta1/adam_beta2"),
        "optimizer.eps": (float(args.adam_epsilon), "TrainingArguments.adam_epsilon"),
        "optimizer.weight_decay": (float(args.weight_decay), "TrainingArguments.weight_decay"),
        "device": (device_name(args.device), "TrainingArguments.device"),
    }


def trainer_deepspeed_values(args: Any, max_steps: int) -> dict[str, Any]:
    """DeepSpeed-only "auto" values, as Hugging Face fills them for DeepSpeed
    (``HfTrainerDeepSpeedConfig.trainer_config_process`` / ``trainer_config_finalize``)."""
    return {
        "train_batch_size": (args.world_size * args.per_device_train_batch_size
                             * args.gradient_accumulation_steps),
        "scheduler.params.warmup_min_lr": 0.0,
        "scheduler.params.warmup_max_lr": float(args.learning_rate),
        "scheduler.params.warmup_num_steps": args.get_warmup_steps(max_steps),
        "scheduler.params.total_num_steps": max_steps,
    }


class _EngineScheduler:
    """The Trainer's handle on a scheduler the engine runs itself (a DeepSpeed ``scheduler``
    section in the config): the engine steps it after each update it takes (DeepSpeed's rule),
    so :meth:`step` does nothing; the rest reads and restores the engine's scheduler."""

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass  # stepped by engine.step()

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)


class InfinityTrainerMixin:
    """Put before a ``transformers.Trainer`` subclass to train through the engine; see the module
    docstring. ``infinity_config``: the engine's config (a DeepSpeed-style or native dict, a JSON
    path, an InfinityConfig, or None for the defaults). A model built under ``infinity.init``
    needs the same config here."""

    def __init__(self, *args: Any, infinity_config: Any = None, **kwargs: Any):
        # Before Trainer.__init__: it calls create_accelerator_and_postprocess, which reads it.
        self.infinity_config = infinity_config
        super().__init__(*args, **kwargs)
        _check_args(self.args)
        if infinity_config is None and any(p.device.type == "meta"
                                           for p in self.model.parameters()):
            raise ValueError("InfinityTrainer: the model was built under infinity.init(config); "
                             "pass the same config as infinity_config")

    @property
    def engine(self) -> Any:
        """The InfinityEngine training the model (None before ``train()`` builds it)."""
        return self.accelerator.engine

    # ------------------------------------------------------------------ set-up

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.accelerator = Accelerator.adopt(self.accelerator,
                                             infinity_config=self.infinity_config)

    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        pass  # the engine places the parameters (and keeps offloaded ones off the device)

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's AdamW with its no-decay groups (the engine takes its groups at
        ``prepare``), and the TrainingArguments' values for the engine's config."""
        optimizer = super().create_optimizer(model)
        self.accelerator.engine_config_values = trainer_config_values(self.args)
        self.accelerator.engine_deepspeed_values = trainer_deepspeed_values(
            self.args, self.state.max_steps)
        return optimizer

    def create_scheduler(self, num_training_steps: int,
                         optimizer: torch.optim.Optimizer | None = None) -> Any:
        engine_scheduler = getattr(self.engine, "lr_scheduler", None)
        if engine_scheduler is not None and self.lr_scheduler is None:
            self.lr_scheduler = _EngineScheduler(engine_scheduler)
            return self.lr_scheduler
        given = self.lr_scheduler  # Trainer(optimizers=(optimizer, scheduler))
        bound_to = getattr(given, "optimizer", None)
        if (self.engine is not None and isinstance(given, torch.optim.lr_scheduler.LRScheduler)
                and bound_to not in (self.optimizer, self.engine.optimizer)):
            rebind_scheduler(given, bound_to, self.engine.optimizer)
        return super().create_scheduler(num_training_steps, optimizer)

    def _wrap_model(self, model: torch.nn.Module, training: bool = True,
                    dataloader: Any = None) -> torch.nn.Module:
        if self.engine is not None:  # evaluation after training, and train() again
            return self.accelerator.prepare_model(model)
        return super()._wrap_model(model, training=training, dataloader=dataloader)

    # ------------------------------------------------------------------ checkpoints

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.engine.save_checkpoint(os.path.join(output_dir, ENGINE_DIR))  # every rank
        if self.args.should_save:
            with warnings.catch_warnings(record=True):  # torch's "save the optimizer too" note
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # Trainer.train() calls this before the engine exists, to load the folder's weights into
        # the plain model; the engine checkpoint (or, without one, those weights) is loaded into
        # the engine by _load_optimizer_and_scheduler once prepare has built it.
        pass

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        engine_dir = os.path.join(checkpoint, ENGINE_DIR)
        if os.path.isdir(engine_dir):
            self.engine.load_checkpoint(engine_dir)
        else:  # save_only_model=True, or a plain Trainer's checkpoint: weights only
            logger.warning("%s has no engine checkpoint (%s/): loading its weights only; the "
                           "optimizer state starts fresh", checkpoint, ENGINE_DIR)
            self.engine.load_weights(checkpoint)
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler_file):
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The model in Hugging Face format (``from_pretrained`` loads it; a peft model's adapter
        files), from ``engine.full_state_dict()``; a collective: every rank calls it."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        state_dict = self.engine.full_state_dict(keys=_adapter_keys(self.engine))
        self._save(output_dir if output_dir is not None else self.args.output_dir,
                   state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


def _adapter_keys(engine: Any) -> list[str] | None:
    """A peft model's adapter entries (every adapter), so that saving gathers only their flat
    groups and not the frozen base (13.5 GB at 7B); None (everything) for any other model."""
    model = engine.module
    if not hasattr(model, "peft_config") or not hasattr(model, "get_base_model"):
        return None
    from infinity.integrations.peft import adapter_keys

    return sorted({key for name in model.peft_config
                   for key in adapter_keys(engine, name).values()})


class InfinityTrainer(InfinityTrainerMixin, Trainer):
    """``transformers.Trainer`` training through the engine; see the module docstring."""
