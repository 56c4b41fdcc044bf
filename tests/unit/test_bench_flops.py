"""bench step's model FLOPs per token against the formula written out for the GPT (PaLM's model
FLOPs: 6 per matmul weight per token, plus attention's 12 * n_layer * d_model * seq_len)."""

from __future__ import annotations

import torch

from infinity.bench._step_worker import model_flops_per_token
from infinity.models.gpt import GPT, GPTConfig


def test_gpt_flops_match_the_written_out_formula():
    cfg = GPTConfig(vocab_size=96, block_size=32, n_layer=3, n_head=2, n_embd=16)
    with torch.device("meta"):
        model = GPT(cfg)
    d, L, V, T = cfg.n_embd, cfg.n_layer, cfg.vocab_size, 32
    want = 6 * (12 * d * d * L + d * V) + 12 * L * d * T  # qkv, proj, MLP; the tied head
    assert model_flops_per_token(model, "Block", T) == want
