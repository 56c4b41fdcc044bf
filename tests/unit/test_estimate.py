"""The memory ledger against the ZeRO papers' own figures, published parameter counts and formulas."""

from __future__ import annotations

import json

import pytest

from infinity import cli
from infinity.cli._estimate import load_model_shape, shape_from_hf_config
from infinity.config import (InfinityConfig, OffloadConfig, OptimizerConfig, PrecisionConfig,
                             ZeroConfig, load_config)
from infinity.ledger import (GB, ModelShape, StateTerms, Tier, activation_bytes,
                             estimate_from_config, estimate_model_states, paper_bytes_per_device)

TiB = 2**40

# ZeRO (Rajbhandari et al., arXiv 1910.02054v3), Table 1: per-device memory in GB of model states
# (K = 12, 2 B params, 2 B grads) for DP degree 1..1024; columns Pos, Pos+g, Pos+g+p = stages 1, 2, 3.
# The paper prints rounded (and for the 1T column truncated) figures: each is met to one unit of
# its last printed digit. (Transcribed from the paper; the search tool could not return its text, so
# each row was cross-checked against the paper's closed form, which all 54 entries satisfy.)
ZERO_TABLE_1 = {
    7.5e9: {1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5),
            64: (31.4, 16.6, 1.88), 256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)},
    128e9: {1: (2048, 2048, 2048), 4: (896, 704, 512), 16: (608, 368, 128),
            64: (536, 284, 32), 256: (518, 263, 8), 1024: (513, 257, 2)},
    1e12: {1: (16000, 16000, 16000), 4: (7000, 5500, 4000), 16: (4750, 2875, 1000),
           64: (4187, 2218, 250), 256: (4046, 2054, 62.5), 1024: (4011, 2013, 15.6)},
}


def _last_digit_unit(printed: float) -> float:
    text = repr(float(printed)).rstrip("0").rstrip(".")
    return 10.0 ** -len(text.split(".")[1]) if "." in text else 1.0


def test_zero_figure_1_7_5b_on_64_gpus():
    """Figure 1: 7.5B params, N = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB, 1.88 GB per device."""
    got = [estimate_model_states(7_500_000_000, s, 64).total_bytes / GB for s in (0, 1, 2, 3)]
    assert [round(got[0]), round(got[1], 1), round(got[2], 1), round(got[3], 2)] == [120, 31.4, 16.6, 1.88]


@pytest.mark.parametrize("numel", sorted(ZERO_TABLE_1))
def test_zero_table_1(numel):
    for dp, printed in ZERO_TABLE_1[numel].items():
        for stage, paper in zip((1, 2, 3), printed):
            ledger = estimate_model_states(int(numel), stage, dp)
            got = ledger.total_bytes / GB
            assert abs(got - paper) < _last_digit_unit(paper), (numel, dp, stage, got, paper)
            # The ledger's per-term sum is the paper's closed form; a shard is rounded up to whole
            # elements, so it may exceed it by at most one element of each term.
            excess = ledger.total_bytes - paper_bytes_per_device(numel, stage, dp)
            assert 0 <= excess <= 16, (numel, dp, stage, excess)


def test_trillion_parameters_fit_1024_gpus_at_stage_3():
    """The trillion-parameter claim: 16 TB of model states / 1024 = 15.6 GB, under a 32 GB V100."""
    ledger = estimate_model_states(10**12, 3, 1024)
    assert ledger.total_bytes / GB == pytest.approx(15.625)
    assert estimate_model_states(10**12, 0, 1).total_bytes == 16 * 10**12


# ZeRO-Infinity (arXiv 2104.07857), Figure 2a: model states in TB (2^40 B) at 20 bytes per parameter
# (fp16 params and grads, fp32 master, momentum, variance and gradient) for 12 L h^2 parameters.
# (Transcribed from the paper; the parameter column checks the shapes, the states column the bytes.)
ZERO_INFINITY_FIG_2A = [  # layers, hidden, params (trillions), model states (TB)
    (80, 10 * 1024, 0.10, 1.83), (100, 20 * 1024, 0.50, 9.16), (128, 25 * 1024, 1.01, 18.31),
    (195, 64 * 1024, 10.05, 182.81), (315, 160 * 1024, 101.47, 1845.70)]


