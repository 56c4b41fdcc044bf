"""Reading checkpoints: the manifest, parsed and checked for consistency, and range reads of the
shard files. The side of :mod:`infinity.checkpoint` that needs no engine and no process group, so
:mod:`._consolidate` uses it alone.

The layout it reads, and how the stored ranges per parameter tile each tensor, are described in
:mod:`infinity.checkpoint` ([Note: crash safety], [Note: ranges per parameter]).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import torch

from infinity.errors import InfinityError
from infinity._dtypes import from_torch_name
from infinity.io import SafetensorsFile

FORMAT = "infinity-checkpoint"
VERSION = 1
"""Bumped on any change a reader of the previous version would misread."""
MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
_SAVE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
"""A save's directory name: ``step-N`` (``-K`` when taken), or a tag the caller chose."""
CLIENT_STATE_NAME = "client_state.pt"
"""``save_checkpoint(..., client_state=...)``: rank 0's object, ``torch.save``d beside the
manifest (DeepSpeed's ``client_state``)."""


def check_save_name(name: Any) -> None:
    """A tag names one directory under the checkpoint root: no path separators, not ``latest``."""
    if not isinstance(name, str) or not _SAVE_NAME.match(name) or name == LATEST_NAME:
        raise ValueError(f"checkpoint tag {name!r}: a directory name of letters, digits, '.', "
                         f"'_' and '-' (not starting with '.' or '-', not {LATEST_NAME!r}), "
                         f"such as 'global_step100'")


def read_client_state(step_dir: str) -> Any:
    """The client state saved with the save at ``step_dir`` (``{}`` when none was); unpickled
    with ``torch.load``: load only checkpoints you trust, as with any pickle."""
    path = os.path.join(step_dir, CLIENT_STATE_NAME)
    with open(os.path.join(step_dir, MANIFEST_NAME), encoding="utf-8") as f:
        if "client_state_file" not in json.load(f):
            return {}
    return torch.load(path, map_location="cpu", weights_only=False)


class CheckpointError(InfinityError, ValueError):
    """A checkpoint is missing, incomplete, corrupted, or belongs to another model."""

    def __init__(self, message: str, *, path: str):
        super().__init__(message)
        self.path = path


def tensor_name(param: str, kind: str, lo: int) -> str:
    """Name of the stored slice ``[lo, ...)`` of ``param``'s ``kind`` values."""
    return f"{param}::{kind}::{lo}"


def resolve_checkpoint(directory: str | os.PathLike[str]) -> str:
    """The save directory ``directory`` names: itself when it holds a manifest, else the save
    its ``latest`` file points to."""
    directory = os.fspath(directory)
    if os.path.isfile(os.path.join(directory, MANIFEST_NAME)):
        return directory
    latest = os.path.join(directory, LATEST_NAME)
    if not os.path.isfile(latest):
        raise CheckpointError(f"{directory}: no checkpoint here (neither {MANIFEST_NAME} nor "
                              f"{LATEST_NAME}); pass the directory given to save_checkpoint or "
                              f"one of its step-* directories", path=directory)
    with open(latest, encoding="utf-8") as f:
        name = f.read().strip()
    step_dir = os.path.join(directory, name)
    if not _SAVE_NAME.match(name) or not os.path.isfile(os.path.join(step_dir, MANIFEST_NAME)):
        raise CheckpointError(f"{latest} names {name!r}, which holds no {MANIFEST_NAME} (removed "
                              f"or not a save); pass an existing step-* directory instead",
                              path=latest)
    return step_dir


@dataclasses.dataclass(frozen=True)
class _Range:
    lo: int
    hi: int
    file: str


