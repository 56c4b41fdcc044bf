"""What a shard optimizer reads, writes and checks for one key: its gradient (a tensor, or slices
held by the tiered store), the parameter partition it writes the new values into (a tensor,
nothing, or a stored shard opened on demand) and the size checks of state loaded into it."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import torch


@dataclasses.dataclass(eq=False, kw_only=True)
class StoredGrad:
    """A key's gradient partition held in the tiered store as slices, one per optimizer
    sub-group (the same ``[lo, hi)`` bounds), homed on NVMe ([Note: gradients on NVMe] in
    infinity/zero/_grad_reducer.py). The offloaded optimizer acquires each slice into HOST with
    its sub-group and evicts it once stepped (a consumed gradient is never read again)."""

    store_keys: tuple[str, ...]
    bounds: tuple[tuple[int, int], ...]
    """``[lo, hi)`` of each slice in the partition, in order."""
    live: bool = False
    """The slices hold this accumulation window's sum (False: the next micro-batch overwrites
    them without reading)."""
    sum_sq: float = 0.0
    """Sum of squares of the accumulated values (fp64 sum; the global norm without reading the
    slices back)."""

    def store_key_of(self, lo: int, hi: int) -> str:
        """The store key of the slice ``[lo, hi)``; ValueError when no slice has these bounds."""
        for bounds, key in zip(self.bounds, self.store_keys):
            if bounds == (lo, hi):
                return key
        raise ValueError(f"stored gradient: no slice [{lo}, {hi}) among {list(self.bounds)}; the "
                         f"gradient slices must follow the optimizer's sub-groups")


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
