"""What a shard optimizer writes and checks for one key: the parameter partition it writes the new
values into (a tensor, nothing, or a stored shard opened on demand) and the size checks of state
loaded into it."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def check_numel(key: str, numel: int, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.numel() != numel:
            raise ValueError(f"shard optimizer: load_state({key!r}) got {t.numel()} elements, the "
                             f"partition holds {numel}; was the checkpoint saved with another "
                             f"world size or unit layout?")


@contextlib.contextmanager
def open_param_out(param_out, *, overwrite: bool = False) -> Iterator[torch.Tensor | None]:
    """``param_out`` is a tensor, None, or a callable returning a context manager that yields the
    tensor to write (a shard held by the tiered store: acquired, then marked dirty on exit).
    ``overwrite``: the caller writes every element, so a stored shard is not read first."""
    if param_out is None or isinstance(param_out, torch.Tensor):
        yield param_out
    else:
        with param_out(overwrite=overwrite) as tensor:
            yield tensor