@pytest.mark.parametrize("layers,hidden,trillions,states_tb", ZERO_INFINITY_FIG_2A)
def test_zero_infinity_model_states(layers, hidden, trillions, states_tb):
    numel = 12 * layers * hidden * hidden
    assert numel / 1e12 == pytest.approx(trillions, abs=0.005)
    terms = StateTerms(param_bytes=2, grad_bytes=2, optimizer_bytes=16)  # K includes an fp32 gradient
    got = estimate_model_states(numel, 0, 1, terms).total_bytes / TiB
    assert got == pytest.approx(states_tb, abs=0.005)


def test_tier_split_with_optimizer_on_host():
    """Stage 2, optimizer on the host: device keeps 2 Psi; the host holds (g + K) Psi / N per rank."""
    psi, n = 7_000_000_000, 4
    ledger = estimate_model_states(psi, 2, n, offload_optimizer="cpu", gpus_per_node=4)
    assert ledger.state_bytes(Tier.DEVICE) == 2 * psi
    assert ledger.state_bytes(Tier.HOST) == (2 + 12) * psi // n
    assert ledger.node_bytes(Tier.HOST) == (2 + 12) * psi
    assert ledger.total_bytes == pytest.approx(paper_bytes_per_device(psi, 2, n))


def test_tier_split_zero_infinity_all_nvme():
    psi, n = 70_000_000_000, 8
    ledger = estimate_model_states(psi, 3, n, offload_param="nvme", offload_optimizer="nvme",
                                   gpus_per_node=8, sub_group_numel=10**8)
    assert ledger.state_bytes(Tier.DEVICE) == 0
    # Parameters and optimizer state on NVMe; the gradient shard accumulates in host memory
    # ([Note: gradient placement] in infinity/ledger/_estimate.py).
    assert ledger.state_bytes(Tier.NVME) == (2 + 12) * psi // n
    assert ledger.state_bytes(Tier.HOST) == 2 * psi // n
    # Host: staging for three sub-groups of 1e8 elements of K bytes (the gradient is read in place).
    assert ledger.buffer_bytes(Tier.HOST) == 3 * 10**8 * 12
    d = ledger.to_dict()
    assert d["tiers"]["nvme"]["node_total_bytes"] == 14 * psi
    assert d["tiers"]["host"]["buffers"] == {"optimizer_staging": 3 * 10**8 * 12}
    assert ledger.total_bytes == 16 * psi // n


