"""ZeRO++'s quantized collectives over :class:`~infinity.zero._collectives.Collectives`: qwZ (the
parameter all-gather in int8) and qgZ (the gradient reduce-scatter in int8 or int4).

Both move the byte buffers of :func:`~infinity.zero._quantize.encode` through the plain
collectives, so the bytes are counted under the caller's phase (``forward-gather``,
``backward-gather``, ``reduce-grad``) as what actually crossed: payload plus scales.

[Note: qwZ dequantizes every slice]
The gathered unit is dequantized from the wire for every rank's slice, this rank's own included,
as DeepSpeed does. Keeping the own slice exact would save nothing on the wire, and each rank
would then compute with a different model (exact in its own slice, rounded in the others), so
the gradients averaged across ranks would come from W slightly different functions and the
result would depend on which rank owns which slice. Dequantizing all keeps every rank's forward
and backward identical. Only the gathered copy is rounded: the shards and the fp32 masters stay
exact, so rounding never accumulates across steps (each step re-quantizes the exact shard).

[Note: qgZ as one all-to-all]
ZeRO++ reduces gradients with a hierarchical all-to-all (inside the node, then across nodes).
Over one data-parallel group it is one level: each rank quantizes the W destination slices of
its fp32 gradient (already divided by W) separately, one ``all_to_all_single`` delivers slice r
of every rank to rank r, and rank r dequantizes the W slices it received and sums them in fp32.
Every rank sends ``W * wire_bytes(shard_numel)`` bytes, the figure of a reduce-scatter whose
input were the quantized buffer, and the sum is rounded once per contribution (never
re-quantized between hops, so the error does not grow with W beyond W independent roundings).
gloo supports ``all_to_all_single`` on CPU (checked with torch 2.x), as NCCL does on GPUs.

Memory: both forms allocate their byte buffers per call and drop them on return. qwZ holds the
gathered wire (W * wire bytes: about half the gathered unit's bf16 bytes) beside the unit's full
buffer while it decodes; qgZ holds a send and a receive buffer (about 1/4 of the fp32 staging
each, int8) beside the staging buffer. Their sizes are ``infinity.ledger.qwz_buffer_bytes`` and
``qgz_buffer_bytes``, for the planner; the estimator's working buffers do not add them yet.
"""

from __future__ import annotations

import torch

from infinity.zero._collectives import Collectives, Phase
from infinity.zero._quantize import QuantSpec, decode, encode


def all_gather_quantized(coll: Collectives, out: torch.Tensor, shard: torch.Tensor, *,
                         spec: QuantSpec, context: str, phase: Phase) -> None:
    """qwZ: ``out`` (W * shard numel, the compute dtype) receives every rank's ``shard``, sent
    as int8 with fp32 block scales and dequantized into ``out`` ([Note: qwZ dequantizes every
    slice]). With one rank nothing crosses, so nothing is rounded: a plain copy."""
    if coll.world_size == 1:
        coll.all_gather(out, shard, context=context, phase=phase)
        return
    numel = shard.numel()
    wire = spec.wire_bytes(numel)
    mine = torch.empty(wire, dtype=torch.uint8, device=shard.device)
    encode(shard, spec, mine)
    gathered = torch.empty(coll.world_size * wire, dtype=torch.uint8, device=shard.device)
    coll.all_gather(gathered, mine, context=context, phase=phase)
    flat = out.view(-1)
    for r in range(coll.world_size):
        decode(gathered[r * wire:(r + 1) * wire], numel, spec, flat[r * numel:(r + 1) * numel])


def reduce_scatter_sum_quantized(coll: Collectives, out: torch.Tensor, full: torch.Tensor, *,
                                 spec: QuantSpec, context: str, phase: Phase) -> None:
    """qgZ: ``out`` (fp32) receives this rank's slice of the sum of every rank's ``full``, each
    contribution quantized per destination slice and summed in fp32 ([Note: qgZ as one
    all-to-all]). With one rank: a plain copy, unrounded."""
    if coll.world_size == 1:
        out.copy_(full)
        return
    world, numel = coll.world_size, out.numel()
    wire = spec.wire_bytes(numel)
    send = torch.empty(world * wire, dtype=torch.uint8, device=full.device)
    flat = full.view(-1)
    for r in range(world):
        encode(flat[r * numel:(r + 1) * numel], spec, send[r * wire:(r + 1) * wire])
    received = torch.empty_like(send)
    coll.all_to_all(received, send, context=context, phase=phase)
    out.zero_()
    part = torch.empty(numel, dtype=torch.float32, device=out.device)
    for r in range(world):  # the same order on every rank: the sum is deterministic
        decode(received[r * wire:(r + 1) * wire], numel, spec, part)
        out.add_(part)
