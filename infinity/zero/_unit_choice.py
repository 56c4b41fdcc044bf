"""Choosing the units of a model (pure logic on the module tree; no hooks, no tensors moved).

A **unit** is a group of parameters fetched and released together. :func:`choose_units` picks them:

* **unit modules**: each module whose class name is in ``zero.unit_class_names`` (outermost wins),
  or, choosing by size, each module whose subtree holds at least ``zero.unit_min_numel`` elements
  not already claimed by a unit module below it (post-order, so blocks become units before the
  model that contains them). Containers without a ``forward`` (``ModuleList``) never become units:
  their hooks would never fire. The root module is always a unit module: it owns the leftovers.
* **the default** (no class names, ``unit_min_numel`` 'auto'): the model's repeated blocks, found
  by :func:`block_class_names` ([Note: default units are the repeated blocks]), chosen exactly as
  if their class names had been given; by size (:data:`AUTO_UNIT_MIN_NUMEL`) when it has none.
  An explicit ``unit_min_numel`` always chooses by size.
* **ownership**: a parameter belongs to the unit of the first module (pre-order) that holds it.
  A parameter held by a second module in another unit (a tied LM head sharing the embedding's
  weight) makes that module a **borrower**: it gets hooks of its own that gather the owner's unit
  whenever it runs. So every parameter is in exactly one flat buffer, and is gathered whenever any
  module holding it runs.
* **persistent**: parameters with fewer elements than ``persistence_threshold_numel`` go into one
  persistent unit that stays gathered (norms and biases: gathering them costs more than keeping
  them). ``'auto'`` is :data:`AUTO_PERSISTENCE_THRESHOLD_NUMEL`.

How a unit's parameters are laid out in flat buffers is :mod:`._flat_group`.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Iterable

from torch import nn

from infinity.config import AUTO, ZeroConfig

logger = logging.getLogger(__name__)

AUTO_PERSISTENCE_THRESHOLD_NUMEL = 2 ** 14
"""'auto' persistence threshold: 16384 elements (64 KiB in fp32). Covers biases and norm weights of
models up to hidden size 16384, which are small and used by every unit; matrices are far above it."""

AUTO_UNIT_MIN_NUMEL = 1_000_000
"""'auto' unit_min_numel when the model has no repeated blocks: by size, a module becomes a unit at
one million elements (4 MB in fp32): large enough that per-unit hooks and collectives stay a small
part of the step, small enough to bound what one gather holds."""
_LAYER_STACKS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
"""Containers a model keeps its layers in (nanoGPT and Hugging Face: ModuleList; torchtitan:
ModuleDict; hand-written stacks: Sequential)."""

_LOGGED: "weakref.WeakKeyDictionary[nn.Module, tuple[str, ...]]" = weakref.WeakKeyDictionary()
"""The default choice logged per model (the engine chooses several times: budgets, then units)."""

PERSISTENT_UNIT_NAME = "<persistent>"
ROOT_UNIT_NAME = "<root>"


@dataclasses.dataclass
class ChosenUnit:
    """One unit as planned: its name, the module it hangs on, and its parameters in order."""

    index: int
    name: str
    """Qualified name of the unit module ('<root>' for the root's leftovers, '<persistent>')."""
    params: list[tuple[str, nn.Parameter]]
    """(first qualified name, parameter), distinct parameters in module pre-order."""
    persistent: bool = False

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.params)


@dataclasses.dataclass
class UnitChoice:
    units: list[ChosenUnit]
    hooked: list[tuple[nn.Module, str, list[int]]]
    """(module, qualified name, unit indices it needs gathered while it runs) for modules that get
    forward hooks: unit modules and borrowers. The persistent unit is never listed (always gathered)."""
    param_names: dict[int, list[str]]
    """id(parameter) -> every qualified name it has (tied parameters have several)."""


def resolve_persistence_threshold(value: int | str) -> int:
    return AUTO_PERSISTENCE_THRESHOLD_NUMEL if value == "auto" else int(value)


