"""Checkpoints across world sizes (2 ranks on gloo and 1 process): save with 2 ranks and load
with 1, save with 1 and load with 2, continue training and match plain PyTorch; consolidate a
2-rank checkpoint; a shard of one rank missing makes every rank refuse before changing state.

One spawn runs every case (a torch import costs ~2 s per process); the single-process halves run
in the pytest process before and after it.
"""

from __future__ import annotations

import json
import os

import pytest

from tests._support.engine import rank_config
from tests._support.launch import launch

pytestmark = pytest.mark.distributed

CASES = [  # name, stage, dtype, gradient accumulation steps, offload (optimizer and parameters)
    ("s3-fp32", 3, "fp32", 1, "none"),
    ("s0-fp32", 0, "fp32", 1, "none"),  # every rank holds everything; each writes its half
    ("s1-fp32-gas2", 1, "fp32", 2, "none"),
    ("s2-bf16", 2, "bf16", 1, "none"),
    ("s3-fp32-nvme", 3, "fp32", 1, "nvme"),
]
STEPS, SAVE_AT = 6, 3


def _state(engine) -> dict:
    return {k: v.detach().cpu().clone() for k, v in engine.full_state_dict().items()}


def worker(rank: int, world_size: int, out_dir: str, root: str) -> dict:
    import shutil

    import torch

    import infinity
    from infinity.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from infinity.io import SafetensorsFile
    from tests._support.engine import batches, engine_train, tiny_gpt

    read_bytes = {"n": 0}
    real_read_into = SafetensorsFile.read_into

    def counting_read_into(self, name, out, *, start_numel=0):  # shard payload read by this rank
        if os.path.basename(self.path).startswith("u"):
            read_bytes["n"] += out.numel() * out.element_size()
        return real_read_into(self, name, out, start_numel=start_numel)

    SafetensorsFile.read_into = counting_read_into
    out = {}
    for name, stage, dtype, gas, offload in CASES:
        cfg = rank_config(root, name, rank, stage=stage, dtype=dtype, offload=offload, gas=gas)
        data = batches(STEPS, gas)
        # Save with 2 ranks (the process at 1 rank loads it afterwards) and keep going.
        engine = infinity.initialize(tiny_gpt(), cfg)
        engine_train(engine, data[:SAVE_AT], rank=rank, world_size=world_size)
        save_checkpoint(engine, os.path.join(root, name, "two"))
        saved = _state(engine)
        rest = engine_train(engine, data[SAVE_AT:], rank=rank, world_size=world_size)
        engine.close()
        # Load what 1 process saved, and keep going.
        engine = infinity.initialize(tiny_gpt(seed=9), cfg)
        read_bytes["n"] = 0
        load_checkpoint(engine, os.path.join(root, name, "one"))
        bytes_read = read_bytes["n"]
        loaded = _state(engine)
        resumed = engine_train(engine, data[SAVE_AT:], rank=rank, world_size=world_size)
        out[name] = {"saved": saved, "rest": rest, "loaded": loaded, "resumed": resumed,
                     "final": _state(engine), "bytes_read": bytes_read}
        engine.close()
    # Rank 1's shard of one unit is gone: both ranks refuse, neither changes anything.
    name, stage, dtype, gas, offload = CASES[0]
    if rank == 0:
        shutil.copytree(os.path.join(root, name, "two"), os.path.join(root, "broken"))
        os.remove(os.path.join(root, "broken", f"step-{SAVE_AT}", "u0002-r00001.safetensors"))
    torch.distributed.barrier()
    engine = infinity.initialize(tiny_gpt(seed=9), rank_config(root, name, rank, stage=stage, dtype=dtype, offload=offload, gas=gas))
    before = _state(engine)
    try:
        load_checkpoint(engine, os.path.join(root, "broken"))
        out["broken"] = "no error"
    except CheckpointError as e:
        out["broken"] = str(e)
    out["broken_unchanged"] = all(v.equal(before[k]) for k, v in _state(engine).items())
    engine.close()
    return out


