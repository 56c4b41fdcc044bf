"""A stage whose module returns a tuple (two activations, one of them an integer tensor that
needs no gradient) on 2 gloo processes, PP=2 x DP=1, 1F1B: losses and weights against plain
PyTorch (``torch.optim.AdamW``) on the whole batch."""

from __future__ import annotations

import pytest

from tests._support.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread")]

MICRO, STEPS, LR = 4, 3, 1e-2


def _model():
    import torch
    from torch import nn

    class Split(nn.Module):
        """x -> (h, 2h, the argmax of h per row: an integer activation)."""

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x):
            h = self.lin(x)
            return h, h * 2, h.argmax(dim=-1)

    class Merge(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 3)
            self.emb = nn.Embedding(6, 3)

        def forward(self, inputs):  # nn.Sequential hands a child its predecessor's output whole
            a, b, idx = inputs
            return self.lin(torch.tanh(a + b)) + self.emb(idx)

    torch.manual_seed(0)
    return nn.Sequential(Split(), Merge())


def _loss(out, target):
    import torch.nn.functional as F

    return F.mse_loss(out, target)


def _data():
    import torch

    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g))
            for _ in range(STEPS)]


def worker(rank: int, world_size: int, out_dir: str) -> dict:
    import infinity.pipeline
    from tests._support.engine import engine_config

    cfg = engine_config(stage=3, gas=MICRO, mesh={"pipeline": 2}, optimizer={"lr": LR},
                        unit_class_names=("Split", "Merge"))
    pipe = infinity.pipeline.initialize(_model(), cfg, loss_fn=_loss)
    losses = [float(pipe.train_batch(x, target=y)) for x, y in _data()]
    out = {"losses": losses, "state": pipe.full_state_dict()}
    pipe.close()
    return out


def test_tuple_output_stage_matches_plain_pytorch():
    import torch

    from tests._support.engine import BETAS, EPS, WD, assert_close_state

    results = launch(__file__, "worker", world_size=2, timeout_s=240)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    ref_losses = []
    for x, y in _data():
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO)):
            loss = _loss(model(xm), ym)
            (loss / MICRO).backward()
            total += loss.item() / MICRO
        opt.step()
        ref_losses.append(total)
    ref_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    merged = {}
    for res in results:
        assert res["losses"] == pytest.approx(ref_losses, abs=1e-5)
        merged.update(res["state"])
    assert_close_state(merged, ref_state, atol=1e-5)
