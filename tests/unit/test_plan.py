"""``infinity plan``: the chosen configuration fits (checked against the paper's formulas), loads as
a config in both forms, and the rules of thumb come out of the numbers."""

from __future__ import annotations

import json
import math

import pytest

from infinity import cli
from infinity._common import GiB, MiB
from infinity.cli._hardware import probe_disk_bandwidth
from infinity.cli._plan import to_config
from infinity.config import load_config
from infinity.ledger import (BUCKET_BYTES, COLLECTIVE_LATENCY_S, DEVICE_RESERVE_BYTES,
                             HOST_RESERVE_BYTES, Hardware, ModelShape, PlanRequest,
                             activation_bytes, make_plan)

LLAMA2_7B = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
             "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32,
             "vocab_size": 32000, "max_position_embeddings": 4096, "tie_word_embeddings": False}


def hardware(gpus=4, device_gib=24, host_gib=128, nvme_gib=2000, **kw) -> Hardware:
    base = dict(gpus=gpus, gpus_per_node=min(gpus, 8), device_memory_bytes=device_gib * GiB,
                host_memory_bytes=host_gib * GiB, nvme_capacity_bytes=nvme_gib * GiB,
                nvme_read_bytes_per_s=3e9, nvme_write_bytes_per_s=2e9, device_flops=100e12,
                device_memory_bytes_per_s=1e12, link_bytes_per_s=20e9, pcie_bytes_per_s=20e9,
                host_memory_bytes_per_s=50e9)
    base.update(kw)
    return Hardware(**base)


def request(numel, **kw) -> PlanRequest:
    return PlanRequest(numel=int(numel), shape=ModelShape.assumed(int(numel)), shape_assumed=True, **kw)


def _paper_device_bytes(psi, n, stage, offload_param, offload_optimizer, k=12):
    """Model states left on one device, from the ZeRO paper's terms (2 + 2 + K) placed by hand."""
    params = 2 * psi / n if stage == 3 else 2 * psi
    if stage == 3 and offload_param != "none":
        params = 0
    if stage < 2:
        grads = 2 * psi
    else:
        grads = 2 * psi / n if offload_optimizer == "none" else 0
    opt = (k * psi / (n if stage else 1)) if offload_optimizer == "none" else 0
    return params + grads + opt


def _check_fits_4x24(best, psi, shape):
    n = 4
    acts = activation_bytes(shape, micro_batch=best.micro_batch, checkpointing=best.checkpointing)
    states = _paper_device_bytes(psi, n, best.stage, best.offload_param, best.offload_optimizer)
    # Working buffers (gathered units, a unit's gradient) come on top: at most a few units.
    unit_bytes = 2 * shape.largest_unit_numel()
    assert states + acts.total_bytes + 4 * unit_bytes + DEVICE_RESERVE_BYTES <= 24 * GiB
    host = 0 if best.offload_optimizer != "cpu" else n * (12 + 2) * psi / n
    if best.offload_param == "cpu":
        host += 2 * psi
    assert host + HOST_RESERVE_BYTES <= 128 * GiB