def _single(root, name, stage, dtype, gas, offload) -> dict:
    import infinity
    from infinity.checkpoint import save_checkpoint
    from tests._support.engine import batches, engine_train, tiny_gpt

    engine = infinity.initialize(tiny_gpt(), rank_config(root, name, 0, stage=stage, dtype=dtype, offload=offload, gas=gas))
    data = batches(STEPS, gas)
    engine_train(engine, data[:SAVE_AT])
    save_checkpoint(engine, os.path.join(root, name, "one"))
    saved = _state(engine)
    engine.close()
    return saved


def test_checkpoints_move_between_world_sizes(tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file

    import infinity
    from infinity.checkpoint import consolidate, load_checkpoint
    from tests._support.engine import (TOL, assert_close_run, batches, engine_train,
                                       reference_train, tiny_gpt)

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    root = str(tmp_path)
    saved_one = {c[0]: _single(root, *c) for c in CASES}
    try:
        results = launch(__file__, "worker", timeout_s=240, args={"root": root})
    finally:
        torch.set_num_threads(old)
    for name, stage, dtype, gas, offload in CASES:
        cfg = rank_config(root, name, 0, stage=stage, dtype=dtype, offload=offload, gas=gas)
        data = batches(STEPS, gas)
        two = results[0][name]
        for rank in (0, 1):  # both ranks see the same model
            for k, v in results[rank][name]["loaded"].items():
                assert torch.equal(v, saved_one[name][k]), (name, rank, k)  # 1 -> 2 ranks: exact
        # Each rank read only the byte ranges of what it owns now (stage 0: everything).
        stored = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in
                     os.walk(os.path.join(root, name, "one")) for f in fs if f.startswith("u"))
        read = [results[rank][name]["bytes_read"] for rank in (0, 1)]
        if stage == 0:
            assert all(stored * 0.9 < r <= stored for r in read), (name, read, stored)
        else:
            assert all(r < stored * 0.55 for r in read) and sum(read) > stored * 0.9, \
                (name, read, stored)
        # 2 -> 1 rank: exact after load; then 1 rank goes on where 2 ranks went on.
        engine = infinity.initialize(tiny_gpt(seed=9), cfg)
        load_checkpoint(engine, os.path.join(root, name, "two"))
        for k, v in _state(engine).items():
            assert torch.equal(v, two["saved"][k]), (name, k)
        resumed = engine_train(engine, data[SAVE_AT:])
        final = _state(engine)
        engine.close()
        # Against plain PyTorch on the global batch (bf16: each rank's half as its own backward).
        ref_losses, ref_state = reference_train(tiny_gpt(), data, dtype=dtype,
                                                splits=1 if dtype == "fp32" else 2)
        tol = TOL[dtype]["loss"]
        assert two["rest"] == pytest.approx(ref_losses[SAVE_AT:], abs=tol), name
        assert two["resumed"] == pytest.approx(ref_losses[SAVE_AT:], abs=tol), name
        assert resumed == pytest.approx(ref_losses[SAVE_AT:], abs=tol), name
        if dtype == "fp32":
            assert_close_run(resumed, final, ref_losses[SAVE_AT:], ref_state, dtype)
            assert_close_run(two["resumed"], two["final"], ref_losses[SAVE_AT:], ref_state, dtype)
        with open(os.path.join(root, name, "two", f"step-{SAVE_AT}", "manifest.json")) as f:
            manifest = json.load(f)
        assert manifest["world_size"] == 2 and {s["rank"] for s in manifest["shards"]} == {0, 1}
        # Consolidating the 2-rank save gives the unsharded state dict, exactly.
        out = os.path.join(root, name, "consolidated")
        consolidate(os.path.join(root, name, "two"), out, max_shard_bytes=8000)
        index = os.path.join(out, "model.safetensors.index.json")
        got = {}
        for f in sorted(os.listdir(out)):
            if f.endswith(".safetensors"):
                got.update(load_file(os.path.join(out, f)))
        assert os.path.exists(index) and list(got) != [] and set(got) == set(two["saved"])
        for k, v in two["saved"].items():
            assert torch.equal(got[k], v.float()), (name, k)
    for rank in (0, 1):
        message = results[rank]["broken"]
        assert "u0002-r00001.safetensors" in message and "missing" in message, message
        assert results[rank]["broken_unchanged"]
    shutil.rmtree(os.path.join(root, "swap"), ignore_errors=True)
