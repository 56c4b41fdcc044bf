"""A decoder-only transformer's shape: enough to count its parameters, its units and its
activations exactly (``infinity estimate --model``, ``infinity plan``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A decoder-only transformer's shape: enough to count parameters and activations exactly."""

    kind: str = "gpt2"
    """'gpt2' (learned positions, biases, LayerNorm, GELU MLP) or 'llama' (RoPE, RMSNorm, gated MLP)."""
    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    seq_len: int = 2048
    """Training sequence length (activations); defaults to the model's max positions when read."""
    intermediate_size: int | None = None
    """MLP inner size; None: 4 x hidden (gpt2)."""
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None: num_heads."""
    head_dim: int | None = None
    """None: hidden_size // num_heads."""
    max_position_embeddings: int | None = None
    """gpt2: rows of the learned position table; None: seq_len."""
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    """llama-family only: biases on q, k, v and o (gpt2 always has them)."""
    qkv_bias: bool = False
    """llama-family only: biases on q, k, v but not o (Qwen2)."""
    mlp_bias: bool = False
    qk_norm: bool = False
    """llama-family only: RMSNorm over each head's q and k (Qwen3)."""
    eager_attention: bool = False
    """The attention's scores, softmax and dropout mask are materialised and kept for backward
    (an 'eager' attention implementation: Korthikanti's 5as/h term per layer); False: SDPA or
    FlashAttention, which keep none of them ([Note: fused attention keeps no scores] in
    infinity/ledger/_activations.py)."""

    def __post_init__(self) -> None:
        if self.kind not in ("gpt2", "llama"):
            raise ValueError(f"ModelShape.kind: expected 'gpt2' or 'llama', got {self.kind!r}")
        for name in ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name}: expected an integer >= 1, got {value!r}")

    @property
    def inner_size(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def layer_numel(self) -> int:
        """Parameters of one transformer block (the natural unit)."""
        h, i, d = self.hidden_size, self.inner_size, self.dim_per_head
        q, kv = self.num_heads * d, self.kv_heads * d
        if self.kind == "gpt2":
            return 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * h + (h * i + i) + (i * h + h)
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias or self.qkv_bias:
            attn += q + 2 * kv
        if self.attention_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * d
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        return attn + mlp + 2 * h  # two RMSNorm weights

    def num_params(self) -> int:
        """Exact parameter count (Hugging Face's GPT2LMHeadModel / LlamaForCausalLM layout)."""
        h, v = self.hidden_size, self.vocab_size
        embed = v * h
        if self.kind == "gpt2":
            embed += (self.max_position_embeddings or self.seq_len) * h
            final_norm = 2 * h
        else:
            final_norm = h
        head = 0 if self.tie_word_embeddings else v * h
        return embed + self.num_layers * self.layer_numel() + final_norm + head

    def num_units(self) -> int:
        """Units when each transformer block is one, plus the embeddings (and an untied head)."""
        return self.num_layers + (1 if self.tie_word_embeddings else 2)

    def largest_unit_numel(self) -> int:
        """The largest unit when units are transformer blocks (embeddings are a unit of their own)."""
        return max(self.layer_numel(), self.vocab_size * self.hidden_size)

    @classmethod
    def assumed(cls, numel: int, *, seq_len: int = 2048, vocab_size: int = 32000) -> "ModelShape":
        """A GPT-style shape for a bare parameter count: 12 L h^2 = numel with h = 128 L (the
        aspect ratio of the GPT-3 and Llama families), h a multiple of 128."""
        hidden = max(128, round((numel * 128 / 12) ** (1 / 3) / 128) * 128)
        layers = max(1, round(numel / (12 * hidden * hidden)))
        return cls(kind="gpt2", num_layers=layers, hidden_size=hidden, num_heads=max(1, hidden // 128),
                   vocab_size=vocab_size, seq_len=seq_len)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}
