"""Checkpoints: a manifest plus per-unit shard files, written atomically, loadable at another world
size (or stage, or unit choice), consolidated to one state dict by :mod:`infinity.consolidate`.

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

Reading a save (the manifest and its checks, ``resolve_checkpoint``, ``CheckpointReader``) is
:mod:`infinity.checkpoint_reader`, which needs no engine; its names are re-exported here.
"""

from __future__ import annotations

import json
import logging
import os
import random
from typing import Any, Callable

import torch

from infinity._common import warn_once
from infinity.checkpoint_reader import (FORMAT, LATEST_NAME, MANIFEST_NAME, VERSION,
                                        CheckpointError, CheckpointReader, resolve_checkpoint,
                                        tensor_name)
from infinity.safetensors_io import SafetensorsError, SafetensorsFile, fsync_dir, write_safetensors
from infinity.shard_optimizer import OffloadedShardOptimizer, open_param_out

logger = logging.getLogger(__name__)

BUFFERS_FILE = "buffers.safetensors"
TRAIN_KINDS = ("master", "exp_avg", "exp_avg_sq")
_MSG_BYTES = 2048
"""Bytes of an error message shared with the other ranks (see _on_every_rank)."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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


def _partition(engine: Any, group: Any) -> tuple[int, int]:
    """(first flat element, numel) of the optimizer/parameter partition this rank holds."""
    m = engine.manager
    if m.stage == 0:
        return 0, group.padded_numel
    return m.rank * group.shard_numel, group.shard_numel


def _atomic_write_text(path: str, text: str) -> None:
    """[Note: crash safety] temporary name, fsync, rename, fsync of the directory."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def _on_every_rank(engine: Any, what: str, fn: Callable[[], Any],
                   cleanup: Callable[[Any], None] | None = None) -> Any:
    """Run ``fn`` on this rank; if it raised on any rank, raise on every rank (the failing rank
    its own error, the others a CheckpointError quoting it), so no rank goes on to change state
    or waits forever in a later collective."""
    coll = engine.collectives
    error, result = None, None
    try:
        result = fn()
    except Exception as e:  # shared below, then re-raised
        error = e
    if coll.world_size > 1:
        msgs = torch.zeros(coll.world_size, _MSG_BYTES, dtype=torch.int32, device=engine.device)
        if error is not None:
            raw = f"{type(error).__name__}: {error}".encode()[:_MSG_BYTES] or b"?"
            msgs[coll.rank, :len(raw)] = torch.tensor(list(raw), dtype=torch.int32)
        coll.all_reduce_sum(msgs, context=what)
        failed = [r for r in range(coll.world_size) if bool(msgs[r].any())]
        if failed and error is None:
            if cleanup is not None:
                cleanup(result)
            row = msgs[failed[0]].cpu()
            text = bytes(row[row != 0].tolist()).decode(errors="replace")
            raise CheckpointError(f"{what}: rank {failed[0]} failed: {text}", path=what)
    if error is not None:
        raise error
    return result


# ----------------------------------------------------------------------------------------------
# Saving


def save_checkpoint(engine: Any, directory: str | os.PathLike[str]) -> str:
    """Save ``engine``'s full training state under ``directory`` (call on every rank); returns
    the new save's directory. See the module docstring for the layout and crash safety."""
    directory = os.fspath(directory)
    _check_saveable(engine)
    name = _agree_on_name(engine, directory)
    step_dir = os.path.join(directory, name)
    _on_every_rank(engine, f"writing checkpoint {step_dir}",
                   lambda: _write_rank_files(engine, step_dir))
    _on_every_rank(engine, f"committing checkpoint {step_dir}",
                   lambda: _commit(engine, directory, name) if engine.collectives.rank == 0
                   else None)
    logger.info("checkpoint saved: %s", step_dir)
    return step_dir


