"""Activation checkpointing chosen by the engine, with optional offload of the saved inputs to host.

``activation_checkpointing.units`` picks the modules: 'all' (every unit module the parameter manager
built, the root excepted) or module class names. Each chosen module's ``forward`` runs under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: autograd keeps only the module's
inputs, and backward runs the forward again to rebuild what it needs (Korthikanti et al. 2022,
arXiv 2205.05198: 2sbh bytes per transformer layer instead of sbh(34 + 5as/h)). With
``offload_to_host`` the saved inputs go through ``torch.autograd.graph.save_on_cpu``: they are
copied to host memory (pinned where CUDA exists) when saved and back to their device when the
recompute needs them, so the device holds one layer's working set at a time, not L layer inputs.

[Note: checkpoint inside the module's hooks]
The wrapper replaces the instance's ``forward`` (an instance attribute, so parameters, names and
``state_dict`` keys stay as they are) and leaves ``Module.__call__`` alone: the module's forward
hooks (the parameter manager's gather and release, its trace) fire once per forward, outside the
checkpointed region. In backward, the output's gradient hook gathers the unit before autograd
reaches the region's nodes, whose first unpacked saved tensor triggers the recompute, which calls
the original forward directly, so the module's own hooks do not fire again (hooks of modules
inside it do; the parameter manager counts those gathers by reference). Non-reentrant checkpoint
saves the region's inputs with ``save_for_backward`` under the saved-tensor hooks active around
the call, which is where ``save_on_cpu`` is entered; the region's own hooks replace everything
saved inside it by recomputation handles.

[Note: recompute may stop early]
Torch stops a recompute as soon as the last tensor backward needs has been rebuilt (its default,
kept here), so the end of the forward, and the forward hooks of modules still running inside the
region, may not run in the recompute. The parameter manager's post-forward hooks are registered
with ``always_call=True`` and run on that early exit too, so a unit nested inside a region is
released (tests/engine/test_activation_checkpointing.py checks the reference counts).

Only forwards with grad enabled are checkpointed; ``torch.no_grad()`` and inference run the
original forward unchanged.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import logging
import types
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from infinity._common import warn_once
from infinity.config import ActivationCheckpointingConfig

logger = logging.getLogger(__name__)


def _checkpointed_forward(original: Any, offload_to_host: bool, module: nn.Module, *args: Any,
                          **kwargs: Any) -> Any:
    """The replacement ``forward`` (bound to ``module``, so ``copy.deepcopy`` rebinds it)."""
    forward = original if original is not None else type(module).forward.__get__(module)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    # Looked up at call time, not imported: ``torch.autograd.graph.save_on_cpu`` is the one path.
    offload = (torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
               if offload_to_host else contextlib.nullcontext())
    if kwargs:  # bound here so a forward keyword never collides with checkpoint's own options
        forward = functools.partial(forward, **kwargs)
    with offload:
        # [Note: recompute may stop early]
        return checkpoint(forward, *args, use_reentrant=False)


@dataclass
class CheckpointedModules:
    """The modules whose forward runs checkpointed; :meth:`remove` restores them."""

    names: list[str]
    """Qualified names (``model.named_modules()``) of the checkpointed modules, in module order."""
    offload_to_host: bool
    _modules: list[nn.Module] = field(default_factory=list, repr=False)
    """The wrapped module objects (to restore their ``forward``)."""
    _originals: list[Any] = field(default_factory=list, repr=False)
    """Each module's instance-level ``forward`` before wrapping (None: the class's)."""

    def remove(self) -> None:
        """Restore every wrapped module's original ``forward``."""
        for module, original in zip(self._modules, self._originals):
            if original is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = original
        self._modules, self._originals, self.names = [], [], []


def _is_checkpointed(forward: Any) -> bool:
    func = getattr(forward, "__func__", None)
    return isinstance(func, functools.partial) and func.func is _checkpointed_forward


def _outermost(names: Iterable[str]) -> list[str]:
    """Drop names nested under another chosen name (checkpointing both would recompute twice)."""
    chosen: list[str] = []
    for name in names:
        if not any(name.startswith(c + ".") for c in chosen):
            chosen.append(name)
    return chosen


def select_modules(model: nn.Module, config: ActivationCheckpointingConfig, *,
                   unit_module_names: Iterable[str] = ()) -> list[str]:
    """Qualified names of the modules to checkpoint (see the module docstring).

    ``unit_module_names``: the parameter manager's unit modules, used by ``units='all'`` (the root,
    named '', is never checkpointed: the loss and the head run outside any region).
    """
    if config.units == "none":
        return []
    modules = dict(model.named_modules())
    if config.units == "all":
        names = [n for n in modules if n and n in set(unit_module_names)]
        if not names:
            warn_once("activation_checkpointing.all_empty",
                      "activation_checkpointing.units='all': the model has no unit module below "
                      "the root, so nothing is checkpointed; set zero.unit_class_names or "
                      "activation_checkpointing.units to the block class names")
        return _outermost(names)
    wanted = set(config.units)
    names = [n for n, m in modules.items() if n and type(m).__name__ in wanted]
    found = {type(modules[n]).__name__ for n in names}
    missing = sorted(wanted - found)
    if missing:
        classes = sorted({type(m).__name__ for m in modules.values()})
        close = difflib.get_close_matches(missing[0], classes, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else f"classes in the model: {', '.join(classes)}"
        raise ValueError(f"activation_checkpointing.units: class name(s) {missing} match no module "
                         f"of the model; {hint}")
    return _outermost(names)


def apply_activation_checkpointing(model: nn.Module, config: ActivationCheckpointingConfig, *,
                                   unit_module_names: Iterable[str] = ()) -> CheckpointedModules:
    """Make the chosen modules' forward run checkpointed (see [Note: checkpoint inside the
    module's hooks]); returns the handle that can undo it."""
    names = select_modules(model, config, unit_module_names=unit_module_names)
    handle = CheckpointedModules(names=names, offload_to_host=config.offload_to_host)
    modules = dict(model.named_modules())
    for name in names:
        module = modules[name]
        original = module.__dict__.get("forward")  # an instance-level forward someone set before
        if _is_checkpointed(original):
            raise ValueError(f"activation_checkpointing: module {name!r} is already checkpointed "
                             f"(was the model passed to initialize twice?)")
        wrapper = functools.partial(_checkpointed_forward, original, config.offload_to_host)
        module.forward = types.MethodType(wrapper, module)
        handle._modules.append(module)
        handle._originals.append(original)
    if names:
        logger.info("activation checkpointing: %d module(s)%s, e.g. %s", len(names),
                    ", inputs offloaded to host" if config.offload_to_host else "", names[0])
    return handle


__all__ = ["CheckpointedModules", "apply_activation_checkpointing", "select_modules"]
