"""Block-wise quantization for ZeRO++'s collectives (infinity/zero/_quantize.py) against a readable
reference (per block: scale = absmax / qmax, q = clamp(round(x / scale))), its error bound, and the
byte formula of the wire format (infinity/ledger/_quantized.py)."""

from __future__ import annotations

import math

import pytest
import torch

from infinity.ledger import quantized_bytes
from infinity.zero._quantize import QuantSpec, decode, dequantize, encode, quantize

QMAX = {8: 127, 4: 7}


def reference(x: torch.Tensor, block: int, bits: int) -> tuple[list[int], list[float]]:
    """One block at a time, element by element: the textbook symmetric quantizer."""
    values, qs, scales = x.tolist(), [], []
    for lo in range(0, len(values), block):
        chunk = values[lo:lo + block]
        scale = max(abs(v) for v in chunk) / QMAX[bits]
        scales.append(scale)
        for v in chunk:
            q = 0 if scale == 0 else round(v / scale)
            qs.append(max(-QMAX[bits], min(QMAX[bits], q)))
    return qs, scales


def unpack_int4(payload: torch.Tensor, numel: int) -> list[int]:
    out = []
    for byte in payload.tolist():
        out += [(byte & 0xF) - 8, (byte >> 4) - 8]
    return out[:numel]


SIZES = [1, 5, 64, 100, 257]  # whole blocks, a partial last block, fewer than one block


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", SIZES)
def test_quantize_matches_the_reference_and_the_error_bound(bits, numel):
    torch.manual_seed(numel)
    x = torch.randn(numel) * torch.logspace(-3, 2, numel)  # blocks of very different scales
    block = 64
    payload, scales = quantize(x, block_numel=block, bits=bits)
    want_q, want_scales = reference(x.double(), block, bits)  # exact math for the reference
    got_q = payload.tolist() if bits == 8 else unpack_int4(payload, numel)
    assert scales.dtype == torch.float32 and scales.numel() == math.ceil(numel / block)
    torch.testing.assert_close(scales.double(), torch.tensor(want_scales, dtype=torch.float64),
                               rtol=1e-6, atol=0)
    # fp32 division may land a value at x.5 on the other side: at most one step, rarely.
    diff = [abs(a - b) for a, b in zip(got_q, want_q)]
    assert max(diff) <= 1 and sum(diff) <= max(1, numel // 100), (bits, numel)
    assert payload.numel() == (numel if bits == 8 else math.ceil(numel / 2))
    back = dequantize(payload, scales, numel=numel, block_numel=block, bits=bits)
    bound = scales.repeat_interleave(block)[:numel] / 2
    assert ((back - x).abs() <= bound * (1 + 1e-5) + 1e-12).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_zero_blocks_have_scale_zero_and_decode_to_zero(bits):
    x = torch.zeros(130)
    x[70:75] = torch.tensor([1.0, -2.0, 3.0, 0.5, -0.25])
    payload, scales = quantize(x, block_numel=64, bits=bits)
    assert scales.tolist()[0] == 0.0 and scales.tolist()[2] == 0.0
    back = dequantize(payload, scales, numel=130, block_numel=64, bits=bits)
    assert torch.isfinite(back).all()
    assert back[:64].eq(0).all() and back[128:].eq(0).all()
    assert back[70:75].abs().max() > 0  # the block's largest element is exact
    assert back[72] == 3.0


def test_the_largest_element_of_a_block_is_exact():
    x = torch.tensor([0.3, -7.5, 1.0, 2.0])
    for bits in (8, 4):
        payload, scales = quantize(x, block_numel=4, bits=bits)
        back = dequantize(payload, scales, numel=4, block_numel=4, bits=bits)
        assert back[1] == -7.5


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [0, 1, 63, 64, 65, 300])
def test_encode_decode_round_trip_in_exactly_the_formula_bytes(bits, numel):
    spec = QuantSpec(bits=bits, block_numel=64)
    x = torch.randn(numel, dtype=torch.bfloat16)
    wire = torch.empty(spec.wire_bytes(numel), dtype=torch.uint8)
    assert wire.numel() == quantized_bytes(numel, 64, bits, 4)
    encode(x, spec, wire)
    out = torch.empty(numel, dtype=torch.bfloat16)
    decode(wire, numel, spec, out)
    payload, scales = quantize(x, block_numel=64, bits=bits)
    want = dequantize(payload, scales, numel=numel, block_numel=64, bits=bits)
    assert torch.equal(out, want.to(torch.bfloat16))
    # A slice of a gathered buffer at an odd offset decodes the same (scales are copied out).
    shifted = torch.empty(wire.numel() + 1, dtype=torch.uint8)
    shifted[1:] = wire
    out2 = torch.empty(numel, dtype=torch.bfloat16)
    decode(shifted[1:], numel, spec, out2)
    assert torch.equal(out2, out)


def test_non_finite_values_poison_only_their_block():
    x = torch.ones(128)
    x[3] = float("inf")
    payload, scales = quantize(x, block_numel=64, bits=8)
    back = dequantize(payload, scales, numel=128, block_numel=64, bits=8)
    assert not torch.isfinite(back[:64]).all()  # the overflow stays visible to the loss scaler
    assert torch.equal(back[64:], torch.ones(64))


def test_wire_buffer_of_the_wrong_size_is_refused():
    spec = QuantSpec(bits=8, block_numel=64)
    with pytest.raises(ValueError, match="needs 108"):
        encode(torch.zeros(100), spec, torch.empty(107, dtype=torch.uint8))
    with pytest.raises(ValueError, match="bits"):
        QuantSpec(bits=2, block_numel=64)


def test_quantized_bytes_formula():
    # int8: one byte per element, one fp32 scale per block (the last one partial).
    assert quantized_bytes(4096, 2048, 8, 4) == 4096 + 2 * 4
    assert quantized_bytes(4097, 2048, 8, 4) == 4097 + 3 * 4
    # int4: two elements per byte, the odd tail in a byte of its own.
    assert quantized_bytes(4097, 2048, 4, 4) == 2049 + 3 * 4
    assert quantized_bytes(0, 2048, 8, 4) == 0
    # The fractions ZeRO++ quotes: int8 + scales against bf16 ~0.5x, against fp32 ~0.25x.
    n = 2048 * 1000
    assert quantized_bytes(n, 2048, 8) / (2 * n) == pytest.approx(0.5 + 4 / 4096)
    assert quantized_bytes(n, 2048, 8) / (4 * n) == pytest.approx(0.25 + 1 / 2048)
    assert quantized_bytes(n, 2048, 4) / (4 * n) == pytest.approx(0.125 + 1 / 2048)
    with pytest.raises(ValueError, match="bits"):
        quantized_bytes(10, 2048, 2)


def test_transient_buffer_bytes_match_what_the_collectives_allocate():
    from infinity.ledger import qgz_buffer_bytes, qwz_buffer_bytes

    # 4 ranks, a unit of 1000 elements: shards of 250, 4 blocks of 64 each (the last partial).
    wire8 = 250 + 4 * 4
    assert qwz_buffer_bytes(1000, 4, 64) == 5 * wire8  # own shard + 4 received
    wire4 = 125 + 4 * 4
    assert qgz_buffer_bytes(1000, 4, 64, 4) == 2 * 4 * wire4 + 4 * 250  # send, receive, a slice
    # Against a bf16 gathered unit, qwZ's buffers are about half of it.
    assert qwz_buffer_bytes(2048 * 64, 4, 2048) / (2 * 2048 * 64) == pytest.approx(
        0.5 * 5 / 4, rel=1e-2)
