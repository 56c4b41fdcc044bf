"""The memory ledger (:mod:`infinity.ledger`) against the engine's own accounting (``engine.stats()``).

For every ZeRO stage x offload tier x compute dtype at world size 1, a small GPT trains two steps
and the measured per-tier peaks are held against the ledger of the same config:

* model states must all be there: ``peak >= state_bytes(tier) * (1 - SLACK_FRACTION)``;
* nothing beyond the ledger's states and working buffers, up to a named transient:
  ``peak <= tier_bytes(tier) * (1 + SLACK_FRACTION) + transient_bytes(tier)``;
* NVMe holds pure state (no staging): ``measured == ledger`` exactly;
* HOST: the host budget is the one ``infinity plan`` writes from the ledger (its HOST bytes plus 5 %,
  rounded up to MiB); the engine must accept it (its own least need fits in the ledger's figure)
  and stay within it. Without an explicit budget the store fills its 'auto' headroom with
  evictable cached copies, which are a policy, not a ledger term.

Where gradients live is [Note: gradient placement] in infinity/ledger/_estimate.py; the engine's side is
``GradientReducer._accumulate`` in infinity/zero/_grad_reducer.py. The ledger is derived from the
config alone (plus the largest unit's size), never from the engine's bookkeeping.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

import infinity
from infinity._common import MiB
from infinity.config import DTYPE_BYTES, load_config
from infinity.ledger import Tier, estimate_from_config
from infinity.models.gpt import GPT, GPTConfig, synthetic_batch

# 4.27 M parameters: embeddings (1.11 M, the largest unit) and four blocks of 0.79 M.
MODEL = GPTConfig(vocab_size=4096, block_size=256, n_layer=4, n_head=4, n_embd=256)
SUB_GROUP_NUMEL = 2 ** 18
"""Several optimizer sub-groups per unit, so the NVMe pipeline really stages."""

SLACK_FRACTION = 0.05
"""Padding of flat buffers to the world size, 4 KiB extent alignment, rounding: well under 5 %."""

PLAN_HOST_MARGIN = 1.05
"""``infinity plan`` sets memory.host_budget_bytes to the ledger's HOST bytes x 1.05, rounded up to
whole MiB (infinity/cli/_plan.py, to_config)."""

CASES = [(stage, offload, dtype) for dtype in ("fp32", "bf16") for stage in (0, 1, 2, 3)
         for offload in ("none", "cpu", "nvme")]


def _config(stage: int, offload: str, dtype: str, nvme_dir: str, unit_numel: int,
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


def _largest_unit_numel(model: GPT) -> int:
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
    unit_numel = _largest_unit_numel(model)
    raw = _config(stage, offload, dtype, nvme_dir, unit_numel, world_size=world_size)
    ledger = estimate_from_config(load_config(raw), numel, world_size, unit_numel=unit_numel)
    config = _config(stage, offload, dtype, nvme_dir, unit_numel, _planned_host_budget(ledger),
                     world_size=world_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = infinity.initialize(model, config)
    try:
        for step in range(2):
            x, y = synthetic_batch(MODEL, 2, 32, seed=step * world_size + rank)
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


@pytest.mark.parametrize("stage,offload,dtype", CASES,
                         ids=[f"s{s}-{o}-{d}" for s, o, d in CASES])
def test_peak_bytes_per_tier_match_the_ledger(stage, offload, dtype, tmp_path):
    stats, ledger, unit_numel = train_and_measure(stage, offload, dtype, str(tmp_path))
    check_against_ledger(stats, ledger, unit_numel=unit_numel, dtype=dtype)


def test_offloaded_optimizer_takes_gradients_off_the_device(tmp_path):
    """[Note: gradient placement]: with the optimizer on the host the device keeps the parameters
    and one unit's transient gradient, not a gradient accumulator (4 B/param, 17 MB here)."""
    on_device, _, unit_numel = train_and_measure(2, "none", "bf16", str(tmp_path))
    offloaded, ledger, _ = train_and_measure(2, "cpu", "bf16", str(tmp_path))
    numel = ledger.numel
    params = numel * 2
    assert offloaded["bytes"]["DEVICE"]["peak"] <= params + unit_numel * (4 + 2)
    assert on_device["bytes"]["DEVICE"]["peak"] >= params + numel * 4  # the fp32 accumulator
    # ... and the host holds it: 12 B of optimizer state per parameter and the gradient, in bf16
    # here (one rank, one micro-batch: ledger.host_grad_dtype_of), not fp32.
    assert numel * (2 + 12) <= offloaded["bytes"]["HOST"]["peak"] < numel * (4 + 12)
