"""[Note: staging writes each gradient once] in infinity/zero/_grad_reducer.py: the staging buffer
is not zeroed when made, so every way a slot can be left unwritten or written twice in a backward
must still give plain PyTorch's gradients. The reference is torch.optim.AdamW on the same model
(tests/_support/engine.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests._support.engine import assert_parity, batches


class _Block(nn.Module):
    """A unit whose flat group has a zero-size parameter before a real one (their slots share an
    offset: keyed by offset, the real one's gradient was added to the unzeroed buffer), a
    parameter used twice in one forward (autograd sums both uses before the hook), and a
    parameter used only on odd forwards (its slot is left unwritten on even ones)."""

    def __init__(self, width: int):
        super().__init__()
        self.empty = nn.Parameter(torch.zeros(0))
        self.twice = nn.Linear(width, width)
        self.sometimes = nn.Linear(width, width)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = torch.tanh(self.twice(torch.tanh(self.twice(x)))) + self.empty.sum()
        if self.calls % 2:
            h = h + self.sometimes(x)
        return h


class _Model(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(2))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for b in self.blocks:
            h = b(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def _model() -> _Model:
    torch.manual_seed(0)
    return _Model()


@pytest.mark.parametrize("stage,gas", [(3, 1), (3, 2), (2, 1), (1, 2)])
def test_unwritten_and_twice_written_slots_train_like_plain_pytorch(stage, gas):
    # The reference runs the same forward, so the 'sometimes' branch is taken on the same calls
    # (the call counter advances per forward, micro-batches included, in both runs).
    assert_parity(_model, stage=stage, gas=gas, steps=6, clip=1.0, data=batches(6, gas),
                  unit_class_names=("_Block",), persistence_threshold_numel=0)
