"""The after-step gathers of stages 1-2, overlapped with the optimizer step and the next forward.

[Note: the after-step gather overlaps the next forward]
At stages 1-2 every unit stays gathered, and after the optimizer step each rank's updated shard is
all-gathered into every rank's full parameters: 1/3 of stage 2's link time, on the critical path
when ``step()`` waits for it (the 110M GPT at 2 gloo ranks, link time = compute time: 0.97 s
exposed of a 3.94 s step). With ``zero.overlap_param_gather`` the gathers are issued inside
``step()``, each unit's as soon as the optimizer has updated its last key, while the later keys
step (:meth:`StepGathers.on_stepped`; on the 135M GPT the tied table's gather, 0.39 s of link,
starts 0.1 s before ``step()`` returns), and waited where the next forward first reads each unit:
its module's forward pre-hook; at the model's own pre-hook, before anything runs, the units no
module of which is hooked (the persistent unit) and those the first training forward read outside
their modules (found as the outside-use detector finds stage 3's, [Note: parameters used outside
their module] in infinity/zero/_param_manager.py). Every other reader waits for all of them first
(``ParameterManager.settle_params``): ``module.state_dict()`` (a hook), ``full_state_dict``,
checkpoints, weights, the next optimizer step, ``finish_step`` and ``close``. User code reading a
parameter directly between ``step()`` and the next forward is the one reader nothing sees (the
config key's docstring says so), as with Megatron's ``overlap_param_gather``.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable, Sequence

from torch import nn

from infinity.zero._flat_group import Unit

logger = logging.getLogger(__name__)


class StepGathers:
    """Where the overlapped after-step gathers are issued and waited. ``issue(unit)`` issues a
    unit's after-step gather, ``wait(unit)`` completes whatever gather it has in flight, and
    ``settle()`` completes every unit's (the manager's, which know the unit storage)."""

    def __init__(self, units: Sequence[Unit], hooked_units: set[int], *,
                 issue: Callable[[Unit], None], wait: Callable[[Unit], None],
                 settle: Callable[[], None]):
        self._units = units
        self._issue = issue
        self._wait = wait
        self._settle = settle
        self._wait_first: set[int] = {u.index for u in units if u.index not in hooked_units}
        """Units waited when the model's forward begins (no module of theirs is hooked: the
        persistent unit; and units the first forward read outside their modules)."""
        self._entered: collections.Counter[int] = collections.Counter()
        """Units whose module's forward runs now (the first forward's outside-read detection)."""
        self._issued: set[int] = set()
        """Units whose gather the optimizer's step issued already (:meth:`on_stepped`)."""
        self._keys: dict[int, frozenset[str]] = {
            u.index: frozenset(g.key for g in u.groups if g.requires_grad)
            for u in units if u.always_gathered}
        """The trainable keys of each unit whose gather follows the step."""
        self._unit_of: dict[str, int] = {key: index for index, keys in self._keys.items()
                                         for key in keys}

    def install(self, module: nn.Module, hooked: list[tuple[nn.Module, str, list[int]]]
                ) -> list[Any]:
        """The hooks that wait for the gathers: the model's, its hooked modules', and the
        settling before ``module.state_dict()``; returns their handles."""
        units = self._units
        handles = [module.register_forward_pre_hook(
            lambda module, args: self._wait_all(units[i] for i in sorted(self._wait_first)))]
        for hooked_module, _name, indices in hooked:
            group = [units[i] for i in indices]
            handles.append(hooked_module.register_forward_pre_hook(
                lambda module, args, group=group: self._enter(group)))
            handles.append(hooked_module.register_forward_hook(
                lambda module, args, output, group=group: self._entered.subtract(
                    u.index for u in group), always_call=True))
        handles.append(module.register_state_dict_pre_hook(
            lambda module, prefix, keep_vars: self._settle()))
        return handles

    def _enter(self, units: list[Unit]) -> None:
        self._entered.update(u.index for u in units)
        self._wait_all(units)

    def _wait_all(self, units: Any) -> None:
        for u in units:
            self._wait(u)

    def read_outside(self, unit: Unit, func_name: str) -> None:
        """The outside-use detector saw a parameter of ``unit`` read: outside the unit's modules,
        its gather is waited when the forward begins from now on."""
        if self._entered[unit.index] <= 0 and unit.index not in self._wait_first:
            logger.info("%s read a parameter of unit %d %r outside its modules: its after-step "
                        "gather is waited when the forward begins", func_name, unit.index,
                        unit.name)
            self._wait_first.add(unit.index)

    def on_stepped(self) -> Callable[[str], None]:
        """What the optimizer calls with each key as its parameter partition takes the step's
        update: a unit's gather is issued as soon as its last trainable key is updated, while
        the later keys step; :meth:`issue_rest` issues the others."""
        left = {index: set(keys) for index, keys in self._keys.items()}
        self._issued = set()

        def stepped(key: str) -> None:
            index = self._unit_of.get(key)
            if index is None:
                return
            keys = left[index]
            keys.discard(key)
            if not keys:
                # The same order on every rank: the optimizer steps its keys in add order, and
                # which keys a step updates is decided over all ranks (_grad_presence.py).
                self._issue(self._units[index])
                self._issued.add(index)
        return stepped

    def issue_rest(self) -> None:
        """After the step: the gathers :meth:`on_stepped` did not issue (units without a
        trainable key, or with one the step left out, or a step run without it)."""
        issued, self._issued = self._issued, set()
        for unit in self._units:
            if unit.always_gathered and unit.index not in issued:
                self._issue(unit)
