"""The engine's inputs rule: ``engine(...)`` moves every tensor it is given to the engine's device.

[Note: the engine moves inputs]
As ``deepspeed.initialize``'s engine and DDP do, the engine's forward moves tensor arguments,
found inside tuples, lists, namedtuples, mappings (``dict``, Hugging Face ``BatchEncoding`` and
``ModelOutput``) and dataclasses, to its device before calling the model, so one training loop runs
on a CPU engine and on a CUDA engine unchanged (the model's parameters live on the engine's device;
a CPU tensor fed to a CUDA engine would raise a device mismatch inside the model). Containers keep
their types; a container with nothing to move is returned as it is (no copy per step), and
non-tensor values are never touched. Host-to-device copies are ``non_blocking``: they are ordered
on the current stream before the forward's kernels that read them.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch


def move_to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor inside it on ``device`` ([Note: the engine moves inputs])."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device, non_blocking=True)
    if isinstance(obj, (list, tuple)):
        items = [move_to_device(v, device) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)  # namedtuple
    if isinstance(obj, Mapping):
        return _move_mapping(obj, device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _move_dataclass(obj, device)
    return obj


def _move_mapping(obj: Mapping, device: torch.device) -> Any:
    moved = {k: move_to_device(v, device) for k, v in obj.items()}
    if all(moved[k] is v for k, v in obj.items()):
        return obj
    if not isinstance(obj, MutableMapping):
        return moved  # read-only views (MappingProxyType): a plain dict of the same items
    # A shallow copy keeps the mapping's type and its other state (BatchEncoding's encodings,
    # ModelOutput's attributes, which its __setitem__ keeps in step with the items).
    out = copy.copy(obj)
    for k, v in moved.items():
        out[k] = v
    return out


def _move_dataclass(obj: Any, device: torch.device) -> Any:
    fields = [f.name for f in dataclasses.fields(obj)]
    moved = {name: move_to_device(getattr(obj, name), device) for name in fields}
    if all(moved[name] is getattr(obj, name) for name in fields):
        return obj
    out = copy.copy(obj)
    for name, value in moved.items():
        object.__setattr__(out, name, value)  # frozen dataclasses too
    return out
