"""Where parameters sit in a unit's flat buffer, padding included: pure arithmetic, no torch.

[Note: 16-byte aligned slots] Each parameter's slot starts at a multiple of 16 bytes, and the
buffer is padded so that every rank's shard is a multiple of 16 bytes too (FSDP2 pads the same
way). Parameters are views of the gathered buffer and shards are what the collectives read and
write: a view at an odd element offset is misaligned for vectorised kernels (the GPU's 16-byte
loads, cuBLAS's alignment checks fall back to slow paths), and an NCCL shard whose byte size or
offset is not a multiple of 16 leaves the fast copy kernels. Padding is zeros in every buffer
(parameters, gradients, master, moments: Adam keeps a zero at zero with a zero gradient), is
never stored in a checkpoint (checkpoints are per parameter, [Note: ranges per parameter] in
infinity/checkpoint/_layout.py), and is counted here, once, for the engine's layout
(``infinity.zero``'s ``layout_group``) and for the ledger's figure of it
(:func:`flat_padding_numel`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

FLAT_ALIGN_BYTES = 16
"""Alignment of every parameter slot and every shard in a flat buffer, in bytes."""


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """The layout of one flat buffer (element counts of its dtype)."""

    offsets: tuple[int, ...]
    """Start of each parameter's slot, in the order given."""
    numel: int
    """Elements of the parameters themselves (padding not counted)."""
    padded_numel: int
    """Elements of the whole buffer: world_size * shard_numel."""
    shard_numel: int
    """Elements of one rank's shard (a multiple of the alignment)."""

    @property
    def padding_numel(self) -> int:
        return self.padded_numel - self.numel


def align_numel(itemsize: int) -> int:
    """Elements of ``itemsize`` bytes in one :data:`FLAT_ALIGN_BYTES` step (1 for items >= 16 B)."""
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize <= 0:
        raise ValueError(f"itemsize: expected an integer > 0 (bytes per element), got {itemsize!r}")
    return max(1, FLAT_ALIGN_BYTES // itemsize)


def flat_layout(numels: Sequence[int], world_size: int, itemsize: int) -> FlatLayout:
    """[Note: 16-byte aligned slots]: slots for parameters of ``numels`` elements, in order, each at
    a multiple of 16 bytes, and the buffer padded to ``world_size`` equal shards of a multiple of 16
    bytes (at least one alignment step per rank, so an empty group still has a shard)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected an integer >= 1, got {world_size!r}")
    step = align_numel(itemsize)
    offsets, end = [], 0
    for n in numels:
        offsets.append(end)
        end = -(-(end + int(n)) // step) * step
    shard = max(step, -(-end // (world_size * step)) * step)
    return FlatLayout(offsets=tuple(offsets), numel=sum(int(n) for n in numels),
                      padded_numel=shard * world_size, shard_numel=shard)


def flat_padding_numel(numels: Sequence[int], world_size: int, itemsize: int) -> int:
    """Padding elements of one flat buffer: the ledger's exact figure for what the engine adds to
    the parameters' own elements (in every per-element term: parameters, gradients, state)."""
    return flat_layout(numels, world_size, itemsize).padding_numel
