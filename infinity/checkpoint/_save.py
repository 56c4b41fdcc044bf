"""Saving a checkpoint: a manifest plus per-unit shard files, written atomically by every rank.

Layout of a checkpoint root ``DIR`` (``save_checkpoint(engine, DIR)`` on every rank)::

    DIR/latest                            name of the newest complete save ("step-6"); replaced last
    DIR/step-6/manifest.json              the save's commit point, written after every other file
    DIR/step-6/u0003-r00001.safetensors   rank 1's slice of unit 3 ([Note: ranges per parameter])
    DIR/step-6/buffers.safetensors        module buffers (replicated; written by rank 0)
    DIR/step-6/rng-r00001.safetensors     rank 1's RNG states (torch CPU/CUDA, python, numpy)

[Note: replica 0 writes the shards]
Over a mesh ([Note: mesh dimensions] in infinity/config/_mesh.py) the R replicas hold the same
shards, so only replica 0 writes them, named by the shard rank (``u0003-r00001``: shard 1 of
S), and the manifest's ``world_size`` is the shard degree S: a save at R x S reads like one at S
ranks, which the loader reshards to any shard degree. The other replicas writing the same
bytes to the same names would cost R times the disk traffic and race on one file name. RNG
states differ on every rank (each replica draws its own dropout), so every data-parallel rank
writes its own, named by its data-parallel rank.

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

from infinity._dtypes import torch_name
from infinity.checkpoint._layout import (BUFFERS_FILE, module_buffers, rank_ranges, rng_file,
                                         saved_kinds, shard_file)
from infinity.checkpoint._ranks import on_every_rank
from infinity.checkpoint._reader import (CLIENT_STATE_NAME, FORMAT, LATEST_NAME, MANIFEST_NAME,
                                         VERSION, CheckpointError, check_save_name, tensor_name)
from infinity.checkpoint._rng import rng_state
from infinity.checkpoint._target import CheckpointTarget, checkpoint_target
from infinity.errors import DiskSpaceError
from infinity.io import free_disk_bytes, fsync_dir, write_safetensors

logger = logging.getLogger(__name__)


def save_checkpoint(engine: Any, directory: str | os.PathLike[str], *, name: str | None = None,
                    client_state: Any = None) -> str:
    """Save ``engine``'s full training state under ``directory`` (call on every rank); returns
    the new save's directory. See the module docstring for the layout and crash safety.
    ``name``: the save's directory name (DeepSpeed's ``tag``) instead of ``step-N``; a save is
    never overwritten, so an existing one is an error naming it. ``client_state``: anything
    ``torch.save`` takes, rank 0's saved beside the manifest (:func:`read_client_state`)."""
    target = checkpoint_target(engine)
    directory = os.fspath(directory)
    if name is not None:
        check_save_name(name)
    if not target.between_steps:
        raise ValueError(
            f"save_checkpoint: micro-step {target.micro_steps} is inside a gradient accumulation "
            f"window ({target.gradient_accumulation_steps} micro-batches per step) and partial "
            f"gradients are not saved; save right after the engine.step() that ran the optimizer")
    _check_free_space(target, directory)  # [Note: space before a save]
    name = _agree_on_name(target, directory) if name is None else _create_named(target, directory,
                                                                                name)
    step_dir = os.path.join(directory, name)
    on_every_rank(target, f"writing checkpoint {step_dir}",
                  lambda: _write_rank_files(target, step_dir))
    on_every_rank(target, f"committing checkpoint {step_dir}",
                  lambda: _commit(target, directory, name, client_state)
                  if target.collectives.world.rank == 0 else None)
    logger.info("checkpoint saved: %s", step_dir)
    return step_dir


HEADER_BYTES_PER_TENSOR = 160
"""Safetensors header bytes per tensor beyond its name (dtype, shape, offsets: ~70 in practice)."""
FIXED_BYTES = 1 << 20
"""Per rank: manifest, ``latest``, RNG states and file headers' fixed parts (a few KiB in
practice; rounded up so the check never passes a save that then fails on the last file)."""
MANIFEST_BYTES_PER_PARAM = 512
"""Manifest JSON per parameter (name, shape, kinds, ranges of each shard)."""


