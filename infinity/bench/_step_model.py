"""The model ``infinity bench step --model NAME`` trains: a GPT preset (``135m``) or a Hugging Face
one (``hf-llama-135m``, ``hf-gpt2-124m``), seen by the bench through one record: how to build it,
its loss on a batch, its block class (the tuned native config's unit) and its batches.

Building imports torch (and transformers for the HF presets): the CLI side uses
:func:`check_model` at run time only, after parsing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from infinity.models.gpt import GPT, PRESETS, synthetic_batch
from infinity.models.hf import HF_PRESETS, build_hf, causal_lm_loss

MODEL_NAMES: tuple[str, ...] = tuple(PRESETS) + tuple(HF_PRESETS)


@dataclasses.dataclass(frozen=True)
class StepModel:
    """One ``--model`` value, resolved."""

    name: str
    block_class_name: str
    """The repeated block: ``unit_class_names`` of the tuned native modes (``stage3``...)."""
    vocab_size: int
    max_seq_len: int
    build: Callable[[], nn.Module]
    """A fresh model from the caller's RNG state (eagerly, or under ``infinity.init``)."""
    loss: Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]
    """(model or engine, inputs, shifted targets) -> scalar loss, the same in every mode."""

    @property
    def is_hf(self) -> bool:
        return self.name in HF_PRESETS

    def batch(self, batch_size: int, seq_len: int, *, seed: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The GPT bench's synthetic tokens over this model's vocabulary."""
        return synthetic_batch(self, batch_size, seq_len, seed=seed)


def _gpt_loss(model: Any, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model(idx, targets)  # GPT's forward computes the loss itself


def step_model(name: str) -> StepModel:
    """The bench's model ``name``; ``ValueError`` naming ``--model`` and the known names."""
    if name in PRESETS:
        cfg = PRESETS[name]
        return StepModel(name=name, block_class_name="Block", vocab_size=cfg.vocab_size,
                         max_seq_len=cfg.block_size, build=lambda: GPT(cfg), loss=_gpt_loss)
    if name in HF_PRESETS:
        preset = HF_PRESETS[name]
        return StepModel(name=name, block_class_name=preset.block_class_name,
                         vocab_size=preset.vocab_size, max_seq_len=preset.max_seq_len,
                         build=lambda: build_hf(name), loss=causal_lm_loss)
    raise ValueError(f"--model: unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")


def check_model(name: str, seq_len: int) -> StepModel:
    """:func:`step_model`, and that ``seq_len`` fits its positions (GPT-2 would index out of
    its position table deep inside a worker)."""
    model = step_model(name)
    if seq_len > model.max_seq_len:
        raise ValueError(f"--seq-len {seq_len} exceeds --model {name}'s {model.max_seq_len} "
                         f"positions; use a shorter sequence")
    return model
