"""Saving a checkpoint: a manifest plus per-unit shard files, written atomically by every rank.

Layout of a checkpoint root ``DIR`` (``save_checkpoint(engine, DIR)`` on every rank)::

    DIR/latest                            name of the newest complete save ("step-6"); replaced last
    DIR/step-6/manifest.json              the save's commit point, written after every other file
    DIR/step-6/u0003-r00001.safetensors   rank 1's slice of unit 3 ([Note: ranges per parameter])
    DIR/step-6/buffers.safetensors        module buffers (replicated; written by rank 0)
    DIR/step-6/rng-r00001.safetensors     rank 1's RNG states (torch CPU/CUDA, python, numpy)

[Note: crash safety]
Every file goes to a temporary name, is fsynced and renamed (``write_safetensors``); the manifest
goes last the same way, then ``latest``. Each save gets a directory name no earlier save used, so
a crash at any moment leaves the previous save, and the ``latest`` pointing to it, untouched. A
directory without a manifest is an incomplete save and is never loaded.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch

from infinity.checkpoint._layout import (BUFFERS_FILE, TRAIN_KINDS, dtype_name, module_buffers,
                                         param_ranges, rng_file, shard_file)
from infinity.checkpoint._ranks import on_every_rank
from infinity.checkpoint._reader import FORMAT, LATEST_NAME, MANIFEST_NAME, VERSION, tensor_name
from infinity.checkpoint._rng import rng_state
from infinity.io import fsync_dir, write_safetensors

logger = logging.getLogger(__name__)


def save_checkpoint(engine: Any, directory: str | os.PathLike[str]) -> str:
    """Save ``engine``'s full training state under ``directory`` (call on every rank); returns
    the new save's directory. See the module docstring for the layout and crash safety."""
    directory = os.fspath(directory)
    if not engine.between_steps:
        raise ValueError(
            f"save_checkpoint: micro-step {engine.micro_steps} is inside a gradient accumulation "
            f"window ({engine.gradient_accumulation_steps} micro-batches per step) and partial "
            f"gradients are not saved; save right after the engine.step() that ran the optimizer")
    name = _agree_on_name(engine, directory)
    step_dir = os.path.join(directory, name)
    on_every_rank(engine, f"writing checkpoint {step_dir}",
                  lambda: _write_rank_files(engine, step_dir))
    on_every_rank(engine, f"committing checkpoint {step_dir}",
                  lambda: _commit(engine, directory, name) if engine.collectives.rank == 0
                  else None)
    logger.info("checkpoint saved: %s", step_dir)
    return step_dir