def _direct_params(module: nn.Module) -> Iterable[tuple[str, nn.Parameter]]:
    return ((n, p) for n, p in module._parameters.items() if p is not None)


def _runs(module: nn.Module) -> bool:
    """The module has a forward of its own, so its hooks fire (a ModuleList's never do)."""
    return type(module).forward is not nn.Module.forward


def _is_composite(module: nn.Module) -> bool:
    """A module built of modules that hold parameters (a block), not a layer (Linear, Embedding)."""
    return any(next(child.parameters(), None) is not None for child in module.children())


def block_class_names(root: nn.Module) -> tuple[str, ...]:
    """Class names of ``root``'s repeated blocks, in model order; () when it has none.

    [Note: default units are the repeated blocks] A *layer stack* is a ModuleList, ModuleDict or
    Sequential holding at least two composite modules (modules built of parameter-holding
    modules) of one class; every composite module it holds with a forward is a *block* (a hybrid
    stack of two layer classes gives both). The search stops at a block: stacks inside blocks
    (the experts of a mixture-of-experts layer) are parts of their block's unit. A model without
    a stack falls back to the classes Hugging Face's ``_no_split_modules`` names, where present
    in the model (a one-layer Llama), and else to nothing (by size). Why blocks: they are what
    DeepSpeed users tune by hand and what the ledger's shape assumes. By size, the larger Linears
    of each block become units of their own and the smaller ones fall to the root unit, gathered
    for the whole step: issue #15 measured a 135M GPT from a plain DeepSpeed config at 1.15x plain
    PyTorch without offload, 1.02x with Block units."""
    names: dict[str, None] = {}  # ordered set

    def visit(module: nn.Module) -> None:
        children = list(module.children())
        if isinstance(module, _LAYER_STACKS):
            composite = [c for c in children if _runs(c) and _is_composite(c)]
            counts: dict[type, int] = {}
            for c in composite:
                counts[type(c)] = counts.get(type(c), 0) + 1
            if counts and max(counts.values()) >= 2:
                for c in composite:
                    names.setdefault(type(c).__name__)
                blocks = {id(c) for c in composite}
                children = [c for c in children if id(c) not in blocks]  # not searched further
        for child in children:
            visit(child)

    visit(root)
    if names:
        return tuple(names)
    return _no_split_class_names(root)


def _no_split_class_names(root: nn.Module) -> tuple[str, ...]:
    """The classes (sorted) the first Hugging Face model in ``root`` (pre-order) lists in
    ``_no_split_modules`` and that occur in ``root`` with a forward; () when none do."""
    present = {type(m).__name__ for m in root.modules() if _runs(m)}
    for module in root.modules():
        declared = getattr(module, "_no_split_modules", None)
        if declared:
            found = tuple(sorted(n for n in declared if isinstance(n, str) and n in present))
            if found:
                return found
    return ()