def _check_saveable(engine: Any) -> None:
    if engine._backward_since_step or engine.micro_steps % engine.gradient_accumulation_steps:
        raise ValueError(
            f"save_checkpoint: micro-step {engine.micro_steps} is inside a gradient accumulation "
            f"window ({engine.gradient_accumulation_steps} micro-batches per step) and partial "
            f"gradients are not saved; save right after the engine.step() that ran the optimizer")


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

    suffix = torch.tensor([_on_every_rank(engine, f"creating a checkpoint in {directory}", pick)],
                          dtype=torch.int64, device=engine.device)
    engine.collectives.broadcast(suffix, src=0, context="checkpoint directory name")
    value = int(suffix.item())
    return base if not value else f"{base}-{value}"


def _write_rank_files(engine: Any, step_dir: str) -> None:
    m, rank = engine.manager, engine.collectives.rank
    if engine.store is not None:
        engine.store.flush()  # home tiers hold every updated shard before we read them
    meta = {"format": FORMAT, "version": str(VERSION)}
    for unit in m.units:
        tensors = [t for g in unit.groups for t in _group_tensors(engine, g)]
        if tensors:  # the manifest lists exactly the non-empty files (see _manifest)
            write_safetensors(os.path.join(step_dir, shard_file(unit.index, rank)), tensors,
                              metadata=meta)
    if rank == 0:  # copies: see _group_tensors
        write_safetensors(os.path.join(step_dir, BUFFERS_FILE),
                          [(k, v.clone()) for k, v in _buffers(m.module)], metadata=meta)
    tensors, rng_meta = _rng_state()
    write_safetensors(os.path.join(step_dir, rng_file(rank)), tensors,
                      metadata={**meta, "rng": json.dumps(rng_meta)})


def _group_tensors(engine: Any, group: Any) -> list[tuple[str, torch.Tensor]]:
    """This rank's save slice of ``group`` ([Note: ranges per parameter])."""
    m, opt = engine.manager, engine.optimizer
    lo, hi = m.rank * group.shard_numel, (m.rank + 1) * group.shard_numel
    ranges = param_ranges(group.slots, lo, hi)
    if not ranges:
        return []
    base, _ = _partition(engine, group)
    # (values, whether they are the engine's live tensors). Live ones are sliced into copies:
    # write_safetensors calls .numpy() on what it gets, which makes a storage non-resizable,
    # and released units resize their flat buffers' storage.
    sources: dict[str, tuple[torch.Tensor, bool]] = {}
    if group.requires_grad:
        live = not isinstance(opt, OffloadedShardOptimizer)  # offloaded: CPU copies already
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


def _buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
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


def _rng_state() -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
    version, ints, gauss = random.getstate()
    tensors = [("torch_cpu", torch.get_rng_state()),
               ("python", torch.tensor(ints, dtype=torch.int64))]
    meta: dict[str, Any] = {"python_version": version, "python_gauss": gauss,
                            "cuda_devices": 0}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states = torch.cuda.get_rng_state_all()
        tensors += [(f"cuda_{i}", s) for i, s in enumerate(states)]
        meta["cuda_devices"] = len(states)
    try:
        import numpy as np
    except ImportError:  # numpy is optional; nothing of it to restore then
        return tensors, meta
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors.append(("numpy", torch.from_numpy(keys.astype(np.int64))))
    meta["numpy"] = [kind, int(pos), int(has_gauss), float(cached)]
    return tensors, meta


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
            "engine": _engine_state(engine), "params": params, "state_dict": state_dict,
            "buffers_file": BUFFERS_FILE, "shards": shards,
            "rng_files": [rng_file(r) for r in range(m.world_size)]}


def _engine_state(engine: Any) -> dict[str, Any]:
    s = engine.scaler
    return {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps, "last_grad_norm": engine.last_grad_norm,
            "optimizer_step_count": engine.optimizer.step_count, "lr": engine.optimizer.lr,
            "loss_scaler": {"scale": s.scale, "hysteresis_left": s._hysteresis_left,
                            "good_steps": s._good_steps}}


# ----------------------------------------------------------------------------------------------
# Loading


