"""The activation ledger: Korthikanti et al. 2022 (arXiv 2205.05198) formulas, the device/host split
with ``offload_to_host``, ``infinity estimate``'s flags and config, and the engine's offloaded bytes.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import infinity
from infinity import cli
from infinity.ledger import ModelShape, Tier, activation_bytes
from tests._support.engine import TINY, batches, engine_config, tiny_gpt

S, B, H, A, L, V = 1024, 4, 2048, 16, 24, 50000
# Korthikanti's formula as the paper writes it: eager attention, which keeps the scores.
SHAPE = ModelShape(kind="gpt2", num_layers=L, hidden_size=H, num_heads=A, vocab_size=V, seq_len=S,
                   eager_attention=True)
PER_LAYER = S * B * H * (34 + 5 * A * S / H)  # sbh(34 + 5as/h), 16-bit, no recomputation
HEAD = 4 * S * B * H + 4 * S * B * V  # final norm and projection inputs, fp32 logits
INPUTS = L * 2 * S * B * H  # 2sbh per layer: what full checkpointing keeps


def test_fused_attention_keeps_no_scores():
    """[Note: fused attention keeps no scores]: SDPA / FlashAttention (the default shape) keep
    34sbh per layer, not the eager 5as/h on top; the kept inputs (2sbh) are the same."""
    fused = dataclasses.replace(SHAPE, eager_attention=False)
    acts = activation_bytes(fused, micro_batch=B, checkpointing=True)
    assert acts.per_layer_bytes == S * B * H * 34
    assert acts.stored_bytes == INPUTS


def test_without_checkpointing_everything_is_on_the_device():
    acts = activation_bytes(SHAPE, micro_batch=B)
    assert acts.per_layer_bytes == PER_LAYER
    assert acts.device_bytes == acts.total_bytes == L * PER_LAYER + HEAD
    assert acts.host_bytes == 0


def test_checkpointing_keeps_the_layer_inputs_and_one_layer_on_the_device():
    acts = activation_bytes(SHAPE, micro_batch=B, checkpointing=True)
    assert acts.stored_bytes == INPUTS
    assert acts.device_bytes == acts.total_bytes == INPUTS + PER_LAYER + HEAD
    assert acts.host_bytes == 0


def test_offload_moves_the_layer_inputs_to_the_host():
    acts = activation_bytes(SHAPE, micro_batch=B, checkpointing=True, offload_to_host=True)
    assert acts.host_bytes == INPUTS
    assert acts.device_bytes == PER_LAYER + HEAD  # one layer's working set and the head
    assert acts.total_bytes == INPUTS + PER_LAYER + HEAD  # moved, not dropped
    assert acts.tier_bytes(Tier.HOST) == INPUTS and acts.tier_bytes("nvme") == 0
    d = acts.to_dict()
    assert d["offload_to_host"] is True and d["device_bytes"] + d["host_bytes"] == d["total_bytes"]


def test_fp32_doubles_the_layer_terms():
    acts = activation_bytes(SHAPE, micro_batch=B, checkpointing=True, offload_to_host=True,
                            dtype_bytes=4)
    assert acts.host_bytes == 2 * INPUTS
    assert acts.device_bytes == 2 * PER_LAYER + 2 * 4 * S * B * H + 4 * S * B * V


def test_offload_without_checkpointing_is_rejected():
    with pytest.raises(ValueError, match="offload_to_host: needs checkpointing"):
        activation_bytes(SHAPE, micro_batch=B, offload_to_host=True)


def _shape_file(tmp_path) -> str:
    path = tmp_path / "shape.json"
    path.write_text(json.dumps({"kind": "gpt2", "num_layers": L, "hidden_size": H, "num_heads": A,
                                "vocab_size": V, "seq_len": S, "eager_attention": True}))
    return str(path)


def _estimate(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(["estimate", *argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_cli_flags_split_the_tiers(tmp_path, capsys):
    model = _shape_file(tmp_path)
    rc, out, _ = _estimate(capsys, "--model", model, "--gpus", "4", "--stage", "3", "--micro-batch",
                           str(B), "--json")
    plain = json.loads(out)
    rc2, out2, _ = _estimate(capsys, "--model", model, "--gpus", "4", "--stage", "3",
                             "--micro-batch", str(B), "--checkpointing", "--offload-activations",
                             "--json")
    assert rc == rc2 == 0
    report = json.loads(out2)
    a = report["activations"]
    assert a["checkpointing"] and a["offload_to_host"] and a["host_bytes"] == INPUTS
    tiers, plain_tiers = report["stages"]["3"]["tiers"], plain["stages"]["3"]["tiers"]
    assert tiers["host"]["total_with_activations_bytes"] == tiers["host"]["total_bytes"] + INPUTS
    assert tiers["device"]["total_with_activations_bytes"] == (
        tiers["device"]["total_bytes"] + PER_LAYER + HEAD)
    assert plain_tiers["device"]["total_with_activations_bytes"] == (
        plain_tiers["device"]["total_bytes"] + L * PER_LAYER + HEAD)
    rc3, out3, _ = _estimate(capsys, "--model", model, "--gpus", "4", "--stage", "3",
                             "--micro-batch", str(B), "--checkpointing", "--offload-activations")
    assert rc3 == 0 and "inputs offloaded to host" in out3 and "stage 3 with activations" in out3


def test_cli_reads_the_config_section(tmp_path, capsys):
    config = tmp_path / "infinity.json"
    config.write_text(json.dumps({"zero": {"stage": 3}, "precision": {"dtype": "bf16"},
                                  "activation_checkpointing": {"units": "all",
                                                               "offload_to_host": True}}))
    rc, out, _ = _estimate(capsys, "--model", _shape_file(tmp_path), "--micro-batch", str(B),
                           "--config", str(config), "--json")
    assert rc == 0
    a = json.loads(out)["activations"]
    assert a["checkpointing"] and a["offload_to_host"] and a["host_bytes"] == INPUTS


def test_cli_offload_without_checkpointing_names_the_fix(tmp_path, capsys):
    rc, _, err = _estimate(capsys, "--model", _shape_file(tmp_path), "--offload-activations")
    assert rc != 0 and "--offload-activations needs checkpointing" in err and "--checkpointing" in err


def test_engine_offloads_the_bytes_the_ledger_puts_on_the_host(monkeypatch):
    """bf16 engine with offload: the bytes the engine's host hooks keep in host memory per forward
    ([Note: activations on the host] in infinity/zero/_activations.py) are the ledger's host term,
    L x 2sbh (the tiny GPT's blocks)."""
    from infinity.zero._activations import HostActivations

    real_pack = HostActivations.pack
    packed = []

    def pack(self, t):
        out = real_pack(self, t)
        kept = out if isinstance(out, torch.Tensor) else out.tensor
        assert kept.device.type == "cpu"
        packed.append(kept.numel() * kept.element_size())
        return out

    monkeypatch.setattr(HostActivations, "pack", pack)
    batch, seq = 8, TINY.block_size
    engine = infinity.initialize(tiny_gpt(), engine_config(
        stage=3, dtype="bf16", activation_checkpointing={"units": ["Block"], "offload_to_host": True}))
    idx, targets = batches(1, 1, batch_size=batch, seq_len=seq)[0][0]
    engine.backward(engine(idx, targets))
    engine.close()
    shape = ModelShape(kind="gpt2", num_layers=TINY.n_layer, hidden_size=TINY.n_embd,
                       num_heads=TINY.n_head, vocab_size=TINY.vocab_size, seq_len=seq)
    ledger = activation_bytes(shape, micro_batch=batch, checkpointing=True, offload_to_host=True)
    assert sum(packed) == ledger.host_bytes


def test_nvme_offload_homes_the_layer_inputs_on_nvme():
    acts = activation_bytes(SHAPE, micro_batch=B, checkpointing=True, offload="nvme")
    assert acts.nvme_bytes == acts.tier_bytes("nvme") == acts.moved_bytes == INPUTS
    assert acts.host_bytes == 0 and acts.device_bytes == PER_LAYER + HEAD
    assert acts.total_bytes == INPUTS + PER_LAYER + HEAD
    with pytest.raises(ValueError, match="offload 'nvme': needs checkpointing"):
        activation_bytes(SHAPE, micro_batch=B, offload="nvme")


def test_cli_puts_nvme_activations_in_the_nvme_column(tmp_path, capsys):
    rc, out, _ = _estimate(capsys, "--model", _shape_file(tmp_path), "--micro-batch", str(B),
                           "--checkpointing", "--offload-activations", "nvme", "--json")
    a = json.loads(out)["activations"]
    assert rc == 0 and a["offload"] == "nvme" and a["nvme_bytes"] == INPUTS and a["host_bytes"] == 0
    rows = json.loads(out)["stages"].values()
    assert all(r["tiers"]["nvme"]["activations_bytes"] == INPUTS for r in rows)
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"activation_checkpointing": {
        "units": "all", "offload": "nvme", "nvme_path": str(tmp_path)}}))
    rc, out, _ = _estimate(capsys, "--model", _shape_file(tmp_path), "--micro-batch", str(B),
                           "--config", str(path))
    assert rc == 0 and "inputs offloaded to NVMe" in out


