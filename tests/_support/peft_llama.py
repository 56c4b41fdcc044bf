"""The tiny LoRA Llama the peft tests share (tests/engine/test_peft.py, the two-rank and CUDA
runs): a transformers Llama (hidden 64, vocab 128) with LoRA r 8 on the attention projections,
its engine config, data, and the plain peft + ``torch.optim.AdamW`` reference loop. Import after
``pytest.importorskip("peft")``: transformers and peft are optional extras."""

from __future__ import annotations

import peft
import torch
import transformers

import infinity

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=128, max_position_embeddings=64)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
RANK = 8
LORA_NUMEL = LLAMA["num_hidden_layers"] * len(TARGETS) * 2 * RANK * LLAMA["hidden_size"]
"""A (r x 64) and B (64 x r) per projection: 16384 (of 213k)."""
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.99), 1e-8, 0.01
STEPS = 8


def lora_config() -> "peft.LoraConfig":
    return peft.LoraConfig(r=RANK, lora_alpha=16, target_modules=TARGETS)


def base_llama(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def eager_peft(seed: int = 0) -> torch.nn.Module:
    """The plain reference: the same construction, eagerly on the CPU."""
    return peft.get_peft_model(base_llama(seed), lora_config())


def lazy_peft(config: dict, seed: int = 0, *, inside: bool = False) -> torch.nn.Module:
    """The base built under ``infinity.init``; peft after the block, as recipes write it
    (``inside``: peft inside the block too)."""
    with infinity.init(config):
        base = base_llama(seed)
        if inside:
            return peft.get_peft_model(base, lora_config())
    return peft.get_peft_model(base, lora_config())


def config(swap_dir, *, stage: int = 3, dtype: str = "fp32", param: str = "nvme",
           opt: str = "none", memory: dict | None = None, persistence_numel: int = 0,
           unit_min_numel: int | None = None) -> dict:
    """Decoder layers as units, nothing persistent by default (every frozen weight is in a unit's
    shard, so NVMe holds exactly the ledger's params term). ``unit_min_numel``: choose units by
    size instead (peft's wrappers then become units of their own: a ``base_layer`` frozen, the
    ``lora.Linear`` around it holding only its adapters)."""
    units = {"unit_class_names": ["LlamaDecoderLayer"]} if unit_min_numel is None else \
        {"unit_class_names": [], "unit_min_numel": unit_min_numel}
    cfg = {"zero": {"stage": stage, **units, "persistence_threshold_numel": persistence_numel},
           "precision": {"dtype": dtype},
           "optimizer": {"type": "adamw", "lr": LR, "betas": list(BETAS), "eps": EPS,
                         "weight_decay": WD},
           "offload_param": {"device": param, "nvme_path": str(swap_dir)},
           "offload_optimizer": {"device": opt, "nvme_path": str(swap_dir)}}
    if memory:
        cfg["memory"] = memory
    return cfg


def token_batches(steps: int = STEPS) -> list[torch.Tensor]:
    """A learnable pattern (each row counts up by 7 from a random start), new rows every step."""
    g = torch.Generator().manual_seed(1234)
    starts = [torch.randint(0, LLAMA["vocab_size"], (2, 1), generator=g) for _ in range(steps)]
    return [(s + 7 * torch.arange(16)) % LLAMA["vocab_size"] for s in starts]


def reference_train(model: torch.nn.Module, data) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def engine_train(engine, data) -> list[float]:
    losses = []
    for ids in data:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def shard_optimizer(engine):
    """The engine's flat-shard optimizer (``engine.shard_optimizer`` once ``engine.optimizer`` is
    the torch.optim facade of issue #15)."""
    return getattr(engine, "shard_optimizer", engine.optimizer)


def lora_names(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}
