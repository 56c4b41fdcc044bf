"""Hugging Face causal LMs for the benchmarks: Llama and GPT-2 built from a config written here
(random init with the model's own ``_init_weights``; no hub download, no network).

``infinity bench step --model hf-llama-135m`` (SmolLM-135M's shape) and ``--model hf-gpt2-124m``
(GPT-2 small's) put the engine on the models people fine-tune, beside the GPT presets; the
``-tiny`` ones are for tests. Like :mod:`infinity.models.gpt` this imports nothing of infinity;
transformers is imported when a model is built, so the GPT presets never need it.

The loss is :func:`causal_lm_loss`, the GPT preset's: cross-entropy of the fp32 logits against
already shifted targets (``synthetic_batch``'s), so every mode of a benchmark trains the same
function of the same batches.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HF_EXTRA = "pip install 'infinity[hf]'"


@dataclasses.dataclass(frozen=True, kw_only=True)
class HFPreset:
    """One Hugging Face model shape: the architecture and its config's keyword arguments."""

    arch: str
    """'llama' (LlamaForCausalLM) or 'gpt2' (GPT2LMHeadModel)."""
    config: dict[str, Any]
    """Keyword arguments of the architecture's config class."""

    @property
    def block_class_name(self) -> str:
        """The transformer block: the unit class of the tuned native config."""
        return BLOCK_CLASS_NAMES[self.arch]

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    @property
    def max_seq_len(self) -> int:
        return self.config["max_position_embeddings" if self.arch == "llama" else "n_positions"]


BLOCK_CLASS_NAMES = {"llama": "LlamaDecoderLayer", "gpt2": "GPT2Block"}

# Every preset: sdpa attention (the GPT preset's kernel), no KV cache (training builds none), and
# no dropout (the GPT presets have none, so every mode computes the same function and the final
# losses of plain PyTorch and the engine compare).
_LLAMA = dict(attn_implementation="sdpa", use_cache=False, attention_dropout=0.0,
              bos_token_id=0, eos_token_id=0, pad_token_id=0)
_GPT2 = dict(attn_implementation="sdpa", use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
             attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)

HF_PRESETS: dict[str, HFPreset] = {
    # For tests: width 128, so that the blocks' matrices (16384 elements and up) are above the
    # 'auto' persistence threshold and the blocks become units, as in the large presets.
    "hf-llama-tiny": HFPreset(arch="llama", config=dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True, **_LLAMA)),
    "hf-gpt2-tiny": HFPreset(arch="gpt2", config=dict(
        vocab_size=256, n_positions=64, n_embd=128, n_layer=2, n_head=4, **_GPT2)),
    # SmolLM-135M's shape (HuggingFaceTB/SmolLM-135M config.json): 30 layers of width 576,
    # grouped-query attention 9/3, tied embeddings; 134.5M parameters.
    "hf-llama-135m": HFPreset(arch="llama", config=dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
        rms_norm_eps=1e-5, tie_word_embeddings=True, **_LLAMA)),
    # GPT-2 small (openai-community/gpt2): 12 layers of width 768, tied head; 124.4M parameters.
    "hf-gpt2-124m": HFPreset(arch="gpt2", config=dict(
        vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, **_GPT2)),
}


def build_hf(name: str) -> nn.Module:
    """A fresh, randomly initialised model of preset ``name`` (seeded by the caller's RNG)."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"--model {name} needs transformers ({e}); install it with: "
                          f"{HF_EXTRA}") from e
    preset = HF_PRESETS[name]
    if preset.arch == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**preset.config))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**preset.config))


def causal_lm_loss(model: Any, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT preset's loss on a Hugging Face model (or an engine wrapping one): cross-entropy
    of the fp32 logits against ``targets``, which are already shifted (so not HF's ``labels``
    path, which shifts again)."""
    logits = model(input_ids=idx).logits
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
