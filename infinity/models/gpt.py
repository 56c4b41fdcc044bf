"""A GPT-style decoder in plain PyTorch (nanoGPT's shape): the model of the benchmarks and main job.

It imports nothing from infinity, so the DeepSpeed reference runs load this very file, and the
parity tests train it with plain ``torch.optim.AdamW``. ``Block`` is the natural unit class.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    """Longest sequence (positions)."""
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    tie_weights: bool = True
    """Share the token embedding with the LM head (the classic ZeRO-3 pitfall)."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")

    @property
    def num_params(self) -> int:
        """Exact parameter count (what ``sum(p.numel())`` gives, tied weights counted once)."""
        d, v = self.n_embd, self.vocab_size
        per_block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
        head = 0 if self.tie_weights else v * d
        return v * d + self.block_size * d + self.n_layer * per_block + 2 * d + head


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32),
    "small": GPTConfig(vocab_size=4096, block_size=256, n_layer=4, n_head=4, n_embd=256),
    "medium": GPTConfig(vocab_size=8192, block_size=256, n_layer=8, n_head=8, n_embd=512),
    # The main job's default: byte-level (vocabulary 256) so it trains on the shipped text.
    "demo": GPTConfig(vocab_size=256, block_size=256, n_layer=8, n_head=8, n_embd=512),
    # Activations on NVMe (issue #34): narrow and deep, byte-level, so that at long context its
    # checkpointed blocks' inputs (32 x 2sbh) are 4x one block's working set (34sbh), the
    # shape of a 7B model's (32 layers) on a CPU's compute.
    "deep": GPTConfig(vocab_size=256, block_size=1024, n_layer=32, n_head=4, n_embd=256),
    "gpt2-124m": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "135m": GPTConfig(vocab_size=50304, block_size=256, n_layer=13, n_head=12, n_embd=768),
    # The 135m's width with a 7B Llama's proportions (issue #30's overlap figures): the embedding
    # is 3% of the 110M parameters (a Llama-7B's: 4%), where the 135m's tied 50k vocabulary is
    # 29%, a unit gathered first and reduced last in every step that nothing can overlap.
    "110m": GPTConfig(vocab_size=4096, block_size=256, n_layer=15, n_head=12, n_embd=768),
    "350m": GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "1b": GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1856),
    # Beyond memory (issue #16): 3.31B parameters, 53 GB of training state at 16 B per parameter,
    # twice the RAM of a 24 GiB machine.
    "3b": GPTConfig(vocab_size=32000, block_size=1024, n_layer=40, n_head=20, n_embd=2560,
                    tie_weights=False),
}


def gpt_for_params(numel: float, *, vocab_size: int = 32000, block_size: int = 1024,
                   width: int | None = None) -> GPTConfig:
    """A GPT of about ``numel`` parameters in the shape of the presets above: width 64 per layer
    (the 3b preset's 2560 / 40), width a multiple of 128, heads of 128, an untied head.
    ``width``: fixed instead (a multiple of 128), the layers making up the size: models of one
    unit size, whose per-unit working set is the same at every size."""
    numel = float(numel)
    if width is not None and (width < 128 or width % 128):
        raise ValueError(f"width must be a multiple of 128 (heads of 128), got {width}")
    width = width or max(128, round((numel * 64 / 12) ** (1 / 3) / 128) * 128)
    ends = 2 * vocab_size * width + block_size * width + 2 * width
    per_block = 12 * width * width + 13 * width
    layers = max(1, round((numel - ends) / per_block))
    return GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=layers,
                     n_head=width // 128, n_embd=width, tie_weights=False)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


class HasVocab(Protocol):
    """What :func:`synthetic_batch` reads of a model's config (a GPTConfig, a Hugging Face one)."""

    @property
    def vocab_size(self) -> int: ...


def synthetic_batch(config: HasVocab, batch_size: int, seq_len: int, *, seed: int,
                    device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic tokens with learnable structure (next token = f(previous)), so loss falls."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, config.vocab_size, (batch_size, 1), generator=g)
    steps = torch.arange(seq_len + 1).unsqueeze(0)
    tokens = (start * 7 + steps * 13 + (steps * steps) % 5) % config.vocab_size
    return tokens[:, :-1].to(device), tokens[:, 1:].contiguous().to(device)


class GPTEmbedding(nn.Module):
    """A GPT's token and position embeddings as one module (the first piece of
    :func:`as_sequential`)."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding) -> None:
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.wpe.num_embeddings:
            raise ValueError(f"sequence length {t} exceeds block_size {self.wpe.num_embeddings}")
        return self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))


class GPTHead(nn.Module):
    """A GPT's final norm and LM head (the last piece of :func:`as_sequential`)."""

    def __init__(self, ln_f: nn.LayerNorm, lm_head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def as_sequential(model: GPT) -> nn.Sequential:
    """``model``'s modules (shared, not copied) as an ``nn.Sequential`` of ``embed``,
    ``block0`` ... ``block{L-1}``, ``head``: the form :func:`infinity.pipeline.initialize` cuts
    into stages. It computes ``model(idx)``'s logits. Tied embeddings (``tie_weights``) put the
    same parameter in the first and the last piece: a pipeline refuses to cut between them."""
    pieces: list[tuple[str, nn.Module]] = [("embed", GPTEmbedding(model.wte, model.wpe))]
    pieces += [(f"block{i}", block) for i, block in enumerate(model.blocks)]
    pieces.append(("head", GPTHead(model.ln_f, model.lm_head)))
    return nn.Sequential(OrderedDict(pieces))


def sequential_names(model: GPT) -> dict[str, str]:
    """Parameter names of :func:`as_sequential` (``model``) -> the same parameters' names in
    ``model`` (a state dict saved from one loads into the other through it)."""
    by_id: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), name)
    return {name: by_id[id(p)]
            for name, p in as_sequential(model).named_parameters(remove_duplicate=False)}
