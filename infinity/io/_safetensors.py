"""Streaming safetensors reading and writing, by byte range, with no whole-file loads.

The format (https://huggingface.co/docs/safetensors): 8 bytes little-endian header length N, N bytes of
JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the
data. Offsets are relative to the end of the header. Tensors are row-major, little-endian.

We read it ourselves (instead of the ``safetensors`` package) because a rank must read *a slice* of
a tensor (its shard of a unit) straight into a preallocated buffer: ``read_into`` preads just those
bytes. The Hugging Face sharded layout (``model.safetensors.index.json`` with a ``weight_map``) is
handled by :class:`SafetensorsCheckpoint`.

Writers are atomic: a temporary name, fsync, rename, fsync of the directory.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import torch

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit; a larger length means corruption
INDEX_NAME = "model.safetensors.index.json"


class SafetensorsError(ValueError):
    """A safetensors file is malformed, truncated, or does not hold what was asked for."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    path: str
    data_begin_bytes: int
    """Absolute file offset of the tensor's first byte."""
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def _read_exact(fd: int, nbytes: int, offset: int, path: str) -> bytes:
    data = os.pread(fd, nbytes, offset)
    if len(data) != nbytes:
        raise SafetensorsError(f"{path}: short read at offset {offset}: expected {nbytes} bytes, got "
                               f"{len(data)} (truncated file?)")
    return data


