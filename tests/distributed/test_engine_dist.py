"""The engine on 2 ranks (gloo): parity with single-process plain PyTorch on the same global batch,
per-rank memory, and ranks that diverge.

Each test spawns the 2 ranks once and loops over its configurations inside the workers (a torch
import costs ~2 s per process).
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

from tests._support.engine import lora_like
from tests._support.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread")]

CONFIGS = [  # (name, stage, dtype, gradient accumulation steps, clip)
    *[(f"s{s}-fp32", s, "fp32", 1, 0.0) for s in (0, 1, 2, 3)],
    *[(f"s{s}-bf16-gas4-clip", s, "bf16", 4, 0.05) for s in (0, 1, 2, 3)],
    ("s3-fp32-gas4-clip-bysize", 3, "fp32", 4, 0.05),
]
STEPS = 10


def worker_parity(rank: int, world_size: int, out_dir: str) -> dict:
    import infinity
    from tests._support.engine import batches, engine_config, engine_train, tiny_gpt

    out = {}
    for name, stage, dtype, gas, clip in CONFIGS:
        extra = dict(unit_class_names=(), unit_min_numel=500) if "bysize" in name else {}
        engine = infinity.initialize(tiny_gpt(), engine_config(stage=stage, dtype=dtype, gas=gas,
                                                               clip=clip, **extra))
        losses = engine_train(engine, batches(STEPS, gas), rank=rank, world_size=world_size)
        trainable = sum(g.padded_numel for u in engine.manager.units for g in u.groups
                        if g.requires_grad)
        out[name] = {"losses": losses, "state": engine.full_state_dict(), "stats": engine.stats(),
                     "trainable_padded_numel": trainable}
    return out


def test_two_ranks_match_plain_pytorch_on_the_global_batch():
    from tests._support.engine import assert_close_run, batches, reference_train, tiny_gpt

    results = launch(__file__, "worker_parity", timeout_s=240)
    for name, stage, dtype, gas, clip in CONFIGS:
        # fp32: the reference trains on the whole global batch at once. bf16: the reference runs
        # each rank's half as its own backward (as the ranks do), so the bf16 rounding matches.
        ref_losses, ref_state = reference_train(tiny_gpt(), batches(STEPS, gas), dtype=dtype,
                                                clip=clip, splits=1 if dtype == "fp32" else 2)
        for rank, res in enumerate(results):
            got = res[name]
            assert_close_run(got["losses"], got["state"], ref_losses, ref_state, dtype)
        # Resident model state per rank: stage 3 shards everything but the persistent unit.
        stats = results[0][name]["stats"]
        assert stats["world_size"] == 2
        # Collective bytes per kind add up to the total; fp32 without accumulation reduces
        # every trainable element once per step, in fp32 (all-reduce below stage 2, else a
        # reduce-scatter whose input is the whole buffer: the same bytes sent).
        by_phase = stats["collective_bytes_sent"]
        assert sum(by_phase.values()) == stats["bytes_moved"]["DEVICE<->DEVICE (collectives, sent)"]
        if dtype == "fp32" and gas == 1:
            assert by_phase["reduce-grad"] == STEPS * results[0][name]["trainable_padded_numel"] * 4
        gathers = by_phase.get("forward-gather", 0) + by_phase.get("backward-gather", 0)
        assert (gathers > 0) == (stage == 3), (name, by_phase)


OFFLOAD_CONFIGS = [  # (name, stage, dtype, gas, clip, optimizer offload, parameter offload, host)
    # + 24576: the fp32 gradient shards' accumulators in the host arena (four groups of 640,
    # 1640, 1640 and 16 elements per rank, 4 KiB extents; [Note: gradient placement]).
    ("s3-bf16-gas2-nvme-nvme-tight", 3, "bf16", 2, 0.05, "nvme", "nvme", 65536 + 24576),
    ("s3-fp32-param-cpu", 3, "fp32", 1, 0.0, "none", "cpu", "auto"),
    ("s2-fp32-gas2-opt-cpu", 2, "fp32", 2, 0.05, "cpu", "none", "auto"),
]


def worker_offload(rank: int, world_size: int, out_dir: str) -> dict:
    import infinity
    from tests._support.engine import batches, engine_config, engine_train, tiny_gpt

    out = {}
    for name, stage, dtype, gas, clip, opt, param, host in OFFLOAD_CONFIGS:
        path = f"{out_dir}/swap"
        engine = infinity.initialize(tiny_gpt(), engine_config(
            stage=stage, dtype=dtype, gas=gas, clip=clip, zero={"sub_group_numel": 200},
            offload_optimizer={"device": opt, "nvme_path": path},
            offload_param={"device": param, "nvme_path": path},
            memory={"host_budget_bytes": host}))
        losses = engine_train(engine, batches(6, gas), rank=rank, world_size=world_size)
        out[name] = {"losses": losses, "state": engine.full_state_dict(), "stats": engine.stats()}
        engine.close()
    # [Note: saved activations are shards of the store]: each rank's block inputs (4 x 16 x 16
    # fp32, 4 KiB) on its own swap files, read back through a 64 KiB arena.
    import infinity.zero._stored_activations as stored_module
    stored_module.MIN_STORED_BYTES = 1024
    for name, stage in ACTIVATION_CONFIGS:
        engine = infinity.initialize(tiny_gpt(), engine_config(
            stage=stage, gas=2, memory={"host_budget_bytes": 65536},
            activation_checkpointing={"units": "all", "offload": "nvme",
                                      "nvme_path": f"{out_dir}/swap-acts"}))
        losses = engine_train(engine, batches(6, 2), rank=rank, world_size=world_size)
        out[name] = {"losses": losses, "state": engine.full_state_dict(), "stats": engine.stats()}
        engine.close()
    return out


ACTIVATION_CONFIGS = [("s3-fp32-gas2-acts-nvme", 3), ("s0-fp32-gas2-acts-nvme", 0)]


def test_two_ranks_with_offload_match_plain_pytorch():
    from tests._support.engine import assert_close_run, batches, reference_train, tiny_gpt

    results = launch(__file__, "worker_offload", timeout_s=240)
    for name, stage, dtype, gas, clip, opt, param, host in OFFLOAD_CONFIGS:
        ref_losses, ref_state = reference_train(tiny_gpt(), batches(6, gas), dtype=dtype,
                                                clip=clip, splits=1 if dtype == "fp32" else 2)
        for res in results:
            got = res[name]
            assert_close_run(got["losses"], got["state"], ref_losses, ref_state, dtype)
            if host != "auto":
                assert got["stats"]["bytes"]["HOST"]["peak"] <= host
                assert got["stats"]["bytes_moved"]["NVME->HOST"] > 0
    ref_losses, ref_state = reference_train(tiny_gpt(), batches(6, 2))
    for name, _stage in ACTIVATION_CONFIGS:
        for res in results:
            got = res[name]
            assert_close_run(got["losses"], got["state"], ref_losses, ref_state, "fp32")
            acts = got["stats"]["activations"]
            assert acts["NVME"]["saved"] == 6 * 2 * 2 * 4 * 16 * 16 * 4  # steps x gas x blocks
            assert acts["nvme_written_bytes"] == acts["NVME"]["saved"]


def _sometimes_model():
    """Tiny GPT plus a block that runs only on every other forward (unused parameters)."""
    from tests._support.models import SometimesGPT

    return SometimesGPT()


EDGE_CASES = [("unused-s2", _sometimes_model, 2), ("unused-s3", _sometimes_model, 3),
              ("frozen-s3", lora_like, 3)]


def worker_edge_cases(rank: int, world_size: int, out_dir: str) -> dict:
    import infinity
    from tests._support.engine import batches, engine_config, engine_train

    out = {}
    for name, make, stage in EDGE_CASES:
        engine = infinity.initialize(make(), engine_config(stage=stage, gas=2))
        losses = engine_train(engine, batches(6, 2), rank=rank, world_size=world_size)
        out[name] = {"losses": losses, "state": engine.full_state_dict()}
    return out


def test_two_ranks_unused_and_frozen_parameters():
    from tests._support.engine import assert_close_run, batches, reference_train

    results = launch(__file__, "worker_edge_cases", timeout_s=180)
    for name, make, _stage in EDGE_CASES:
        ref_losses, ref_state = reference_train(make(), batches(6, 2))
        for res in results:
            assert_close_run(res[name]["losses"], res[name]["state"], ref_losses, ref_state,
                             "fp32")


def worker_memory(rank: int, world_size: int, out_dir: str) -> dict:
    import infinity
    from tests._support.engine import batches, engine_config, engine_train, tiny_gpt

    engine = infinity.initialize(tiny_gpt(), engine_config(stage=3, persistence_threshold_numel=0))
    engine_train(engine, batches(2, 1), rank=rank, world_size=world_size)
    return engine.stats()


def test_stage3_resident_model_state_halves_with_two_ranks():
    import infinity
    from tests._support.engine import batches, engine_config, engine_train, tiny_gpt

    one = infinity.initialize(tiny_gpt(), engine_config(stage=3, persistence_threshold_numel=0))
    engine_train(one, batches(2, 1))
    single = one.stats()["bytes"]["DEVICE"]["current"]
    # Independent figure: fp32 AdamW at stage 3 keeps the parameter shard (the master) and two
    # moments, 12 bytes per element, all sharded (nothing persistent, gradients freed by step).
    numel = sum(p.numel() for p in tiny_gpt().parameters())
    assert single == pytest.approx(12 * numel, rel=0.01)
    per_rank = [s["bytes"]["DEVICE"]["current"] for s in launch(__file__, "worker_memory")]
    for value in per_rank:
        assert value == pytest.approx(single / 2, rel=0.02)


def worker_diverge(rank: int, world_size: int, out_dir: str, at_micro_step: int) -> str:
    import infinity
    from infinity.zero import CollectiveError
    from infinity.zero._collectives import CHECK_ENV
    from tests._support.engine import batches, engine_config, tiny_gpt

    # Past the first step the agreement check runs only when asked for: without it, units of
    # one size gathered in a different order go unnoticed, and the first collective whose sizes
    # differ aborts the process inside gloo (no Python error to raise).
    os.environ[CHECK_ENV] = "1" if at_micro_step else "0"
    model = tiny_gpt()
    calls = {"n": 0}
    block = model.blocks[1]

    class MaybeSkipped(type(block)):
        def __call__(self, x):  # rank 1 skips block 1, hooks and all, on one micro-step:
            if rank == 1 and calls["n"] == at_micro_step:  # its gathers diverge
                return x
            return super().__call__(x)

    # (A block whose hooks run and whose compute does not only leaves its gradients out on
    # rank 1: that trains, tests/distributed/test_rank_branch_dist.py.)
    MaybeSkipped.__name__ = type(block).__name__  # still a unit: unit_class_names=("Block",)
    block.__class__ = MaybeSkipped
    engine = infinity.initialize(model, engine_config(stage=3))
    try:
        for micro in batches(4, 1):
            x, y = (t.chunk(world_size)[rank] for t in micro[0])
            engine.backward(engine(x, y))
            engine.step()
            calls["n"] += 1
    except CollectiveError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("at_micro_step", [0, 2], ids=["first-step-check", "later-timeout"])
def test_diverging_ranks_raise_instead_of_hanging(at_micro_step):
    messages = launch(__file__, "worker_diverge", timeout_s=90, pg_timeout_s=4,
                      args={"at_micro_step": at_micro_step})
    print(messages)
    for message in messages:
        assert message != "no error"
        if at_micro_step == 0:
            assert "ranks diverged" in message and "unit" in message and "step 0" in message
        else:
            assert "micro-step 2" in message or "step 2" in message, message


_TORCHRUN_SCRIPT = """
import json, os, sys, torch
torch.set_num_threads(1)
import infinity
from tests._support.engine import batches, engine_config, engine_train, tiny_gpt
engine = infinity.initialize(tiny_gpt(), engine_config(stage=3))   # no init_process_group here
rank = torch.distributed.get_rank()
losses = engine_train(engine, batches(4, 1), rank=rank, world_size=engine.stats()["world_size"])
state = engine.full_state_dict()
if rank == 0:
    torch.save({"losses": losses, "state": state, "world_size": engine.stats()["world_size"]},
               sys.argv[1])
