"""Loading weights from safetensors (single file, Hugging Face sharded index) straight into the
engine's shards: equal to the saved state dict (and to what ``load_state_dict`` gives) for stages
0-3 and every offload mode, training after the load matches plain PyTorch from the same weights,
tied weights stored once, buffers, bytes read = bytes of the parameters, and clear errors that
leave the engine unchanged.

References are independent of the code under test: files written by the ``safetensors`` package
or ``transformers.save_pretrained``, ``nn.Module.load_state_dict``, plain PyTorch training.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from torch import nn

import infinity
from infinity import io as safetensors_io
from infinity.checkpoint import WeightsError
from infinity.checkpoint import _weights as weights
from tests._support.engine import (DTYPES, assert_close_run, assert_exactly_equal, batches,
                                   engine_train, offload_config, reference_train, tiny_gpt)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

safetensors_torch = pytest.importorskip("safetensors.torch")


def _config(tmp_path, *, stage, dtype="fp32", opt="none", param="none", units=("Block",),
            **extra):
    return offload_config(tmp_path / "swap", stage=stage, dtype=dtype, opt=opt, param=param,
                          unit_class_names=units, **extra)


def _save_hf_style(model: nn.Module, path) -> dict[str, torch.Tensor]:
    """What Hugging Face stores: each tensor once (a tied alias dropped), via ``safetensors``.
    Returns the model's full state dict (fp32 copies), the expected result of a load."""
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    seen, stored = set(), {}
    for k, v in model.state_dict(keep_vars=True).items():
        if id(v) not in seen:
            seen.add(id(v))
            stored[k] = v.detach().clone().contiguous()
    safetensors_torch.save_file(stored, str(path))
    return full


def _assert_loaded(engine, want: dict[str, torch.Tensor], dtype: str) -> None:
    """fp32 masters equal the file exactly; the compute-dtype parameter shards equal it cast."""
    got = engine.full_state_dict()
    assert_exactly_equal({k: v.float() for k, v in got.items()}, {k: v.float() for k, v in want.items()},
                   "masters")
    low = engine.manager.full_state_dict()  # from the parameter shards (no masters)
    cast = {k: v.to(DTYPES[dtype]).float() for k, v in want.items()}
    assert_exactly_equal({k: v.float() for k, v in low.items()}, cast, "parameter shards")


# ------------------------------------------------------------------- the GPT of infinity.models

GPT_CASES = [  # stage, dtype, optimizer offload, parameter offload
    (0, "fp32", "none", "none"),
    (1, "bf16", "none", "none"),
    (2, "fp32", "cpu", "none"),
    (3, "fp32", "none", "none"),
    (3, "bf16", "none", "none"),
    (3, "fp32", "cpu", "cpu"),
    (3, "bf16", "nvme", "nvme"),
    (0, "bf16", "nvme", "none"),
]


@pytest.mark.parametrize("stage,dtype,opt,param", GPT_CASES,
                         ids=[f"s{s}-{d}-opt_{o}-param_{p}" for s, d, o, p in GPT_CASES])
def test_gpt_load_equals_saved_and_trains_like_pytorch(tmp_path, stage, dtype, opt, param):
    saved = _save_hf_style(tiny_gpt(seed=0), tmp_path / "model.safetensors")
    reference = tiny_gpt(seed=1)  # what load_state_dict gives (lm_head tied to wte: missing)
    stored = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    result = reference.load_state_dict(stored, strict=False)
    assert list(result.missing_keys) == ["lm_head.weight"]  # tied, stored once
    engine = infinity.initialize(tiny_gpt(seed=1), _config(tmp_path, stage=stage, dtype=dtype,
                                                           opt=opt, param=param))
    try:
        assert engine.load_weights(str(tmp_path)) == {"missing_keys": [], "unexpected_keys": []}
        _assert_loaded(engine, saved, dtype)
        assert_exactly_equal(engine.full_state_dict(),
                       {k: v.float() for k, v in reference.state_dict().items()})
        data = batches(2, 1)
        losses = engine_train(engine, data)
        state = engine.full_state_dict()
    finally:
        engine.close()
    ref_losses, ref_state = reference_train(reference, data, dtype=dtype)
    assert_close_run(losses, state, ref_losses, ref_state, dtype)


def test_load_leaves_optimizer_moments_alone(tmp_path):
    """A trained engine keeps its Adam moments and step count (as load_state_dict on a model
    keeps its optimizer's state); the weights are replaced."""
    saved = _save_hf_style(tiny_gpt(seed=0), tmp_path / "model.safetensors")
    engine = infinity.initialize(tiny_gpt(seed=1), _config(tmp_path, stage=3, opt="cpu"))
    try:
        engine_train(engine, batches(1, 1))
        moments = {k: {n: t.clone() for n, t in engine.shard_optimizer.state_of(k).items()}
                   for k in engine.shard_optimizer.keys()}
        assert any(float(m["exp_avg_sq"].abs().sum()) > 0 for m in moments.values())
        engine.load_weights(str(tmp_path / "model.safetensors"))
        _assert_loaded(engine, saved, "fp32")
        assert engine.shard_optimizer.step_count == 1
        for k, m in moments.items():
            for n, t in engine.shard_optimizer.state_of(k).items():
                assert torch.equal(t, m[n]), (k, n)
    finally:
        engine.close()