def save_bytes(engine: Any) -> int:
    """Bytes this rank's files of a save will take (an upper bound within a few KiB), from the
    layout alone: no tensor is read ([Note: space before a save]). ``engine``: the engine or
    its :class:`CheckpointTarget`."""
    target = checkpoint_target(engine)
    param_itemsize = target.compute_dtype.itemsize
    total = FIXED_BYTES
    writes_shards = target.collectives.replicate_rank == 0  # [Note: replica 0 writes the shards]
    for unit in target.units if writes_shards else ():
        for group in unit.groups:
            kinds = saved_kinds(group.requires_grad, target.compute_dtype)
            element = sum(param_itemsize if k == "param" else 4 for k in kinds)
            for s, a, b in rank_ranges(group, target.shard_rank):
                total += (b - a) * element
                total += len(kinds) * (len(tensor_name(s.name, "exp_avg_sq", a))
                                       + HEADER_BYTES_PER_TENSOR)
            if target.shard_rank == 0:
                total += MANIFEST_BYTES_PER_PARAM * len(group.slots)
    if target.collectives.world.rank == 0:
        total += sum(v.numel() * v.element_size() + len(k) + HEADER_BYTES_PER_TENSOR
                     for k, v in module_buffers(target.module))
    return total


def _check_free_space(target: CheckpointTarget, directory: str) -> None:
    """[Note: space before a save]: raise DiskSpaceError on every rank when the save's files
    would not fit in ``directory``'s file system; writes nothing."""
    needed = torch.tensor([save_bytes(target)], dtype=torch.int64, device=target.device)
    if target.collectives.world.world_size > 1:
        target.collectives.world.all_reduce_sum(needed, context="checkpoint size")
    needed_bytes = int(needed.item())

    def check() -> None:
        free = free_disk_bytes(directory)
        if needed_bytes > free:
            raise DiskSpaceError(
                f"save_checkpoint: the save needs {needed_bytes / 1e9:.2f} GB under {directory!r} "
                f"and its file system has {free / 1e9:.2f} GB free; nothing was written. Free "
                f"{(needed_bytes - free) / 1e9:.2f} GB (older saves are the step-* folders "
                f"there), or save to a directory on another disk",
                path=directory, needed_bytes=needed_bytes, free_bytes=free)

    on_every_rank(target, f"checking free space for a checkpoint in {directory}", check)


def _atomic_write_text(path: str, text: str) -> None:
    """[Note: crash safety] temporary name, fsync, rename, fsync of the directory."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def _agree_on_name(target: CheckpointTarget, directory: str) -> str:
    """Rank 0 picks a directory name no earlier save used ([Note: crash safety]) and creates
    it; the others receive its suffix (shared file system assumed)."""
    base = f"step-{target.global_steps}"

    def pick() -> int:
        if target.collectives.world.rank != 0:
            return 0
        os.makedirs(directory, exist_ok=True)
        suffix = 0
        while os.path.exists(os.path.join(directory, base if not suffix else f"{base}-{suffix}")):
            suffix += 1
        os.makedirs(os.path.join(directory, base if not suffix else f"{base}-{suffix}"))
        return suffix

    suffix = torch.tensor([on_every_rank(target, f"creating a checkpoint in {directory}", pick)],
                          dtype=torch.int64, device=target.device)
    target.collectives.broadcast(suffix, src=0, context="checkpoint directory name")
    value = int(suffix.item())
    return base if not value else f"{base}-{value}"


def _write_rank_files(target: CheckpointTarget, step_dir: str) -> None:
    rank, coll = target.collectives.rank, target.collectives
    target.flush_offload()  # home tiers hold every updated shard before we read them
    meta = {"format": FORMAT, "version": str(VERSION)}
    # [Note: replica 0 writes the shards]
    for unit in target.units if coll.replicate_rank == 0 else ():
        tensors = [t for g in unit.groups for t in _group_tensors(target, g)]
        if tensors:  # the manifest lists exactly the non-empty files (see _manifest)
            write_safetensors(os.path.join(step_dir, shard_file(unit.index, rank)), tensors,
                              metadata=meta)
    if coll.world.rank == 0:  # copies: see _group_tensors
        write_safetensors(os.path.join(step_dir, BUFFERS_FILE),
                          [(k, v.clone()) for k, v in module_buffers(target.module)], metadata=meta)
    tensors, rng_meta = rng_state()
    write_safetensors(os.path.join(step_dir, rng_file(coll.world.rank)), tensors,
                      metadata={**meta, "rng": json.dumps(rng_meta)})


def _group_tensors(target: CheckpointTarget, group: Any) -> list[tuple[str, torch.Tensor]]:
    """This rank's save slice of ``group`` ([Note: ranges per parameter])."""
    ranges = rank_ranges(group, target.shard_rank)
    if not ranges:
        return []
    base, _ = target.partition_of(group)
    # (values, whether they are the engine's live tensors). Live ones are sliced into copies:
    # write_safetensors calls .numpy() on what it gets, which makes a storage non-resizable,
    # and released units resize their flat buffers' storage.
    sources: dict[str, tuple[torch.Tensor, bool]] = {}
    if group.requires_grad:
        live = not target.optimizer_state_is_copy  # offloaded: the values are copies
        sources["master"] = target.master_values(group.key), live
        state = target.optimizer_state_of(group.key)
        sources["exp_avg"] = state["exp_avg"].float(), live
        sources["exp_avg_sq"] = state["exp_avg_sq"].float(), live
    if "param" in saved_kinds(group.requires_grad, target.compute_dtype):
        sources["param"] = target.read_shard(group), group.store_key is None
    out = []
    for s, a, b in ranges:
        start = s.offset + a - base
        for kind, (src, live) in sources.items():
            piece = src[start:start + b - a]
            out.append((tensor_name(s.name, kind, a), piece.clone() if live else piece))
    return out


