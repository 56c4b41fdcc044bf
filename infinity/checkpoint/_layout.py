"""The layout of one save: which file holds what, and which element ranges a rank stores.

[Note: ranges per parameter]
Rank r writes, for each flat group of each unit, the even slice ``[r*S, (r+1)*S)`` of the padded
flat buffer (its stage 1-3 optimizer partition; at stage 0, where every rank holds everything, the
slice splits the writing among ranks). It is stored per parameter, by the parameter's name in
``model.state_dict()``, as the parameter-local element range ``[lo, hi)``: tensors
``<param>::master::<lo>``, ``::exp_avg::``, ``::exp_avg_sq::`` (fp32) and ``::param::`` (the
compute-dtype values; frozen parameters, and trainable ones when the compute dtype is not fp32,
so a resume is bitwise). The manifest lists each file's ranges. A loader computes the partition it
owns now, at any world size, stage or unit choice, and reads just the overlapping byte ranges.
Padding is never stored (it is zero in every buffer). Tied parameters are stored once, under their
first name; the manifest maps every ``state_dict()`` key to its source.
"""

from __future__ import annotations

from typing import Any

import torch

from infinity._common import warn_once

BUFFERS_FILE = "buffers.safetensors"
TRAIN_KINDS = ("master", "exp_avg", "exp_avg_sq")
"""The fp32 values stored for a trainable parameter (the optimizer's state)."""


def shard_file(unit_index: int, rank: int) -> str:
    return f"u{unit_index:04d}-r{rank:05d}.safetensors"


def rng_file(rank: int) -> str:
    return f"rng-r{rank:05d}.safetensors"


def param_ranges(slots: list[Any], lo: int, hi: int) -> list[tuple[Any, int, int]]:
    """``(slot, a, b)``: the parameter-local range ``[a, b)`` of each slot inside the flat range
    ``[lo, hi)`` of its group (slots have ``offset`` and ``numel``); empty overlaps left out."""
    out = []
    for s in slots:
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a < b:
            out.append((s, a - s.offset, b - s.offset))
    return out


def rank_ranges(group: Any, rank: int) -> list[tuple[Any, int, int]]:
    """:func:`param_ranges` of the slice ``[rank*S, (rank+1)*S)`` of ``group`` (``slots``,
    ``shard_numel`` S) that rank ``rank`` writes ([Note: ranges per parameter])."""
    return param_ranges(group.slots, rank * group.shard_numel, (rank + 1) * group.shard_numel)


def saved_kinds(requires_grad: bool, compute_dtype: torch.dtype) -> list[str]:
    """The kinds a group's parameters are saved as ([Note: ranges per parameter]): the
    optimizer's fp32 state when it trains, and ``param`` (its compute-dtype values) when it is
    frozen or the compute dtype is not fp32 (an fp32 trainable parameter is its master). A load
    reads what this says was written."""
    kinds = list(TRAIN_KINDS) if requires_grad else []
    if not requires_grad or compute_dtype != torch.float32:
        kinds.append("param")
    return kinds


def module_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``state_dict()`` entries that are not parameters (replicated buffers), detached; a
    non-tensor entry (extra state) is named in a one-time warning and not saved."""
    params = {id(p) for p in module.parameters()}
    out = []
    for key, value in module.state_dict(keep_vars=True).items():
        if id(value) in params:
            continue
        if isinstance(value, torch.Tensor):
            out.append((key, value.detach()))
        else:
            warn_once(f"ckpt-extra-state:{key}",
                      f"state_dict entry {key!r} is not a tensor ({type(value).__name__}); "
                      f"checkpoints do not save it")
    return out
