"""The rows a tapped embedding hands over ([Note: embedding rows cross ranks as rows] in
infinity/zero/_embedding_rows.py) on the GPU, against torch's own embedding gradient there: the
tapped backward (``torch.unique``, an fp32 ``index_add_``) and the payload built on the device.
One GPU has one rank, where the engine taps nothing: the 2-rank parity runs on gloo
(tests/distributed/test_embedding_rows_dist.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from infinity.zero._embedding_rows import EmbeddingRows, RowsPayload
from tests.gpu._cuda import CUDA

pytestmark = pytest.mark.gpu


def test_rows_on_the_gpu_sum_to_torchs_embedding_gradient():
    torch.manual_seed(0)
    table = nn.Embedding(8192, 64, padding_idx=1).to(CUDA)
    head = nn.Linear(64, 8192, bias=False).to(CUDA)
    head.weight = table.weight
    ids = torch.randint(0, 300, (4, 128), device=CUDA)
    got = []
    taps = EmbeddingRows(nn.ModuleList([table, head]), {id(table.weight)},
                         lambda w, i, r: got.append((i, r)), unit_of=lambda p: 0)
    taps.install()
    head(table(ids)).square().mean().backward()
    head_only = table.weight.grad.clone()
    taps.remove()
    table.weight.grad = None
    head(table(ids)).square().mean().backward()
    (unique, rows), = got
    assert unique.device.type == "cuda" and rows.dtype == torch.float32
    dense = torch.zeros_like(head_only)
    dense[unique] = rows
    torch.testing.assert_close(head_only + dense, table.weight.grad, rtol=1e-5, atol=1e-6)
    payload, _ = RowsPayload.pack([(0, 0, unique, rows)], 0.5, CUDA, shard_numel=[8192 * 64],
                                  world=1)
    number, index, values = RowsPayload.unpack(payload)
    assert values.device.type == "cuda"
    back = torch.zeros(8192 * 64, device=CUDA).index_add_(0, index, values)
    torch.testing.assert_close(back.view(8192, 64), dense / 2)


def test_the_heads_pieces_on_the_gpu_are_autograds_weight_gradient():
    """[Note: the head's gradient reduced as it is made] (infinity/zero/_head_grad.py): the rows
    the tapped head's backward computes piece by piece, and the input's gradient it returns, on
    the GPU in bf16 against autograd's."""
    from infinity.zero._head_grad import HeadTaps, plan_head, weight_rows_grad

    torch.manual_seed(0)
    head = nn.Linear(64, 8192, bias=False).to(CUDA, torch.bfloat16)
    x = torch.randn(4, 128, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(4, 128, 8192, device=CUDA, dtype=torch.bfloat16)
    head(x).backward(grad_out)
    ref_weight, ref_x = head.weight.grad.float(), x.grad.clone()
    head.weight.grad, x.grad = None, None
    plan = plan_head(world=2, shard_numel=8192 * 32, pieces=5, offset=0, rows=8192, width=64,
                     late=[])
    table = torch.full((8192, 64), float("nan"), device=CUDA)

    def sink(module, inputs, grads):
        inputs, grads = inputs.reshape(-1, 64), grads.reshape(-1, 8192)
        for _, row_ranges, _ in plan.early:
            for lo, hi in row_ranges:
                table[lo:hi] = weight_rows_grad(grads, inputs, lo, hi).float()
        for lo, hi in plan.rest:
            table[lo:hi] = weight_rows_grad(grads, inputs, lo, hi).float()
        return (grads @ module.weight).view(4, 128, 64)
    taps = HeadTaps([head], sink)
    taps.install()
    head(x).backward(grad_out)
    taps.remove()
    assert head.weight.grad is None
    torch.testing.assert_close(table, ref_weight, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x.grad, ref_x)
