"""Parameter groups: ``initialize(model, config, model_parameters=...)`` resolved into torch-style
group dicts over the model's own parameters, validated before anything is built.

``model_parameters`` (DeepSpeed's name) is None (every parameter with ``requires_grad``, one group),
an iterable of parameters (one group), or torch-style groups ``[{"params": [...], "lr": ...}, ...]``
(``params`` entries may be parameters or ``(name, parameter)`` pairs, as torch allows). Missing
hyperparameters take the config's values (the optimizer's ``defaults``); other keys are kept as
they are. Frozen parameters may be listed or left out; a trainable parameter in no group, or in
two, is a ValueError naming it.
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping

import torch
from torch import nn

HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
"""The per-group hyperparameters the engine's Adam reads at every step."""

_UNSUPPORTED = {"amsgrad": "AMSGrad", "maximize": "maximize", "nesterov": "Nesterov momentum"}
"""torch.optim group keys that would change the update rule; set to a true value: rejected."""


def _number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def check_hyperparameters(group: Mapping[str, Any], where: str) -> None:
    """ValueError naming ``where[key]`` for a hyperparameter Adam cannot take."""
    for key in ("lr", "eps", "weight_decay"):
        value = _number(group[key])
        if value is None or not value >= 0.0:
            raise ValueError(f"{where}[{key!r}]: expected a number >= 0, got {group[key]!r}")
    betas = group["betas"]
    ok = isinstance(betas, (tuple, list)) and len(betas) == 2 and all(
        _number(b) is not None and 0.0 <= _number(b) < 1.0 for b in betas)
    if not ok:
        raise ValueError(f"{where}['betas']: expected two numbers in [0, 1), got {betas!r}")
    for key, what in _UNSUPPORTED.items():
        if group.get(key):
            raise ValueError(f"{where}[{key!r}]: {what} is not supported by the engine's "
                             f"Adam(W); remove the key or set it to False")


def _group_params(raw: Any, where: str) -> list[Any]:
    if isinstance(raw, torch.Tensor):
        return [raw]
    if isinstance(raw, (set, frozenset)):
        raise ValueError(f"{where}['params']: a set has no fixed order; pass a list")
    try:
        return list(raw)
    except TypeError:
        raise ValueError(f"{where}['params']: expected a list of parameters, got "
                         f"{type(raw).__name__}") from None


def _raw_groups(model: nn.Module, model_parameters: Any) -> list[Any]:
    """``model_parameters`` as a list of group mappings, each with its ``params`` as given (None:
    one group of every parameter with ``requires_grad``; bare parameters: one group of them)."""
    if model_parameters is None:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    if isinstance(model_parameters, (torch.Tensor, Mapping)):
        model_parameters = [model_parameters]
    try:
        items = list(model_parameters)
    except TypeError:
        raise ValueError(f"model_parameters: expected parameters or a list of parameter "
                         f"groups, got {type(model_parameters).__name__}") from None
    if not items:
        raise ValueError("model_parameters: empty; pass the parameters to train, or None "
                         "for every parameter with requires_grad")
    if all(isinstance(i, Mapping) for i in items):
        return items
    if any(isinstance(i, Mapping) for i in items):
        raise ValueError("model_parameters: mixes parameter groups (dicts) with bare "
                         "parameters; put every parameter into a group")
    return [{"params": items}]


def resolve_param_groups(model: nn.Module, model_parameters: Any,
                         defaults: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Torch-style group dicts over ``model``'s parameters (see the module docstring); each group
    has every key of ``defaults`` (its own value where given). Raises ValueError before anything
    is changed."""
    names = names_of(model)
    groups: list[dict[str, Any]] = []
    owner: dict[int, int] = {}
    for i, raw in enumerate(_raw_groups(model, model_parameters)):
        where = f"model_parameters[{i}]"
        if "params" not in raw:
            raise ValueError(f"{where}: a parameter group needs a 'params' key")
        group = {**defaults, **{k: v for k, v in raw.items() if k != "params"}}
        params, param_names = [], []
        for entry in _group_params(raw["params"], where):
            p = entry[1] if isinstance(entry, tuple) and len(entry) == 2 else entry
            if isinstance(entry, tuple) and len(entry) == 2:
                param_names.append(entry[0])
            if not isinstance(p, torch.Tensor) or id(p) not in names:
                shape = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
                raise ValueError(f"{where}['params']: holds a tensor that is not a parameter of "
                                 f"the model ({shape}); pass the model's own parameters "
                                 f"(model.named_parameters())")
            if id(p) in owner:
                raise ValueError(f"model_parameters: parameter {names[id(p)]!r} is in group "
                                 f"{owner[id(p)]} and in group {i}; put it into one group only")
            owner[id(p)] = i
            params.append(p)
        if param_names and len(param_names) != len(params):
            raise ValueError(f"{where}['params']: mixes (name, parameter) pairs with bare "
                             f"parameters; use one form")
        check_hyperparameters(group, where)
        group["betas"] = tuple(float(b) for b in group["betas"])
        groups.append({"params": [(n, p) for n, p in zip(param_names, params)]
                       if param_names else params, **group})
    missing = [names[id(p)] for p in model.parameters() if p.requires_grad and id(p) not in owner]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ValueError(f"model_parameters: trainable parameter {missing[0]!r} is in no group"
                         f"{', nor are ' + repr(missing[1:3]) if len(missing) > 1 else ''}{more}; "
                         f"add it to a group, or freeze it (requires_grad_(False))")
    return groups


def names_of(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first qualified name in ``model``."""
    out: dict[int, str] = {}
    for name, p in model.named_parameters():
        out.setdefault(id(p), name)
    return out


def json_safe_group(group: Mapping[str, Any]) -> dict[str, Any]:
    """A group's keys other than ``params`` as JSON values (tensors as numbers, tuples as lists);
    values JSON cannot hold are left out (they are not the engine's hyperparameters)."""
    out: dict[str, Any] = {}
    for key, value in group.items():
        if key == "params":
            continue
        converted = _json_value(value)
        if converted is not _SKIP:
            out[key] = converted
    return out


_SKIP = object()


def _json_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    number = _number(value)
    if number is not None:
        return int(value) if isinstance(value, numbers.Integral) else number
    if isinstance(value, (tuple, list)):
        items = [_json_value(v) for v in value]
        return _SKIP if any(i is _SKIP for i in items) else items
    return _SKIP


def rebind_param_groups(groups: list[dict[str, Any]], new_of: Mapping[int, nn.Parameter]
                        ) -> list[dict[str, Any]]:
    """``groups`` with each parameter ``p`` replaced by ``new_of[id(p)]`` where given (a model
    built under ``infinity.init`` swaps its placeholders for real parameters after the groups
    were resolved)."""
    out = []
    for g in groups:
        params = [(e[0], new_of.get(id(e[1]), e[1])) if isinstance(e, tuple)
                  else new_of.get(id(e), e) for e in g["params"]]
        out.append({**g, "params": params})
    return out
