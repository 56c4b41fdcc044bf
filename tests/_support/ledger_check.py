"""The memory ledger against the engine's accounting, shared by
tests/engine/test_ledger_vs_engine.py (every stage x offload x dtype at one rank) and the
two-rank and hpZ runs (tests/distributed/test_ledger_dist.py, test_hpz_dist.py): the config of a
case, a training run that measures the engine's per-tier peaks, and the check of those peaks
against the ledger (named slack, named transients; the rules are in test_ledger_vs_engine.py's
docstring)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

import infinity
from infinity._common import MiB
from infinity.config import DTYPE_BYTES, load_config
from infinity.ledger import Tier, estimate_from_config
from infinity.models.gpt import GPT, GPTConfig, synthetic_batch

# 4.27 M parameters: embeddings (1.11 M, the largest unit) and four blocks of 0.79 M.
MODEL = GPTConfig(vocab_size=4096, block_size=256, n_layer=4, n_head=4, n_embd=256)
BATCH, SEQ = 1, 8
"""The micro-batch each rank trains on: what is measured (the engine's bytes per tier) does not
depend on it, and bf16 matrix products without AVX-512 are slow (2-4 s a configuration at 2 x 32
tokens on an AVX2 VM, a third of that here)."""
SUB_GROUP_NUMEL = 2 ** 18
"""Several optimizer sub-groups per unit, so the NVMe pipeline really stages."""

SLACK_FRACTION = 0.05
"""Padding of flat buffers to the world size, 4 KiB extent alignment, rounding: well under 5 %."""

PLAN_HOST_MARGIN = 1.05
"""``infinity plan`` sets memory.host_budget_bytes to the ledger's HOST bytes x 1.05, rounded up to
whole MiB (infinity/cli/_plan.py, to_config)."""

CASES = [(stage, offload, dtype) for dtype in ("fp32", "bf16") for stage in (0, 1, 2, 3)
         for offload in ("none", "cpu", "nvme")]


def ledger_config(stage: int, offload: str, dtype: str, nvme_dir: str, unit_numel: int,
            host_budget_bytes: int | None = None, world_size: int = 1) -> dict:
    config = {"zero": {"stage": stage, "unit_class_names": ["Block"],
                       "persistence_threshold_numel": 0, "sub_group_numel": SUB_GROUP_NUMEL},
              "precision": {"dtype": dtype}, "optimizer": {"lr": 1e-3}}
    if offload != "none":
        config["offload_optimizer"] = {"device": offload, "nvme_path": nvme_dir}
        if stage == 3:
            config["offload_param"] = {"device": offload, "nvme_path": nvme_dir}
            # The least device budget the engine accepts (the largest unit and two shards in
            # flight): with 'auto' on a machine without a GPU the store keeps evictable device
            # copies up to needed + 64 MiB, a cache no ledger can predict.
            shard = -(-unit_numel // world_size)
            config["memory"] = {"device_budget_bytes": (unit_numel + 2 * shard) * DTYPE_BYTES[dtype]}
    if host_budget_bytes is not None:
        config.setdefault("memory", {})["host_budget_bytes"] = host_budget_bytes
    return config


def _planned_host_budget(ledger) -> int | None:
    need = ledger.tier_bytes(Tier.HOST)
    return math.ceil(need * PLAN_HOST_MARGIN / MiB) * MiB if need else None


def largest_unit_numel(model: GPT) -> int:
    """The largest unit: a Block, or what is left over (embeddings, final norm) as one unit."""
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    rest = sum(p.numel() for p in model.parameters()) - sum(blocks)
    return max(blocks + [rest])


def _transient_bytes(tier: Tier, ledger, *, unit_numel: int, dtype: str) -> int:
    if tier is Tier.DEVICE:
        # Autograd's param.grad of one unit in the compute dtype, before the gradient hook folds it
        # into the unit's fp32 staging buffer (the ledger's ``unit_gradient``).
        return unit_numel * DTYPE_BYTES[dtype]
    if tier is Tier.HOST:
        return MiB  # the planned budget's rounding up to whole MiB
    return 0


def train_and_measure(stage: int, offload: str, dtype: str, nvme_dir: str, *,
                      world_size: int = 1, rank: int = 0) -> tuple[dict, Any, int]:
    """Two steps of MODEL under the config; (engine.stats(), the config's ledger, largest unit).
    The ledger comes from the config alone, before any engine state exists."""
    torch.manual_seed(0)
    model = GPT(MODEL)
    numel = sum(p.numel() for p in model.parameters())
    unit_numel = largest_unit_numel(model)
    raw = ledger_config(stage, offload, dtype, nvme_dir, unit_numel, world_size=world_size)
    ledger = estimate_from_config(load_config(raw), numel, world_size, unit_numel=unit_numel)
    config = ledger_config(stage, offload, dtype, nvme_dir, unit_numel, _planned_host_budget(ledger),
                     world_size=world_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = infinity.initialize(model, config)
    try:
        for step in range(2):
            x, y = synthetic_batch(MODEL, BATCH, SEQ, seed=step * world_size + rank)
            engine.backward(engine(x, y))
            engine.step()
        stats = engine.stats()
    finally:
        engine.close()
    return stats, ledger, unit_numel


def check_against_ledger(stats: dict, ledger, *, unit_numel: int, dtype: str,
                         nvme_padding_bytes: int = 0) -> None:
    """The per-tier assertions of the module docstring (``nvme_padding_bytes``: flat buffers
    are padded per group to the world size, the ledger rounds the whole model once)."""
    measured = stats["bytes"]
    for tier in Tier:
        peak = measured[tier.name]["peak"]
        states, total = ledger.state_bytes(tier), ledger.tier_bytes(tier)
        transient = _transient_bytes(tier, ledger, unit_numel=unit_numel, dtype=dtype)
        where = (f"{tier.name}: measured peak {peak} B, ledger states {states} B, states + "
                 f"buffers {total} B, transient {transient} B "
                 f"({ledger.to_dict()['tiers'][tier.value]})")
        assert peak >= states * (1 - SLACK_FRACTION), where
        assert peak <= total * (1 + SLACK_FRACTION) + transient, where
    # NVMe holds only model states (no staging): the swap files' bytes are the ledger's.
    assert abs(measured["NVME"]["peak"] - ledger.tier_bytes(Tier.NVME)) <= nvme_padding_bytes
    if ledger.offload_optimizer != "none":
        assert measured["HOST"]["budget"] == _planned_host_budget(ledger)
        assert measured["HOST"]["peak"] <= measured["HOST"]["budget"]
