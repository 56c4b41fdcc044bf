"""Random tensors and the bytewise comparison the I/O and store tests check against."""

from __future__ import annotations

import torch

from infinity.io import aligned_empty


def random_values(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Reproducible random values: normal for floating dtypes, integers in [0, 100) otherwise
    (arithmetic on them stays finite)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen, dtype=torch.float32).to(dtype)
    return torch.randint(0, 100, (numel,), generator=gen, dtype=torch.int64).to(dtype)


def random_bytes(numel: int, dtype: torch.dtype, *, gen: torch.Generator | None = None,
                 aligned: bool = True, misalign: int = 0) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (any bit pattern, NaNs included: compare with
    :func:`same_bytes`), in page-aligned memory, or, ``aligned=False``, at an address that is not
    a multiple of 4096 (``misalign`` elements further), which forces the swapper's staging path."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize  # int32 draws viewed as bytes: ~100x faster than uint8 draws
    raw = torch.randint(-2**31, 2**31 - 1, ((nbytes + 3) // 4,), dtype=torch.int32,
                        generator=gen).view(torch.uint8)[:nbytes]
    if aligned:
        out = aligned_empty(numel, dtype)
    else:
        base = torch.empty(numel + misalign + 4096 // itemsize, dtype=dtype)
        skip = ((-base.data_ptr()) % 4096) // itemsize + misalign
        out = base[skip:skip + numel]
    out.view(torch.uint8).copy_(raw)
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, same shape, bitwise the same bytes (NaN-safe), read on the CPU."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def seed_all(seed: int) -> None:
    """Seed every generator a training step may draw from: torch's (CPU and every CUDA device),
    Python's ``random`` and numpy's, as a checkpoint's RNG state restores them."""
    import random

    import numpy as np

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
