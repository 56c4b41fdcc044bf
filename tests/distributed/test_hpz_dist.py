"""ZeRO++ hpZ on 4 ranks (gloo) with secondary groups of 2 ([Note: hpZ secondary shards] in
infinity/zero/_hpz.py): the same training as without hpZ (bit for bit) and as single-process
plain PyTorch on the global batch, the collective bytes of each phase by formula, and the
secondary shards' device bytes against the ledger's hpZ term.

Each test spawns the 4 ranks once and loops over its configurations inside the workers.
"""

from __future__ import annotations

import warnings

import pytest

from tests._support.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread")]

WORLD = 4
H = 2
STEPS = 4
CONFIGS = [  # (name, dtype, gradient accumulation steps, clip, extra engine_config settings)
    ("fp32", "fp32", 1, 0.0, {}),
    ("fp32-gas3-clip", "fp32", 3, 0.05, {}),
    # Units by size inside Blocks checkpointed whole: backward gathers some units twice.
    ("fp32-gas2-ckpt-nested", "fp32", 2, 0.0,
     dict(unit_class_names=(), unit_min_numel=1000,
          activation_checkpointing={"units": ["Block"]})),
    ("bf16-gas2-clip-ckpt-all", "bf16", 2, 0.05, dict(activation_checkpointing={"units": "all"})),
]


def _gathers_per_micro_step(config: str, unit: str) -> tuple[int, int]:
    """(forward, backward) gathers of ``unit`` per micro-step, from the model's structure.

    Units by Block: each unit (the root, the blocks) is gathered once in forward and once in
    backward. In the nested case (units by size: 'wte', each block's 'attn', 'mlp.fc' and
    'mlp.proj', and the root): the tied LM head borrows wte's unit, so wte is gathered again at
    the end of the forward; and each Block is one checkpointed region, whose backward first
    reaches the output of its last unit (mlp.proj, gathered by its pre-backward hook), whose saved
    tensors trigger the recompute of the whole Block: attn and mlp.fc are gathered for the
    recompute, released after it, and gathered again when backward reaches their outputs."""
    if config != "fp32-gas2-ckpt-nested":
        return 1, 1
    return (2 if unit == "wte" else 1), (2 if unit.endswith((".attn", ".mlp.fc")) else 1)


def _backward_gathers(config: str, unit: str, micro_steps: int) -> int:
    """Backward gathers of ``unit`` over the run. The root's forward ends the forward and its
    pre-backward starts the backward, so from the second micro-step on (the first records the
    order) it stays gathered in between ([Note: gathers issued ahead] in
    infinity/zero/_gather_ahead.py): gathered in backward in the first micro-step only; so is
    the forward's last unit (the last block; with units by size, wte, which the tied head uses
    last), whose backward comes next after the root's. In the nested case a Block's mlp.fc,
    recomputed while its mlp.proj is held, is used next by its own backward: kept from its
    recomputation on, it is gathered once a micro-step after the first."""
    per_micro_step = _gathers_per_micro_step(config, unit)[1]
    nested = config == "fp32-gas2-ckpt-nested"
    if unit in ("<root>", "wte" if nested else "blocks.1"):
        return per_micro_step
    if nested and unit.endswith(".mlp.fc"):
        return per_micro_step + (micro_steps - 1) * (per_micro_step - 1)
    return micro_steps * per_micro_step


def _unit_layout(engine) -> list[dict]:
    """Per unit gathered on demand: its name, padded bytes and numel."""
    return [{"name": u.name,
             "padded_bytes": sum(g.padded_numel * g.full.element_size() for g in u.groups),
             "padded_numel": sum(g.padded_numel for g in u.groups),
             "numel": sum(g.numel for g in u.groups)}
            for u in engine.manager.units if not u.always_gathered]


