"""Shared set-up for the tiered-store tests (a real Swapper in a temp directory)."""

from __future__ import annotations

import contextlib

import torch

from infinity._common import align_up
from infinity.swapper import Swapper, aligned_empty
from infinity.tiers import StoreConfig, TieredStore

KB4 = 4096


@contextlib.contextmanager
def make_store(tmp_path, *, device_bytes: int = 1 << 20, host_bytes: int = 1 << 20, **kwargs):
    with Swapper(tmp_path / "swap") as swapper:
        store = TieredStore("cpu", StoreConfig(device_budget_bytes=device_bytes,
                                               host_budget_bytes=host_bytes),
                            swapper=swapper, **kwargs)
        try:
            yield store, swapper
        finally:
            store.close()


def random_tensor(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen, dtype=torch.float32).to(dtype)
    return torch.randint(0, 100, (numel,), generator=gen, dtype=torch.int64).to(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe), read on the CPU."""
    a, b = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def read_swap_file(swapper: Swapper, key: str, nbytes: int, alignment: int) -> torch.Tensor:
    """The shard's bytes as stored on disk, read by a fresh swap-in (not through the store)."""
    out = aligned_empty(max(align_up(nbytes, alignment), alignment), torch.uint8)
    swapper.swap_in(key, out).wait()
    return out[:nbytes]
