"""A tiered store over a real Swapper in a temp directory, and the bytes of a swap file read back."""

from __future__ import annotations

import contextlib

import torch

from infinity._common import align_up
from infinity.io import Swapper, aligned_empty
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


def read_swap_file(swapper: Swapper, key: str, nbytes: int, alignment: int) -> torch.Tensor:
    """The shard's bytes as stored on disk, read by a fresh swap-in (not through the store)."""
    out = aligned_empty(max(align_up(nbytes, alignment), alignment), torch.uint8)
    swapper.swap_in(key, out).wait()
    return out[:nbytes]