def test_acceptance_7b_full_finetune_on_4x24gb(tmp_path, capsys):
    native, ds = tmp_path / "infinity.json", tmp_path / "ds_config.json"
    rc = cli.main(["plan", "--params", "7e9", "--gpus", "4", "--gpu-memory-gb", "24",
                   "--host-memory-gb", "128", "--nvme-path", str(tmp_path), "--nvme-gb", "2000",
                   "--no-probe", "--out-native", str(native), "--out-deepspeed", str(ds), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"]
    best = out["best"]
    for tier, need in best["need_bytes"].items():
        assert need <= best["usable_bytes"][tier], tier
    shape = ModelShape(**out["model"]["shape"])

    class Best:  # the fields _check_fits_4x24 reads
        stage, offload_param, offload_optimizer = best["stage"], best["offload_param"], best["offload_optimizer"]
        micro_batch, checkpointing = best["micro_batch"], best["checkpointing"]

    _check_fits_4x24(Best, 7e9, shape)
    # A 7B model cannot keep its Adam state on 4 x 24 GB: something must be sharded and offloaded.
    assert best["stage"] >= 2 and best["offload_optimizer"] != "none"
    for path in (native, ds):
        config = load_config(str(path))
        assert config.zero.stage == best["stage"]
        assert config.offload_optimizer.device == best["offload_optimizer"]
        assert config.offload_param.device == best["offload_param"]
        assert config.train_micro_batch_size_per_gpu == best["micro_batch"]
        assert config.gradient_accumulation_steps == best["gradient_accumulation_steps"]
        assert config.precision.dtype == "bf16"
    budgets = load_config(str(native)).memory
    assert best["ledger"]["tiers"]["device"]["total_bytes"] <= budgets.device_budget_bytes <= 24 * GiB
    if best["offload_optimizer"] == "cpu":
        assert 4 * budgets.host_budget_bytes <= 128 * GiB
    assert json.loads(ds.read_text())["zero_optimization"]["stage"] == best["stage"]


def test_acceptance_with_a_llama_7b_hf_config(tmp_path, capsys):
    model = tmp_path / "config.json"
    model.write_text(json.dumps(LLAMA2_7B))
    rc = cli.main(["plan", "--model", str(model), "--seq-len", "2048", "--gpus", "4",
                   "--gpu-memory-gb", "24", "--host-memory-gb", "128", "--nvme-path", str(tmp_path),
                   "--nvme-gb", "2000", "--no-probe", "--out-native", str(tmp_path / "n.json")])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "6,738,415,616 params" in text and "chosen:" in text and "bounds the step" in text
    assert load_config(str(tmp_path / "n.json")).zero.stage >= 2


@pytest.mark.parametrize("numel", [125e6, 350e6, 1e9])
@pytest.mark.parametrize("hw", [hardware(), hardware(gpus=8, device_gib=80, host_gib=512)],
                         ids=["4x24GB", "8x80GB"])
def test_small_models_do_not_use_stage_3(numel, hw):
    """The ZeRO paper's trade (stage 3 moves 1.5x data parallelism's bytes) holds when gradients
    cross ranks in the parameters' dtype; see the fp32 case below."""
    plan = make_plan(request(numel, reduce_dtype="compute"), hw)
    assert plan.fits
    assert any(c.fits for c in plan.candidates if c.stage == 3)  # it would fit ...
    assert plan.best.stage < 3                                    # ... but it is slower
    assert plan.best.offload_optimizer == "none" and plan.best.offload_param == "none"


def test_sgd_without_momentum_never_picks_stage_1():
    """fp32 SGD has K = 0: stage 1 shards nothing, so it costs time and saves no memory. Adam's K
    makes stage 1 the choice for some of the same sizes, so the rule comes from the numbers."""
    hw = hardware(gpus=8, device_gib=80, host_gib=512)
    adam_stages, sgd_stages = set(), set()
    for numel in (1e9, 2e9, 4e9, 6e9):
        sgd = make_plan(request(numel, optimizer="sgd", dtype="fp32"), hw)
        adam = make_plan(request(numel, optimizer="adam", dtype="fp32"), hw)
        sgd_stages.add(sgd.best.stage)
        adam_stages.add(adam.best.stage)
        by_key = {(c.stage, c.micro_batch, c.checkpointing): c for c in sgd.candidates
                  if c.offload_optimizer == "none" and c.offload_param == "none"}
        for (stage, mb, ckpt), c in by_key.items():
            if stage == 1:
                assert c.need_bytes == by_key[(0, mb, ckpt)].need_bytes
    assert 1 not in sgd_stages
    assert 1 in adam_stages


def test_nothing_fits_is_reported(capsys):
    rc = cli.main(["plan", "--params", "1e12", "--gpus", "1", "--gpu-memory-gb", "24",
                   "--host-memory-gb", "64", "--nvme-gb", "100", "--no-probe"])
    assert rc == 1
    assert "NO CONFIGURATION FITS" in capsys.readouterr().out


def test_sgd_plan_is_not_written_as_a_config():
    plan = make_plan(request(1e9, optimizer="sgd"), hardware())
    with pytest.raises(ValueError, match="Adam/AdamW only"):
        to_config(plan)


def test_plan_on_this_machine_measures_what_it_can(capsys):
    rc = cli.main(["plan", "--params", "50e6", "--no-probe", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"]
    assert out["hardware"]["host_memory_bytes"] > 0 and out["hardware"]["nvme_capacity_bytes"] > 0
    assert any("measured" in n for n in out["notes"])


def test_disk_probes(tmp_path):
    read, write, how = probe_disk_bandwidth(str(tmp_path), 16 * MiB)
    assert read > 0 and write > 0 and how
    assert list(tmp_path.iterdir()) == []  # the probe cleans up after itself


def test_written_native_config_carries_the_chosen_checkpointing(tmp_path):
    """The plan's checkpointing choice reaches the engine through the native config."""
    import json

    from infinity.cli import main
    from infinity.config import load_config

    native = tmp_path / "infinity.json"
    rc = main(["plan", "--params", "7e9", "--gpus", "4", "--gpu-memory-gb", "24",
               "--host-memory-gb", "128", "--no-probe", "--nvme-path", str(tmp_path),
               "--checkpointing", "on", "--out-native", str(native)])
    assert rc == 0
    config = load_config(json.loads(native.read_text()))
    assert config.activation_checkpointing.units == "all"


def test_gradient_reduce_dtype_prices_the_bytes_the_engine_sends():
    """Stage 0 all-reduces every gradient once per step (2 (N-1)/N x the bytes of the gradients):
    fp32 reduction sends twice the bf16 bytes, and the planner's link time says so."""
    hw = hardware(gpus=8, device_gib=80, host_gib=512)
    times = {}
    for reduce_dtype in ("fp32", "compute"):
        plan = make_plan(request(350e6, reduce_dtype=reduce_dtype, micro_batches=(8,),
                                 checkpointing=(False,)), hw)
        stage0 = next(c for c in plan.candidates if c.stage == 0 and c.offload_optimizer == "none")
        times[reduce_dtype] = stage0.times_s["link"]
    psi, ring, link = 350e6, 7 / 8, hw.link_bytes_per_s
    buckets = math.ceil(psi * 4 / BUCKET_BYTES) - math.ceil(psi * 2 / BUCKET_BYTES)  # latency each
    assert times["fp32"] - times["compute"] == pytest.approx(
        2 * psi * (4 - 2) * ring / link + buckets * COLLECTIVE_LATENCY_S, rel=1e-6)


@pytest.mark.parametrize("global_batch,want", [(4, 2), (16, 4)])
def test_planner_prices_the_host_gradients_the_engine_holds(global_batch, want):
    """[Note: gradient placement]: with the optimizer offloaded, one micro-batch per step on one
    rank keeps bf16 host gradients (2 B/param), accumulation keeps fp32 (4 B); the planner's
    ledger and the estimate of the config it writes agree with each other on that."""
    from infinity.ledger import Tier, estimate_from_config, price

    psi = 125e6
    hw = hardware(gpus=1, device_gib=4, host_gib=64)
    req = request(psi, global_batch=global_batch, micro_batches=(4,), checkpointing=(False,))
    c = price(req, hw, stage=3, offload_param="none", offload_optimizer="cpu", micro_batch=4,
              checkpointing=False)
    assert c.grad_accum == global_batch // 4
    assert c.ledger.states["grads"][Tier.HOST] == int(psi) * want
    config = load_config({"zero": {"stage": 3}, "precision": {"dtype": "bf16"},
                          "offload_optimizer": {"device": "cpu"},
                          "gradient_accumulation_steps": c.grad_accum})
    assert estimate_from_config(config, int(psi), 1).states["grads"][Tier.HOST] == int(psi) * want


def _long_context_request(**kw) -> PlanRequest:
    shape = ModelShape(kind="llama", num_layers=24, hidden_size=2048, num_heads=16,
                       vocab_size=32000, seq_len=4096, intermediate_size=5632)
    return PlanRequest(numel=shape.num_params(), shape=shape, shape_assumed=False,
                       global_batch=8, micro_batches=(8,), checkpointing=(True,), **kw)


def test_offloaded_activations_are_priced_in_their_tier():
    """The kept layer inputs (L x 2sbh, bf16) leave the device for the host or NVMe column, and
    cost their bytes over PCIe (out and back) and, on NVMe, a write and a read."""
    from infinity.ledger import ACTIVATION_STAGING_BYTES, price
    req, hw = _long_context_request(), hardware(gpus=1)
    kw = dict(stage=3, offload_param="nvme", offload_optimizer="nvme", micro_batch=8,
              checkpointing=True)
    none, host, nvme = (price(req, hw, offload_activations=t, **kw) for t in ("none", "host", "nvme"))
    stored = 24 * 2 * 4096 * 8 * 2048  # L x 2sbh: bf16, 2 bytes per element
    assert none.activations.stored_bytes == stored
    assert none.need_bytes["device"] - host.need_bytes["device"] == stored
    assert none.need_bytes["device"] - nvme.need_bytes["device"] == stored
    assert host.need_bytes["host"] - none.need_bytes["host"] == stored
    assert nvme.need_bytes["nvme"] - none.need_bytes["nvme"] == stored
    assert nvme.need_bytes["host"] - none.need_bytes["host"] == ACTIVATION_STAGING_BYTES
    assert host.times_s["pcie"] - none.times_s["pcie"] == pytest.approx(
        2 * stored / hw.pcie_bytes_per_s)
    assert nvme.times_s["nvme"] - none.times_s["nvme"] == pytest.approx(
        stored / hw.nvme_write_bytes_per_s + stored / hw.nvme_read_bytes_per_s)


@pytest.mark.parametrize("host_room", [True, False])
def test_the_plan_moves_activations_off_a_full_device(tmp_path, host_room):
    """A device that holds the states' working set but not the kept inputs: the plan offloads
    them (to the host or NVMe, whichever prices faster; to NVMe when the host has no room for
    them), and the written config carries the choice and loads."""
    from infinity.ledger import price
    req = _long_context_request(nvme_path=str(tmp_path))
    big = hardware(gpus=1)
    kw = dict(stage=3, offload_param="nvme", offload_optimizer="nvme", micro_batch=8,
              checkpointing=True)
    on_device, on_host = (price(req, big, offload_activations=t, **kw) for t in ("none", "host"))
    keep = 1 - req.headroom
    device = (on_device.need_bytes["device"] + on_host.need_bytes["device"]) / 2 / keep
    host = (on_host.need_bytes["host"] + 1 * GiB if host_room
            else on_device.need_bytes["host"] + 2 * GiB) / keep
    hw = hardware(gpus=1, device_gib=device / GiB, host_gib=host / GiB)
    plan = make_plan(req, hw)
    assert plan.best is not None
    assert not any(c.fits for c in plan.candidates if c.checkpointing
                   and c.offload_activations == "none")
    assert plan.best.offload_activations in (("host", "nvme") if host_room else ("nvme",)), \
        plan.best.describe()
    config = to_config(plan)
    assert config.activation_checkpointing.offload == plan.best.offload_activations
    assert load_config(config.to_dict()) == config
