"""A model whose parameters get no gradient in some steps, in the two shapes the engine meets:
part of a unit unused (the unit is reduced at the end of backward with zeros for them) and a
whole unit unused (never reduced). Shared by the single-process and the 2-rank tests of
[Note: parameters without a gradient] (infinity/zero/_grad_presence.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH = 64, 16
UNITS = dict(unit_class_names=("Experts", "Linear"), unit_min_numel=1,
             persistence_threshold_numel=0)
"""Engine settings: the experts are one unit; each other Linear is its own."""


class Experts(nn.Module):
    """Three experts in one unit; ``use`` says which run (the others get no gradient)."""

    def __init__(self):
        super().__init__()
        self.x = nn.Linear(WIDTH, WIDTH)
        self.y = nn.Linear(WIDTH, WIDTH)
        self.z = nn.Linear(WIDTH, WIDTH)
        self.use: tuple[str, ...] = ("x", "y", "z")

    def forward(self, h):
        out = h
        for name in self.use:
            out = out + torch.tanh(getattr(self, name)(h))
        return out


class Sometimes(nn.Module):
    """Embedding, experts, an extra Linear that ``extra`` switches on, and a head."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.experts = Experts()
        self.extra = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.use_extra = True

    def forward(self, idx, targets):
        h = self.experts(self.emb(idx))
        if self.use_extra:
            h = h + torch.relu(self.extra(h))
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def set_use(model: nn.Module, experts: tuple[str, ...], extra: bool) -> None:
    """Choose what the next forward runs (``model`` or the engine's ``module``)."""
    model.experts.use = experts
    model.use_extra = extra


def batch(step: int, micro: int, batch_size: int = 4, seq_len: int = 8):
    gen = torch.Generator().manual_seed(1000 * step + micro)
    idx = torch.randint(0, VOCAB, (batch_size, seq_len), generator=gen)
    return idx, torch.roll(idx, -1, dims=1)


def run_record(engine, model: nn.Module, losses: list[float]) -> dict:
    """What a 2-rank worker returns for one configuration: losses, the full state, and each
    parameter's optimizer step count (a parameter without a gradient is not stepped)."""
    return {"losses": losses, "state": engine.full_state_dict(),
            "steps": {n: engine.optimizer.step_of(p) for n, p in model.named_parameters()}}
