"""Checkpoints (single process): bitwise resume for every stage and offload mode, buffers and RNG,
crash safety, corrupted/incomplete checkpoints rejected before any state changes, and
consolidation to one state dict (checked with the ``safetensors`` package and ``transformers``).

References are independent of the code under test: the run that never stopped, the engine's own
``full_state_dict()``/optimizer state before the failed load, bytes read back by ``safetensors``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

import infinity
from infinity import checkpoint as ckpt
from infinity.errors import DiskSpaceError
from infinity.checkpoint import (CheckpointError, consolidate, load_checkpoint, param_ranges,
                                 save_checkpoint)
from infinity.checkpoint import _save as save_module
from infinity.cli._consolidate import parse_bytes
from tests._support.engine import (assert_exactly_equal, batches, engine_config, engine_train,
                                   offload_config, tiny_gpt)
from tests._support.tensors import seed_all

pytestmark = pytest.mark.usefixtures("one_torch_thread")

safetensors_torch = pytest.importorskip("safetensors.torch")


def noisy_loss(m, batch):
    """Draws from torch, python and numpy RNGs, so a resume matches only if all three are
    restored (the draw scales the loss, hence the gradients and the logged loss)."""
    noise = float(torch.rand(())) + random.random() + float(np.random.rand())
    return m(*batch) * (1.0 + 0.1 * noise)


def _config(tmp_path, *, stage, dtype="fp32", gas=1, clip=0.0, opt="none", param="none",
            host="auto", **extra):
    return offload_config(tmp_path / "swap", stage=stage, dtype=dtype, gas=gas, clip=clip,
                          opt=opt, param=param, host=host, **extra)


# ------------------------------------------------------------------------------------ layout


def test_param_ranges_cut_slots_at_partition_bounds():
    class S:
        def __init__(self, offset, numel):
            self.offset, self.numel = offset, numel

    a, b, c = S(0, 5), S(5, 3), S(8, 4)  # flat buffer of 12, padded to 12
    assert [(s, x, y) for s, x, y in param_ranges([a, b, c], 0, 6)] == [(a, 0, 5), (b, 0, 1)]
    assert [(s, x, y) for s, x, y in param_ranges([a, b, c], 6, 12)] == [(b, 1, 3), (c, 0, 4)]
    assert param_ranges([a, b, c], 12, 16) == []  # only padding


# ------------------------------------------------------------------------------------ resume

RESUME_CASES = [  # stage, dtype, gas, clip, optimizer offload, parameter offload, host budget
    (0, "fp32", 1, 0.0, "none", "none", "auto"),
    (1, "bf16", 2, 0.05, "none", "none", "auto"),
    (2, "fp32", 2, 0.05, "none", "none", "auto"),
    (3, "fp32", 1, 0.0, "none", "none", "auto"),
    (3, "bf16", 1, 0.05, "none", "none", "auto"),
    (3, "fp16", 1, 0.0, "none", "none", "auto"),
    (3, "bf16", 1, 0.0, "cpu", "cpu", "auto"),
    # The least the engine accepts: shards are evicted and read back. 45056: the fp32 gradient
    # accumulators homed in the host arena ([Note: gradient placement] in infinity/ledger/_estimate.py).
    (3, "fp32", 1, 0.05, "nvme", "nvme", 65536 + 45056),
    (3, "bf16", 2, 0.0, "nvme", "nvme", 40960 + 45056),
    # Room beyond the read-ahead window: about half the sub-groups are homed on HOST ([Note:
    # host-resident sub-groups] in infinity/tiers/_offload_budgets.py), the parameter shards stay dirty on the device.
    (3, "bf16", 2, 0.05, "nvme", "nvme", 40960 + 45056 + 6 * 8192),
    (0, "fp32", 1, 0.0, "nvme", "none", "auto"),
]


@pytest.mark.parametrize("stage,dtype,gas,clip,opt,param,host", RESUME_CASES,
                         ids=[f"s{c[0]}-{c[1]}-gas{c[2]}-opt_{c[4]}-param_{c[5]}"
                              for c in RESUME_CASES])
def test_resume_matches_the_run_that_never_stopped(tmp_path, stage, dtype, gas, clip, opt,
                                                   param, host):
    cfg = _config(tmp_path, stage=stage, dtype=dtype, gas=gas, clip=clip, opt=opt, param=param,
                  host=host)
    data = batches(6, gas)
    seed_all(1)
    straight = infinity.initialize(tiny_gpt(), cfg)
    want_losses = engine_train(straight, data, loss_fn=noisy_loss)
    want_state, want_scale = straight.full_state_dict(), straight.loss_scale
    straight.close()

    seed_all(1)
    first = infinity.initialize(tiny_gpt(), cfg)
    losses = engine_train(first, data[:3], loss_fn=noisy_loss)
    save_checkpoint(first, tmp_path / "ckpt")
    first.close()
    seed_all(99)  # the resumed run must take nothing from its own start: other init, other RNG
    resumed = infinity.initialize(tiny_gpt(seed=7), cfg)
    load_checkpoint(resumed, tmp_path / "ckpt")
    assert resumed.global_steps == 3 and resumed.micro_steps == 3 * gas
    losses += engine_train(resumed, data[3:], loss_fn=noisy_loss)
    assert losses == want_losses  # bitwise
    assert_exactly_equal(resumed.full_state_dict(), want_state)
    assert resumed.loss_scale == want_scale
    resumed.close()


class BNNet(nn.Module):
    """Buffers (BatchNorm running stats, an int64 counter) and dropout (the torch RNG)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.fc1 = nn.Linear(32, 64)
        self.bn = nn.BatchNorm1d(64)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(64, 64)

    def forward(self, idx, targets):
        h = self.emb(idx).mean(1)
        logits = self.fc2(self.drop(torch.relu(self.bn(self.fc1(h)))))
        return nn.functional.cross_entropy(logits, targets[:, 0])