def test_an_auto_sub_group_stages_what_the_engine_stages():
    """A config at 'auto' stages 4 Mi-element sub-groups, as the engine's 'auto' does (the ledger
    assumed 1e8 until 2026-12-04: 3.6 GB of staging against the engine's 0.15 GB); the size the
    engine resolved (smaller for a small host budget) overrides it."""
    config = load_config({"zero": {"stage": 3},
                          "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"},
                          "offload_param": {"device": "nvme", "nvme_path": "/tmp"}})
    assert config.zero.sub_group_numel == "auto"
    staging = estimate_from_config(config, 10**9, 1).to_dict()["tiers"]["host"]["buffers"]
    assert staging["optimizer_staging"] == 3 * 2**22 * 12
    resolved = estimate_from_config(config, 10**9, 1, sub_group_numel=2**18)
    assert resolved.to_dict()["tiers"]["host"]["buffers"]["optimizer_staging"] == 3 * 2**18 * 12
    explicit = load_config({"zero": {"stage": 3, "sub_group_numel": 10**6},
                            "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}})
    assert estimate_from_config(explicit, 10**9, 1).to_dict()["tiers"]["host"]["buffers"][
        "optimizer_staging"] == 3 * 10**6 * 12


def test_frozen_parameters_have_only_their_params_term():
    """[Note: frozen parameters]: LoRA r 16 on q/k/v/o of a 7B Llama (16.8 M of 6.74 G train),
    base on NVMe, optimizer on the host: the gradient and optimizer terms are the adapters' alone."""
    psi, lora = 6_738_415_616, 32 * 4 * 2 * 16 * 4096
    terms = StateTerms.for_training(dtype="bf16", grad_dtype="fp32")
    full = estimate_model_states(psi, 3, 1, terms, offload_param="nvme", offload_optimizer="cpu")
    ledger = estimate_model_states(psi, 3, 1, terms, offload_param="nvme", offload_optimizer="cpu",
                                   trainable_numel=lora, unit_numel=202_383_360)
    assert ledger.trainable_numel == lora and full.trainable_numel == psi
    assert ledger.params_bytes == full.params_bytes == 2 * psi
    assert ledger.states["params"] == {Tier.NVME: 2 * psi}
    assert ledger.states["grads"] == {Tier.HOST: 4 * lora}
    assert ledger.states["optimizer"] == {Tier.HOST: 12 * lora}
    # A unit's gradient buffer: its even share of the adapters (unit_numel * lora / psi), or the
    # count given.
    assert ledger.buffers[Tier.DEVICE]["unit_gradient"] == -(-202_383_360 * lora // psi) * 4
    explicit = estimate_model_states(psi, 3, 1, terms, offload_param="nvme",
                                     offload_optimizer="cpu", trainable_numel=lora,
                                     unit_numel=202_383_360, unit_trainable_numel=524_288)
    assert explicit.buffers[Tier.DEVICE]["unit_gradient"] == 524_288 * 4
    # Sharded over 4 ranks, stage 0 replicates what trains; stage 3 shards it.
    assert estimate_model_states(psi, 0, 4, terms, trainable_numel=lora).optimizer_bytes == 12 * lora
    assert estimate_model_states(psi, 3, 4, terms, trainable_numel=lora).optimizer_bytes == \
        12 * lora // 4
    for bad in (-1, psi + 1, 1.5, True):
        with pytest.raises(ValueError, match="trainable_numel"):
            estimate_model_states(psi, 3, 1, terms, trainable_numel=bad)
    config = InfinityConfig(zero=ZeroConfig(stage=3), offload_param=OffloadConfig(
        name="offload_param", device="nvme", nvme_path="/tmp"))
    assert estimate_from_config(config, psi, 1, trainable_numel=lora).optimizer_bytes == 12 * lora


def test_param_offload_below_stage_3_is_rejected():
    with pytest.raises(ValueError, match="needs stage 3"):
        estimate_model_states(10**9, 2, 4, offload_param="cpu")


# The engine reduces and accumulates gradients in fp32: g = 4 B for every engine config
# ([Note: gradient placement] in infinity/ledger/_estimate.py); the paper's g = 2 B is StateTerms().
@pytest.mark.parametrize("dtype,state,offload,expected", [
    ("bf16", "fp32", "none", (2, 4, 12)),   # the paper's mixed-precision Adam, fp32 gradients
    ("fp16", "fp32", "cpu", (2, 4, 12)),
    ("bf16", "bf16", "none", (2, 4, 8)),    # bf16 moments halve 8 of the 12 bytes
    ("fp32", "fp32", "none", (4, 4, 8)),    # the parameter is the master: moments only
    ("fp32", "fp32", "cpu", (4, 4, 12)),    # off-device optimizer keeps its own fp32 master
])
def test_terms_from_config(dtype, state, offload, expected):
    config = InfinityConfig(zero=ZeroConfig(stage=2), precision=PrecisionConfig(dtype=dtype),
                            optimizer=OptimizerConfig(state_dtype=state),
                            offload_optimizer=OffloadConfig(name="offload_optimizer", device=offload))
    terms = StateTerms.from_config(config)
    assert (terms.param_bytes, terms.grad_bytes, terms.optimizer_bytes) == expected
    ledger = estimate_from_config(config, 10**9, 8)
    p, g, k = expected
    assert ledger.total_bytes == pytest.approx(10**9 * (p + (g + k) / 8))


def test_sgd_gains_little_from_stage_1():
    """K is what stage 1 shards: Adam's 12 B shrink to 12/N, plain fp32 SGD has nothing to shard."""
    psi, n = 10**9, 8
    saved = {}
    for opt in ("adam", "sgd-momentum", "sgd"):
        terms = StateTerms.for_training(dtype="fp32", optimizer=opt)
        s0, s1 = (estimate_model_states(psi, s, n, terms).total_bytes for s in (0, 1))
        saved[opt] = (s0 - s1) / s0
    assert saved["sgd"] == 0.0
    assert saved["sgd-momentum"] == pytest.approx((4 * 7 / 8) / 12)
    assert saved["adam"] == pytest.approx((8 * 7 / 8) / 16)


# Published parameter counts (Hugging Face model cards / num_parameters()).
GPT2_SMALL = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024,
              "vocab_size": 50257}
LLAMA2_7B = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
             "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32,
             "vocab_size": 32000, "max_position_embeddings": 4096, "tie_word_embeddings": False}
TINYLLAMA_1_1B = {"model_type": "llama", "num_hidden_layers": 22, "hidden_size": 2048,
                  "intermediate_size": 5632, "num_attention_heads": 32, "num_key_value_heads": 4,
                  "vocab_size": 32000, "max_position_embeddings": 2048, "tie_word_embeddings": False}
QWEN2_0_5B = {"model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896,
              "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2,
              "vocab_size": 151936, "max_position_embeddings": 32768, "tie_word_embeddings": True}


@pytest.mark.parametrize("raw,count", [(GPT2_SMALL, 124_439_808), (LLAMA2_7B, 6_738_415_616),
                                       (TINYLLAMA_1_1B, 1_100_048_384), (QWEN2_0_5B, 494_032_768)])
def test_parameter_count_of_hf_configs(raw, count):
    assert shape_from_hf_config(raw).num_params() == count


def test_gpt2_count_matches_a_torch_module():
    """An independent count: a tiny GPT-2 built from torch modules in the HF layout."""
    torch = pytest.importorskip("torch")
    nn = torch.nn
    h, layers, vocab, pos, inner = 64, 3, 101, 32, 200

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.c_attn, self.c_proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.c_fc, self.mlp_proj = nn.Linear(h, inner), nn.Linear(inner, h)

    model = nn.ModuleList([nn.Embedding(vocab, h), nn.Embedding(pos, h), nn.LayerNorm(h)]
                          + [Block() for _ in range(layers)])
    expected = sum(p.numel() for p in model.parameters())
    shape = ModelShape(kind="gpt2", num_layers=layers, hidden_size=h, num_heads=4, vocab_size=vocab,
                       intermediate_size=inner, max_position_embeddings=pos, seq_len=pos)
    assert shape.num_params() == expected


def test_unknown_model_type_names_the_fix():
    with pytest.raises(ValueError, match="--params"):
        shape_from_hf_config({"model_type": "t5"})


@pytest.mark.parametrize("eager", [True, False], ids=["eager-attention", "sdpa"])
def test_activations_follow_korthikanti(eager):
    """sbh(34 + 5as/h) per layer in 16-bit, the 5as/h term (scores, softmax, dropout mask) with
    eager attention only ([Note: fused attention keeps no scores]); with checkpointing 2sbh per
    layer plus one layer."""
    shape = ModelShape(kind="gpt2", num_layers=24, hidden_size=2048, num_heads=16, vocab_size=50000,
                       seq_len=1024, eager_attention=eager)
    s, b, h, a, L, v = 1024, 4, 2048, 16, 24, 50000
    per_layer = s * b * h * (34 + (5 * a * s / h if eager else 0))
    head = 4 * s * b * h + 4 * s * b * v
    full = activation_bytes(shape, micro_batch=b)
    assert full.per_layer_bytes == per_layer
    assert full.total_bytes == L * per_layer + head
    ckpt = activation_bytes(shape, micro_batch=b, checkpointing=True)
    assert ckpt.total_bytes == L * 2 * s * b * h + per_layer + head
    assert ckpt.total_bytes < full.total_bytes / (5 if eager else 3)


def _run_cli(capsys, *argv):
    rc = cli.main(list(argv))
    out = capsys.readouterr().out
    return rc, out


def test_cli_json_reproduces_figure_1(capsys):
    rc, out = _run_cli(capsys, "estimate", "--params", "7.5e9", "--gpus", "64", "--json")
    assert rc == 0
    stages = json.loads(out)["stages"]
    assert sorted(stages) == ["0", "1", "2", "3"]
    assert stages["0"]["total_bytes"] == 120 * GB
    assert round(stages["3"]["total_bytes"] / GB, 2) == 1.88
    for row in stages.values():
        assert row["total_bytes"] == row["params_bytes"] + row["grads_bytes"] + row["optimizer_bytes"]


def test_cli_model_file_offload_and_activations(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA2_7B))
    assert load_model_shape(str(path)).num_params() == 6_738_415_616
    rc, out = _run_cli(capsys, "estimate", "--model", str(path), "--gpus", "4", "--stage", "3",
                       "--offload-optimizer", "cpu", "--checkpointing", "--seq-len", "2048", "--json")
    assert rc == 0
    report = json.loads(out)
    psi = 6_738_415_616
    tiers = report["stages"]["3"]["tiers"]
    assert tiers["host"]["total_bytes"] == 14 * psi // 4
    assert tiers["device"]["params_bytes"] == 2 * psi // 4
    assert report["activations"]["checkpointing"] is True and report["activations"]["seq_len"] == 2048


