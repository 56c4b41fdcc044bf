"""Small models with an edge the engine must handle: parameters unused in some steps, replicated
buffers (BatchNorm running statistics), a GPT of five units for device budgets that evict every
step. Shared by the single-process, the 2-rank and the GPU tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from infinity.models.gpt import GPT, GPTConfig
from tests._support.engine import TINY, tiny_gpt


class SometimesGPT(nn.Module):
    """An extra block that runs only on every other forward: parameters unused in some steps and
    control flow that differs between steps."""

    def __init__(self):
        super().__init__()
        self.gpt = tiny_gpt()
        torch.manual_seed(1)
        self.extra = type(self.gpt.blocks[0])(TINY)
        self.calls = 0

    def forward(self, idx, targets):
        g = self.gpt
        self.calls += 1
        x = g.wte(idx) + g.wpe(torch.arange(idx.shape[1]))
        for block in g.blocks:
            x = block(x)
        if self.calls % 2 == 0:
            x = self.extra(x)
        logits = g.lm_head(g.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(TINY.vocab_size, 32)
        # No bias before the norm: its gradient is mathematically zero (rounding noise only).
        self.body = nn.Sequential(nn.Linear(32, 64, bias=False), nn.BatchNorm1d(64), nn.ReLU(),
                                  nn.Linear(64, TINY.vocab_size))

    def forward(self, idx, targets):
        h = self.emb(idx).view(-1, 32)
        return F.cross_entropy(self.body(h), targets.view(-1))



FOUR = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)
"""Five units (four Blocks and the root): a device budget of three of them evicts every step."""


def four_gpt(seed: int = 0) -> nn.Module:
    """The offload tests' GPT of :data:`FOUR`."""
    torch.manual_seed(seed)
    return GPT(FOUR)


def unit_numels(model: nn.Module) -> list[int]:
    """Elements per unit of a GPT with Block units: one per block, then the root's."""
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    return blocks + [sum(p.numel() for p in model.parameters()) - sum(blocks)]
