"""ZeRO++ quantized collectives on 4 ranks (gloo): qwZ (int8 parameter all-gather) and qgZ (int8 /
int4 gradient reduce-scatter as one all-to-all).

- The bytes each rank sends per step are exactly what the wire format predicts
  (``infinity.ledger.quantized_bytes`` per shard, [Note: quantized wire format]), against the
  exact run's bf16 all-gather and fp32 reduce-scatter bytes counted the same way.
- A small GPT trained on the shipped text ends within 2% of the unquantized run's loss.
"""

from __future__ import annotations

import os

import pytest

from tests._support.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread")]

SLOW = os.environ.get("INFINITY_SLOW") == "1"
WORLD = 4
BLOCK = 64
"""Small blocks: TINY's shards hold several, the last one partial, so the scale bytes and the
partial block both show in the byte count."""
BYTES_STEPS = 2
BYTES_CONFIGS = [  # (name, stage, quantized weights, quantized gradients, gradient bits)
    ("s3-exact", 3, False, False, 8),
    ("s3-qwz-qgz8", 3, True, True, 8),
    ("s2-qgz4", 2, False, True, 4),
    ("s3-lora-qwz-frozen", 3, False, False, 8),  # DeepSpeed's zero_quantized_nontrainable_weights
    ("s3-qwz-qgz8-param-cpu", 3, True, True, 8),  # shards gathered from the store's host copies
]


def _zero(stage: int, weights: bool, grads: bool, bits: int, block: int) -> dict:
    return {"stage": stage, "quantized_weights": weights, "quantized_gradients": grads,
            "quantized_gradient_bits": bits, "quantization_block_numel": block}


def worker_bytes(rank: int, world_size: int, out_dir: str) -> dict:
    import infinity
    from tests._support.engine import (batches, engine_config, engine_train, lora_like,
                                       offload_config, tiny_gpt)

    out = {}
    for name, stage, weights, grads, bits in BYTES_CONFIGS:
        zero = _zero(stage, weights, grads, bits, BLOCK)
        if "frozen" in name:
            zero["quantized_frozen_weights"] = True
        model = lora_like() if "lora" in name else tiny_gpt()
        if "param-cpu" in name:
            config = offload_config(os.path.join(out_dir, f"swap-{rank}"), stage=stage,
                                    dtype="bf16", param="cpu", zero=zero)
        else:
            config = engine_config(stage=stage, dtype="bf16", zero=zero)
        engine = infinity.initialize(model, config)
        losses = engine_train(engine, batches(BYTES_STEPS, 1), rank=rank, world_size=world_size)
        units = [{"always_gathered": u.always_gathered, "name": u.name,
                  "groups": [(g.shard_numel, g.padded_numel, g.requires_grad) for g in u.groups]}
                 for u in engine.manager.units]
        out[name] = {"losses": losses, "bytes": engine.stats()["collective_bytes_sent"],
                     "units": units}
    return out


def test_collective_bytes_per_step_are_what_the_formats_predict():
    from infinity.ledger import quantized_bytes

    results = launch(__file__, "worker_bytes", world_size=WORLD, timeout_s=180)
    for res in results:
        exact, quant, qgz4, frozen, offloaded = (res[name] for name, *_ in BYTES_CONFIGS)
        gathered = [s for u in exact["units"] if not u["always_gathered"] for s, _, _ in u["groups"]]
        trainable = [s for u in exact["units"] for s, _, rg in u["groups"] if rg]
        assert gathered and trainable
        # Exact run: each unit gathered on demand once in the forward and once in the backward
        # of every step, bf16 shards (the root and the last block in the first backward only:
        # from the second step on they stay gathered from their forward into their backward,
        # [Note: gathers issued ahead] in infinity/zero/_gather_ahead.py); every trainable group
        # reduce-scattered once, fp32.
        root = [s for u in exact["units"] if u["name"] in ("<root>", "blocks.1")
                and not u["always_gathered"] for s, _, _ in u["groups"]]
        bf16_gather = BYTES_STEPS * sum(2 * s for s in gathered)
        bf16_backward = bf16_gather - (BYTES_STEPS - 1) * sum(2 * s for s in root)
        fp32_reduce = BYTES_STEPS * sum(WORLD * s * 4 for s in trainable)
        assert root and exact["bytes"]["forward-gather"] == bf16_gather
        assert exact["bytes"]["backward-gather"] == bf16_backward
        assert exact["bytes"]["reduce-grad"] == fp32_reduce
        # qwZ + qgZ int8: the same collectives, each shard as int8 + one fp32 scale per block.
        q_gather = BYTES_STEPS * sum(quantized_bytes(s, BLOCK, 8, 4) for s in gathered)
        q_backward = q_gather - (BYTES_STEPS - 1) * sum(quantized_bytes(s, BLOCK, 8, 4)
                                                        for s in root)
        q_reduce = BYTES_STEPS * sum(WORLD * quantized_bytes(s, BLOCK, 8, 4) for s in trainable)
        assert quant["bytes"]["forward-gather"] == q_gather
        assert quant["bytes"]["backward-gather"] == q_backward
        assert quant["bytes"]["reduce-grad"] == q_reduce
        # The fractions the formats predict: 1/2 of bf16 and 1/4 of fp32, plus 4 B of scale per
        # 64-element block (1 + 4/64 of the payload) and the partial last blocks.
        assert 0.5 < q_gather / bf16_gather <= 0.5 * (1 + 4 / BLOCK) * 1.05
        assert 0.25 < q_reduce / fp32_reduce <= 0.25 * (1 + 4 / BLOCK) * 1.05
        # qgZ int4 at stage 2: two elements per byte; no parameter gathers at stage 2.
        q4_reduce = BYTES_STEPS * sum(WORLD * quantized_bytes(s, BLOCK, 4, 4) for s in trainable)
        assert qgz4["bytes"]["reduce-grad"] == q4_reduce
        assert 0.125 < q4_reduce / fp32_reduce <= 0.125 * (1 + 8 / BLOCK) * 1.05
        assert "forward-gather" not in qgz4["bytes"]
        # Frozen weights only: the frozen groups' gathers in int8, the trainable ones exact.
        lora = [(s, rg) for u in frozen["units"] if not u["always_gathered"]
                for s, _, rg in u["groups"]]
        assert any(rg for _, rg in lora) and not all(rg for _, rg in lora)
        mixed = BYTES_STEPS * sum(2 * s if rg else quantized_bytes(s, BLOCK, 8, 4) for s, rg in lora)
        assert frozen["bytes"]["forward-gather"] == mixed
        # Parameter offload: the shards come from the store, are quantized the same way, and
        # the same numbers train (the prefetcher may keep units between forward and backward,
        # so only the forward's gathers are compared).
        assert offloaded["bytes"]["forward-gather"] == q_gather
        assert offloaded["bytes"]["reduce-grad"] == q_reduce
        assert offloaded["losses"] == quant["losses"]
        # Rounding the collectives does not derail these first steps (the loss test below
        # measures the cost properly).
        for got in (quant["losses"], qgz4["losses"]):
            assert all(abs(a - b) < 0.05 * b for a, b in zip(got, exact["losses"])), (
                got, exact["losses"])


