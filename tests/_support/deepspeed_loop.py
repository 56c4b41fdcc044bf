"""The DeepSpeed drop-in's tests (one process and two): a DeepSpeed config, its data, the plain
PyTorch run it must equal, and a ``GatheredParameters``-style edit of the weights."""

from __future__ import annotations

import torch

from tests._support.engine import BETAS, EPS, LR, WD, tiny_gpt

MICRO, STEPS = 4, 6


def ds_config(tmp_path, **zero) -> dict:
    swap = str(tmp_path / "nvme")
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS),
                                                      "eps": EPS, "weight_decay": WD}},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme",
                                                                "nvme_path": swap},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": swap},
                                  **zero}}


def dataset(n: int = MICRO * STEPS) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 64, (n, 16), generator=g)
    return torch.utils.data.TensorDataset(x, torch.roll(x, -1, dims=1))


def plain_losses(batches, model=None, edit=None, edit_after: int | None = None):
    model = model or tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = []
    for i, (x, y) in enumerate(batches):
        if edit is not None and i == edit_after:
            with torch.no_grad():
                edit(model)
        loss = model(x, y)
        loss.backward()
        # DeepSpeed clips at 1.0 when the config has no gradient_clipping (infinity/config/
        # _deepspeed.py): so does the drop-in, and so does the reference.
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def edit_rows_and_tie(model) -> None:
    """Resize-style row edit (new rows set to the mean of the others) and a tie by value."""
    w = model.wte.weight
    w[-4:] = w[:-4].mean(dim=0, keepdim=True)
    model.blocks[1].mlp.fc.weight.copy_(model.blocks[0].mlp.fc.weight)