class SafetensorsFile:
    """One ``.safetensors`` file, header parsed and checked against the file size; reads by range."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise SafetensorsError(f"{self.path}: no such safetensors file") from None
        try:
            self.entries, self.metadata = self._parse()
        except BaseException:
            os.close(self._fd)
            raise

    def _parse(self) -> tuple[dict[str, TensorEntry], dict[str, str]]:
        size = os.fstat(self._fd).st_size
        (header_len,) = struct.unpack("<Q", _read_exact(self._fd, 8, 0, self.path))
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            raise SafetensorsError(f"{self.path}: header length {header_len} does not fit in a file of "
                                   f"{size} bytes (not a safetensors file, or truncated)")
        try:
            header = json.loads(_read_exact(self._fd, header_len, 8, self.path))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SafetensorsError(f"{self.path}: header is not valid JSON: {e}") from None
        metadata = header.pop("__metadata__", {}) or {}
        data_start = 8 + header_len
        entries: dict[str, TensorEntry] = {}
        for name, info in header.items():
            try:
                dtype = _DTYPES[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise SafetensorsError(f"{self.path}: bad header entry for {name!r}: {info!r}") from None
            entry = TensorEntry(name, dtype, shape, self.path, data_start + begin, end - begin)
            expected = entry.numel * torch.empty((), dtype=dtype).element_size()
            if end < begin or entry.nbytes != expected:
                raise SafetensorsError(f"{self.path}: {name!r} spans {end - begin} bytes but shape "
                                       f"{list(shape)} of {info['dtype']} needs {expected}")
            if data_start + end > size:
                raise SafetensorsError(f"{self.path}: {name!r} ends at byte {data_start + end} but the "
                                       f"file has {size} bytes (truncated file)")
            entries[name] = entry
        return entries, dict(metadata)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def read_into(self, name: str, out: torch.Tensor, *, start_numel: int = 0) -> torch.Tensor:
        """Read ``out.numel()`` elements of tensor ``name`` (flattened), from ``start_numel``, into ``out``.

        ``out`` must be a contiguous CPU tensor of the stored dtype; nothing else is read.
        """
        entry = self.entries.get(name)
        if entry is None:
            raise SafetensorsError(f"{self.path}: no tensor named {name!r}")
        if out.dtype != entry.dtype or out.device.type != "cpu" or not out.is_contiguous():
            raise SafetensorsError(f"{self.path}: {name!r} is {entry.dtype}; out must be a contiguous "
                                   f"CPU tensor of that dtype, got {out.dtype} on {out.device}")
        if start_numel < 0 or start_numel + out.numel() > entry.numel:
            raise SafetensorsError(f"{self.path}: {name!r} has {entry.numel} elements; asked for "
                                   f"[{start_numel}, {start_numel + out.numel()})")
        item = out.element_size()
        view = memoryview(out.view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        offset, done = entry.data_begin_bytes + start_numel * item, 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n <= 0:
                raise SafetensorsError(f"{self.path}: short read of {name!r} at offset {offset + done}: "
                                       f"expected {len(view) - done} more bytes (truncated file?)")
            done += n
        return out

    def get(self, name: str) -> torch.Tensor:
        entry = self.entries.get(name)
        if entry is None:
            raise SafetensorsError(f"{self.path}: no tensor named {name!r}")
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self.read_into(name, out.view(-1))
        return out


class SafetensorsCheckpoint:
    """A single ``.safetensors`` file, a directory holding one, or a Hugging Face sharded index."""

    def __init__(self, path: str | os.PathLike[str]):
        path = os.fspath(path)
        if os.path.isdir(path):
            index = os.path.join(path, INDEX_NAME)
            single = os.path.join(path, "model.safetensors")
            if os.path.exists(index):
                path = index
            elif os.path.exists(single):
                path = single
            else:
                raise SafetensorsError(f"{path}: holds neither {INDEX_NAME} nor model.safetensors")
        self.path = path
        self._files: dict[str, SafetensorsFile] = {}
        self.entries: dict[str, TensorEntry] = {}
        if path.endswith(".json"):
            try:
                with open(path, encoding="utf-8") as f:
                    weight_map: Mapping[str, str] = json.load(f)["weight_map"]
            except (OSError, KeyError, json.JSONDecodeError) as e:
                raise SafetensorsError(f"{path}: not a safetensors index ({e})") from None
            base = os.path.dirname(path)
            for shard in sorted(set(weight_map.values())):
                self._open(os.path.join(base, shard))
            for name, shard in weight_map.items():
                entry = self._files[os.path.join(base, shard)].entries.get(name)
                if entry is None:
                    raise SafetensorsError(f"{path}: index maps {name!r} to {shard}, which lacks it")
                self.entries[name] = entry
        else:
            self.entries.update(self._open(path).entries)

    def _open(self, path: str) -> SafetensorsFile:
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = SafetensorsFile(path)
        return f

    def read_into(self, name: str, out: torch.Tensor, *, start_numel: int = 0) -> torch.Tensor:
        entry = self.entries.get(name)
        if entry is None:
            raise SafetensorsError(f"{self.path}: no tensor named {name!r}")
        return self._files[entry.path].read_into(name, out, start_numel=start_numel)

    def get(self, name: str) -> torch.Tensor:
        entry = self.entries.get(name)
        if entry is None:
            raise SafetensorsError(f"{self.path}: no tensor named {name!r}")
        return self._files[entry.path].get(name)

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __enter__(self) -> "SafetensorsCheckpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def fsync_dir(directory: str) -> None:
    fd = os.open(directory or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_safetensors(path: str | os.PathLike[str], tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                      *, metadata: Mapping[str, str] | None = None) -> int:
    """Write tensors atomically (temporary name, fsync, rename); returns the file's size in bytes.

    Memory stays bounded by what the caller passes: write one file per unit (or per size-capped
    group) to keep only that much in memory.
    """
    path = os.fspath(path)
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    header: dict[str, Any] = {}
    offset = 0
    for name, t in items:
        if t.dtype not in _NAMES:
            raise SafetensorsError(f"{path}: {name!r} has dtype {t.dtype}, which safetensors cannot store")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as the reference writer does
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, t in items:
            cpu = t.detach().to("cpu").contiguous()
            nbytes = cpu.numel() * cpu.element_size()
            if nbytes:
                # Not .numpy(): that marks the storage non-resizable, and the engine frees and
                # re-grows the storage of live parameters (stage 3) that may be passed here.
                f.write(memoryview((ctypes.c_char * nbytes).from_address(cpu.data_ptr())))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    return 8 + len(raw) + offset


def iter_tensors(checkpoint: SafetensorsCheckpoint) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor in turn (one in memory at a time)."""
    for name in checkpoint.entries:
        yield name, checkpoint.get(name)
