"""A tiered store over a real Swapper in a temp directory, the bytes of a swap file read back, and
an arena pinned full by the test (through each backward of a training loop)."""

from __future__ import annotations

import contextlib

import torch

from infinity._common import align_up
from infinity.io import Swapper, aligned_empty
from infinity.errors import TierCapacityError
from infinity.tiers import StoreConfig, Tier, TieredStore

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


def pin_the_whole_arena(store: TieredStore) -> list[str]:
    """Register HOST-homed shards ``test/pin/<n>`` until no more fit, each acquired: the caller
    holds every extent of ``store``'s arena, as the states' work in flight can (clean cached
    copies are evicted for them). Returns their keys for :func:`unpin_the_arena`."""
    keys: list[str] = []
    align = store.arena.alignment_bytes
    while True:
        key = f"test/pin/{len(keys)}"
        for size in (max(store.arena.largest_free_bytes(), align), align):  # a hole, an extent
            try:
                store.register(key, size // 4, torch.float32, Tier.HOST)
                break
            except TierCapacityError:
                continue
        else:
            return keys
        store.acquire(key, Tier.HOST).wait()
        keys.append(key)


def unpin_the_arena(store: TieredStore, keys: list[str]) -> None:
    for key in keys:
        store.release(key, Tier.HOST)
        store.unregister(key)


def train_with_the_arena_pinned_in_backward(engine, data) -> list[float]:
    """Train on ``data`` (one micro-batch a step) with every arena extent pinned by the test
    during each backward, the saved inputs' files complete and their arena copies clean
    (written behind, then flushed) before it: each comes back from its file outside the arena.
    The steps' losses."""
    store, losses = engine.store, []
    for micro in data:
        (x, y), = micro
        loss = engine(x, y)
        store.flush()
        pins = pin_the_whole_arena(store)
        assert store.reclaimable_bytes(Tier.HOST) == 0 and len(pins) > 0
        engine.backward(loss)
        unpin_the_arena(store, pins)
        engine.step()
        losses.append(loss.item())
    return losses
