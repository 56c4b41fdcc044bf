"""The module, tensor and gradient hooks the parameter manager puts on one model, and their
handles: where each hook goes, and what it hands to the manager.

Split out of :class:`~infinity.zero._param_manager.ParameterManager` (#35). The hooks decide
nothing: each tells the manager (through :class:`HookCalls`) that a unit's forward begins or
ends, that its backward begins, that its inputs' gradients are in, or that a parameter's
gradient is; the manager decides when to gather and release ([Note: backward gather and
release] in infinity/zero/_param_manager.py).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
from torch import nn

from infinity.zero._flat_group import FlatGroup, ParamSlot, Unit, UnitState
from infinity.zero._outside_use import tensors_in
from infinity.zero._step_gathers import StepGathers

logger = logging.getLogger(__name__)

__all__ = ["HookCalls", "UnitHooks"]

Hooked = list[tuple[nn.Module, str, list[int]]]
"""(module, its name, the indices of the units it holds), from the unit choice."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class HookCalls:
    """What the hooks tell the parameter manager."""

    forward_begins: Callable[[list[Unit]], None]
    """A module holding ``units`` is about to run its forward."""
    forward_ends: Callable[[list[Unit]], None]
    """That module's forward returned."""
    backward_begins: Callable[[list[Unit]], None]
    """The gradient of one of that module's outputs is ready: its backward is next."""
    inputs_done: Callable[[list[Unit]], None]
    """The gradient of one of its inputs is ready: every node between them has run."""
    enter_backward: Callable[[], None]
    """The model's output got its gradient: the backward has begun."""
    on_grad: Callable[[torch.Tensor], None]
    """A trainable parameter's gradient was accumulated."""


class UnitHooks:
    """Installs the manager's hooks on one model, and removes them (see the module doc)."""

    def __init__(self, module: nn.Module, units: list[Unit],
                 slot_of: dict[int, tuple[Unit, FlatGroup, ParamSlot]], *, stage: int,
                 calls: HookCalls):
        self.module = module
        self.units = units
        self.stage = stage
        self.calls = calls
        self._slot_of = slot_of
        self._handles: list[Any] = []
        """Hook handles, removed by remove()."""

    def install(self, hooked: Hooked, step_gathers: StepGathers | None) -> None:
        """Every hook: gradients, the model's outputs, the after-step gathers' reads, and at
        stage 3 each holding module's forward and its state dict."""
        for u in self.units:
            for g in u.groups:
                if g.requires_grad:
                    for s in g.slots:
                        self._handles.append(
                            s.param.register_post_accumulate_grad_hook(self.calls.on_grad))
        # The model's outputs get their gradient first, in the outermost backward (a
        # parameter's, inside a reentrant checkpoint, may come in a nested one, whose end is not
        # the backward's): [Note: the end of backward] in infinity/zero/_param_manager.py.
        self._handles.append(self.module.register_forward_hook(self._mark_outputs))
        if step_gathers is not None:
            self._handles.extend(step_gathers.install(self.module, hooked))
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

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _make_pre_forward(self, units: list[Unit]):
        calls = self.calls

        def pre_forward(module, args, kwargs):
            calls.forward_begins(units)
            if torch.is_grad_enabled() and any(u.has_frozen for u in units):
                for t in tensors_in((args, kwargs)):
                    if t.requires_grad:
                        t.register_hook(lambda grad: calls.inputs_done(units))
            return None
        return pre_forward

    def _make_post_forward(self, units: list[Unit]):
        calls = self.calls

        def post_forward(module, args, output):
            calls.forward_ends(units)
            if torch.is_grad_enabled():
                for t in tensors_in(output):
                    if t.requires_grad:
                        t.register_hook(lambda grad: calls.backward_begins(units))
            return None
        return post_forward

    def _mark_outputs(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(lambda grad: self.calls.enter_backward())

    def _refuse_released_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        """``module.state_dict()`` between steps would hand out views of released storage (0
        bytes, [Note: release keeps parameter identity] in infinity/zero/_param_manager.py):
        whoever reads one crashes the process. Raise instead, naming what to call.
        ``keep_vars=True`` returns the Parameter objects themselves (the engine's own key
        lookups) and is allowed."""
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