from infinity._process_exit import exit_after_distributed
exit_after_distributed(0)  # [Note: gloo teardown at exit] in infinity/_process_exit.py
"""


def test_torchrun_without_init_process_group_uses_the_launcher_environment(tmp_path):
    """Under torchrun the engine creates the default process group itself (gloo on CPU)."""
    import os
    import subprocess

    import torch

    from tests._support.engine import assert_close_run, batches, reference_train, tiny_gpt

    script = tmp_path / "train.py"
    script.write_text(_TORCHRUN_SCRIPT)
    out = tmp_path / "result.pt"
    repo = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(repo), str(repo / "tests" / "unit")]))
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node", "2", str(script), str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: killable as one
    try:
        log, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # torchrun and both workers
        log, _ = proc.communicate()
    assert proc.returncode == 0, log[-4000:]
    result = torch.load(out, weights_only=False)
    assert result["world_size"] == 2
    ref_losses, ref_state = reference_train(tiny_gpt(), batches(4, 1))
    assert_close_run(result["losses"], result["state"], ref_losses, ref_state, "fp32")


def _batchnorm_net():
    from tests._support.models import BatchNormNet

    return BatchNormNet()


def worker_buffers(rank: int, world_size: int, out_dir: str) -> dict:
    import infinity
    from tests._support.engine import batches, engine_config, engine_train

    engine = infinity.initialize(_batchnorm_net(), engine_config(stage=3,
                                                                 unit_class_names=("Linear",)))
    losses = engine_train(engine, batches(4, 1), rank=rank, world_size=world_size)
    return {"losses": losses, "state": engine.full_state_dict()}


def _ddp_reference(model, data):
    """Plain PyTorch emulating DistributedDataParallel on 2 ranks: each half of the batch runs
    from the same buffers (rank 0's, broadcast), gradients are averaged, and rank 0's updated
    buffers are kept (BatchNorm statistics of its half)."""
    import torch

    from tests._support.engine import BETAS, EPS, LR, WD

    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = []
    for (batch,) in data:
        start = {k: b.clone() for k, b in model.named_buffers()}
        kept, total = None, 0.0
        for r, part in enumerate(zip(*(t.chunk(2) for t in batch))):
            with torch.no_grad():
                for k, b in model.named_buffers():
                    b.copy_(start[k])
            loss = model(*part)
            (loss / 2).backward()
            total += loss.item() / 2
            if r == 0:
                kept = {k: b.clone() for k, b in model.named_buffers()}
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(kept[k])
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().float() for k, v in model.state_dict().items()}


def test_two_ranks_keep_rank0_buffers_like_ddp():
    """BatchNorm running statistics: each training forward starts from rank 0's buffers, so both
    ranks end with the same values, those of DistributedDataParallel (emulated in plain PyTorch)."""
    from tests._support.engine import assert_close_run, batches

    results = launch(__file__, "worker_buffers", timeout_s=120)
    ref_losses, ref_state = _ddp_reference(_batchnorm_net(), batches(4, 1))
    for res in results:
        assert_close_run(res["losses"], res["state"], ref_losses, ref_state, "fp32")
    assert results[0]["state"]["body.1.running_mean"].equal(
        results[1]["state"]["body.1.running_mean"])


REDUCE_CASES = [("s2-bf16", 2), ("s3-bf16", 3), ("s1-bf16", 1)]


def worker_reduce_dtype(rank: int, world_size: int, out_dir: str) -> dict:
    import infinity
    from tests._support.engine import batches, engine_config, engine_train, tiny_gpt

    out = {}
    for name, stage in REDUCE_CASES:
        for reduce_dtype in ("fp32", "compute"):
            config = engine_config(stage=stage, dtype="bf16")
            config["precision"]["reduce_dtype"] = reduce_dtype
            engine = infinity.initialize(tiny_gpt(), config)
            losses = engine_train(engine, batches(STEPS, 1), rank=rank, world_size=world_size)
            trainable = sum(g.padded_numel for u in engine.manager.units for g in u.groups
                            if g.requires_grad)
            out[name, reduce_dtype] = {
                "losses": losses, "state": engine.full_state_dict(), "trainable": trainable,
                "sent": engine.stats()["bytes_moved"]["DEVICE<->DEVICE (collectives, sent)"]}
            engine.close()
    return out


def test_gradients_cross_ranks_in_the_compute_dtype_when_asked():
    """precision.reduce_dtype 'compute' (DeepSpeed's communication_data_type = bf16): each
    gradient reduction sends bf16, exactly half the fp32 bytes, and training still matches plain
    PyTorch within the bf16 tolerance."""
    from tests._support.engine import assert_close_run, batches, reference_train, tiny_gpt

    results = launch(__file__, "worker_reduce_dtype", timeout_s=240)
    for name, _stage in REDUCE_CASES:
        ref_losses, ref_state = reference_train(tiny_gpt(), batches(STEPS, 1), dtype="bf16",
                                                splits=2)
        for res in results:
            fp32, compute = res[name, "fp32"], res[name, "compute"]
            # One reduction per trainable element per step: 4 bytes on the wire become 2.
            assert fp32["sent"] - compute["sent"] == STEPS * fp32["trainable"] * 2, name
            assert_close_run(compute["losses"], compute["state"], ref_losses, ref_state, "bf16")