def _choose_unit_modules(root: nn.Module, *, unit_class_names: tuple[str, ...],
                         unit_min_numel: int | str, persistent_ids: set[int]) -> set[str]:
    """Qualified names of the unit modules (always including the root, named '')."""
    modules = dict(root.named_modules())
    chosen: set[str] = {""}
    if not unit_class_names and unit_min_numel == AUTO:
        unit_class_names = block_class_names(root)
        if unit_class_names and _LOGGED.get(root) != unit_class_names:  # once per model
            _LOGGED[root] = unit_class_names
            logger.info("units: the repeated blocks %s (set zero.unit_class_names to choose "
                        "others)", list(unit_class_names))
        unit_min_numel = AUTO_UNIT_MIN_NUMEL
    if unit_class_names:
        wanted = set(unit_class_names)
        for name, module in modules.items():
            if name and type(module).__name__ in wanted and not any(
                    name.startswith(c + ".") for c in chosen if c):
                chosen.add(name)
        if len(chosen) == 1:
            logger.warning("zero.unit_class_names %s matched no module; the whole model is one unit",
                           sorted(wanted))
        return chosen
    claimed: set[int] = set(persistent_ids)

    def visit(name: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        if not name or type(module).forward is nn.Module.forward:
            return  # the root, and containers that never run (ModuleList): hooks would not fire
        fresh = {id(p): p for sub in module.modules() for _, p in _direct_params(sub)
                 if id(p) not in claimed}
        if sum(p.numel() for p in fresh.values()) >= int(unit_min_numel):
            chosen.add(name)
            claimed.update(fresh)

    visit("", root)
    return chosen


def choose_units(root: nn.Module, *, unit_class_names: tuple[str, ...] = (),
                 unit_min_numel: int | str = AUTO, persistence_threshold_numel: int) -> UnitChoice:
    """Choose units, owners and borrowers for ``root`` (see the module docstring): by
    ``unit_class_names`` when given, else by size at ``unit_min_numel`` elements, else ('auto')
    the repeated blocks or, without any, by size at :data:`AUTO_UNIT_MIN_NUMEL`."""
    param_names: dict[int, list[str]] = {}
    all_params: dict[int, nn.Parameter] = {}
    for mod_name, module in root.named_modules(remove_duplicate=False):
        for p_name, p in _direct_params(module):
            param_names.setdefault(id(p), []).append(f"{mod_name}.{p_name}" if mod_name else p_name)
            all_params[id(p)] = p
    persistent_ids = {i for i, p in all_params.items() if p.numel() < persistence_threshold_numel}
    unit_modules = _choose_unit_modules(root, unit_class_names=unit_class_names,
                                        unit_min_numel=unit_min_numel,
                                        persistent_ids=persistent_ids)

    owner: dict[int, str] = {}  # id(param) -> unit module name
    members: dict[str, list[tuple[str, nn.Parameter]]] = {}
    borrows: dict[str, set[str]] = {}  # module name -> unit module names it borrows from
    module_objs: dict[str, nn.Module] = {}
    for mod_name, module in root.named_modules():
        module_objs[mod_name] = module
        scope = _scope_of(mod_name, unit_modules)
        for p_name, p in _direct_params(module):
            if id(p) in persistent_ids:
                continue
            if id(p) not in owner:
                owner[id(p)] = scope
                members.setdefault(scope, []).append(
                    (f"{mod_name}.{p_name}" if mod_name else p_name, p))
            elif owner[id(p)] != scope:
                borrows.setdefault(mod_name, set()).add(owner[id(p)])

    units: list[ChosenUnit] = []
    index_of: dict[str, int] = {}
    persistent = [(param_names[i][0], all_params[i]) for i in all_params if i in persistent_ids]
    if persistent:
        units.append(ChosenUnit(index=0, name=PERSISTENT_UNIT_NAME, params=persistent,
                              persistent=True))
    for mod_name in module_objs:  # pre-order: the order the forward usually runs them in
        if mod_name in members:
            index_of[mod_name] = len(units)
            units.append(ChosenUnit(index=len(units), name=mod_name or ROOT_UNIT_NAME,
                                  params=members[mod_name]))

    hooked: list[tuple[nn.Module, str, list[int]]] = []
    for mod_name, module in module_objs.items():
        needed = []
        if mod_name in index_of:
            needed.append(index_of[mod_name])
        needed += sorted(index_of[o] for o in borrows.get(mod_name, ()) if o in index_of)
        if needed:
            hooked.append((module, mod_name, needed))
    return UnitChoice(units=units, hooked=hooked, param_names=param_names)


def units_of(root: nn.Module, zero: ZeroConfig) -> UnitChoice:
    """:func:`choose_units` with the ``zero`` config's unit settings ('auto' persistence resolved)."""
    return choose_units(root, unit_class_names=zero.unit_class_names,
                        unit_min_numel=zero.unit_min_numel,
                        persistence_threshold_numel=resolve_persistence_threshold(
                            zero.persistence_threshold_numel))


def _scope_of(mod_name: str, unit_modules: set[str]) -> str:
    """The nearest unit module at or above ``mod_name``."""
    parts = mod_name.split(".") if mod_name else []
    for cut in range(len(parts), 0, -1):
        candidate = ".".join(parts[:cut])
        if candidate in unit_modules:
            return candidate
    return ""
