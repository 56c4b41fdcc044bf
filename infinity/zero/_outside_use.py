"""Seeing parameters used outside the modules that hold them, and the tensors inside a module's
inputs and outputs (both walk arbitrary Python structures the hooks receive).

[Note: parameters used outside their module]
A unit is gathered while a module that holds one of its parameters runs. Code that reads a
parameter elsewhere (``F.linear(x, other.weight)`` in a parent's forward) would read a released
buffer. The first forward per grad mode runs under :class:`OutsideUseDetector`, a
TorchFunctionMode that sees every torch call: a released unit's parameter passed to one is
gathered on the spot, and its unit stays gathered from then on (a warning names it). No
__torch_function__ cost after that first forward; a use that first appears later raises torch's
"storage of size 0" error, which the engine re-raises with the fix.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

_METADATA_FUNCS = frozenset({
    "dtype", "shape", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "ndim", "layout",
    "is_cuda", "is_sparse", "is_quantized", "is_meta", "names", "_version", "data", "size", "dim",
    "numel", "nelement", "element_size", "is_floating_point", "is_complex", "stride",
    "is_contiguous", "storage_offset", "untyped_storage", "data_ptr", "__hash__", "__eq__",
    "_base", "is_nested", "itemsize", "nbytes", "get_device", "__repr__", "__format__",
    "register_hook", "register_post_accumulate_grad_hook", "requires_grad_", "__reduce_ex__",
})
"""Tensor functions that read only metadata (no bytes): a released parameter may go through them."""


def tensors_in(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors inside a module's inputs or output: tensors, sequences, dicts, dataclasses (HF
    ModelOutput), at most 8 levels deep."""
    if depth > 8:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors_in(item, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, f.name, None), depth + 1)


class OutsideUseDetector(TorchFunctionMode):
    """During traced forwards: every tensor argument of a torch function that reads bytes is handed
    to ``check(tensor, function_name)``, which gathers a released unit's parameter on the spot
    ([Note: parameters used outside their module])."""

    def __init__(self, check: Callable[[torch.Tensor, str], None]):
        super().__init__()
        self._check = check

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__
        if name == "__get__":
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name not in _METADATA_FUNCS:
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor):
                    self._check(leaf, name)
        return func(*args, **kwargs)