def test_cli_config_file_sets_terms(tmp_path, capsys):
    ds = {"zero_optimization": {"stage": 1}, "bf16": {"enabled": False},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    rc, out = _run_cli(capsys, "estimate", "--params", "1e9", "--gpus", "8", "--config", str(path),
                       "--json")
    assert rc == 0
    report = json.loads(out)
    assert list(report["stages"]) == ["1"]
    assert report["terms"]["optimizer_bytes"] == 8  # fp32: the parameter is the master
    assert report["stages"]["1"]["total_bytes"] == 10**9 * (4 + 4 + 8 / 8)


def test_cli_table_and_errors(capsys):
    rc, out = _run_cli(capsys, "estimate", "--params", "1e9", "--gpus", "8", "--offload-optimizer",
                       "nvme")
    assert rc == 0 and "stage" in out and "optimizer_staging" in out
    assert cli.main(["estimate", "--gpus", "8"]) == 2
    assert "--params" in capsys.readouterr().err


def test_a_device_that_holds_every_parameter_shard_stages_none_through_the_host():
    """The engine's budgets stage no parameter shard through the host where the device keeps
    every one (``device_holds_params``): the ledger of that plan has no host ``param_staging``
    and the same rows otherwise (the 25M main job in fp32 measured 195 MB on the host against
    219 MB estimated with the row, 181 MB without)."""
    terms = StateTerms.for_training(dtype="fp32", grad_dtype="fp32")
    kw = dict(offload_param="nvme", offload_optimizer="nvme", unit_numel=1_000_000,
              sub_group_numel=2 ** 20)
    staged = estimate_model_states(10_000_000, 3, 1, terms, **kw)
    held = estimate_model_states(10_000_000, 3, 1, terms, device_holds_params=True, **kw)
    rows = staged.buffers[Tier.HOST]
    assert rows["param_staging"] > 0 and "param_staging" not in held.buffers[Tier.HOST]
    assert {k: v for k, v in rows.items() if k != "param_staging"} == held.buffers[Tier.HOST]
    assert staged.tier_bytes(Tier.HOST) - held.tier_bytes(Tier.HOST) == rows["param_staging"]
    assert held.buffers[Tier.DEVICE] == staged.buffers[Tier.DEVICE]