def _create_named(target: CheckpointTarget, directory: str, name: str) -> str:
    """Rank 0 creates ``directory/name``, which must not exist (a save is never overwritten)."""
    def create() -> None:
        if target.collectives.world.rank != 0:
            return
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, name)
        if os.path.exists(path):
            raise CheckpointError(f"save_checkpoint(tag={name!r}): {path} exists; a save is never "
                                  f"overwritten: pass another tag, or remove it first", path=path)
        os.makedirs(path)

    on_every_rank(target, f"creating checkpoint {os.path.join(directory, name)}", create)
    return name


def _commit(target: CheckpointTarget, directory: str, name: str, client_state: Any = None) -> None:
    """Rank 0, after every rank's files are durable: the client state, the manifest, then
    ``latest``."""
    step_dir = os.path.join(directory, name)
    manifest = _manifest(target)
    if client_state is not None:
        path = os.path.join(step_dir, CLIENT_STATE_NAME)
        with open(path + ".tmp", "wb") as f:
            torch.save(client_state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
        manifest["client_state_file"] = CLIENT_STATE_NAME
    _atomic_write_text(os.path.join(step_dir, MANIFEST_NAME), json.dumps(manifest, indent=1))
    _atomic_write_text(os.path.join(directory, LATEST_NAME), name + "\n")


def _manifest(target: CheckpointTarget) -> dict[str, Any]:
    params: dict[str, Any] = {}
    source: dict[int, str] = {}
    for unit in target.units:
        for g in unit.groups:
            for s in g.slots:
                params[s.name] = {"shape": list(s.shape), "trainable": g.requires_grad,
                                  "kinds": saved_kinds(g.requires_grad, target.compute_dtype),
                                  "param_dtype": torch_name(target.compute_dtype)}
                source[id(s.param)] = s.name
    state_dict = []
    for key, value in target.module.state_dict(keep_vars=True).items():
        if id(value) in source:
            state_dict.append({"key": key, "param": source[id(value)]})
        elif isinstance(value, torch.Tensor):
            state_dict.append({"key": key, "buffer": key, "shape": list(value.shape),
                               "dtype": torch_name(value.dtype)})
    shards = []
    for rank in range(target.shard_world_size):
        for unit in target.units:
            ranges = {s.name: [a, b] for g in unit.groups
                      for s, a, b in rank_ranges(g, rank)}
            if ranges:
                shards.append({"file": shard_file(unit.index, rank), "rank": rank,
                               "unit": unit.name, "ranges": ranges})
    return {"format": FORMAT, "version": VERSION, "world_size": target.shard_world_size,
            "stage": target.stage,
            "compute_dtype": torch_name(target.compute_dtype), "torch_version": torch.__version__,
            "engine": target.step_state_dict(), "params": params, "state_dict": state_dict,
            "buffers_file": BUFFERS_FILE, "shards": shards,
            "mesh": {"replicate": target.collectives.replicate_size,
                     "shard": target.shard_world_size},
            "rng_files": [rng_file(r) for r in range(target.collectives.data_parallel_size)]}
