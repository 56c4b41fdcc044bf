"""Dtype names, each spelling converted in one place.

Two spellings meet in the package: the config's precision names (``'fp32' | 'bf16' | 'fp16'``,
DeepSpeed's), and torch's own (``'bfloat16'``: ``str(dtype)`` without ``torch.``), which
checkpoint manifests, swap-file headers and flat-group keys record. :func:`torch_dtype`,
:func:`torch_name` and :func:`from_torch_name` are the only conversions between them and torch
dtypes; the config's ``DTYPE_BYTES`` (pure, no torch) agrees with the first
(``tests/unit/test_dtypes.py``).
"""

from __future__ import annotations

import torch

PRECISION_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16,
                                            "fp16": torch.float16}
"""The config's precision names (``precision.dtype``, ``infinity consolidate --dtype``)."""

_STORED = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool)
"""The dtypes a checkpoint or a swap file may hold (a model's parameters and buffers)."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a precision name ('fp32', 'bf16', 'fp16')."""
    try:
        return PRECISION_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r}: expected one of {sorted(PRECISION_DTYPES)}") from None


def torch_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``'bfloat16'`` (what files and keys record)."""
    return str(dtype).removeprefix("torch.")


_BY_TORCH_NAME = {torch_name(d): d for d in _STORED}


def from_torch_name(name: str) -> torch.dtype:
    """The inverse of :func:`torch_name` over the dtypes a file may hold; ValueError naming the
    name otherwise (a corrupted or foreign record)."""
    try:
        return _BY_TORCH_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(f"dtype name {name!r} is not one of {sorted(_BY_TORCH_NAME)}") from None