TEXT_WORLD = 2
"""2 ranks: the loss comparison needs no more, and 4 would double its time on a 2-core machine."""
TEXT_STEPS = 300 if SLOW else 40
TEXT_LR = 1e-2
TEXT_BATCH, TEXT_SEQ = 16, 32
TEXT_SEED_OFFSETS = (0,) if SLOW else (0, 1000, 2000)
"""Data samples the bounded version averages over. One 40-step sample's difference ranged -0.4%
to +2.05% across data (2026-12-04: then the corpus was the package's current source, which every
commit changed); the mean of three is steadier, and the corpus is now a fixed snapshot
(tests/_support/corpus.py), so an unrelated edit no longer moves the figure."""


def worker_text(rank: int, world_size: int, out_dir: str, steps: int, seed: int = 0) -> dict:
    import torch

    import infinity
    from infinity.models.data import text_batch
    from tests._support.corpus import fixed_text_corpus
    from infinity.models.gpt import GPT, GPTConfig
    from tests._support.engine import engine_config, engine_train

    corpus = fixed_text_corpus()
    data = [[text_batch(corpus, TEXT_BATCH, TEXT_SEQ, seed=seed + s)] for s in range(steps)]
    out = {}
    for name, quantized in (("exact", False), ("qwz-qgz8", True)):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=256, block_size=TEXT_SEQ, n_layer=2, n_head=2,
                              n_embd=32))
        zero = _zero(3, quantized, quantized, 8, 2048)
        engine = infinity.initialize(model, engine_config(
            stage=3, dtype="bf16", zero=zero, optimizer={"lr": TEXT_LR}))
        out[name] = engine_train(engine, data, rank=rank, world_size=world_size)
    return out


@pytest.mark.slow
def test_quantized_training_ends_within_two_percent_of_the_exact_loss():
    """300 steps with INFINITY_SLOW=1 (the issue's test); 40 in CI, over three data samples. The
    loss compared is the mean of the last 10 steps of each run (same data, same seeds: what
    differs is the rounding of the collectives; one step's loss is too noisy a figure), averaged
    over the samples (TEXT_SEED_OFFSETS). At 40 steps the loss is still falling
    fast (5.5 -> ~3.4), where a lag of the quantized run would show most, and the two runs'
    difference measured here was within 0.4% (-0.37%, +0.38% on two runs; +0.40% at 300 steps,
    loss ~2.78), so the bounded version keeps the issue's 2% bound: a margin of 5x over the
    measured effect, still tight enough to catch a broken dequantization (which leaves the loss
    near its start) or a missing scale (which diverges)."""
    tails = {"exact": [], "qwz-qgz8": []}
    for seed in TEXT_SEED_OFFSETS:
        results = launch(__file__, "worker_text", world_size=TEXT_WORLD,
                         timeout_s=120 if not SLOW else 900,
                         args={"steps": TEXT_STEPS, "seed": seed})
        exact = results[0]["exact"]
        assert exact[-1] < 0.75 * exact[0], exact  # it learned: the comparison means something
        for name in tails:
            tails[name].append(sum(results[0][name][-10:]) / 10)
    tail_exact = sum(tails["exact"]) / len(TEXT_SEED_OFFSETS)
    tail_quant = sum(tails["qwz-qgz8"]) / len(TEXT_SEED_OFFSETS)
    print(f"last-10 mean loss: exact {tail_exact:.4f}, quantized {tail_quant:.4f} "
          f"({tail_quant / tail_exact - 1:+.2%})")
    assert abs(tail_quant - tail_exact) <= 0.02 * tail_exact, (tail_exact, tail_quant)