def test_engine_writes_to_nvme_the_bytes_the_ledger_puts_there(tmp_path, monkeypatch):
    """bf16 engine, activations on NVMe: the bytes saved and written per forward are the ledger's
    NVMe term, L x 2sbh (the tiny GPT's blocks)."""
    import infinity.zero._stored_activations as stored_module
    monkeypatch.setattr(stored_module, "MIN_STORED_BYTES", 1024)
    batch, seq = 8, TINY.block_size
    engine = infinity.initialize(tiny_gpt(), engine_config(
        stage=3, dtype="bf16", activation_checkpointing={
            "units": ["Block"], "offload": "nvme", "nvme_path": str(tmp_path)}))
    idx, targets = batches(1, 1, batch_size=batch, seq_len=seq)[0][0]
    engine.backward(engine(idx, targets))
    engine.store.flush()
    acts = engine.stats()["activations"]
    engine.close()
    shape = ModelShape(kind="gpt2", num_layers=TINY.n_layer, hidden_size=TINY.n_embd,
                       num_heads=TINY.n_head, vocab_size=TINY.vocab_size, seq_len=seq)
    ledger = activation_bytes(shape, micro_batch=batch, checkpointing=True, offload="nvme")
    assert acts["NVME"]["saved"] == acts["nvme_written_bytes"] == ledger.nvme_bytes
    assert acts["NVME"]["peak"] == ledger.nvme_bytes


def test_a_hugging_face_config_asking_for_eager_attention_keeps_the_scores():
    from infinity.cli._estimate import shape_from_hf_config
    raw = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 256,
           "num_attention_heads": 4, "vocab_size": 1000, "intermediate_size": 512}
    assert not shape_from_hf_config(raw).eager_attention
    assert shape_from_hf_config({**raw, "_attn_implementation": "eager"}).eager_attention
    assert shape_from_hf_config({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2,
                                 "vocab_size": 100, "attn_implementation": "eager"}).eager_attention
