"""The model's full state dict assembled from the units' flat groups (collective): each group's
values over all ranks, cut back into ``model.state_dict()``'s entries.

Split out of :class:`~infinity.zero._param_manager.ParameterManager` (#35), whose
``full_state_dict`` hands its arguments here with its own ``full_flat`` (one group's values).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

from infinity.zero._collectives import Collectives, Phase
from infinity.zero._flat_group import FlatGroup, Unit
from infinity.zero._tensor_parallel import full_value

logger = logging.getLogger(__name__)

__all__ = ["full_flat", "full_state_dict"]

FullFlat = Callable[[FlatGroup, "torch.Tensor | None"], torch.Tensor]
"""(group, this rank's fp32 master or None) -> the group's values over all ranks."""


def full_flat(group: FlatGroup, src: torch.Tensor, coll: Collectives, *, stage: int,
              device: torch.device) -> torch.Tensor:
    """``group``'s values over all ranks, in fp32, from ``src`` (this rank's partition: its fp32
    master, or its parameter shard); a collective unless ``src`` is the whole buffer."""
    src = src.to(device)
    if stage == 0 or src.numel() == group.padded_numel:
        return src.float().clone()
    out = torch.empty(group.padded_numel, dtype=src.dtype, device=device)
    coll.all_gather(out, src, context=f"state-dict gather of {group.key}",
                    phase=Phase.STATE_DICT)
    return out.float()


def full_state_dict(module: nn.Module, units: list[Unit], full_flat: FullFlat,
                    master_of: Any = None, keys: Any = None) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` keys; parameters from ``master_of(group key)`` (fp32 masters)
    where it returns a tensor, else from ``full_flat``. ``keys``: only these entries (only the
    flat groups holding them are gathered); a ``ValueError`` names one not in the state dict."""
    state = module.state_dict(keep_vars=True)
    if keys is not None:
        keys = list(keys)
        unknown = [k for k in keys if k not in state]
        if unknown:
            raise ValueError(f"full_state_dict(keys=...): {unknown[:5]} not in the model's "
                             f"state_dict ({len(state)} keys, e.g. {list(state)[:3]}); pass "
                             f"keys of engine.module.state_dict()")
        state = {k: state[k] for k in keys}
    wanted = {id(v) for v in state.values()}
    values: dict[int, torch.Tensor] = {}
    for unit in units:
        for g in unit.groups:
            if not any(id(s.param) in wanted for s in g.slots):
                continue
            master = master_of(g.key) if (master_of is not None and g.requires_grad) else None
            flat = full_flat(g, master)
            for s in g.slots:
                values[id(s.param)] = full_value(  # a DTensor's: over the tensor ranks too
                    s.param, flat[s.offset:s.offset + s.numel].view(s.shape))
    out = {}
    for key, value in state.items():
        if id(value) in values:
            out[key] = values[id(value)]
        else:
            out[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    return out
