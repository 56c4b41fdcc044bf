"""One state dict from a sharded checkpoint, in bounded memory (``infinity consolidate DIR OUT``).

Usage::

    infinity consolidate ckpt/ out/ [--dtype fp32|bf16] [--max-shard-bytes 5GB]

writes ``out/model.safetensors`` (or ``model-00001-of-0000N.safetensors`` files plus the Hugging
Face ``model.safetensors.index.json``) holding exactly the keys of the model's ``state_dict()``
(tied weights under each of their keys), loadable by ``model.load_state_dict`` and
``transformers``' ``from_pretrained``. Trained parameters come from the fp32 masters.

Memory: each output file's header is computed from the manifest first (names, dtypes, shapes),
then each tensor is assembled from its stored ranges, written, and dropped: about one parameter
(fp32, plus its cast) is held at a time, whatever the model or the output file size (DeepSpeed's
zero_to_fp32 holds the whole model: over 1 TB of RAM for 80B parameters, PR #4025). No process
group is needed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import struct
from typing import Any

import torch

from infinity._dtypes import PRECISION_DTYPES, from_torch_name
from infinity.checkpoint._reader import CheckpointReader, resolve_checkpoint
from infinity.io import INDEX_NAME, fsync_dir

logger = logging.getLogger(__name__)

_OUT_DTYPES = PRECISION_DTYPES
_ST_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
             torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
             torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
DEFAULT_MAX_SHARD_BYTES = 5 * 10 ** 9
"""Hugging Face's default shard size ("5GB")."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConsolidateResult:
    files: list[str]
    """Paths of the written .safetensors files, in order."""
    index_path: str | None
    """The HF index (None when one file holds everything)."""
    total_bytes: int
    """Bytes of tensor data written (tied weights once per key)."""
    num_tensors: int
    peak_held_bytes: int
    """Most bytes of tensors consolidation held at once (the bounded-memory claim, measured)."""


@dataclasses.dataclass(frozen=True)
class _Entry:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    param: str | None
    """Source parameter (stored name), or None for a buffer."""

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


class _Producer:
    """Builds one output tensor at a time and tracks the bytes it holds."""

    def __init__(self, reader: CheckpointReader):
        self.reader = reader
        self.peak_held_bytes = 0
        self._buffers = None

    def __call__(self, entry: _Entry) -> torch.Tensor:
        r = self.reader
        if entry.param is None:
            if self._buffers is None:
                self._buffers = r.open(r.manifest["buffers_file"])
            value = self._buffers.get(entry.key)
        else:
            kind = r.value_kind(entry.param)
            value = torch.empty(r.numel(entry.param), dtype=r.stored_dtype(entry.param, kind))
            r.read(entry.param, kind, value, 0)
        held = value.numel() * value.element_size()
        if value.dtype != entry.dtype:
            value = value.to(entry.dtype)
            held += value.numel() * value.element_size()
        self.peak_held_bytes = max(self.peak_held_bytes, held)
        return value.view(entry.shape)


def _entries(reader: CheckpointReader, dtype: torch.dtype) -> list[_Entry]:
    out = []
    for item in reader.manifest["state_dict"]:
        if "param" in item:
            shape = tuple(int(d) for d in reader.params[item["param"]]["shape"])
            out.append(_Entry(item["key"], dtype, shape, item["param"]))
        else:
            stored = from_torch_name(item["dtype"])
            target = dtype if stored.is_floating_point else stored
            out.append(_Entry(item["key"], target, tuple(int(d) for d in item["shape"]), None))
    return out


def _plan_files(entries: list[_Entry], max_shard_bytes: int) -> list[list[_Entry]]:
    """Greedy in state-dict order; a tensor larger than the cap gets a file of its own."""
    files: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        if files[-1] and size + e.nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(e)
        size += e.nbytes
    return files


def _write_file(path: str, entries: list[_Entry], produce: _Producer) -> int:
    """A safetensors file written tensor by tensor (header first, from the manifest), atomically:
    temporary name, fsync, rename, fsync of the directory."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.key] = {"dtype": _ST_NAMES[e.dtype], "shape": list(e.shape),
                         "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for e in entries:
                value = produce(e).contiguous()
                if value.numel():
                    f.write(memoryview(value.view(-1).view(torch.uint8).numpy()))
                del value
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    return offset


_OWNED = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")


def _prepare_out(out_dir: str, overwrite: bool) -> None:
    os.makedirs(out_dir, exist_ok=True)
    existing = [n for n in os.listdir(out_dir) if _OWNED.match(n) or n == INDEX_NAME]
    if existing and not overwrite:
        raise ValueError(f"{out_dir}: already holds {sorted(existing)[:3]}; choose an empty "
                         f"directory or pass --overwrite to replace them")
    for name in existing:
        os.remove(os.path.join(out_dir, name))


def consolidate(checkpoint: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
                dtype: str = "fp32", max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                overwrite: bool = False) -> ConsolidateResult:
    """Write the state dict of ``checkpoint`` (a checkpoint root or one save) into ``out_dir``."""
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {sorted(_OUT_DTYPES)}")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes: must be > 0, got {max_shard_bytes}")
    out_dir = os.fspath(out_dir)
    with CheckpointReader(resolve_checkpoint(checkpoint)) as reader:
        for shard in reader.manifest["shards"]:  # every file checked before anything is written
            reader.open(shard["file"])
        reader.open(reader.manifest["buffers_file"])
        entries = _entries(reader, _OUT_DTYPES[dtype])
        groups = _plan_files(entries, max_shard_bytes)
        _prepare_out(out_dir, overwrite)
        produce = _Producer(reader)
        n = len(groups)
        names = (["model.safetensors"] if n == 1 else
                 [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
        total = 0
        for name, group in zip(names, groups):
            total += _write_file(os.path.join(out_dir, name), group, produce)
        index_path = None
        if len(groups) > 1:
            index_path = os.path.join(out_dir, INDEX_NAME)
            index = {"metadata": {"total_size": total},
                     "weight_map": {e.key: n for n, g in zip(names, groups) for e in g}}
            tmp = f"{index_path}.tmp-{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(index, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, index_path)
            fsync_dir(out_dir)
    logger.info("consolidated %d tensors (%d bytes) into %d file(s) under %s", len(entries),
                total, len(names), out_dir)
    return ConsolidateResult(files=[os.path.join(out_dir, n) for n in names],
                             index_path=index_path, total_bytes=total, num_tensors=len(entries),
                             peak_held_bytes=produce.peak_held_bytes)


OUT_DTYPES = _OUT_DTYPES
"""``--dtype`` choices of ``infinity consolidate``: name -> torch dtype."""

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "OUT_DTYPES", "ConsolidateResult", "consolidate"]
