"""Block-wise symmetric quantization for ZeRO++'s quantized collectives (qwZ, qgZ): pure math.

:func:`quantize` / :func:`dequantize` turn a flat float tensor into int8 (or int4, two values per
byte) with one scale per block of ``block_numel`` elements and back; :func:`encode` /
:func:`decode` put both into one byte buffer, the format that crosses ranks ([Note: quantized
wire format] in infinity/ledger/_quantized.py, whose :func:`quantized_bytes` sizes it).

Per element ``|x - dequantize(quantize(x))| <= scale / 2`` with ``scale = absmax(block) / qmax``:
the rounding error of one step of the grid. A block of zeros has scale 0 and decodes to zeros.
A non-finite element makes its block's scale non-finite, and the block decodes to NaN, so the
fp16 loss scaler still sees the overflow after a quantized reduction.

[Note: fp32 block scales]
Scales are fp32, not bf16: a bf16 scale carries 8 bits of mantissa, a relative error of up to
2**-9 that multiplies every element of its block, as large as the int8 grid's own error for the
largest elements, and systematic (every element of the block moves the same way). At the
default 2048 elements per block an fp32 scale costs 4 B per 2048 B of int8 payload (0.2%), so
halving it to bf16 would save 0.1% of the bytes for that bias. DeepSpeed's quantizer keeps fp32
scales too.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from infinity._common import warn_once
from infinity.ledger import QUANTIZED_BITS, SCALE_BYTES, num_blocks, payload_bytes, quantized_bytes

_QMAX = {8: 127, 4: 7}
"""Largest magnitude of the symmetric grid: int8 [-127, 127] (no -128, so the grid is symmetric
and negation is exact), int4 [-7, 7]."""
_INT4_OFFSET = 8
"""int4 values are stored as ``q + 8`` in a nibble (1..15; 8 is zero, also the odd tail's pad)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantSpec:
    """How one kind of collective quantizes (resolved from ``zero.quantization_block_numel``,
    ``zero.quantized_gradient_bits``)."""

    bits: int
    """Width of one quantized element: 8 (int8) or 4 (int4, two per byte)."""
    block_numel: int
    """Elements sharing one fp32 scale; the last block of a tensor may be partial."""

    def __post_init__(self) -> None:
        if self.bits not in QUANTIZED_BITS:
            raise ValueError(f"QuantSpec.bits: expected one of {QUANTIZED_BITS}, got {self.bits}")
        if self.block_numel < 1:
            raise ValueError(f"QuantSpec.block_numel: expected >= 1, got {self.block_numel}")

    def wire_bytes(self, numel: int) -> int:
        """Bytes of ``numel`` elements encoded by :func:`encode`."""
        return quantized_bytes(numel, self.block_numel, self.bits, SCALE_BYTES)


def _blocks(x: torch.Tensor, block_numel: int) -> torch.Tensor:
    """``x`` as fp32 rows of ``block_numel``, the last row padded with zeros (which change
    neither its absmax nor, being cut off again, the result)."""
    flat = x.reshape(-1).float()
    pad = num_blocks(flat.numel(), block_numel) * block_numel - flat.numel()
    return F.pad(flat, (0, pad)).view(-1, block_numel)


def quantize(x: torch.Tensor, *, block_numel: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any float dtype, any shape; read flat) as ``(payload, scales)``: payload int8 of
    ``x.numel()`` elements (bits 8) or uint8 of ``ceil(numel / 2)`` bytes holding two int4 values
    each, low nibble first (bits 4); scales fp32, one per block."""
    qmax = _QMAX[bits]
    numel = x.numel()
    blocks = _blocks(x, block_numel)
    scales = blocks.abs().amax(dim=1) / qmax
    # A zero block: scale 0, divide by 1 instead (its elements are 0 and stay 0).
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-qmax, qmax).to(torch.int8).view(-1)[:numel]
    if bits == 8:
        return q, scales
    nibbles = (q.to(torch.int16) + _INT4_OFFSET).to(torch.uint8)
    if numel % 2:
        nibbles = F.pad(nibbles, (0, 1), value=_INT4_OFFSET)
    return nibbles[0::2] | (nibbles[1::2] << 4), scales


def dequantize(payload: torch.Tensor, scales: torch.Tensor, *, numel: int, block_numel: int,
               bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of :func:`quantize`: ``numel`` values ``q * scale`` (fp32), written into
    ``out`` (flat, any float dtype) when given, else returned as a new fp32 tensor."""
    if bits == 8:
        q = payload.view(torch.int8)[:numel].float()
    else:
        packed = payload.view(torch.uint8)
        q = torch.stack((packed & 0xF, packed >> 4), dim=1).view(-1)[:numel].float() - _INT4_OFFSET
    values = (_blocks(q, block_numel) * scales[:, None]).view(-1)[:numel]
    if out is None:
        return values
    out.view(-1).copy_(values)
    return out


def encode(x: torch.Tensor, spec: QuantSpec, out: torch.Tensor) -> None:
    """Quantize ``x`` into ``out`` (uint8, ``spec.wire_bytes(x.numel())`` bytes): the scales'
    bytes, then the payload ([Note: quantized wire format] in infinity/ledger/_quantized.py)."""
    payload, scales = quantize(x, block_numel=spec.block_numel, bits=spec.bits)
    nscale = scales.numel() * SCALE_BYTES
    if out.numel() != nscale + payload.numel():
        raise ValueError(f"encode: the wire buffer holds {out.numel()} bytes, the quantized "
                         f"tensor needs {nscale + payload.numel()}")
    out[:nscale].copy_(scales.view(torch.uint8))
    out[nscale:].copy_(payload.view(torch.uint8))


def decode(wire: torch.Tensor, numel: int, spec: QuantSpec, out: torch.Tensor) -> None:
    """Dequantize the ``numel`` elements encoded in ``wire`` into ``out`` (flat, any float
    dtype). The scales are copied out first: a slice of a gathered byte buffer need not sit at
    an fp32-aligned offset."""
    nscale = num_blocks(numel, spec.block_numel) * SCALE_BYTES
    if wire.numel() != nscale + payload_bytes(numel, spec.bits):
        raise ValueError(f"decode: {wire.numel()} bytes on the wire, {numel} elements need "
                         f"{spec.wire_bytes(numel)}")
    scales = wire[:nscale].clone().view(torch.float32)
    dequantize(wire[nscale:], scales, numel=numel, block_numel=spec.block_numel, bits=spec.bits,
               out=out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantPolicy:
    """ZeRO++'s quantized collectives of one engine, resolved from its config once
    (:func:`quant_policy`)."""

    weights: QuantSpec | None = None
    """qwZ: how stage 3's forward and backward all-gathers quantize parameters (``zero.
    quantized_weights``); None: exact ([Note: qwZ dequantizes every slice])."""
    frozen_only: bool = False
    """Apply ``weights`` to frozen flat groups only (``zero.quantized_frozen_weights``)."""
    gradients: QuantSpec | None = None
    """qgZ: how the gradient reduce-scatter quantizes (``zero.quantized_gradients``); None: exact."""

    def quantizes_gather(self, requires_grad: bool) -> QuantSpec | None:
        """The spec a stage 3 gather of a group that does (not) train uses; None: exact."""
        if self.weights is None or (self.frozen_only and requires_grad):
            return None
        return self.weights


def quant_policy(zero, precision=None) -> QuantPolicy:
    """The quantization policy of ``zero`` (a ``ZeroConfig``): qwZ is int8 only, as in ZeRO++;
    qgZ takes ``zero.quantized_gradient_bits``. ``precision`` (a ``PrecisionConfig``): its
    ``reduce_dtype`` 'compute' has no effect under qgZ, which says so once."""
    block = zero.quantization_block_numel
    if zero.quantized_gradients and precision is not None and precision.reduce_dtype != "fp32":
        warn_once("quantized-gradients-reduce-dtype",
                  f"precision.reduce_dtype {precision.reduce_dtype!r} has no effect with "
                  f"zero.quantized_gradients: gradients cross ranks as "
                  f"int{zero.quantized_gradient_bits} with fp32 block scales and are summed in fp32")
    weights = zero.quantized_weights or zero.quantized_frozen_weights
    return QuantPolicy(
        weights=QuantSpec(bits=8, block_numel=block) if weights else None,
        frozen_only=zero.quantized_frozen_weights and not zero.quantized_weights,
        gradients=(QuantSpec(bits=zero.quantized_gradient_bits, block_numel=block)
                   if zero.quantized_gradients else None))
