"""``deepspeed.initialize`` and the engine's DeepSpeed names, on :class:`InfinityEngine`."""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch import nn

from infinity.checkpoint import read_client_state, resolve_checkpoint
from infinity.config import load_config
from infinity.zero import InfinityEngine, initialize as _initialize


class DeepSpeedEngine:
    """The engine as a DeepSpeed script sees it: DeepSpeed's names where they differ from the
    engine's (methods where the engine has attributes, checkpoint tags and client state), every
    other attribute the :class:`~infinity.zero.InfinityEngine`'s (``engine.infinity`` is it)."""

    def __init__(self, engine: InfinityEngine, micro_batch_size: int | None):
        self.infinity = engine
        self._micro_batch_size = micro_batch_size

    def __getattr__(self, name: str) -> Any:  # only for names not found on this class
        return getattr(self.infinity, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.infinity(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.infinity(*args, **kwargs)

    # ------------------------------------------------------------------ the training loop

    def backward(self, loss: torch.Tensor, allreduce_gradients: bool = True,
                 release_loss: bool = False, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        if retain_graph:
            raise ValueError("engine.backward(loss, retain_graph=True) is not supported: the "
                             "engine releases and reduces each unit once its gradient is done")
        if not allreduce_gradients:
            raise ValueError("engine.backward(loss, allreduce_gradients=False) is not supported: "
                             "gradients are reduced as the backward makes them; for gradient "
                             "accumulation set gradient_accumulation_steps in the config")
        self.infinity.backward(loss, scale_wrt_gas=scale_wrt_gas)
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        if lr_kwargs:
            raise ValueError(f"engine.step(lr_kwargs={lr_kwargs!r}) is not supported: step the "
                             f"scheduler's own arguments through engine.lr_scheduler")
        self.infinity.step()

    def zero_grad(self) -> None:
        """DeepSpeed scripts call it after ``step()``: the engine drops gradients at each
        optimizer step, so between steps there is nothing to zero."""
        if not self.infinity.between_steps:
            raise ValueError(f"engine.zero_grad() at micro-step {self.infinity.micro_steps}, "
                             f"inside a gradient accumulation window: the window's gradients "
                             f"are kept until the step; call it after engine.step()")

    def train(self, mode: bool = True) -> "DeepSpeedEngine":
        self.infinity.module.train(mode)
        return self

    def eval(self) -> "DeepSpeedEngine":
        return self.train(False)

    # ------------------------------------------------------------------ counters and settings

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.infinity.optimizer.param_groups]

    def gradient_accumulation_steps(self) -> int:
        return self.infinity.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.infinity.is_gradient_accumulation_boundary

    def train_micro_batch_size_per_gpu(self) -> int:
        if self._micro_batch_size is None:
            raise ValueError("train_micro_batch_size_per_gpu is not set in the config (nor "
                             "train_batch_size): add it to the DeepSpeed config")
        return self._micro_batch_size

    def train_batch_size(self) -> int:
        return (self.train_micro_batch_size_per_gpu() * self.gradient_accumulation_steps()
                * self.infinity.collectives.data_parallel_size)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, save_dir: str | os.PathLike[str], tag: Any = None,
                        client_state: Any = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> str:
        """Every rank. ``tag``: the save's directory name (default: ``global_step<N>``, as
        DeepSpeed names it); ``client_state``: rank 0's, returned by :meth:`load_checkpoint`.
        ``latest`` always names the newest save (``save_latest=False`` is refused: a
        checkpoint root's ``latest`` is what a resume reads)."""
        if not save_latest:
            raise ValueError("save_checkpoint(save_latest=False) is not supported: the save is "
                             "committed by writing 'latest'; save to another directory instead")
        if exclude_frozen_parameters:
            raise ValueError("save_checkpoint(exclude_frozen_parameters=True) is not supported; "
                             "for an adapter alone use infinity.integrations.peft.save_adapter")
        tag = f"global_step{self.infinity.global_steps}" if tag is None else str(tag)
        return self.infinity.save_checkpoint(os.fspath(save_dir), tag=tag,
                                             client_state=client_state if client_state else None)

    def load_checkpoint(self, load_dir: str | os.PathLike[str], tag: Any = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn: Callable | None = None) -> tuple[str, Any]:
        """Every rank: the save named ``tag`` under ``load_dir`` (default: the one ``latest``
        names), all of the training state. Returns ``(path, client_state)`` as DeepSpeed does."""
        refused = {"load_module_strict": not load_module_strict,
                   "load_optimizer_states": not load_optimizer_states,
                   "load_lr_scheduler_states": not load_lr_scheduler_states,
                   "load_module_only": load_module_only, "custom_load_fn": custom_load_fn}
        bad = [k for k, v in refused.items() if v]
        if bad:
            raise ValueError(f"load_checkpoint({bad[0]}=...) is not supported: a checkpoint "
                             f"restores the whole training state; for weights alone use "
                             f"engine.load_weights(path)")
        root = os.fspath(load_dir)
        step_dir = resolve_checkpoint(os.path.join(root, str(tag)) if tag is not None else root)
        self.infinity.load_checkpoint(step_dir)
        return step_dir, read_client_state(step_dir)


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: Any = None, mpu: Any = None, dist_init_required: Any = None,
               collate_fn: Callable | None = None, config: Any = None, mesh_param: Any = None,
               config_params: Any = None
               ) -> tuple[DeepSpeedEngine, torch.optim.Optimizer, Any, Any]:
    """``deepspeed.initialize``: returns ``(engine, engine.optimizer, dataloader or None,
    engine.lr_scheduler)``. The config is ``config``, else ``config_params``, else
    ``args.deepspeed_config`` (a path or dict, DeepSpeed's format or ours). ``optimizer``: the
    engine runs its own Adam over the shards, so an optimizer object is refused (describe it in
    the config's ``optimizer`` section). ``lr_scheduler``: a callable taking the optimizer (as
    DeepSpeed accepts), or None for the config's ``scheduler`` section. ``training_data``: a
    dataset, loaded ``train_micro_batch_size_per_gpu`` at a time, each data-parallel rank its
    part (``DistributedSampler``; ``RandomSampler`` in one process), as DeepSpeed's loader."""
    if model is None:
        raise ValueError("deepspeed.initialize: model= is required")
    for name, value in (("mpu", mpu), ("mesh_param", mesh_param)):
        if value is not None:
            raise ValueError(f"deepspeed.initialize({name}=...) is not supported: tensor "
                             f"parallelism comes from torch's parallelize_module and a mesh "
                             f"(README 'Tensor parallelism composed with ZeRO')")
    if optimizer is not None:
        raise ValueError(f"deepspeed.initialize(optimizer={type(optimizer).__name__}): the engine "
                         f"steps its own Adam/AdamW over the parameter shards; describe the "
                         f"optimizer in the config's 'optimizer' section (type, params) instead")
    if lr_scheduler is not None and (not callable(lr_scheduler) or isinstance(
            lr_scheduler, torch.optim.lr_scheduler.LRScheduler)):
        raise ValueError("deepspeed.initialize(lr_scheduler=<scheduler object>): it is bound to "
                         "an optimizer the engine does not step; pass a callable taking the "
                         "optimizer (lambda opt: LambdaLR(opt, f)), or the config's 'scheduler' "
                         "section")
    source = config if config is not None else config_params
    if source is None and args is not None:
        source = getattr(args, "deepspeed_config", None)
    loaded = load_config(source)
    if lr_scheduler is not None and loaded.scheduler.enabled:
        raise ValueError("deepspeed.initialize: lr_scheduler= and the config's 'scheduler' "
                         "section both given; keep one")
    engine = _initialize(model, loaded, model_parameters=model_parameters)
    if lr_scheduler is not None:
        engine.lr_scheduler = lr_scheduler(engine.optimizer)
    micro = loaded.train_micro_batch_size_per_gpu
    micro = micro if isinstance(micro, int) else None
    wrapped = DeepSpeedEngine(engine, micro)
    loader = None
    if training_data is not None:
        loader = _data_loader(training_data, wrapped, collate_fn)
    return wrapped, engine.optimizer, loader, engine.lr_scheduler


def _data_loader(dataset: Any, engine: DeepSpeedEngine, collate_fn: Callable | None) -> Any:
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

    coll = engine.infinity.collectives
    if coll.data_parallel_size > 1:
        sampler = DistributedSampler(dataset, num_replicas=coll.data_parallel_size,
                                     rank=coll.world.rank)
    else:
        sampler = RandomSampler(dataset)
    return DataLoader(dataset, batch_size=engine.train_micro_batch_size_per_gpu(),
                      sampler=sampler, collate_fn=collate_fn)
