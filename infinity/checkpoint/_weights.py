"""Loading model weights from safetensors straight into the engine's shards.

``load_weights(engine, path)`` reads a ``.safetensors`` file, a directory holding
``model.safetensors``, or a Hugging Face sharded checkpoint (``model.safetensors.index.json`` and
its shard files, what ``save_pretrained`` writes), keyed like ``model.state_dict()``. Call it on
every rank, after ``infinity.initialize`` and before training (or between optimizer steps).

[Note: each rank reads its partition]
For each flat group of each unit, a rank reads from the file only the parameter-local element
ranges its optimizer partition covers (``CheckpointTarget.partition_of``: the rank's 1/W shard at
stages 1-3, the whole buffer at stage 0), by byte range (``SafetensorsCheckpoint.read_into``),
through one reusable staging buffer of at most ``_STAGING_BYTES``. The values go to the fp32
master (trainable groups) and to the compute-dtype parameter partition (every group, frozen ones
too); ``after_shards_written()`` then re-gathers the always-gathered units from the new shards,
exactly as after an optimizer step. Buffers (``state_dict`` entries that are not parameters; non-persistent
buffers are not in it) are replicated: every rank reads them whole.

What is *not* touched: the optimizer moments (``exp_avg``, ``exp_avg_sq``), the step count, the
learning rate and the loss scale. On a fresh engine the moments are zero, so training starts from
the loaded weights exactly as ``torch.optim.AdamW`` over ``model.load_state_dict(...)`` would.
On an engine that has trained, the moments of the old weights stay (like ``load_state_dict`` on a
model whose optimizer already has state); load a full checkpoint (``load_checkpoint``) to restore
training state instead.

Everything is validated on every rank before anything changes (keys, shapes, dtypes, files
present and long enough); any problem raises on every rank and leaves the engine as it was.

A wrapped model loads its unwrapped model's checkpoint through ``key_map`` (model key -> the
name in the file) and ``optional_keys`` (model keys a strict load may miss): a peft model's base
weights (``infinity.integrations.peft.load_base_weights`` makes both from peft's naming).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Collection, Iterator, Mapping

import torch
from torch import nn

from infinity._common import MiB, warn_once
from infinity.checkpoint._layout import param_ranges
from infinity.checkpoint._ranks import on_every_rank
from infinity.checkpoint._target import CheckpointTarget, checkpoint_target
from infinity.errors import InfinityError
from infinity.io import SafetensorsCheckpoint

logger = logging.getLogger(__name__)

_STAGING_BYTES = 16 * MiB
"""Cap of the one staging buffer (larger ranges are read in pieces): bounds the host memory a
load needs beyond what the engine already holds."""
_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_LIST_AT_MOST = 10
"""Keys named in an error message before '... and N more'."""


class WeightsError(InfinityError, ValueError):
    """A weights file does not fit this model (keys, shapes, dtypes) or cannot be read."""

    def __init__(self, message: str, *, path: str):
        super().__init__(message)
        self.path = path


@dataclass(frozen=True)
class _Plan:
    """What a load will do, settled (and checked) before any state changes."""

    sources: dict[int, str]
    """id(parameter) -> the file tensor it is loaded from (the first of its tied names stored)."""
    buffers: dict[str, torch.Tensor]
    """state_dict key -> the module buffer to overwrite (those present in the file)."""
    missing_keys: list[str]
    unexpected_keys: list[str]
    max_range_bytes: int
    """Largest stored byte range one parameter read asks for (sizes the staging buffer)."""


def load_weights(engine: Any, path: str | os.PathLike[str], *, strict: bool = True,
                 key_map: Mapping[str, str] | None = None,
                 optional_keys: Collection[str] = ()) -> dict[str, list[str]]:
    """Load ``path`` (safetensors file, directory, or HF index) into ``engine``'s shards; call on
    every rank. ``strict``: as in ``load_state_dict``, missing or unexpected keys raise (before
    any change); otherwise what matches is loaded. ``key_map``: model state_dict key -> its name
    in the file, for keys named differently there. ``optional_keys``: model keys that a strict
    load does not require (still listed as missing). Returns ``{"missing_keys",
    "unexpected_keys"}`` (missing: model keys; unexpected: file names). Shape or dtype
    mismatches always raise. See the module docstring for what is written."""
    target = checkpoint_target(engine)
    path = os.fspath(path)
    what = f"loading weights from {path}"
    names = _Names(dict(key_map or {}), frozenset(optional_keys))
    ckpt, plan = on_every_rank(target, what, lambda: _open_and_plan(target, path, strict, names),
                                cleanup=lambda r: r[0].close() if r is not None else None)
    try:
        _write(target, ckpt, plan)  # collectives inside (after_step): not under on_every_rank
    finally:
        ckpt.close()
    logger.info("weights loaded from %s: %d parameters, %d buffers; missing %d, unexpected %d",
                path, len(plan.sources), len(plan.buffers), len(plan.missing_keys),
                len(plan.unexpected_keys))
    return {"missing_keys": list(plan.missing_keys),
            "unexpected_keys": list(plan.unexpected_keys)}


# ----------------------------------------------------------------------------------------------
# Validation (nothing changes here)


@dataclass(frozen=True)
class _Names:
    """How model keys are named in the file (see ``load_weights``)."""

    key_map: dict[str, str]
    optional: frozenset[str]

    def file_name(self, key: str) -> str:
        return self.key_map.get(key, key)


def _open_and_plan(target: CheckpointTarget, path: str, strict: bool, names: _Names
                   ) -> tuple[SafetensorsCheckpoint, _Plan]:
    _check_between_steps(target, f"load_weights({path!r})", path)
    ckpt = SafetensorsCheckpoint(path)  # parses every header; a truncated file raises here
    try:
        plan = _plan(target, ckpt, strict, names)
    except BaseException:
        ckpt.close()
        raise
    return ckpt, plan


def _check_between_steps(target: CheckpointTarget, what: str, path: str) -> None:
    if not target.between_steps:
        raise WeightsError(
            f"{what}: micro-step {target.micro_steps} is inside a gradient "
            f"accumulation window; the partial gradients belong to the old weights. Load before "
            f"training or right after the engine.step() that ran the optimizer", path=path)
    busy = [u.name for u in target.units if u.in_use]
    if busy:
        raise WeightsError(f"{what}: units {busy[:5]} are in use by a forward or "
                           f"backward; load between steps", path=path)


def _plan(target: CheckpointTarget, ckpt: SafetensorsCheckpoint, strict: bool,
          names: _Names) -> _Plan:
    slot_of = {id(s.param): s for u in target.units for g in u.groups for s in g.slots}
    aliases: dict[int, list[str]] = {}
    """id(parameter) -> the file names of its state_dict keys."""
    model_keys: dict[str, str] = {}
    """File name -> the model key it stands for (error messages name model keys)."""
    buffers: dict[str, torch.Tensor] = {}
    """File name -> the module buffer."""
    for key, value in target.module.state_dict(keep_vars=True).items():
        name = names.file_name(key)
        model_keys[name] = key
        if isinstance(value, torch.Tensor) and id(value) in slot_of:
            aliases.setdefault(id(value), []).append(name)
        elif isinstance(value, torch.Tensor):
            buffers[name] = value
    entries = ckpt.entries
    missing: list[str] = []
    sources: dict[int, str] = {}
    for pid, keys in aliases.items():
        # Tied parameters: HF stores the shared tensor once, under any one of its names.
        stored = [k for k in keys if k in entries]
        if stored:
            sources[pid] = stored[0]
            if len(stored) > 1:  # saved from an untied model? the copies may differ
                warn_once(f"weights-tied:{stored[0]}",
                          f"{ckpt.path}: {stored} are one tied parameter in this model; "
                          f"loading {stored[0]!r}, ignoring the others")
        else:
            missing += keys
    missing += [k for k in buffers if k not in entries]
    missing = [model_keys[k] for k in missing]
    known = {k for keys in aliases.values() for k in keys} | set(buffers)
    unexpected = [k for k in entries if k not in known]
    required = [k for k in missing if k not in names.optional]
    if strict and (required or unexpected):
        raise WeightsError(f"{ckpt.path}: does not match the model (strict=True): missing keys "
                           f"{_some(required)}, unexpected keys {_some(unexpected)}; fix the "
                           f"names, or pass strict=False to load the keys that match"
                           f"{_wrapped_hint(required, unexpected)}", path=ckpt.path)
    max_range = 0
    for pid, name in sources.items():
        slot = slot_of[pid]
        _check_entry(ckpt, name, tuple(slot.shape), floating=True, what="parameter")
        max_range = max(max_range, slot.numel * entries[name].dtype.itemsize)
    for key, buf in buffers.items():
        if key in entries:
            _check_entry(ckpt, key, tuple(buf.shape), floating=buf.is_floating_point(),
                         what="buffer")
    return _Plan(sources=sources, buffers={k: v for k, v in buffers.items() if k in entries},
                 missing_keys=missing, unexpected_keys=unexpected, max_range_bytes=max_range)


def _check_entry(ckpt: SafetensorsCheckpoint, name: str, shape: tuple[int, ...], *,
                 floating: bool, what: str) -> None:
    entry = ckpt.entries[name]
    if entry.shape != shape:
        raise WeightsError(f"{entry.path}: {what} {name!r} has shape {list(entry.shape)} in the "
                           f"file, the model expects {list(shape)} (another model or "
                           f"configuration?)", path=entry.path)
    if (entry.dtype in _FLOATS) != floating:
        raise WeightsError(f"{entry.path}: {what} {name!r} is stored as {entry.dtype}, the model "
                           f"holds a {'floating-point' if floating else 'non-floating'} tensor "
                           f"there", path=entry.path)


def _wrapped_hint(missing: list[str], unexpected: list[str]) -> str:
    """A base model's checkpoint loaded into its peft wrapping: name the loader that maps it."""
    if missing and unexpected and all(k.startswith("base_model.model.") for k in missing):
        return (" (a base model's checkpoint for a peft model? load it with "
                "infinity.integrations.peft.load_base_weights(engine, path))")
    return ""


