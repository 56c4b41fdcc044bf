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