def _bn_net(seed=0):
    torch.manual_seed(seed)
    return BNNet()


@pytest.mark.parametrize("stage", [0, 3])
def test_buffers_and_dropout_resume(tmp_path, stage):
    cfg = engine_config(stage=stage, unit_class_names=(), unit_min_numel=1000)
    data = batches(6, 1)
    torch.manual_seed(3)
    straight = infinity.initialize(_bn_net(), cfg)
    want_losses = engine_train(straight, data)
    want = straight.full_state_dict()
    straight.close()

    torch.manual_seed(3)
    first = infinity.initialize(_bn_net(), cfg)
    losses = engine_train(first, data[:3])
    saved_buffers = {k: v.clone() for k, v in first.module.named_buffers()}
    save_checkpoint(first, tmp_path / "ckpt")
    first.close()
    resumed = infinity.initialize(_bn_net(seed=5), cfg)
    load_checkpoint(resumed, tmp_path / "ckpt")
    assert set(saved_buffers) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    for k, v in resumed.module.named_buffers():
        assert torch.equal(v, saved_buffers[k]), k
    assert int(resumed.module.bn.num_batches_tracked) == 3
    losses += engine_train(resumed, data[3:])
    assert losses == want_losses
    assert_exactly_equal(resumed.full_state_dict(), want)
    resumed.close()


def _partly_frozen(seed=0):
    model = tiny_gpt(seed)
    for p in (model.wpe.weight, *model.blocks[0].mlp.parameters()):
        p.requires_grad_(False)
    return model


@pytest.mark.parametrize("stage", [0, 3])
def test_frozen_parameters_resume_and_consolidate(tmp_path, stage):
    cfg = engine_config(stage=stage, dtype="bf16")
    data = batches(4, 1)
    straight = infinity.initialize(_partly_frozen(), cfg)
    want_losses = engine_train(straight, data)
    want = straight.full_state_dict()
    straight.close()
    first = infinity.initialize(_partly_frozen(), cfg)
    losses = engine_train(first, data[:2])
    save_checkpoint(first, tmp_path / "ckpt")
    at_save = first.full_state_dict()
    first.close()
    resumed = infinity.initialize(_partly_frozen(seed=6), cfg)
    load_checkpoint(resumed, tmp_path / "ckpt")
    losses += engine_train(resumed, data[2:])
    assert losses == want_losses
    assert_exactly_equal(resumed.full_state_dict(), want)
    resumed.close()
    consolidate(tmp_path / "ckpt", tmp_path / "out")
    got = _read_consolidated(tmp_path / "out")
    assert_exactly_equal(got, {k: v.float() for k, v in at_save.items()})
    assert torch.equal(got["wpe.weight"], tiny_gpt().wpe.weight.detach().bfloat16().float())