class CheckpointReader:
    """A save's manifest, checked for consistency, and range reads of its shard files."""

    def __init__(self, step_dir: str | os.PathLike[str]):
        self.step_dir = os.fspath(step_dir)
        self.manifest_path = os.path.join(self.step_dir, MANIFEST_NAME)
        self.manifest = self._read_manifest()
        self.params: dict[str, Any] = self.manifest["params"]
        self.ranges: dict[str, list[_Range]] = {name: [] for name in self.params}
        for shard in self.manifest["shards"]:
            for name, (lo, hi) in shard["ranges"].items():
                if name not in self.ranges:
                    self._bad(f"shard {shard['file']} holds {name!r}, which is not in 'params'")
                self.ranges[name].append(_Range(int(lo), int(hi), shard["file"]))
        for name, rs in self.ranges.items():
            rs.sort(key=lambda r: r.lo)
            self._check_tiling(name, rs)
        self._files: dict[str, SafetensorsFile] = {}

    def _bad(self, why: str) -> None:
        raise CheckpointError(f"{self.manifest_path}: {why} (corrupted or hand-edited manifest)",
                              path=self.manifest_path)

    def _read_manifest(self) -> dict[str, Any]:
        try:
            with open(self.manifest_path, encoding="utf-8") as f:
                manifest = json.load(f)
        except FileNotFoundError:
            raise CheckpointError(f"{self.manifest_path}: missing; the save did not complete "
                                  f"(load the previous one: its directory, or the checkpoint "
                                  f"root whose '{LATEST_NAME}' names it)",
                                  path=self.manifest_path) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{self.manifest_path}: unreadable ({e})",
                                  path=self.manifest_path) from None
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        if found != FORMAT:
            raise CheckpointError(f"{self.manifest_path}: not an infinity checkpoint manifest "
                                  f"(format {found!r}, expected {FORMAT!r})",
                                  path=self.manifest_path)
        if manifest.get("version") != VERSION:
            raise CheckpointError(f"{self.manifest_path}: checkpoint format version "
                                  f"{manifest.get('version')!r}, this infinity reads version "
                                  f"{VERSION}; use the infinity release that wrote it",
                                  path=self.manifest_path)
        for key in ("params", "state_dict", "shards", "engine", "world_size", "rng_files"):
            if key not in manifest:
                self._bad(f"no {key!r} entry")
        return manifest

    def _check_tiling(self, name: str, rs: list[_Range]) -> None:
        numel = 1
        for d in self.params[name]["shape"]:
            numel *= int(d)
        at = 0
        for r in rs:
            if r.lo != at or r.hi <= r.lo:
                self._bad(f"the stored ranges of {name!r} do not tile [0, {numel}) "
                          f"(at element {at}: {r.file} holds [{r.lo}, {r.hi}))")
            at = r.hi
        if at != numel:
            self._bad(f"the stored ranges of {name!r} end at element {at}, not at {numel}")

    def numel(self, name: str) -> int:
        n = 1
        for d in self.params[name]["shape"]:
            n *= int(d)
        return n

    def stored_dtype(self, name: str, kind: str) -> torch.dtype:
        return from_torch_name(self.params[name]["param_dtype"]) if kind == "param" \
            else torch.float32

    def files_for(self, name: str, lo: int, hi: int) -> set[str]:
        return {r.file for r in self.ranges[name] if r.lo < hi and lo < r.hi}

    def open(self, file: str) -> SafetensorsFile:
        """Open (once) and check a file: parsed header, size, and every tensor the manifest
        says it holds present with the right dtype and numel."""
        f = self._files.get(file)
        if f is not None:
            return f
        path = os.path.join(self.step_dir, file)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing (listed in {self.manifest_path}); the "
                                  f"checkpoint is incomplete: restore the file or load an "
                                  f"earlier save",
                                  path=path)
        f = SafetensorsFile(path)  # SafetensorsError (a ValueError) names the path on truncation
        try:
            for name, kind, lo, hi in self._expected(file):
                entry = f.entries.get(tensor_name(name, kind, lo))
                dtype = self.stored_dtype(name, kind)
                if entry is None or entry.dtype != dtype or entry.numel != hi - lo:
                    raise CheckpointError(
                        f"{path}: expected tensor {tensor_name(name, kind, lo)!r} ({dtype}, "
                        f"{hi - lo} elements), found "
                        f"{'none' if entry is None else f'{entry.dtype}, {entry.numel}'}; the file "
                        f"does not belong to this manifest", path=path)
        except BaseException:
            f.close()
            raise
        self._files[file] = f
        return f

    def _expected(self, file: str):
        if file == self.manifest.get("buffers_file"):
            return []
        for shard in self.manifest["shards"]:
            if shard["file"] == file:
                for name, (lo, hi) in shard["ranges"].items():
                    for kind in self.params[name]["kinds"]:
                        yield name, kind, int(lo), int(hi)

    def read(self, name: str, kind: str, out: torch.Tensor, start: int) -> torch.Tensor:
        """Fill ``out`` (1-D CPU, any float dtype) with elements ``[start, start + numel)`` of
        ``name``'s ``kind`` values, reading only the overlapping byte ranges."""
        stop = start + out.numel()
        dtype = self.stored_dtype(name, kind)
        for r in self.ranges[name]:
            a, b = max(start, r.lo), min(stop, r.hi)
            if a >= b:
                continue
            dst = out[a - start:b - start]
            tmp = dst if dst.dtype == dtype else torch.empty(b - a, dtype=dtype)
            self.open(r.file).read_into(tensor_name(name, kind, r.lo), tmp, start_numel=a - r.lo)
            if tmp is not dst:
                dst.copy_(tmp)
        return out

    def has_kind(self, name: str, kind: str) -> bool:
        return kind in self.params[name]["kinds"]

    def value_kind(self, name: str) -> str:
        """The kind holding ``name``'s model value: the fp32 master when trained, else 'param'."""
        return "master" if self.has_kind(name, "master") else "param"

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["FORMAT", "LATEST_NAME", "MANIFEST_NAME", "VERSION", "CheckpointError",
           "CheckpointReader", "resolve_checkpoint", "tensor_name"]
