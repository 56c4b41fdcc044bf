"""Loading a checkpoint at any world size, stage or unit choice: validated on every rank before any
state changes, then each rank reads just the ranges of the partition it owns now
([Note: ranges per parameter] in :mod:`._layout`)."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from infinity._common import warn_once
from infinity.checkpoint._layout import TRAIN_KINDS, module_buffers, param_ranges, saved_kinds
from infinity.checkpoint._ranks import on_every_rank
from infinity.checkpoint._reader import CheckpointError, CheckpointReader, resolve_checkpoint
from infinity.checkpoint._rng import set_rng_state
from infinity.checkpoint._target import CheckpointTarget, checkpoint_target

logger = logging.getLogger(__name__)


def load_checkpoint(engine: Any, directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Restore ``engine`` from a save (the root given to save_checkpoint, or a step-* directory);
    call on every rank. Everything is validated on every rank first; any problem raises before
    any state changes. Returns the manifest's engine counters."""
    target = checkpoint_target(engine)
    reader = on_every_rank(target, f"validating checkpoint {os.fspath(directory)}",
                           lambda: _prepare_load(target, directory),
                           cleanup=lambda r: r.close() if r is not None else None)
    try:
        _apply(target, reader)
    finally:
        reader.close()
    logger.info("checkpoint loaded: %s (saved at world size %d)", reader.step_dir,
                reader.manifest["world_size"])
    return dict(reader.manifest["engine"])


def _prepare_load(target: CheckpointTarget, directory: str | os.PathLike[str]) -> CheckpointReader:
    reader = CheckpointReader(resolve_checkpoint(directory))
    try:
        _check_matches_model(target, reader)
        try:  # the parameter groups and step counts fit this engine
            target.check_step_state_dict(reader.manifest["engine"])
        except ValueError as e:
            raise CheckpointError(f"{reader.manifest_path}: {e}", path=reader.manifest_path
                                  ) from None
        # Every data-parallel rank: the file checks and RNG states are per rank, the
        # partitions per shard rank ([Note: replica 0 writes the shards] in ._save).
        rank, world = target.collectives.world.rank, target.collectives.world.world_size
        needed = {reader.manifest["buffers_file"]}
        for unit in target.units:
            for g in unit.groups:
                lo, n = target.partition_of(g)
                for s, a, b in param_ranges(g.slots, lo, lo + n):
                    needed |= reader.files_for(s.name, a, b)
        listed = sorted({s["file"] for s in reader.manifest["shards"]})
        needed |= set(listed[rank::world])  # together the ranks check every file
        if rank < len(reader.manifest["rng_files"]):
            needed.add(reader.manifest["rng_files"][rank])
        for file in sorted(needed):
            reader.open(file)
        buffers = reader.open(reader.manifest["buffers_file"])
        for item in reader.manifest["state_dict"]:
            if "buffer" in item and item["buffer"] not in buffers.entries:
                raise CheckpointError(f"{buffers.path}: buffer {item['buffer']!r} is missing",
                                      path=buffers.path)
    except BaseException:
        reader.close()
        raise
    return reader


def _check_matches_model(target: CheckpointTarget, reader: CheckpointReader) -> None:
    """Same parameter names, shapes and trainability; same buffer keys and shapes."""
    mine: dict[str, tuple[list[int], bool]] = {
        s.name: (list(s.shape), g.requires_grad)
        for u in target.units for g in u.groups for s in g.slots}
    theirs = {name: (list(p["shape"]), bool(p["trainable"])) for name, p in reader.params.items()}
    where = reader.manifest_path
    missing, unexpected = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
    if missing or unexpected:
        raise CheckpointError(f"{where}: saved from another model: parameters missing from the "
                              f"checkpoint {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                              f"unknown to this model {unexpected[:5]}"
                              f"{'...' if len(unexpected) > 5 else ''}", path=where)
    for name, (shape, trainable) in mine.items():
        if theirs[name][0] != shape:
            raise CheckpointError(f"{where}: parameter {name!r} has shape {theirs[name][0]} in the "
                                  f"checkpoint, {shape} in this model (another model or "
                                  f"configuration)", path=where)
        if trainable and not theirs[name][1]:
            raise CheckpointError(f"{where}: parameter {name!r} was frozen when saved (no "
                                  f"optimizer state) but is trainable now; freeze it as then",
                                  path=where)
    saved = {i["buffer"]: i["shape"] for i in reader.manifest["state_dict"] if "buffer" in i}
    buffers = {k: list(v.shape) for k, v in module_buffers(target.module)}
    if saved != buffers:
        diff = sorted(k for k in set(saved) | set(buffers) if saved.get(k) != buffers.get(k))
        raise CheckpointError(f"{where}: buffers differ from this model's (keys/shapes of "
                              f"{diff[:5]}); saved from another model", path=where)


def _assemble(reader: CheckpointReader, slots: list[Any], lo: int, n: int, kind: str,
              dtype: torch.dtype, *, fallback: str | None = None) -> torch.Tensor:
    """A partition ``[lo, lo + n)`` of a flat group, assembled from the stored ranges (zero
    padding). ``fallback``: the kind to read where ``kind`` was not stored."""
    out = torch.zeros(n, dtype=dtype)
    for s, a, b in param_ranges(slots, lo, lo + n):
        k = kind if reader.has_kind(s.name, kind) or fallback is None else fallback
        reader.read(s.name, k, out[s.offset + a - lo:s.offset + b - lo], a)
    return out


def _apply(target: CheckpointTarget, reader: CheckpointReader) -> None:
    for unit in target.units:
        for g in unit.groups:
            lo, n = target.partition_of(g)
            kinds = saved_kinds(g.requires_grad, target.compute_dtype)  # what a save of it wrote
            parts = {k: _assemble(reader, g.slots, lo, n, k, torch.float32)
                     for k in TRAIN_KINDS if k in kinds}
            if parts:
                target.load_optimizer_state(g.key, **parts)
            # "param" may be missing from a save in fp32: its master is the parameter
            low = _assemble(reader, g.slots, lo, n, "param", target.compute_dtype,
                            fallback="master") if "param" in kinds else parts["master"]
            with target.open_param_partition(g, overwrite=True) as out:
                out.copy_(low.to(out.device))
    target.flush_offload()
    target.after_shards_written()  # drops gradients; re-gathers always-gathered units
    buffers = reader.open(reader.manifest["buffers_file"])
    current = dict(module_buffers(target.module))
    with torch.no_grad():
        for key, tensor in current.items():
            tensor.copy_(buffers.get(key).to(tensor.device))
    rank = target.collectives.world.rank
    if rank < len(reader.manifest["rng_files"]):
        set_rng_state(reader.open(reader.manifest["rng_files"][rank]))
    else:
        warn_once("ckpt-rng", f"checkpoint {reader.step_dir} was saved by "
                              f"{reader.manifest['world_size']} ranks; rank {rank} keeps its RNG")
    target.load_step_state_dict(reader.manifest["engine"])