def _atomic_write_text(path: str, text: str) -> None:
    """[Note: crash safety] temporary name, fsync, rename, fsync of the directory."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def _agree_on_name(engine: Any, directory: str) -> str:
    """Rank 0 picks a directory name no earlier save used ([Note: crash safety]) and creates
    it; the others receive its suffix (shared file system assumed)."""
    base = f"step-{engine.global_steps}"

    def pick() -> int:
        if engine.collectives.rank != 0:
            return 0
        os.makedirs(directory, exist_ok=True)
        suffix = 0
        while os.path.exists(os.path.join(directory, base if not suffix else f"{base}-{suffix}")):
            suffix += 1
        os.makedirs(os.path.join(directory, base if not suffix else f"{base}-{suffix}"))
        return suffix

    suffix = torch.tensor([on_every_rank(engine, f"creating a checkpoint in {directory}", pick)],
                          dtype=torch.int64, device=engine.device)
    engine.collectives.broadcast(suffix, src=0, context="checkpoint directory name")
    value = int(suffix.item())
    return base if not value else f"{base}-{value}"


def _write_rank_files(engine: Any, step_dir: str) -> None:
    m, rank = engine.manager, engine.collectives.rank
    engine.flush_offload()  # home tiers hold every updated shard before we read them
    meta = {"format": FORMAT, "version": str(VERSION)}
    for unit in m.units:
        tensors = [t for g in unit.groups for t in _group_tensors(engine, g)]
        if tensors:  # the manifest lists exactly the non-empty files (see _manifest)
            write_safetensors(os.path.join(step_dir, shard_file(unit.index, rank)), tensors,
                              metadata=meta)
    if rank == 0:  # copies: see _group_tensors
        write_safetensors(os.path.join(step_dir, BUFFERS_FILE),
                          [(k, v.clone()) for k, v in module_buffers(m.module)], metadata=meta)
    tensors, rng_meta = rng_state()
    write_safetensors(os.path.join(step_dir, rng_file(rank)), tensors,
                      metadata={**meta, "rng": json.dumps(rng_meta)})


def _group_tensors(engine: Any, group: Any) -> list[tuple[str, torch.Tensor]]:
    """This rank's save slice of ``group`` ([Note: ranges per parameter])."""
    m, opt = engine.manager, engine.shard_optimizer
    lo, hi = m.rank * group.shard_numel, (m.rank + 1) * group.shard_numel
    ranges = param_ranges(group.slots, lo, hi)
    if not ranges:
        return []
    base, _ = m.partition_of(group)
    # (values, whether they are the engine's live tensors). Live ones are sliced into copies:
    # write_safetensors calls .numpy() on what it gets, which makes a storage non-resizable,
    # and released units resize their flat buffers' storage.
    sources: dict[str, tuple[torch.Tensor, bool]] = {}
    if group.requires_grad:
        live = not opt.offloaded  # offloaded: master_values and state_of are copies
        sources["master"] = opt.master_values(group.key), live
        state = opt.state_of(group.key)
        sources["exp_avg"] = state["exp_avg"].float(), live
        sources["exp_avg_sq"] = state["exp_avg_sq"].float(), live
    if not group.requires_grad or engine.compute_dtype != torch.float32:
        sources["param"] = m.read_shard(group), group.store_key is None
    out = []
    for s, a, b in ranges:
        start = s.offset + a - base
        for kind, (src, live) in sources.items():
            piece = src[start:start + b - a]
            out.append((tensor_name(s.name, kind, a), piece.clone() if live else piece))
    return out


def _commit(engine: Any, directory: str, name: str) -> None:
    """Rank 0, after every rank's files are durable: the manifest, then ``latest``."""
    step_dir = os.path.join(directory, name)
    _atomic_write_text(os.path.join(step_dir, MANIFEST_NAME),
                       json.dumps(_manifest(engine), indent=1))
    _atomic_write_text(os.path.join(directory, LATEST_NAME), name + "\n")


def _manifest(engine: Any) -> dict[str, Any]:
    m = engine.manager
    params: dict[str, Any] = {}
    source: dict[int, str] = {}
    for unit in m.units:
        for g in unit.groups:
            for s in g.slots:
                kinds = list(TRAIN_KINDS) if g.requires_grad else []
                if not g.requires_grad or engine.compute_dtype != torch.float32:
                    kinds.append("param")
                params[s.name] = {"shape": list(s.shape), "trainable": g.requires_grad,
                                  "kinds": kinds, "param_dtype": dtype_name(engine.compute_dtype)}
                source[id(s.param)] = s.name
    state_dict = []
    for key, value in m.module.state_dict(keep_vars=True).items():
        if id(value) in source:
            state_dict.append({"key": key, "param": source[id(value)]})
        elif isinstance(value, torch.Tensor):
            state_dict.append({"key": key, "buffer": key, "shape": list(value.shape),
                               "dtype": dtype_name(value.dtype)})
    shards = []
    for rank in range(m.world_size):
        for unit in m.units:
            ranges = {s.name: [a, b] for g in unit.groups
                      for s, a, b in param_ranges(g.slots, rank * g.shard_numel,
                                                  (rank + 1) * g.shard_numel)}
            if ranges:
                shards.append({"file": shard_file(unit.index, rank), "rank": rank,
                               "unit": unit.name, "ranges": ranges})
    return {"format": FORMAT, "version": VERSION, "world_size": m.world_size, "stage": m.stage,
            "compute_dtype": dtype_name(engine.compute_dtype), "torch_version": torch.__version__,
            "engine": engine.step_state_dict(), "params": params, "state_dict": state_dict,
            "buffers_file": BUFFERS_FILE, "shards": shards,
            "rng_files": [rng_file(r) for r in range(m.world_size)]}