def load_checkpoint(engine: Any, directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Restore ``engine`` from a save (the root given to save_checkpoint, or a step-* directory);
    call on every rank. Everything is validated on every rank first; any problem raises before
    any state changes. Returns the manifest's engine counters."""
    reader = _on_every_rank(engine, f"validating checkpoint {os.fspath(directory)}",
                            lambda: _prepare_load(engine, directory),
                            cleanup=lambda r: r.close() if r is not None else None)
    try:
        _apply(engine, reader)
    finally:
        reader.close()
    logger.info("checkpoint loaded: %s (saved at world size %d)", reader.step_dir,
                reader.manifest["world_size"])
    return dict(reader.manifest["engine"])


def _prepare_load(engine: Any, directory: str | os.PathLike[str]) -> CheckpointReader:
    reader = CheckpointReader(resolve_checkpoint(directory))
    try:
        _check_matches_model(engine, reader)
        rank, world = engine.collectives.rank, engine.collectives.world_size
        needed = {reader.manifest["buffers_file"]}
        for unit in engine.manager.units:
            for g in unit.groups:
                lo, n = _partition(engine, g)
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


def _check_matches_model(engine: Any, reader: CheckpointReader) -> None:
    """Same parameter names, shapes and trainability; same buffer keys and shapes."""
    mine: dict[str, tuple[list[int], bool]] = {
        s.name: (list(s.shape), g.requires_grad)
        for u in engine.manager.units for g in u.groups for s in g.slots}
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
    buffers = {k: list(v.shape) for k, v in _buffers(engine.manager.module)}
    if saved != buffers:
        diff = sorted(k for k in set(saved) | set(buffers) if saved.get(k) != buffers.get(k))
        raise CheckpointError(f"{where}: buffers differ from this model's (keys/shapes of "
                              f"{diff[:5]}); saved from another model", path=where)


def _gather(reader: CheckpointReader, slots: list[Any], lo: int, n: int, kind: str,
            dtype: torch.dtype, *, fallback: str | None = None) -> torch.Tensor:
    """A partition ``[lo, lo + n)`` of a flat group, assembled from the stored ranges (zero
    padding). ``fallback``: the kind to read where ``kind`` was not stored."""
    out = torch.zeros(n, dtype=dtype)
    for s, a, b in param_ranges(slots, lo, lo + n):
        k = kind if reader.has_kind(s.name, kind) or fallback is None else fallback
        reader.read(s.name, k, out[s.offset + a - lo:s.offset + b - lo], a)
    return out


def _apply(engine: Any, reader: CheckpointReader) -> None:
    m = engine.manager
    for unit in m.units:
        for g in unit.groups:
            lo, n = _partition(engine, g)
            if g.requires_grad:
                parts = {k: _gather(reader, g.slots, lo, n, k, torch.float32) for k in TRAIN_KINDS}
                write_optimizer_state(engine.optimizer, g.key, parts)
                low = _gather(reader, g.slots, lo, n, "param", engine.compute_dtype,
                              fallback="master") if engine.compute_dtype != torch.float32 \
                    else parts["master"]
            else:
                low = _gather(reader, g.slots, lo, n, "param", engine.compute_dtype,
                              fallback="master")
            with open_param_out(m.param_partition(g), overwrite=True) as out:
                out.copy_(low.to(out.device))
    if engine.store is not None:
        engine.store.flush()
    m.after_step()  # drops gradients; re-gathers always-gathered units from the new shards
    buffers = reader.open(reader.manifest["buffers_file"])
    current = dict(_buffers(m.module))
    with torch.no_grad():
        for key, tensor in current.items():
            tensor.copy_(buffers.get(key).to(tensor.device))
    rank = engine.collectives.rank
    if rank < len(reader.manifest["rng_files"]):
        _set_rng_state(reader.open(reader.manifest["rng_files"][rank]))
    else:
        warn_once("ckpt-rng", f"checkpoint {reader.step_dir} was saved by "
                              f"{reader.manifest['world_size']} ranks; rank {rank} keeps its RNG")
    _set_engine_state(engine, reader.manifest["engine"])


def write_optimizer_state(optimizer: Any, key: str, parts: dict[str, torch.Tensor]) -> None:
    """Overwrite master, exp_avg and exp_avg_sq (fp32 CPU, the partition's numel) of ``key``.

    Wanted as ``optimizer.load_state(key, master=, exp_avg=, exp_avg_sq=)`` on both optimizer
    classes; until then this uses the attributes they expose."""
    if isinstance(optimizer, OffloadedShardOptimizer):
        _write_offloaded(optimizer, key, parts)
        return
    master = optimizer.master_values(key)  # the live tensors, not copies, in memory
    if master.numel() != parts["master"].numel():
        raise CheckpointError(f"optimizer key {key!r}: {master.numel()} elements held, "
                              f"{parts['master'].numel()} assembled", path=key)
    master.copy_(parts["master"].to(master.device))
    for name, tensor in optimizer.state_of(key).items():
        tensor.copy_(parts[name].to(device=tensor.device, dtype=tensor.dtype))


def _write_offloaded(optimizer: OffloadedShardOptimizer, key: str,
                     parts: dict[str, torch.Tensor]) -> None:
    """Each sub-group shard ``[master | exp_avg | exp_avg_sq]`` acquired on HOST, overwritten,
    marked dirty and written back to its home (NVMe)."""
    tier = optimizer._tier
    store = optimizer.store
    handles = []
    for shard_key, lo, hi in optimizer._sub_groups(key):
        n = hi - lo
        buf = store.acquire(shard_key, tier.HOST).wait()
        try:
            for i, kind in enumerate(TRAIN_KINDS):
                buf[i * n:(i + 1) * n].copy_(parts[kind][lo:hi])
            store.mark_dirty(shard_key, tier.HOST)
        finally:
            store.release(shard_key, tier.HOST)
        if optimizer.home is tier.NVME:
            handles.append(store.write_back(shard_key))
    for handle in handles:
        handle.wait()


def _set_rng_state(f: SafetensorsFile) -> None:
    meta = json.loads(f.metadata.get("rng", "{}"))
    torch.set_rng_state(f.get("torch_cpu"))
    random.setstate((meta["python_version"], tuple(f.get("python").tolist()),
                     meta["python_gauss"]))
    if meta.get("cuda_devices") and torch.cuda.is_available():
        states = [f.get(f"cuda_{i}") for i in range(meta["cuda_devices"])]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
        else:
            warn_once("ckpt-cuda-rng", f"{f.path}: saved {len(states)} CUDA RNG states, "
                                       f"{torch.cuda.device_count()} devices now; not restored")
    if "numpy" in meta:
        try:
            import numpy as np
        except ImportError:
            return
        kind, pos, has_gauss, cached = meta["numpy"]
        np.random.set_state((kind, f.get("numpy").numpy().astype(np.uint32), pos, has_gauss,
                             cached))


def _set_engine_state(engine: Any, state: dict[str, Any]) -> None:
    engine.global_steps = int(state["global_steps"])
    engine.micro_steps = int(state["micro_steps"])
    engine.skipped_steps = int(state["skipped_steps"])
    engine.last_grad_norm = state["last_grad_norm"]
    engine._backward_since_step = False
    engine.optimizer.step_count = int(state["optimizer_step_count"])
    engine.optimizer.lr = float(state["lr"])
    scaler = state["loss_scaler"]
    engine.scaler.scale = float(scaler["scale"])
    engine.scaler._hysteresis_left = int(scaler["hysteresis_left"])
    engine.scaler._good_steps = int(scaler["good_steps"])


__all__ = ["CheckpointError", "CheckpointReader", "SafetensorsError", "load_checkpoint",
           "param_ranges", "resolve_checkpoint", "save_checkpoint", "tensor_name",
           "write_optimizer_state"]