@pytest.mark.parametrize("stored", ["bf16", "fp16"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_stored_dtype_converted(tmp_path, stored, dtype):
    """A bf16/fp16 file: the fp32 masters hold the stored values exactly (widened), the
    compute-dtype shards hold them cast, buffers and all."""
    model = tiny_gpt(seed=0).to(DTYPES[stored])
    saved = _save_hf_style(model, tmp_path / "model.safetensors")
    engine = infinity.initialize(tiny_gpt(seed=1), _config(tmp_path, stage=3, dtype=dtype,
                                                           opt="cpu"))
    try:
        engine.load_weights(str(tmp_path / "model.safetensors"))
        _assert_loaded(engine, {k: v.float() for k, v in saved.items()}, dtype)
    finally:
        engine.close()


def test_reads_only_the_parameter_bytes(tmp_path, monkeypatch):
    """World size 1, stage 3: every stored byte read exactly once (ranges read piecewise into
    the staging buffer add up to the file's tensors), nothing more; a staging buffer smaller
    than a tensor reads it in pieces of at most its size."""
    monkeypatch.setattr(weights, "_STAGING_BYTES", 1000)
    saved = _save_hf_style(tiny_gpt(seed=0), tmp_path / "model.safetensors")
    with safetensors_io.SafetensorsCheckpoint(tmp_path) as ckpt:
        stored_bytes = sum(e.nbytes for e in ckpt.entries.values())
    engine = infinity.initialize(tiny_gpt(seed=1), _config(tmp_path, stage=3))
    read, original = [], safetensors_io.SafetensorsFile.read_into

    def counting(self, name, out, *, start_numel=0):
        read.append((name, start_numel, out.numel() * out.element_size()))
        return original(self, name, out, start_numel=start_numel)

    monkeypatch.setattr(safetensors_io.SafetensorsFile, "read_into", counting)
    try:
        engine.load_weights(str(tmp_path))
        _assert_loaded(engine, saved, "fp32")
    finally:
        engine.close()
    assert sum(n for _, _, n in read) == stored_bytes
    assert max(n for _, _, n in read) == 1000  # wte (4096 bytes) came in pieces
    assert len({(name, start) for name, start, _ in read}) == len(read)  # no range twice


# ------------------------------------------------------------------------------------ buffers


class _WithBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 3)
        self.register_buffer("scratch", torch.zeros(4), persistent=False)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.out(torch.relu(self.bn(self.fc(x)))), y)


def test_buffers_loaded_non_persistent_skipped(tmp_path):
    torch.manual_seed(0)
    src = _WithBuffers()
    src.bn.running_mean.uniform_()
    src.bn.running_var.uniform_(1, 2)
    src.bn.num_batches_tracked.fill_(7)
    saved = _save_hf_style(src, tmp_path / "model.safetensors")
    torch.manual_seed(1)
    model = _WithBuffers()
    model.scratch.fill_(5.0)
    engine = infinity.initialize(model, _config(tmp_path, stage=3, units=()))
    try:
        assert engine.load_weights(str(tmp_path)) == {"missing_keys": [], "unexpected_keys": []}
        assert_exactly_equal(engine.full_state_dict(), saved)
        assert torch.equal(engine.module.scratch, torch.full((4,), 5.0))  # not in the file
    finally:
        engine.close()


# ------------------------------------------------------------------------------------- errors


def _engine_and_before(tmp_path, stage=3, **kw):
    engine = infinity.initialize(tiny_gpt(seed=1), _config(tmp_path, stage=stage, **kw))
    return engine, engine.full_state_dict()


def test_missing_key_strict_raises_and_changes_nothing(tmp_path):
    sd = {k: v for k, v in tiny_gpt(seed=0).state_dict().items() if k != "lm_head.weight"}
    del sd["blocks.1.mlp.fc.bias"]
    sd["extra.weight"] = torch.ones(2)
    safetensors_torch.save_file(sd, str(tmp_path / "model.safetensors"))
    engine, before = _engine_and_before(tmp_path, opt="cpu")
    try:
        with pytest.raises(WeightsError, match=r"missing keys \['blocks.1.mlp.fc.bias'\].*"
                                               r"unexpected keys \['extra.weight'\]"):
            engine.load_weights(str(tmp_path))
        assert_exactly_equal(engine.full_state_dict(), before)
        result = engine.load_weights(str(tmp_path), strict=False)
        assert result == {"missing_keys": ["blocks.1.mlp.fc.bias"],
                          "unexpected_keys": ["extra.weight"]}
        got = engine.full_state_dict()
        for k, v in got.items():
            want = before[k] if k == "blocks.1.mlp.fc.bias" else sd.get(k, sd["wte.weight"])
            assert torch.equal(v, want), k
    finally:
        engine.close()


