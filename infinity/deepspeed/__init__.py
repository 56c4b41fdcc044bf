"""A DeepSpeed drop-in: ``import infinity.deepspeed as deepspeed`` and a DeepSpeed training script
runs on the engine unchanged.

- :func:`initialize` ``(args=None, model=, optimizer=None, model_parameters=None,
  training_data=None, lr_scheduler=None, collate_fn=None, config=, config_params=None)`` returns
  ``(engine, optimizer, dataloader, lr_scheduler)`` as ``deepspeed.initialize`` does; the engine
  (:class:`DeepSpeedEngine`) answers the names scripts use (``backward``, ``step``,
  ``zero_grad``, ``train``/``eval``, ``module``, ``optimizer``, ``lr_scheduler``, ``get_lr``,
  ``global_steps``, ``train_batch_size()``, ``train_micro_batch_size_per_gpu()``,
  ``gradient_accumulation_steps()``, ``is_gradient_accumulation_boundary()``,
  ``save_checkpoint(save_dir, tag=None, client_state={})``, ``load_checkpoint(load_dir,
  tag=None)`` returning ``(path, client_state)``), and everything of
  :class:`~infinity.zero.InfinityEngine` besides.
- :mod:`.zero`: ``zero.Init(config_dict_or_path=...)`` (``infinity.init``) and
  ``zero.GatheredParameters(params, modifier_rank=None)``.
- :func:`init_distributed`: the default process group from the launcher's environment.

The config file is the user's DeepSpeed JSON, read by :func:`infinity.load_config` (its keys'
fates: ``infinity/config/_ds_keys.py``). ``deepspeed.comm`` is not wrapped: torch.distributed is
the transport. What is not supported raises, naming the DeepSpeed name and what to do instead.
"""

from __future__ import annotations

from typing import Any

from infinity.deepspeed import zero
from infinity.deepspeed._engine import DeepSpeedEngine, initialize
from infinity.zero import init_distributed as _init_distributed

_NOT_WRAPPED = {
    "comm": "deepspeed.comm is not wrapped: use torch.distributed (the engine's transport; "
            "infinity.deepspeed.init_distributed() sets up its default group)",
    "ops": "deepspeed.ops: the engine's CPU Adam is infinity.cpu_adam.CPUAdam; the optimizer "
           "itself is the config's 'optimizer' section",
    "pipe": "deepspeed.pipe: pipeline parallelism is not supported yet",
    "moe": "deepspeed.moe: build MoE layers with plain PyTorch modules; the engine shards them",
}


def init_distributed(dist_backend: str | None = None, **_ignored: Any) -> None:
    """``deepspeed.init_distributed()``: the default process group from the launcher's
    environment (NCCL on GPUs, gloo on CPUs; ``dist_backend`` is chosen that way whatever it
    says), a no-op in a single process."""
    _init_distributed()


def __getattr__(name: str) -> Any:
    if name in _NOT_WRAPPED:
        raise AttributeError(f"infinity.deepspeed has no {name!r}: {_NOT_WRAPPED[name]}")
    raise AttributeError(f"infinity.deepspeed has no {name!r} (DeepSpeed's deepspeed.{name} is "
                         f"not part of the drop-in; see README 'Coming from DeepSpeed')")


__all__ = ["DeepSpeedEngine", "init_distributed", "initialize", "zero"]
