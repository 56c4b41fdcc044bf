"""``loss.backward()`` without ``engine.backward`` ([Note: the end of backward] in
infinity/zero/_param_manager.py): the end of backward runs from the callback queued on autograd's
engine, so a trainer that calls ``loss.backward()`` itself trains like plain PyTorch (the caller
divides by the accumulation steps, as accelerate does), at every stage, with gradient
accumulation, clipping, and the optimizer (and its deferred step) on NVMe."""

from __future__ import annotations

import pytest
import torch

import infinity
from tests._support.engine import (assert_close_run, batches, engine_config, offload_config,
                                   reference_train, tiny_gpt)

STEPS = 4
CASES = [  # name, stage, gradient accumulation, clip, offload of (optimizer, parameters)
    ("s0", 0, 1, 0.0, None),
    ("s1-gas2", 1, 2, 0.05, None),
    ("s2-gas2", 2, 2, 0.0, None),
    ("s3", 3, 1, 0.05, None),
    ("s3-gas2-nvme", 3, 2, 0.05, ("nvme", "nvme")),
]


@pytest.mark.parametrize("name,stage,gas,clip,offload", CASES, ids=[c[0] for c in CASES])
def test_loss_backward_trains_as_plain_pytorch(name, stage, gas, clip, offload, tmp_path):
    data = batches(STEPS, gas)
    ref_losses, ref_state = reference_train(tiny_gpt(), data, clip=clip)
    if offload is None:
        config = engine_config(stage=stage, gas=gas, clip=clip)
    else:
        config = offload_config(tmp_path / "swap", stage=stage, gas=gas, clip=clip,
                                opt=offload[0], param=offload[1])
    engine = infinity.initialize(tiny_gpt(), config)
    losses = []
    for micro in data:
        total = 0.0
        for x, y in micro:
            loss = engine(x, y)
            (loss / gas).backward()  # no engine.backward: the hooks end the backward
            engine.step()
            total += loss.item() / gas
        losses.append(total)
    assert engine.global_steps == STEPS
    assert engine.manager.micro_step == STEPS * gas  # every backward was finished
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    engine.close()


class _CheckpointedChain(torch.nn.Module):
    """An embedding, Linear blocks each under ``torch.utils.checkpoint(use_reentrant=True)``
    (Hugging Face's gradient checkpointing default), and the embedding as the head: the first
    parameter gradients of a backward arrive inside the last block's nested backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(64, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, idx, targets):
        from torch.utils.checkpoint import checkpoint

        h = self.emb(idx)
        for block in self.blocks:
            h = torch.tanh(checkpoint(block, h, use_reentrant=True))
        logits = h @ self.emb.weight.T
        return torch.nn.functional.cross_entropy(logits.view(-1, 64), targets.view(-1))


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_loss_backward_through_reentrant_checkpoints(stage):
    """The backward ends once, at its end, not with the first nested backward (a callback
    queued there would run when that nested backward ends)."""
    data = batches(STEPS, 1)
    ref_losses, ref_state = reference_train(_CheckpointedChain(), data)
    engine = infinity.initialize(_CheckpointedChain(), engine_config(
        stage=stage, unit_class_names=("Linear",)))
    losses = []
    for micro in data:
        for x, y in micro:
            loss = engine(x, y)
            loss.backward()
            engine.step()
            losses.append(loss.item())
    assert engine.manager.micro_step == STEPS
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    engine.close()
