"""Shared by the integration tests: tiny GPT-2 and Llama built from transformers' config classes
(fp32, random init with a fixed seed), a token dataset, TrainingArguments the tests vary, and a
runner that returns what a test compares (logged losses, grad norms, lrs; final weights)."""

from __future__ import annotations

from typing import Any

import torch

from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          TrainingArguments)

VOCAB, SEQ = 64, 16

UNITS = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer"}
"""Each model's transformer block: the unit class of the stage-3 configs."""


def tiny(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                          n_head=2, bos_token_id=0, eos_token_id=0))
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, max_position_embeddings=SEQ,
                                        bos_token_id=0, eos_token_id=0, pad_token_id=0))


class Tokens(torch.utils.data.Dataset):
    """``n`` sequences of a learnable pattern (start + 7 * position, mod the vocabulary)."""

    def __init__(self, n: int = 40):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = torch.randint(0, VOCAB, (1,), generator=torch.Generator().manual_seed(i))
        ids = (start + 7 * torch.arange(SEQ)) % VOCAB
        return {"input_ids": ids, "labels": ids}


def training_args(output_dir: str, **overrides: Any) -> TrainingArguments:
    """10 optimizer steps of 2 micro-batches of 2, cosine schedule with 3 warmup steps, weight
    decay 0.1 (HF's no-decay groups matter), clipping at 0.5 (below every step's norm here, so
    each step clips). adam_epsilon 1e-6: the attention's key bias gets a mathematically zero
    gradient, rounding noise that Adam with eps 1e-8 turns into lr-sized steps in a random
    direction, different under any other summation order."""
    kwargs = dict(output_dir=output_dir, per_device_train_batch_size=2,
                  gradient_accumulation_steps=2, max_steps=10, learning_rate=3e-3,
                  lr_scheduler_type="cosine", warmup_steps=3, weight_decay=0.1, max_grad_norm=0.5,
                  adam_epsilon=1e-6, logging_steps=1, save_strategy="no", report_to=[],
                  use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0)
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def logs_of(trainer: Any) -> list[tuple[float, float, float]]:
    """(loss, grad_norm, learning_rate) of every logged step."""
    return [(h["loss"], h["grad_norm"], h["learning_rate"]) for h in trainer.state.log_history
            if "loss" in h]


def weights_of(trainer: Any) -> dict[str, torch.Tensor]:
    """The trained weights: the engine's full state dict, or the plain model's."""
    engine = getattr(trainer, "engine", None)
    sd = engine.full_state_dict() if engine is not None else trainer.model.state_dict()
    return {k: v.detach().float().cpu().clone() for k, v in sd.items()}


def assert_same_run(ours: Any, reference: Any, *, loss_tol: float = 1e-4,
                    weight_tol: float = 1e-3, initial: dict[str, torch.Tensor] | None = None
                    ) -> None:
    """Same logged losses (and grad norms, lrs) and the same final weights; with ``initial``,
    also that training moved the weights well beyond the tolerance (the check can fail)."""
    a, b = logs_of(ours), logs_of(reference)
    assert len(a) == len(b) and a, (a, b)
    for step, ((la, ga, ra), (lb, gb, rb)) in enumerate(zip(a, b), 1):
        assert abs(la - lb) <= loss_tol, f"step {step}: loss {la} vs {lb}"
        assert abs(ga - gb) <= 1e-4 * max(1.0, gb), f"step {step}: grad_norm {ga} vs {gb}"
        assert ra == rb or abs(ra - rb) <= 1e-12, f"step {step}: lr {ra} vs {rb}"
    wa, wb = weights_of(ours), weights_of(reference)
    assert wa.keys() == wb.keys()
    worst = max((wa[k] - wb[k]).abs().max().item() for k in wb)
    assert worst <= weight_tol, f"final weights differ by {worst}"
    if initial is not None:
        moved = max((wb[k] - initial[k]).abs().max().item() for k in wb)
        assert moved > 10 * weight_tol, f"training moved the weights by only {moved}"


def stage3(kind: str, **extra):
    """ZeRO-3 with ``kind``'s blocks as units (``extra``: more config sections)."""
    return {"zero": {"stage": 3, "unit_class_names": [UNITS[kind]], "unit_min_numel": 1,
                     "persistence_threshold_numel": 64}, **extra}


HF_DS_CONFIG = {  # Hugging Face's example DeepSpeed config: the Trainer fills every "auto"
    "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                          "offload_param": {"device": "cpu"}},
}

TRAINER_CASES = {  # the Trainer parity cases (test_trainer.py; the CUDA run repeats two)
    "gpt2-stage3": ("gpt2", stage3("gpt2")),
    "llama-stage3": ("llama", stage3("llama")),
    "llama-deepspeed-auto-offload-host": ("llama", HF_DS_CONFIG),
}
