"""Choosing the units of a model (pure logic on the module tree; no hooks, no tensors moved).

A **unit** is a group of parameters fetched and released together. :func:`choose_units` picks them:

* **unit modules**: each module whose class name is in ``zero.unit_class_names`` (outermost wins),
  or, choosing by size, each module whose subtree holds at least ``zero.unit_min_numel`` elements
  not already claimed by a unit module below it (post-order, so blocks become units before the
  model that contains them). Containers without a ``forward`` (``ModuleList``) never become units:
  their hooks would never fire. The root module is always a unit module: it owns the leftovers.
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
from typing import Iterable

from torch import nn

from infinity.config import ZeroConfig

logger = logging.getLogger(__name__)

AUTO_PERSISTENCE_THRESHOLD_NUMEL = 2 ** 14
"""'auto' persistence threshold: 16384 elements (64 KiB in fp32). Covers biases and norm weights of
models up to hidden size 16384, which are small and used by every unit; matrices are far above it."""

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


def _choose_unit_modules(root: nn.Module, *, unit_class_names: tuple[str, ...],
                         unit_min_numel: int, persistent_ids: set[int]) -> set[str]:
    """Qualified names of the unit modules (always including the root, named '')."""
    modules = dict(root.named_modules())
    chosen: set[str] = {""}
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
        if sum(p.numel() for p in fresh.values()) >= unit_min_numel:
            chosen.add(name)
            claimed.update(fresh)

    visit("", root)
    return chosen


def choose_units(root: nn.Module, *, unit_class_names: tuple[str, ...] = (), unit_min_numel: int,
               persistence_threshold_numel: int) -> UnitChoice:
    """Choose units, owners and borrowers for ``root`` (see the module docstring)."""
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
