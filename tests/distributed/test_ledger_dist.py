"""The memory ledger against the engine's accounting on 2 ranks (gloo): what each rank holds per
tier matches the ledger at N = 2, and at stage 3 the resident model states are half of N = 1.

The per-tier assertions are those of tests/engine/test_ledger_vs_engine.py (named slack, the
planned host budget); the 2 ranks are spawned once and loop over the configurations.
"""

from __future__ import annotations

import pytest

from tests._support.launch import launch

pytestmark = pytest.mark.distributed

CONFIGS = [(stage, offload) for stage in (0, 1, 2, 3) for offload in ("none", "cpu", "nvme")]
DTYPE = "bf16"
NUM_GROUPS_BOUND = 16
"""More than the trainable flat groups of the test model (embeddings, four blocks, final norm)."""


def worker_ledger(rank: int, world_size: int, out_dir: str) -> dict:
    from tests._support.ledger_check import train_and_measure

    out = {}
    for stage, offload in CONFIGS:
        stats, _ledger, unit_numel = train_and_measure(
            stage, offload, DTYPE, f"{out_dir}/swap", world_size=world_size, rank=rank)
        out[(stage, offload)] = {"stats": stats, "unit_numel": unit_numel}
    return out


def _resident_states(stats: dict) -> int:
    """Bytes held after a step on every tier (device gradients are dropped by then, and stage 3
    has released every unit): parameters, masters, optimizer state, host gradient accumulators,
    cached staging copies."""
    b = stats["bytes"]
    return b["DEVICE"]["current"] + b["HOST"]["current"] + b["NVME"]["current"]


def test_per_rank_bytes_match_the_ledger_at_two_ranks(tmp_path):
    from infinity.ledger import Tier
    from tests._support.ledger_check import (SLACK_FRACTION, check_against_ledger,
                                             train_and_measure)

    results = launch(__file__, "worker_ledger", timeout_s=240)
    for stage, offload in CONFIGS:
        for rank, res in enumerate(results):
            got = res[(stage, offload)]
            stats = got["stats"]
            assert stats["world_size"] == 2
            # The ledger at N = 2 from the same config (rebuilt here: a config is pure data).
            ledger = _ledger_at(stage, offload, tmp_path, world_size=2)
            per_elem = ledger.terms.optimizer_bytes + ledger.terms.param_bytes
            check_against_ledger(stats, ledger, unit_numel=got["unit_numel"], dtype=DTYPE,
                                 nvme_padding_bytes=int(NUM_GROUPS_BOUND * per_elem))
            # Resident after the step: params + optimizer state of this rank (no gradients on
            # the device; the host arena keeps its gradient accumulators), plus at most the
            # staging buffers, whose copies the store may keep cached.
            states = sum(ledger.term_bytes(t) for t in ("params", "optimizer"))
            states += ledger.states["grads"].get(Tier.HOST, 0)
            staging = ledger.buffer_bytes(Tier.HOST) + ledger.buffer_bytes(Tier.DEVICE)
            resident = _resident_states(stats)
            where = (stage, offload, rank, resident, states, staging)
            assert resident >= states * (1 - SLACK_FRACTION), where
            assert resident <= (states + staging) * (1 + SLACK_FRACTION), where

    # Stage 3 shards everything: each of 2 ranks holds half of what one process holds alone
    # (pure model state: the device after a step without offload, the swap files with NVMe).
    for offload, tier in (("none", "DEVICE"), ("nvme", "NVME")):
        single, _, _ = train_and_measure(3, offload, DTYPE, str(tmp_path / f"n1-{offload}"))
        for res in results:
            two = res[(3, offload)]["stats"]
            ratio = two["bytes"][tier]["current"] / single["bytes"][tier]["current"]
            assert abs(ratio - 0.5) <= SLACK_FRACTION / 2, (offload, tier, ratio)


def _ledger_at(stage: int, offload: str, tmp_path, *, world_size: int):
    import torch

    from infinity.config import load_config
    from infinity.ledger import estimate_from_config
    from infinity.models.gpt import GPT
    from tests._support.ledger_check import MODEL, ledger_config, largest_unit_numel

    with torch.device("meta"):
        model = GPT(MODEL)
    numel = sum(p.numel() for p in model.parameters())
    unit_numel = largest_unit_numel(model)
    raw = ledger_config(stage, offload, DTYPE, str(tmp_path / "swap"), unit_numel,
                        world_size=world_size)
    return estimate_from_config(load_config(raw), numel, world_size, unit_numel=unit_numel)