def worker_parity(rank: int, world_size: int, out_dir: str) -> dict:
    import infinity
    from tests._support.engine import batches, engine_config, engine_train, tiny_gpt

    out = {}
    for name, dtype, gas, clip, extra in CONFIGS:
        for hpz in (1, H):
            cfg = engine_config(stage=3, dtype=dtype, gas=gas, clip=clip,
                                zero={"hpz_partition_size": hpz}, **extra)
            engine = infinity.initialize(tiny_gpt(), cfg)
            losses = engine_train(engine, batches(STEPS, gas), rank=rank, world_size=world_size)
            out[(name, hpz)] = {"losses": losses, "state": engine.full_state_dict(),
                                "stats": engine.stats(), "units": _unit_layout(engine)}
            engine.close()
    # A partition as large as the world: allowed, with one warning that it gains nothing.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = infinity.initialize(tiny_gpt(), engine_config(
            stage=3, zero={"hpz_partition_size": world_size}))
    losses = engine_train(engine, batches(1, 1), rank=rank, world_size=world_size)
    out["whole-world"] = {"warnings": [str(w.message) for w in caught], "losses": losses,
                          "hpz": engine.stats()["hpz"]}
    engine.close()
    return out


def test_hpz_trains_as_without_it_and_as_plain_pytorch():
    import torch

    from tests._support.engine import assert_close_run, batches, reference_train, tiny_gpt

    results = launch(__file__, "worker_parity", world_size=WORLD, timeout_s=300)
    for name, dtype, gas, clip, _extra in CONFIGS:
        # fp32: the whole global batch at once. bf16: each rank's quarter as its own backward.
        ref_losses, ref_state = reference_train(tiny_gpt(), batches(STEPS, gas), dtype=dtype,
                                                clip=clip, splits=1 if dtype == "fp32" else WORLD)
        micro_steps = STEPS * gas
        for rank, res in enumerate(results):
            on, off = res[(name, H)], res[(name, 1)]
            assert_close_run(on["losses"], on["state"], ref_losses, ref_state, dtype)
            assert_close_run(off["losses"], off["state"], ref_losses, ref_state, dtype)
            # The backward gathers the same values from the secondary shards: bit for bit.
            assert on["losses"] == off["losses"], name
            for key, value in off["state"].items():
                assert torch.equal(on["state"][key], value), (name, key)

            units = on["units"]
            assert units and units == off["units"]
            # Bytes each rank contributes per phase: a unit's padded bytes over W for a W-way
            # gather, over H for a gather inside the secondary group (on the wire: (H-1)/H of
            # them, never leaving the pair), times the gathers of _gathers_per_micro_step.
            counts = [_gathers_per_micro_step(name, u["name"]) for u in units]
            forward = micro_steps * sum(f * u["padded_bytes"] for u, (f, _) in zip(units, counts))
            forward //= WORLD
            backward_bytes = sum(_backward_gathers(name, u["name"], micro_steps) * u["padded_bytes"]
                                 for u in units)
            sent_on = on["stats"]["collective_bytes_sent"]
            sent_off = off["stats"]["collective_bytes_sent"]
            assert sent_on["forward-gather"] == sent_off["forward-gather"] == forward, name
            assert sent_on["secondary-gather"] == backward_bytes // H, name
            assert sent_on.get("backward-gather", 0) == 0, (name, sent_on)  # nothing across W
            assert sent_off["backward-gather"] == backward_bytes // WORLD, name
            assert "secondary-gather" not in sent_off
            for phase in ("reduce-grad", "norm"):
                assert sent_on[phase] == sent_off[phase], (name, phase)
            if name == "fp32-gas2-ckpt-nested":  # the case does gather units twice in backward
                assert sum(b == 2 for _, b in counts) == 2 * 2, [u["name"] for u in units]
            # The secondary group is this rank's pair of consecutive ranks; its shards (1/H of
            # every unit) were all held at once between forward and backward, and are gone.
            hpz = on["stats"]["hpz"]
            assert hpz["group_ranks"] == [rank // H * H + i for i in range(H)]
            assert hpz["secondary_peak_bytes"] == sum(u["padded_bytes"] for u in units) // H
            assert hpz["secondary_bytes"] == 0
            assert on["stats"]["model_state_bytes"]["hpz_secondary"] == 0
            assert off["stats"]["hpz"] is None

    ref_losses, _ = reference_train(tiny_gpt(), batches(1, 1))
    for res in results:
        whole = res["whole-world"]
        assert [m for m in whole["warnings"] if "hpz_partition_size" in m and
                "whole data-parallel group" in m] != [], whole["warnings"]
        assert whole["hpz"]["group_ranks"] == list(range(WORLD))
        assert whole["losses"] == pytest.approx(ref_losses, abs=1e-5)


LEDGER_DTYPE = "bf16"


def _ledger_model():
    from infinity.models.gpt import GPTConfig

    return GPTConfig(vocab_size=512, block_size=32, n_layer=2, n_head=2, n_embd=64)


def _ledger_config(hpz: int, unit_numel: int) -> dict:
    from tests._support.ledger_check import ledger_config

    raw = ledger_config(3, "none", LEDGER_DTYPE, "", unit_numel, world_size=WORLD)
    raw["zero"]["hpz_partition_size"] = hpz
    return raw


def worker_ledger(rank: int, world_size: int, out_dir: str) -> dict:
    import torch

    import infinity
    from infinity.models.gpt import GPT, synthetic_batch
    from tests._support.ledger_check import largest_unit_numel

    config = _ledger_model()
    out = {}
    for hpz in (1, H):
        torch.manual_seed(0)
        model = GPT(config)
        unit_numel = largest_unit_numel(model)
        engine = infinity.initialize(model, _ledger_config(hpz, unit_numel))
        mid_step = None
        for step in range(2):
            x, y = synthetic_batch(config, 2, 32, seed=step * world_size + rank)
            loss = engine(x, y)
            mid_step = engine.stats()  # between forward and backward: every secondary shard held
            engine.backward(loss)
            engine.step()
        out[hpz] = {"stats": engine.stats(), "mid_step": mid_step, "unit_numel": unit_numel,
                    "units": _unit_layout(engine)}
        engine.close()
    return out


def test_secondary_shard_bytes_match_the_ledger():
    import torch

    from infinity.config import load_config
    from infinity.ledger import Tier, estimate_from_config
    from infinity.models.gpt import GPT
    from tests._support.ledger_check import check_against_ledger

    results = launch(__file__, "worker_ledger", world_size=WORLD, timeout_s=300)
    with torch.device("meta"):
        numel = sum(p.numel() for p in GPT(_ledger_model()).parameters())
    item = 2  # bf16
    for res in results:
        on, off = res[H], res[1]
        ledger = estimate_from_config(load_config(_ledger_config(H, on["unit_numel"])), numel,
                                      WORLD, unit_numel=on["unit_numel"])
        ledger_off = estimate_from_config(load_config(_ledger_config(1, off["unit_numel"])),
                                          numel, WORLD, unit_numel=off["unit_numel"])
        term = ledger.buffers[Tier.DEVICE]["hpz_secondary"]
        assert "hpz_secondary" not in ledger_off.buffers.get(Tier.DEVICE, {})
        assert ledger.tier_bytes(Tier.DEVICE) - ledger_off.tier_bytes(Tier.DEVICE) == term
        assert term == -(-numel * item // H)  # 2/H bytes per parameter for bf16 weights
        # Every parameter is in a unit gathered on demand (persistence threshold 0), so the
        # engine holds exactly the ledger's term plus the flat buffers' padding over H.
        units = on["units"]
        assert sum(u["numel"] for u in units) == numel
        padding = sum(u["padded_numel"] - u["numel"] for u in units) * item // H
        held = on["mid_step"]["model_state_bytes"]["hpz_secondary"]
        assert held == on["stats"]["hpz"]["secondary_peak_bytes"]
        assert term <= held <= term + padding, (term, held, padding)
        # The device peak, secondary shards included, stays within the ledger's device figure.
        check_against_ledger(on["stats"], ledger, unit_numel=on["unit_numel"], dtype=LEDGER_DTYPE)
        check_against_ledger(off["stats"], ledger_off, unit_numel=off["unit_numel"],
                             dtype=LEDGER_DTYPE)
        assert on["stats"]["bytes"]["DEVICE"]["peak"] >= off["stats"]["bytes"]["DEVICE"]["peak"]
