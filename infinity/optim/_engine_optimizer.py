"""``engine.optimizer``: the engine's Adam(W) as a ``torch.optim.Optimizer``, for the code outside
the engine that drives an optimizer (LR schedulers, ``transformers.Trainer``, ``accelerate``).

[Note: the optimizer seen from outside]
The update itself runs in ``engine.step()`` at accumulation boundaries, over the flat fp32 shards
of the shard optimizer (:class:`~infinity.optim.InMemoryShardOptimizer` or
:class:`~infinity.optim.OffloadedShardOptimizer`, ``engine.shard_optimizer``), as in DeepSpeed's
engine. :class:`EngineOptimizer` holds what the outside reads and writes:

- ``param_groups``: the model's own parameters with ``lr``, ``betas``, ``eps``, ``weight_decay``
  per group (extra keys kept). Each engine step reads every group's *current* values, so a
  scheduler that sets ``group["lr"]`` after a step sets the lr of the next one.
- ``state``: per parameter, ``{"step": n}``, the number of updates it received (Adam's bias
  correction uses it; a parameter without a gradient in a step is not updated, as in torch).
  The fp32 masters and the moments live in the shard optimizer's tiers; ``engine.save_checkpoint``
  saves them (with these step counts and the groups' hyperparameters).
- ``step()`` and ``zero_grad()`` are no-ops (the engine owns gradients and runs the update);
  ``engine.step()`` at a boundary marks the optimizer as stepped (``_opt_called``, what torch's LR
  schedulers check before warning "lr_scheduler.step() before optimizer.step()").
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from infinity.optim._param_groups import HYPERPARAMETERS, check_hyperparameters
from infinity.optim._runs import Hyperparameters


class EngineOptimizer(torch.optim.Optimizer):
    """``engine.optimizer``; see [Note: the optimizer seen from outside]. Built by the engine from
    :func:`~infinity.optim.resolve_param_groups`; its groups are fixed after construction."""

    def __init__(self, param_groups: list[dict[str, Any]], defaults: Mapping[str, Any]):
        self._fixed = False
        super().__init__(param_groups, dict(defaults))
        self._fixed = True
        self._opt_called = False
        """An engine step ran (torch's LR schedulers read it)."""
        self._group_of: dict[int, int] = {id(p): i for i, g in enumerate(self.param_groups)
                                          for p in g["params"]}
        """id(parameter) -> index of its group (groups never change members)."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._fixed:
            raise ValueError("engine.optimizer.add_param_group: the engine's parameter groups are "
                             "fixed at initialize; pass every group as "
                             "infinity.initialize(model, config, model_parameters=[...])")
        super().add_param_group(param_group)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """No update here ([Note: the optimizer seen from outside]): ``engine.step()`` runs it.
        ``closure``, when given, is called (torch's contract) and its loss returned."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """A no-op: the engine drops the gradients after each optimizer step."""

    def mark_stepped(self) -> None:
        """``engine.step()`` ran at an accumulation boundary."""
        self._opt_called = True

    # ------------------------------------------------------------------ read by the engine

    def group_index(self, param: torch.Tensor) -> int | None:
        """Index of ``param``'s group; None for a parameter in no group (a frozen one)."""
        return self._group_of.get(id(param))

    def hyperparameters(self, index: int) -> Hyperparameters:
        """Group ``index``'s current values (a scheduler may have changed them since the last
        step); ValueError naming the group and key for a value Adam cannot take."""
        group = self.param_groups[index]
        check_hyperparameters(group, f"engine.optimizer.param_groups[{index}]")
        beta1, beta2 = group["betas"]
        return Hyperparameters(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                               eps=float(group["eps"]), weight_decay=float(group["weight_decay"]))

    def step_of(self, param: torch.Tensor) -> int:
        """Updates ``param`` received so far (0 before its first)."""
        state = self.state.get(param)
        return int(state["step"]) if state else 0

    def set_step(self, param: torch.Tensor, step: int) -> None:
        if step:
            self.state[param]["step"] = int(step)
        else:
            self.state.pop(param, None)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """torch's ``load_state_dict`` (hyperparameters of each group, per-parameter step counts);
        the moments are not part of it (``engine.load_checkpoint`` restores them)."""
        for index, state in state_dict.get("state", {}).items():
            extra = sorted(set(state) - {"step"})
            if extra:
                raise ValueError(f"engine.optimizer.load_state_dict: state of parameter {index} "
                                 f"holds {extra}; this optimizer's state dict holds only step "
                                 f"counts (the moments are in engine checkpoints: "
                                 f"engine.load_checkpoint)")
        for i, group in enumerate(state_dict.get("param_groups", [])):
            missing = [k for k in HYPERPARAMETERS if k not in group]
            if missing:
                raise ValueError(f"engine.optimizer.load_state_dict: param_groups[{i}] lacks "
                                 f"{missing}")
            check_hyperparameters(group, f"engine.optimizer.load_state_dict: param_groups[{i}]")
        super().load_state_dict(dict(state_dict))
        for group in self.param_groups:
            group["betas"] = tuple(float(b) for b in group["betas"])
        for param, state in list(self.state.items()):
            if "step" in state:
                state["step"] = int(state["step"])