@pytest.mark.parametrize("save,load", [(0, 3), (3, 1), (2, 0)])
def test_load_at_another_stage(tmp_path, save, load):
    data = batches(5, 1)
    first = infinity.initialize(tiny_gpt(), engine_config(stage=save))
    engine_train(first, data[:3])
    saved = first.full_state_dict()
    save_checkpoint(first, tmp_path / "ckpt")
    want_losses = engine_train(first, data[3:])
    first.close()
    other = infinity.initialize(tiny_gpt(seed=4), engine_config(stage=load))
    load_checkpoint(other, tmp_path / "ckpt")
    assert_exactly_equal(other.full_state_dict(), saved)
    assert engine_train(other, data[3:]) == pytest.approx(want_losses, abs=1e-5)
    other.close()


def test_save_inside_an_accumulation_window_is_refused(tmp_path):
    engine = infinity.initialize(tiny_gpt(), engine_config(stage=3, gas=2))
    x, y = batches(1, 1)[0][0]
    engine.backward(engine(x, y))
    engine.step()  # micro-batch 1 of 2: gradients are partial
    with pytest.raises(ValueError, match="accumulation window"):
        save_checkpoint(engine, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_each_save_is_a_new_directory_and_latest_moves_last(tmp_path):
    engine = infinity.initialize(tiny_gpt(), engine_config(stage=3))
    engine_train(engine, batches(1, 1))
    a = save_checkpoint(engine, tmp_path)
    b = save_checkpoint(engine, tmp_path)  # same step: must not overwrite the first
    assert os.path.basename(a) == "step-1" and os.path.basename(b) == "step-1-1"
    assert (tmp_path / "latest").read_text().strip() == "step-1-1"
    assert ckpt.resolve_checkpoint(tmp_path) == b and ckpt.resolve_checkpoint(a) == a
    manifest = json.loads((tmp_path / "step-1" / "manifest.json").read_text())
    # Tied weights are stored once (under the first name) but both keys are in the state dict.
    keys = {i["key"]: i.get("param") for i in manifest["state_dict"]}
    assert keys["lm_head.weight"] == keys["wte.weight"] == "wte.weight"
    stored = set()
    for shard in manifest["shards"]:
        with safetensors_torch.safe_open(os.path.join(a, shard["file"]), "pt") as f:
            stored |= {k.split("::")[0] for k in f.keys()}
    assert "wte.weight" in stored and "lm_head.weight" not in stored
    assert stored == set(manifest["params"])
    engine.close()


# ----------------------------------------------------------------------- space before a save


def _files_bytes(root) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


@pytest.mark.parametrize("dtype,param", [("fp32", "none"), ("bf16", "nvme")])
def test_save_bytes_counts_the_files_a_save_writes(tmp_path, dtype, param):
    """The pre-save count, taken from the layout alone, bounds the bytes the save then puts on
    disk, and its data part (everything but the fixed allowance) is within 10% of them."""
    config = _config(tmp_path, stage=3, dtype=dtype, opt="nvme" if param == "nvme" else "none",
                     param=param)
    engine = infinity.initialize(tiny_gpt(), config)
    engine_train(engine, batches(1, 1))
    counted = save_module.save_bytes(engine)
    save_checkpoint(engine, tmp_path / "ckpt")
    written = _files_bytes(tmp_path / "ckpt")
    assert written <= counted
    assert 0.9 * written <= counted - save_module.FIXED_BYTES <= 1.1 * written
    numel = sum(p.numel() for p in tiny_gpt().parameters())  # tied weights once
    assert written > numel * (12 if dtype == "fp32" else 14)  # the state itself, not headers
    engine.close()


def test_a_save_that_does_not_fit_fails_before_writing_anything(tmp_path, monkeypatch):
    engine = infinity.initialize(tiny_gpt(), _config(tmp_path, stage=3, opt="nvme",
                                                     param="nvme", dtype="bf16"))
    engine_train(engine, batches(1, 1))
    root = tmp_path / "ckpt"
    first = save_checkpoint(engine, root)
    before = sorted(os.listdir(root)), (root / "latest").read_text()
    engine_train(engine, batches(1, 1))
    needed = save_module.save_bytes(engine)
    monkeypatch.setattr(save_module, "free_disk_bytes", lambda path: needed - 1)
    with pytest.raises(DiskSpaceError) as info:
        save_checkpoint(engine, root)
    e = info.value
    assert (e.needed_bytes, e.free_bytes, e.path) == (needed, needed - 1, os.fspath(root))
    assert os.fspath(root) in str(e) and "nothing was written" in str(e)
    assert (sorted(os.listdir(root)), (root / "latest").read_text()) == before
    assert ckpt.resolve_checkpoint(root) == first
    monkeypatch.setattr(save_module, "free_disk_bytes", lambda path: needed)  # exactly enough
    assert os.path.basename(save_checkpoint(engine, root)) == "step-2"
    engine.close()


def test_free_disk_bytes_reads_the_nearest_existing_directory(tmp_path):
    from infinity.io import free_disk_bytes

    st = os.statvfs(tmp_path)
    got = free_disk_bytes(tmp_path / "not" / "made" / "yet")
    assert abs(got - st.f_bavail * st.f_frsize) < 64 << 20  # the same file system, give or take
    assert not (tmp_path / "not").exists()


# ------------------------------------------------------------------------------ crash safety


def _flaky(real, fail_at):
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise OSError(28, "No space left on device (injected)")
        return real(*args, **kwargs)
    return wrapper


def test_a_crash_at_any_point_of_a_save_leaves_the_previous_one_loadable(tmp_path, monkeypatch):
    data = batches(3, 1)
    engine = infinity.initialize(tiny_gpt(), engine_config(stage=3, dtype="bf16"))
    engine_train(engine, data[:2])
    save_checkpoint(engine, tmp_path)
    at_step2 = engine.full_state_dict()
    engine_train(engine, data[2:])
    n_files = len(engine.manager.units) + 2  # unit shards, buffers, RNG
    points = [("write_safetensors", k) for k in range(1, n_files + 1)]
    points += [("_atomic_write_text", 1), ("_atomic_write_text", 2)]  # manifest, then latest
    for name, k in points:
        with monkeypatch.context() as mp:
            mp.setattr(save_module, name, _flaky(getattr(save_module, name), k))
            with pytest.raises(OSError, match="injected"):
                save_checkpoint(engine, tmp_path)
        fresh = infinity.initialize(tiny_gpt(seed=3), engine_config(stage=3, dtype="bf16"))
        load_checkpoint(fresh, tmp_path)
        assert fresh.global_steps == 2, (name, k)
        assert_exactly_equal(fresh.full_state_dict(), at_step2)
        fresh.close()
    good = save_checkpoint(engine, tmp_path)  # after the failures, a save still works
    assert ckpt.resolve_checkpoint(tmp_path) == good
    engine.close()


# ------------------------------------------------------------------------- corrupt checkpoints


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A stage-3 bf16 checkpoint after 2 steps, plus checkpoints of two other models."""
    root = tmp_path_factory.mktemp("saved")
    engine = infinity.initialize(tiny_gpt(), engine_config(stage=3, dtype="bf16"))
    engine_train(engine, batches(2, 1))
    step_dir = save_checkpoint(engine, root / "good")
    engine.close()
    from infinity.models.gpt import GPTConfig
    wider = infinity.initialize(tiny_gpt(config=GPTConfig(vocab_size=64, block_size=16, n_layer=2,
                                                          n_head=2, n_embd=32)),
                                engine_config(stage=3, dtype="bf16"))
    other_shapes = save_checkpoint(wider, root / "wider")
    wider.close()
    bn = infinity.initialize(_bn_net(), engine_config(stage=3, dtype="bf16"))
    other_names = save_checkpoint(bn, root / "bn")
    bn.close()
    return {"good": step_dir, "shapes": other_shapes, "names": other_names}


def _snapshot(engine):
    opt = engine.shard_optimizer
    return {"state": engine.full_state_dict(),
            "opt": {k: {"master": opt.master_values(k).clone(),
                        **{n: t.clone() for n, t in opt.state_of(k).items()}} for k in opt.keys()},
            "counters": (engine.global_steps, engine.micro_steps, opt.step_count),
            "rng": torch.get_rng_state().clone()}


def _same(a, b):
    assert_exactly_equal(a["state"], b["state"])
    for k in a["opt"]:
        for n in a["opt"][k]:
            assert torch.equal(a["opt"][k][n], b["opt"][k][n]), (k, n)
    assert a["counters"] == b["counters"] and torch.equal(a["rng"], b["rng"])


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)


def _edit_manifest(path, fn):
    m = json.loads(path.read_text())
    fn(m)
    path.write_text(json.dumps(m))


CORRUPTIONS = {
    # name: (how to break a copy of the good save, the file the error must name)
    "missing-shard": (lambda d: os.remove(d / "u0002-r00000.safetensors"), "u0002-r00000"),
    "truncated-shard": (lambda d: _truncate(d / "u0001-r00000.safetensors"), "u0001-r00000"),
    "swapped-shard": (lambda d: shutil.copy(d / "u0001-r00000.safetensors",
                                            d / "u0002-r00000.safetensors"), "u0002-r00000"),
    "missing-buffers": (lambda d: os.remove(d / "buffers.safetensors"), "buffers.safetensors"),
    "truncated-rng": (lambda d: _truncate(d / "rng-r00000.safetensors"), "rng-r00000"),
    "wrong-version": (lambda d: _edit_manifest(d / "manifest.json",
                                               lambda m: m.update(version=99)), "manifest.json"),
    "truncated-manifest": (lambda d: _truncate(d / "manifest.json"), "manifest.json"),
    "ranges-do-not-tile": (lambda d: _edit_manifest(
        d / "manifest.json", lambda m: m["shards"].pop()), "manifest.json"),
    "no-manifest": (lambda d: os.remove(d / "manifest.json"), "latest"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS) + ["other-shapes", "other-names"])
def test_bad_checkpoints_are_rejected_before_any_state_changes(tmp_path, saved, case):
    root = tmp_path / "root"
    if case in ("other-shapes", "other-names"):
        shutil.copytree(saved["shapes" if case == "other-shapes" else "names"], root / "step-1")
        must_name = "manifest.json"
    else:
        shutil.copytree(saved["good"], root / "step-2")
        corrupt, must_name = CORRUPTIONS[case]
        corrupt(root / "step-2")
    (root / "latest").write_text(os.listdir(root)[0] + "\n")
    engine = infinity.initialize(tiny_gpt(seed=1), engine_config(stage=3, dtype="bf16"))
    engine_train(engine, batches(1, 1))
    before = _snapshot(engine)
    with pytest.raises(ValueError) as info:
        load_checkpoint(engine, root)
    print(info.value)
    assert must_name in str(info.value)
    _same(_snapshot(engine), before)
    engine_train(engine, batches(1, 1))  # and the engine still trains
    engine.close()


def test_manifest_from_another_model_names_the_parameters(saved, tmp_path):
    engine = infinity.initialize(tiny_gpt(), engine_config(stage=3, dtype="bf16"))
    with pytest.raises(CheckpointError,
                       match=r"ln_1\.weight' has shape \[32\] in the checkpoint, \[16\]"):
        load_checkpoint(engine, saved["shapes"])
    with pytest.raises(CheckpointError, match="another model.*'blocks"):
        load_checkpoint(engine, saved["names"])
    with pytest.raises(CheckpointError, match="no checkpoint here"):
        load_checkpoint(engine, tmp_path)
    engine.close()


# ------------------------------------------------------------------------------- consolidation


def _read_consolidated(out_dir):
    index = os.path.join(out_dir, "model.safetensors.index.json")
    if not os.path.exists(index):
        return safetensors_torch.load_file(os.path.join(out_dir, "model.safetensors"))
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    out = {}
    for name in sorted(set(weight_map.values())):
        part = safetensors_torch.load_file(os.path.join(out_dir, name))
        assert {k for k, v in weight_map.items() if v == name} == set(part)
        out.update(part)
    return out


@pytest.mark.parametrize("stage,dtype", [(3, "bf16"), (1, "fp32")])
def test_consolidate_equals_the_full_state_dict(tmp_path, stage, dtype):
    engine = infinity.initialize(tiny_gpt(), engine_config(stage=stage, dtype=dtype))
    engine_train(engine, batches(2, 1))
    save_checkpoint(engine, tmp_path / "ckpt")
    full = engine.full_state_dict()
    engine.close()
    result = consolidate(tmp_path / "ckpt", tmp_path / "one")
    got = _read_consolidated(tmp_path / "one")
    assert list(got) == list(tiny_gpt().state_dict())  # the key set, tied keys included
    assert_exactly_equal(got, {k: v.float() for k, v in full.items()})
    model = tiny_gpt(seed=2)
    model.load_state_dict(got, strict=True)
    assert result.index_path is None and len(result.files) == 1

    cap = 4_000  # several files, HF index
    result = consolidate(tmp_path / "ckpt", tmp_path / "many", dtype="bf16", max_shard_bytes=cap)
    assert len(result.files) > 3 and os.path.exists(result.index_path)
    for path in result.files:
        with safetensors_torch.safe_open(path, "pt") as f:
            keys = list(f.keys())
            sizes = [f.get_tensor(k).nbytes for k in keys]
            assert sum(sizes) <= cap or len(keys) == 1, path
            assert f.metadata()["format"] == "pt"
    got = _read_consolidated(tmp_path / "many")
    assert_exactly_equal(got, {k: v.to(torch.bfloat16) for k, v in full.items()})
    # Bounded memory: at most one parameter (fp32) and its bf16 cast held at once.
    largest = max(p.numel() for p in tiny_gpt().parameters())
    assert result.peak_held_bytes <= largest * (4 + 2)
    assert result.peak_held_bytes < result.total_bytes / 2


def test_consolidate_command_line(tmp_path, capsys):
    from infinity.cli import main

    engine = infinity.initialize(tiny_gpt(), engine_config(stage=3))
    engine_train(engine, batches(1, 1))
    save_checkpoint(engine, tmp_path / "ckpt")
    full = engine.full_state_dict()
    engine.close()
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out"),
                 "--max-shard-bytes", "8KB"]) == 0
    assert "tensors" in capsys.readouterr().out
    assert_exactly_equal(_read_consolidated(tmp_path / "out"), full)
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2  # not empty
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--overwrite"]) == 0
    assert sorted(os.listdir(tmp_path / "out")) == ["model.safetensors"]
    assert parse_bytes("5GB") == 5 * 10 ** 9 and parse_bytes("512MiB") == 512 * 2 ** 20


def test_consolidated_output_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2,
                                     n_head=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    keys = list(model.state_dict())
    engine = infinity.initialize(model, engine_config(stage=3, unit_class_names=("GPT2Block",)))
    engine_train(engine, batches(2, 1),
                 loss_fn=lambda m, b: m(input_ids=b[0], labels=b[1]).loss)
    save_checkpoint(engine, tmp_path / "ckpt")
    full = engine.full_state_dict()
    engine.close()
    consolidate(tmp_path / "ckpt", tmp_path / "hf", max_shard_bytes=30_000)
    config.save_pretrained(tmp_path / "hf")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    got = loaded.state_dict()
    assert list(got) == keys
    assert_exactly_equal({k: v.float() for k, v in got.items()}, {k: v.float() for k, v in full.items()})
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


_RSS_SCRIPT = textwrap.dedent("""
    import sys, torch
    from infinity.checkpoint import consolidate
    torch.set_num_threads(1)

    def status(field):  # this process's VmRSS / VmHWM (peak since the last reset) in bytes
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    base = status("VmRSS")
    result = consolidate(sys.argv[1], sys.argv[2], max_shard_bytes=10 ** 12)
    print(status("VmHWM") - base, result.total_bytes)
""")


def test_consolidate_memory_stays_near_one_parameter(tmp_path):
    """A 64 MiB model consolidated into ONE file: the process grows by about one parameter
    (4 MiB), not by the model."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(16)])
    engine = infinity.initialize(model, engine_config(stage=3, unit_class_names=("Linear",)))
    save_checkpoint(engine, tmp_path / "ckpt")
    engine.close()
    del engine, model
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(tmp_path / "ckpt"),
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                         check=True)
    growth, total = (int(x) for x in out.stdout.split())
    assert total == 16 * 1024 * 1024 * 4
    print(f"RSS grew by {growth} bytes consolidating {total} bytes")
    assert growth < total / 4, f"RSS grew by {growth} bytes consolidating {total} bytes"


def test_engine_methods_save_and_load(tmp_path):
    """engine.save_checkpoint / engine.load_checkpoint are the public face of this module."""
    seed_all(0)
    engine = infinity.initialize(tiny_gpt(), _config(tmp_path, stage=3))
    data = [micro[0] for micro in batches(4, 1)]
    for batch in data[:2]:
        engine.backward(engine(*batch))
        engine.step()
    saved = engine.save_checkpoint(str(tmp_path / "ckpt"))
    want = engine.full_state_dict()
    for batch in data[2:]:
        engine.backward(engine(*batch))
        engine.step()
    assert not torch.equal(next(iter(engine.full_state_dict().values())), next(iter(want.values())))
    engine.load_checkpoint(str(tmp_path / "ckpt"))
    assert_exactly_equal(engine.full_state_dict(), want)
    assert os.path.dirname(saved) == str(tmp_path / "ckpt")
    engine.close()
