"""Activation checkpointing chosen by the engine, with optional offload of the saved inputs.

``activation_checkpointing.units`` picks the modules: 'all' (every unit module the parameter manager
built, the root excepted) or module class names. Each chosen module's ``forward`` runs under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: autograd keeps only the module's
inputs, and backward runs the forward again to rebuild what it needs (Korthikanti et al. 2022,
arXiv 2205.05198: 2sbh bytes per transformer layer instead of sbh(34 + 5as/h)). With
``activation_checkpointing.offload`` the saved inputs go elsewhere when saved and back to their
device when the recompute needs them, so the device holds one layer's working set at a time, not L
layer inputs: into the engine's tiered store (host arena, NVMe: [Note: saved activations are shards
of the store] in infinity/zero/_stored_activations.py), or, with 'host' and no store to hold them
(nothing else offloaded, an 'auto' host budget), into host memory of torch's ([Note: activations on
the host]).

[Note: activations on the host]
``torch.autograd.graph.save_on_cpu(pin_memory=True)`` copies each saved tensor with a blocking copy
(the host waits for the GPU at every saved tensor of the forward) into pinned memory of torch's
own host cache, which nothing counts. :class:`HostActivations` replaces it: on a GPU the copy down
is non-blocking into pinned memory, an event recorded after it, and the copy back up makes the
backward's stream wait on that event (the GPU waits, never the host); every host byte is counted
(``live_bytes``, ``peak_bytes``, reported by ``engine.stats()`` beside the host arena, which does
not hold them: torch's host allocator may round each block up to a power of two on top). On a CPU
device a saved tensor already is in host memory: kept as it is, as ``save_on_cpu`` did.

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
from typing import Any, Iterable, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from infinity._common import warn_once
from infinity.config import ActivationCheckpointingConfig

logger = logging.getLogger(__name__)


class SavedTensorPlace(Protocol):
    """Where offloaded saved tensors go: saved-tensor hooks and their byte counts."""

    def hooks(self, owner: str = "") -> Any:
        """Saved-tensor hooks for one checkpointed region; ``owner``: its module's name."""


class _HostCopy:
    """One saved tensor in host memory; its bytes leave the count when it is freed."""

    __slots__ = ("device", "tensor", "event", "_owner", "__weakref__")

    def __init__(self, device: torch.device, tensor: torch.Tensor, event: Any,
                 owner: "HostActivations"):
        self.device, self.tensor, self.event, self._owner = device, tensor, event, owner
        owner._add(tensor.untyped_storage().nbytes())

    def __del__(self) -> None:
        self._owner._add(-self.tensor.untyped_storage().nbytes())


class HostActivations:
    """[Note: activations on the host]: saved-tensor hooks that keep saved tensors in host memory,
    counted. ``always_copy``: copy tensors already in host memory too (tests run the GPU path's
    bookkeeping on a CPU with it)."""

    def __init__(self, *, always_copy: bool = False):
        self.always_copy = always_copy
        self.live_bytes = 0
        """Host bytes of saved tensors alive now."""
        self.peak_bytes = 0
        """High-water mark of ``live_bytes`` since start (or :meth:`reset_peak`)."""

    def _add(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def hooks(self, owner: str = "") -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor) -> Any:
        cuda = tensor.device.type == "cuda"
        if not cuda and not self.always_copy:
            return tensor  # already in host memory: nothing to move (save_on_cpu did the same)
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout,
                           pin_memory=cuda)
        host.copy_(tensor, non_blocking=cuda)
        event = None
        if cuda:
            # The host buffer is written by the GPU later; the copy back up waits for this
            # event on its own stream (autograd may run backward on another stream).
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(tensor.device))
        return _HostCopy(tensor.device, host, event, self)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if packed.event is None:
            return packed.tensor.to(packed.device)
        stream = torch.cuda.current_stream(packed.device)
        stream.wait_event(packed.event)
        out = packed.tensor.to(packed.device, non_blocking=True)
        # torch's host allocator keeps the pinned block until the copy's stream passes it, so
        # ``packed`` may be freed right after this returns.
        return out


def _checkpointed_forward(original: Any, host: "SavedTensorPlace | None", name: str,
                          module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The replacement ``forward`` (bound to ``module``, so ``copy.deepcopy`` rebinds it);
    ``host``: where the saved inputs go (:class:`HostActivations`, or the store's
    :class:`~infinity.zero._stored_activations.StoredActivations`; None: they stay)."""
    forward = original if original is not None else type(module).forward.__get__(module)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    offload = host.hooks(name) if host is not None else contextlib.nullcontext()
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
    host: "SavedTensorPlace | None" = None
    """Where the saved inputs go when offloaded: :class:`HostActivations` (host memory outside
    the store, counted), or the store's shards (:class:`~infinity.zero._stored_activations.
    StoredActivations`); None: they stay on the device."""
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
                                   unit_module_names: Iterable[str] = (),
                                   place: "SavedTensorPlace | None" = None) -> CheckpointedModules:
    """Make the chosen modules' forward run checkpointed (see [Note: checkpoint inside the
    module's hooks]); returns the handle that can undo it. ``place``: where the saved inputs go
    (the engine's store with ``activation_checkpointing.offload``); None with offload 'host':
    :class:`HostActivations`."""
    names = select_modules(model, config, unit_module_names=unit_module_names)
    offloaded = config.offload_tier != "none"
    host = place if place is not None else HostActivations() if offloaded else None
    handle = CheckpointedModules(names=names, offload_to_host=offloaded, host=host)
    modules = dict(model.named_modules())
    for name in names:
        module = modules[name]
        original = module.__dict__.get("forward")  # an instance-level forward someone set before
        if _is_checkpointed(original):
            raise ValueError(f"activation_checkpointing: module {name!r} is already checkpointed "
                             f"(was the model passed to initialize twice?)")
        wrapper = functools.partial(_checkpointed_forward, original, host, name)
        module.forward = types.MethodType(wrapper, module)
        handle._modules.append(module)
        handle._originals.append(original)
    if names:
        logger.info("activation checkpointing: %d module(s)%s, e.g. %s", len(names),
                    f", inputs offloaded ({config.offload_tier})" if offloaded else "", names[0])
    return handle


__all__ = ["CheckpointedModules", "HostActivations", "apply_activation_checkpointing",
           "select_modules"]
