"""The engine's step state as a checkpoint keeps it (the manifest's ``engine``): the window's
counters, the optimizer's step count, the parameter groups' hyperparameters and each parameter's
own step count by qualified name, the loss scaler's and the scheduler's state."""

from __future__ import annotations

from typing import Any, Mapping

from infinity.optim import check_hyperparameters, json_safe_group

__all__ = ["check_step_state_dict", "load_step_state_dict", "step_state_dict"]


def step_state_dict(engine: Any) -> dict[str, Any]:
    """The step counters of ``engine``, its optimizer and its loss scaler, the parameter groups'
    hyperparameters (JSON values) and the per-parameter step counts by qualified name."""
    opt, names = engine.optimizer, engine._param_names
    steps = {names[id(p)]: opt.step_of(p)
             for g in opt.param_groups for p in g["params"] if opt.step_of(p)}
    return {**engine._window.counters(), "last_grad_norm": engine.last_grad_norm,
            "optimizer_step_count": engine.shard_optimizer.step_count, "lr": engine.lr,
            "param_groups": [json_safe_group(g) for g in opt.param_groups],
            "param_steps": steps, "loss_scaler": engine.scaler.state_dict(),
            "lr_scheduler": (None if engine.lr_scheduler is None
                             else engine.lr_scheduler.state_dict())}


def check_step_state_dict(engine: Any, state: Mapping[str, Any]) -> None:
    """ValueError when :func:`load_step_state_dict` could not take ``state`` (checked before a
    checkpoint changes anything)."""
    groups = state.get("param_groups")
    if groups is None:
        return  # saved before parameter groups: one lr, every parameter stepped each time
    if len(groups) != len(engine.optimizer.param_groups):
        raise ValueError(f"the checkpoint has {len(groups)} parameter groups, "
                         f"engine.optimizer has {len(engine.optimizer.param_groups)}; pass the "
                         f"same model_parameters groups as when it was saved")
    for i, group in enumerate(groups):
        check_hyperparameters(group, f"checkpoint param_groups[{i}]")


def load_step_state_dict(engine: Any, state: Mapping[str, Any]) -> None:
    """Restore what :func:`step_state_dict` returned into ``engine`` (between steps)."""
    check_step_state_dict(engine, state)
    engine._window.load(global_steps=state["global_steps"], micro_steps=state["micro_steps"],
                        skipped_steps=state["skipped_steps"])
    engine.last_grad_norm = state["last_grad_norm"]
    engine.shard_optimizer.step_count = int(state["optimizer_step_count"])
    opt, names = engine.optimizer, engine._param_names
    if state.get("param_groups") is None:  # an older save: one lr, every step updated all
        engine.lr = float(state["lr"])
        steps = {names[id(p)]: int(state["optimizer_step_count"])
                 for g in opt.param_groups for p in g["params"] if p.requires_grad}
    else:
        for group, saved in zip(opt.param_groups, state["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
            group["betas"] = tuple(float(b) for b in group["betas"])
        steps = state.get("param_steps", {})
    for g in opt.param_groups:
        for p in g["params"]:
            opt.set_step(p, int(steps.get(names[id(p)], 0)))
    engine.scaler.load_state_dict(state["loss_scaler"])
    if engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])  # sets the groups' lr too
