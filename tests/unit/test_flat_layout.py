"""[Note: 16-byte aligned slots]: the flat layout's arithmetic (infinity/ledger/_flat_layout.py)."""

from __future__ import annotations

import itertools

import pytest

from infinity.ledger import FLAT_ALIGN_BYTES, flat_layout, flat_padding_numel

ODD = [7, 1, 13, 1000, 3, 0, 65, 2]


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_slots_and_shards_are_16_byte_aligned_and_disjoint(itemsize, world_size):
    lay = flat_layout(ODD, world_size, itemsize)
    assert all(off * itemsize % FLAT_ALIGN_BYTES == 0 for off in lay.offsets)
    assert lay.shard_numel * itemsize % FLAT_ALIGN_BYTES == 0 and lay.shard_numel > 0
    assert lay.padded_numel == lay.shard_numel * world_size
    ends = [o + n for o, n in zip(lay.offsets, ODD)]
    assert all(e <= o for e, o in zip(ends, lay.offsets[1:]))  # in order, never overlapping
    assert ends[-1] <= lay.padded_numel and lay.numel == sum(ODD)
    # As tight as the alignment allows: each slot starts at the first aligned element after the
    # previous one, and the shard is the least aligned size that covers the buffer.
    step = max(1, FLAT_ALIGN_BYTES // itemsize)
    for o, prev_end in zip(lay.offsets[1:], ends):
        assert o - prev_end < step
    assert (lay.shard_numel - step) * world_size < ends[-1] or lay.shard_numel == step


def test_padding_figure_is_what_the_layout_adds():
    for n, world, item in itertools.product([[5], [8], [1, 1, 1], ODD], [1, 4], [2, 4]):
        lay = flat_layout(n, world, item)
        assert flat_padding_numel(n, world, item) == lay.padded_numel - sum(n)


def test_already_aligned_parameters_add_only_the_shard_padding():
    # Multiples of 8 bf16 elements: slots back to back, as before the alignment existed.
    lay = flat_layout([16, 64, 8], 1, 2)
    assert lay.offsets == (0, 16, 80) and lay.padded_numel == 88


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="world_size"):
        flat_layout([1], 0, 4)
    with pytest.raises(ValueError, match="itemsize"):
        flat_layout([1], 1, 0)
