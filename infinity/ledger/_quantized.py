"""Bytes of a block-quantized tensor on the wire (ZeRO++ qwZ / qgZ): pure arithmetic.

[Note: quantized wire format]
A flat tensor of ``numel`` elements is cut into blocks of ``block_numel`` (the last one may be
partial); each block has one symmetric scale, ``absmax / qmax`` (qmax 127 for int8, 7 for int4),
and each element is ``round(x / scale)`` clamped to [-qmax, qmax]. On the wire it is one byte
buffer: the scales first (``scale_bytes`` each; fp32), then the payload (one byte per element for
int8, two elements per byte for int4, the last byte half used when ``numel`` is odd). Nothing else
travels: no padding, no header (the receiver knows ``numel`` from the unit). The engine
(:mod:`infinity.zero._quantize`) sizes its buffers with :func:`quantized_bytes`, and the
planner prices quantized collectives with it, so the two agree byte for byte.
"""

from __future__ import annotations

QUANTIZED_BITS = (8, 4)
"""Element widths of the quantized formats: int8 (qwZ, qgZ) and int4 packed two per byte (qgZ)."""
SCALE_BYTES = 4
"""Bytes of one block's scale: fp32 ([Note: fp32 block scales] in infinity/zero/_quantize.py)."""


def num_blocks(numel: int, block_numel: int) -> int:
    """Blocks of ``block_numel`` covering ``numel`` elements (the last one may be partial)."""
    if block_numel < 1:
        raise ValueError(f"block_numel must be >= 1, got {block_numel}")
    return -(-numel // block_numel)


def payload_bytes(numel: int, bits: int) -> int:
    """Bytes of ``numel`` quantized elements: one per element (int8), two elements per byte (int4)."""
    if bits not in QUANTIZED_BITS:
        raise ValueError(f"bits must be one of {QUANTIZED_BITS}, got {bits}")
    return -(-numel * bits // 8)


def quantized_bytes(numel: int, block_numel: int, bits: int, scale_bytes: int = SCALE_BYTES) -> int:
    """Bytes on the wire of ``numel`` elements quantized to ``bits`` with one ``scale_bytes``
    scale per block of ``block_numel`` ([Note: quantized wire format])."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return payload_bytes(numel, bits) + num_blocks(numel, block_numel) * scale_bytes


def qwz_buffer_bytes(unit_numel: int, world_size: int, block_numel: int) -> int:
    """Transient bytes of one qwZ gather beside the gathered unit: this rank's encoded shard and
    the W encoded shards received (``unit_numel`` padded to a multiple of ``world_size``)."""
    wire = quantized_bytes(-(-unit_numel // world_size), block_numel, 8)
    return (world_size + 1) * wire


def qgz_buffer_bytes(unit_numel: int, world_size: int, block_numel: int, bits: int) -> int:
    """Transient bytes of one qgZ reduce-scatter beside the fp32 staging buffer: the encoded
    send and receive buffers (W destination slices each) and one fp32 slice decoded at a time."""
    shard = -(-unit_numel // world_size)
    return 2 * world_size * quantized_bytes(shard, block_numel, bits) + 4 * shard
