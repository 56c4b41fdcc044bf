"""A model with the embeddings [Note: embedding rows cross ranks as rows] (in
infinity/zero/_embedding_rows.py) taps, for the single-process and the 2-rank tests: a token
table with a padding index, a position table, a second table that ``use_extra`` switches on,
two repeated layers and an untied head (which ``head_twice`` calls twice a forward: [Note: the
head's gradient reduced as it is made] in infinity/zero/_head_grad.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, SEQ = 4500, 8, 8
PAD = 3
"""A padding index (torch leaves its row's gradient at zero); the batches use it too."""


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, h):
        return h + torch.tanh(self.fc(h))


class RowsModel(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.tok = nn.Embedding(VOCAB, WIDTH, padding_idx=PAD)
        self.pos = nn.Embedding(SEQ, WIDTH)
        self.extra = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.use_extra = True
        self.head_twice = False

    def forward(self, idx, targets):
        h = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        if self.use_extra:
            h = h + self.extra((idx * 7) % VOCAB)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h)
        if self.head_twice:
            logits = logits + self.head(torch.tanh(h))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def uses_extra(rank: int, step: int, micro: int) -> bool:
    """Rank 0 uses the second table in even steps' first micro-batch; rank 1 never does."""
    return rank == 0 and step % 2 == 0 and micro == 0


def batch(step: int, micro: int, batch_size: int = 4):
    gen = torch.Generator().manual_seed(1000 * step + micro)
    idx = torch.randint(0, VOCAB, (batch_size, SEQ), generator=gen)
    idx[:, -1] = PAD
    return idx, torch.roll(idx, -1, dims=1)


def run_record(engine, model: nn.Module, losses: list[float]) -> dict:
    return {"losses": losses, "state": engine.full_state_dict(),
            "steps": {n: engine.optimizer.step_of(p) for n, p in model.named_parameters()}}


def maybe_autocast(on: bool):
    """CPU autocast to bf16 when ``on`` (the layer norm's output stays fp32, the linear layers'
    run in bf16: a tapped head's input and output gradient then differ in dtype)."""
    import contextlib

    return torch.autocast("cpu", dtype=torch.bfloat16) if on else contextlib.nullcontext()


def reference(steps: int, gas: int, *, head_twice: bool = False, autocast: bool = False):
    """Plain PyTorch on the global batch, each rank's half run as it chooses (losses per rank,
    state, per-parameter optimizer step counts); ``autocast``: each forward under CPU autocast
    to bf16 (:func:`maybe_autocast`)."""
    from tests._support.engine import BETAS, EPS, LR, WD

    model = RowsModel()
    model.head_twice = head_twice
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = [[], []]
    for t in range(steps):
        for m in range(gas):
            idx, targets = batch(t, m)
            halves = []
            for rank, (i, y) in enumerate(zip(idx.chunk(2), targets.chunk(2))):
                model.use_extra = uses_extra(rank, t, m)
                with maybe_autocast(autocast):
                    halves.append(model(i, y))
            ((halves[0] + halves[1]) / (2 * gas)).backward()
            for rank in range(2):
                losses[rank].append(halves[rank].item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad(set_to_none=True)
    step_counts = {n: int(opt.state[p]["step"]) if p in opt.state else 0
                   for n, p in model.named_parameters()}
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, step_counts