def test_wrong_shape_names_tensor_and_shapes(tmp_path):
    sd = {k: v for k, v in tiny_gpt(seed=0).state_dict().items() if k != "lm_head.weight"}
    sd["blocks.0.attn.proj.weight"] = torch.zeros(16, 15)
    safetensors_torch.save_file(sd, str(tmp_path / "model.safetensors"))
    engine, before = _engine_and_before(tmp_path, dtype="bf16")
    try:
        with pytest.raises(WeightsError, match=r"'blocks.0.attn.proj.weight' has shape \[16, 15\] "
                                               r"in the file, the model expects \[16, 16\]"):
            engine.load_weights(str(tmp_path))
        assert_exactly_equal(engine.full_state_dict(), before)
    finally:
        engine.close()


def test_truncated_shard_of_an_index_raises_and_changes_nothing(tmp_path):
    sd = {k: v.contiguous() for k, v in tiny_gpt(seed=0).state_dict().items()
          if k != "lm_head.weight"}
    names = list(sd)
    shards = {"model-00001-of-00002.safetensors": names[:10],
              "model-00002-of-00002.safetensors": names[10:]}
    for file, keys in shards.items():
        safetensors_torch.save_file({k: sd[k] for k in keys}, str(tmp_path / file))
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: file for file, keys in shards.items()
                                                  for k in keys}}, f)
    second = tmp_path / "model-00002-of-00002.safetensors"
    os.truncate(second, os.path.getsize(second) - 10)
    engine, before = _engine_and_before(tmp_path, opt="nvme", param="nvme")
    try:
        with pytest.raises(ValueError, match=r"model-00002-of-00002.safetensors.*truncated"):
            engine.load_weights(str(tmp_path))
        assert_exactly_equal(engine.full_state_dict(), before)
    finally:
        engine.close()


def test_load_inside_accumulation_window_is_refused(tmp_path):
    _save_hf_style(tiny_gpt(seed=0), tmp_path / "model.safetensors")
    engine = infinity.initialize(tiny_gpt(seed=1), _config(tmp_path, stage=2,
                                                           gradient_accumulation_steps=2))
    try:
        x, y = batches(1, 1)[0][0]
        engine.backward(engine(x, y))
        engine.step()
        with pytest.raises(WeightsError, match="accumulation window"):
            engine.load_weights(str(tmp_path))
    finally:
        engine.close()


# -------------------------------------------------------------------------------- transformers


def _hf_model(kind: str, seed: int):
    transformers = pytest.importorskip("transformers")
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            tie_word_embeddings=True)
        unit = "LlamaDecoderLayer"
    else:
        config = transformers.GPT2Config(vocab_size=512, n_positions=32, n_embd=64, n_layer=2,
                                         n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0, tie_word_embeddings=True,
                                         bos_token_id=0, eos_token_id=0)
        unit = "GPT2Block"
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config), unit


HF_CASES = [  # model, sharded index, stage, dtype, optimizer offload, parameter offload
    ("llama", True, 3, "fp32", "none", "none"),
    ("llama", False, 1, "bf16", "cpu", "none"),
    ("gpt2", True, 3, "bf16", "nvme", "nvme"),
    ("gpt2", False, 0, "fp32", "none", "none"),
]


@pytest.mark.parametrize("kind,sharded,stage,dtype,opt,param", HF_CASES,
                         ids=[f"{k}-{'index' if s else 'single'}-s{st}-{d}-{o}-{p}"
                              for k, s, st, d, o, p in HF_CASES])
def test_transformers_save_pretrained_loads(tmp_path, kind, sharded, stage, dtype, opt, param):
    source, unit = _hf_model(kind, seed=0)
    model_dir = tmp_path / "hf"
    source.save_pretrained(model_dir, max_shard_size="200KB" if sharded else "1GB")
    files = sorted(os.listdir(model_dir))
    assert ("model.safetensors.index.json" in files) == sharded, files
    saved = {k: v.detach().clone() for k, v in source.state_dict().items()}
    model, _ = _hf_model(kind, seed=1)
    reference = copy.deepcopy(model)
    reference.load_state_dict(saved)
    engine = infinity.initialize(model, _config(tmp_path, stage=stage, dtype=dtype, opt=opt,
                                                param=param, units=(unit,)))
    try:
        assert engine.load_weights(str(model_dir)) == {"missing_keys": [], "unexpected_keys": []}
        _assert_loaded(engine, saved, dtype)
        data = [[(x % 512, y % 512)] for ((x, y),) in batches(2, 1)]

        def loss_fn(m, b):
            return m(input_ids=b[0], labels=b[0]).loss

        losses = engine_train(engine, data, loss_fn=loss_fn)
        state = engine.full_state_dict()
    finally:
        engine.close()
    ref_losses, ref_state = reference_train(reference, data, dtype=dtype, loss_fn=loss_fn)
    assert_close_run(losses, state, ref_losses, ref_state, dtype)