def _some(keys: list[str]) -> str:
    more = f" ... and {len(keys) - _LIST_AT_MOST} more" if len(keys) > _LIST_AT_MOST else ""
    return f"{keys[:_LIST_AT_MOST]}{more}"


# ----------------------------------------------------------------------------------------------
# Writing


class _Staging:
    """One reusable host buffer; reads a parameter-local element range piece by piece into it."""

    def __init__(self, nbytes: int, device: torch.device):
        pin = device.type == "cuda" and torch.cuda.is_available()
        self._buf = torch.empty(max(nbytes, 8), dtype=torch.uint8, pin_memory=pin)
        """Raw bytes, viewed as the stored dtype of whatever is being read."""

    def read(self, ckpt: SafetensorsCheckpoint, name: str, start: int, count: int
             ) -> Iterator[tuple[int, torch.Tensor]]:
        """``(offset into the range, values)`` pieces covering elements ``[start, start+count)``;
        each piece is valid until the next one is asked for."""
        dtype = ckpt.entries[name].dtype
        per = max(1, self._buf.numel() // dtype.itemsize)
        for off in range(0, count, per):
            k = min(per, count - off)
            view = self._buf[:k * dtype.itemsize].view(dtype)
            ckpt.read_into(name, view, start_numel=start + off)
            yield off, view


def _write(target: CheckpointTarget, ckpt: SafetensorsCheckpoint, plan: _Plan) -> None:
    staging = _Staging(min(_STAGING_BYTES, plan.max_range_bytes), target.device)
    for unit in target.units:
        for g in unit.groups:
            lo, n = target.partition_of(g)
            ranges = [(s, a, b) for s, a, b in param_ranges(g.slots, lo, lo + n)
                      if id(s.param) in plan.sources]
            if ranges:
                _write_group(target, ckpt, g, lo, n, ranges, plan.sources, staging)
    target.flush_offload()  # every written shard is back in its home tier
    target.after_shards_written()  # re-gathers the always-gathered units (no grads exist)
    with torch.no_grad():
        for key, buf in plan.buffers.items():
            buf.copy_(ckpt.get(key).to(buf.device))


def _write_group(target: CheckpointTarget, ckpt: SafetensorsCheckpoint, g: Any, lo: int, n: int,
                 ranges: list[tuple[Any, int, int]], sources: dict[int, str],
                 staging: _Staging) -> None:
    """Partition ``[lo, lo + n)`` of group ``g``: file values into the compute-dtype parameter
    partition and, window by window (the offloaded optimizer's sub-groups), the fp32 master."""
    masters = target.open_master(g.key) if g.requires_grad else \
        contextlib.nullcontext([(0, n, contextlib.nullcontext(None))])
    # The parameter shard closes first (marked dirty, written back), then the masters' write-backs
    # are waited for.
    with masters as windows, target.open_param_partition(g) as param_out:
        for w_lo, w_hi, master_ctx in windows:
            with master_ctx as master:
                same = master is not None and master.data_ptr() == param_out.data_ptr() and \
                    master.dtype == param_out.dtype and w_lo == 0
                for s, a, b in ranges:
                    p_lo, p_hi = max(s.offset + a - lo, w_lo), min(s.offset + b - lo, w_hi)
                    if p_lo >= p_hi:
                        continue
                    first = p_lo - (s.offset - lo)  # parameter-local element of p_lo
                    for off, values in staging.read(ckpt, sources[id(s.param)], first,
                                                    p_hi - p_lo):
                        at, k = p_lo + off, values.numel()
                        param_out[at:at + k].copy_(values)
                        if master is not None and not same:
                            master[at - w_lo:at - w_lo + k].copy_(values)


class _InMemory:
    """Full parameter values in memory, read the way :func:`_write` reads a weights file."""

    def __init__(self, values: dict[str, torch.Tensor]):
        self.values = {k: v.detach().reshape(-1) for k, v in values.items()}
        self.entries = {k: SimpleNamespace(dtype=v.dtype) for k, v in self.values.items()}

    def read_into(self, name: str, out: torch.Tensor, *, start_numel: int) -> None:
        out.copy_(self.values[name][start_numel:start_numel + out.numel()])


def write_param_values(engine: Any, values: Mapping[nn.Parameter, torch.Tensor]) -> None:
    """Write full values of managed parameters (every rank passes the same) into their shards:
    the fp32 masters, the compute-dtype parameter shards wherever they live (NVMe too), then the
    always-gathered units are gathered again, as :func:`load_weights` does with a file's. A
    collective; between steps only."""
    target = checkpoint_target(engine)
    slot_of = {id(s.param): s for u in target.units for g in u.groups for s in g.slots}
    sources, named = {}, {}
    for i, (param, value) in enumerate(values.items()):
        slot = slot_of.get(id(param))
        if slot is None:
            raise ValueError(f"write_param_values: a parameter of shape {list(param.shape)} is "
                             f"not managed by this engine")
        if tuple(value.shape) != tuple(slot.shape):
            raise ValueError(f"write_param_values: {slot.name} holds shape {list(slot.shape)}, "
                             f"got {list(value.shape)} (a parameter's shape cannot change after "
                             f"initialize)")
        sources[id(param)], named[f"v{i}"] = f"v{i}", value.to("cpu")
    _check_between_steps(target, "write_param_values", "")
    plan = _Plan(sources=sources, buffers={}, missing_keys=[], unexpected_keys=[],
                 max_range_bytes=max((v.numel() * v.element_size() for v in named.values()),
                                     default=8))
    _write(target, _InMemory(named), plan)


__all__ = ["WeightsError", "load_weights", "write_param_values"]
