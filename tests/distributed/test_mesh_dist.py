"""The engine over a device mesh on 4 ranks (gloo): HSDP 2 x 2 (shard over 2, replicate over 2)
and the flat shard-4 layout against single-process plain PyTorch on the same global batch, at
stages 1, 2 and 3 with clipping; the collective bytes per kind; a checkpoint saved at 2 x 2
loaded at shard-4 and in one process ([Note: mesh dimensions] in infinity/config/_mesh.py,
[Note: collectives over a mesh] in infinity/zero/_collectives.py).

The ranks are spawned once per test; the configurations loop inside the workers.
"""

from __future__ import annotations

import os

import pytest

from tests._support.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread")]

WORLD = 4
STEPS = 6
CLIP = 0.05
HSDP = {"replicate": 2, "shard": 2}
CONFIGS = [  # (name, stage, mesh section or "device-mesh", gradient accumulation steps)
    *[(f"hsdp-s{s}", s, HSDP, 1) for s in (0, 1, 2, 3)],
    ("hsdp-s3-gas2", 3, HSDP, 2),
    ("hsdp-s1-gas2", 1, HSDP, 2),
    ("hsdp-s3-device-mesh", 3, "device-mesh", 1),
    ("shard4-s3", 3, {}, 1),
    ("ddp4-s2", 2, {"shard": 1}, 1),
    ("hsdp-s3-bf16-gas2", 3, HSDP, 2),
    # Shard degree 1: gradients cross ranks only between replicas (in fp32 into fp32 host
    # accumulators, priced so by the offload budgets), each micro-batch's: host accumulators
    # are not summed across replicas at the step ([Note: replicas summed once per step]).
    ("ddp4-s2-bf16-fp32wire-optimizer-cpu", 2, {"shard": 1}, 2),
]
BF16 = {"dtype": "bf16", "reduce_dtype": "compute"}
"""The ``-bf16`` configs: the wire (reduce-scatter and replicate all-reduce) in bf16."""


def _engine(stage: int, mesh, gas: int = 1, precision: dict | None = None, **extra):
    import infinity
    from tests._support.engine import engine_config, tiny_gpt

    device_mesh = None
    if mesh == "device-mesh":
        from torch.distributed.device_mesh import init_device_mesh
        device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        mesh = {}
    return infinity.initialize(tiny_gpt(), engine_config(stage=stage, clip=CLIP, gas=gas,
                                                         mesh=mesh, precision=precision or {},
                                                         **extra),
                               mesh=device_mesh)


def _tensor_mesh_groups() -> dict:
    """This rank's groups on a shard 2 x tensor 2 mesh, built from the config and from a 3-D
    DeviceMesh (tensor parallelism itself is another part's; the groups are this one's)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from infinity.config import MeshConfig
    from infinity.zero._mesh import mesh_collectives

    def ranks(group):
        return None if group is None else dist.get_process_group_ranks(group)

    out = {}
    for how in ("config", "device-mesh"):
        device_mesh = (init_device_mesh("cpu", (1, 2, 2),
                                        mesh_dim_names=("replicate", "shard", "tensor"))
                       if how == "device-mesh" else None)
        config = MeshConfig(shard=2, tensor=2) if device_mesh is None else MeshConfig()
        coll = mesh_collectives(config, device_mesh)
        out[how] = {"shard": ranks(coll.group), "tensor": ranks(coll.tensor_group),
                    "data_parallel": ranks(coll.world.group), "replicate": coll.replicate}
    return out


def worker_parity(rank: int, world_size: int, out_dir: str, steps: int = STEPS) -> dict:
    import torch.distributed as dist

    from tests._support.engine import batches, engine_train

    out = {"groups": _tensor_mesh_groups()}
    for name, stage, mesh, gas in CONFIGS:
        if os.environ.get("MESH_ONLY") and name not in os.environ["MESH_ONLY"].split(","):
            continue
        extra = {"offload_optimizer": {"device": "cpu"}} if "optimizer-cpu" in name else {}
        precision = None if "bf16" not in name else {"dtype": "bf16"} if "fp32wire" in name \
            else BF16
        engine = _engine(stage, mesh, gas, precision, **extra)
        losses = engine_train(engine, batches(steps, gas), rank=rank, world_size=world_size)
        coll = engine.collectives
        shard_group = (list(range(world_size)) if coll.group is None
                       else dist.get_process_group_ranks(coll.group))
        trainable = [(g.padded_numel, g.shard_numel) for u in engine.manager.units
                     for g in u.groups if g.requires_grad]
        state = engine.full_state_dict()  # a collective: on every rank
        out[name] = {"losses": losses, "stats": engine.stats(), "shard_group": shard_group,
                     "trainable": trainable,
                     "state": state if rank in (0, world_size - 1) else None}
    return out


def test_hsdp_and_shard4_match_plain_pytorch_on_the_global_batch():
    from tests._support.engine import assert_close_run, batches, reference_train, tiny_gpt

    results = launch(__file__, "worker_parity", world_size=WORLD, timeout_s=300)
    for rank, res in enumerate(results):  # tensor innermost: [[0, 1], [2, 3]] x shard [0, 2]
        for how, groups in res["groups"].items():
            assert groups["tensor"] == [rank // 2 * 2, rank // 2 * 2 + 1], (how, rank)
            assert groups["shard"] == [rank % 2, rank % 2 + 2], (how, rank)
            assert groups["data_parallel"] == groups["shard"], (how, rank)
            assert groups["replicate"] is None
    for name, stage, mesh, gas in CONFIGS:
        # bf16: the reference runs each rank's quarter as its own backward (as the ranks do).
        dtype = "bf16" if "bf16" in name else "fp32"
        wire_bytes = 2 if dtype == "bf16" and "fp32wire" not in name else 4
        ref_losses, ref_state = reference_train(tiny_gpt(), batches(STEPS, gas), clip=CLIP,
                                                dtype=dtype, splits=1 if dtype == "fp32" else WORLD)
        for rank in (0, WORLD - 1):  # one rank of each replica
            got = results[rank][name]
            assert_close_run(got["losses"], got["state"], ref_losses, ref_state, dtype)
        shard = 4 if name.startswith("shard4") else 1 if name.startswith("ddp4") else 2
        for rank, res in enumerate(results):  # shard groups: contiguous ranks
            first = rank // shard * shard
            assert res[name]["shard_group"] == list(range(first, first + shard)), name
        got = results[0][name]
        stats, by_phase = got["stats"], got["stats"]["collective_bytes_sent"]
        assert stats["world_size"] == WORLD
        assert stats["mesh"] == {"replicate": WORLD // shard, "shard": shard, "tensor": 1}
        assert sum(by_phase.values()) == stats["bytes_moved"]["DEVICE<->DEVICE (collectives, sent)"]
        micro_batches = STEPS * gas
        # [Note: replicas summed once per step]: with the optimizer on the device the replicas
        # sum the accumulators once per step; an offloaded optimizer's cross them per micro-batch.
        replica_sums = micro_batches if "optimizer-cpu" in name else STEPS
        # [Note: one all-reduce per window at stages 0-1]: there the shard group too sums once.
        shard_sums = STEPS if stage < 2 and "optimizer-cpu" not in name else micro_batches
        if stage == 0:  # replicated: the whole buffer crosses the replicas, no norm exchange
            full_bytes = sum(padded for padded, _ in got["trainable"]) * 4
            assert by_phase["reduce-grad"] == shard_sums * full_bytes
            assert by_phase["replicate-reduce"] == replica_sums * full_bytes
            assert "norm" not in by_phase
            continue
        full_bytes = sum(padded for padded, _ in got["trainable"]) * wire_bytes
        shard_bytes = sum(part for _, part in got["trainable"]) * wire_bytes
        # The shard group reduces every trainable element once per micro-batch (a reduce-scatter
        # or all-reduce whose input is the whole buffer) ...
        assert by_phase.get("reduce-grad", 0) == (shard_sums * full_bytes if shard > 1 else 0), \
            (name, by_phase)
        # ... and only this rank's gradient shard crosses the replicas (stage 1: the shard of
        # the all-reduced buffer; stages 2-3: the reduce-scatter's output).
        replicas = WORLD // shard
        assert by_phase.get("replicate-reduce", 0) == (
            replica_sums * shard_bytes if replicas > 1 else 0), (name, by_phase)
        # The norm is summed over the shard group only: one fp64 per step.
        assert by_phase.get("norm", 0) == (STEPS * 8 if shard > 1 else 0), (name, by_phase)


SAVE_AT, MORE = 3, 3
CHECKPOINT_CONFIGS = {  # name: (stage, extra config)
    "s1": (1, {}),
    "s3": (3, {}),
    "s2-optimizer-cpu": (2, {"offload_optimizer": {"device": "cpu"}}),
}


def worker_checkpoint(rank: int, world_size: int, out_dir: str, root: str) -> dict:
    from tests._support.engine import batches, engine_train

    data = batches(SAVE_AT + MORE, 1)
    out = {}
    for name, (stage, extra) in CHECKPOINT_CONFIGS.items():
        ckpt = os.path.join(root, name)
        engine = _engine(stage, HSDP, **extra)
        engine_train(engine, data[:SAVE_AT], rank=rank, world_size=world_size)
        engine.save_checkpoint(ckpt)
        after = engine_train(engine, data[SAVE_AT:], rank=rank, world_size=world_size)
        state = engine.full_state_dict()
        engine.close()
        engine = _engine(stage, {}, **extra)  # shard-4
        engine.load_checkpoint(ckpt)
        resumed = engine_train(engine, data[SAVE_AT:], rank=rank, world_size=world_size)
        resumed_state = engine.full_state_dict()  # a collective: on every rank
        out[name] = {"after": after, "resumed": resumed,
                      "state": state if rank == 0 else None,
                      "resumed_state": resumed_state if rank == 0 else None,
                      "files": sorted(os.listdir(os.path.join(ckpt, f"step-{SAVE_AT}")))}
    return out


def test_checkpoint_saved_at_2x2_loads_at_shard4_and_in_one_process(tmp_path):
    import infinity
    from tests._support.engine import (assert_close_state, batches, engine_config, engine_train,
                                       tiny_gpt)

    results = launch(__file__, "worker_checkpoint", world_size=WORLD, timeout_s=300,
                     args={"root": str(tmp_path)})
    data = batches(SAVE_AT + MORE, 1)
    for name, (stage, extra) in CHECKPOINT_CONFIGS.items():
        got = results[0][name]
        # Replica 0 wrote the shards, named by shard rank; every rank its RNG state.
        shards = {f.rsplit("-", 1)[1] for f in got["files"] if f.startswith("u")}
        assert shards == {"r00000.safetensors", "r00001.safetensors"}, got["files"]
        assert sum(f.startswith("rng-") for f in got["files"]) == WORLD
        assert got["resumed"] == pytest.approx(got["after"], abs=1e-5)
        assert_close_state(got["resumed_state"], got["state"], atol=2e-5)
        one = infinity.initialize(tiny_gpt(), engine_config(stage=stage, clip=CLIP, **extra))
        one.load_checkpoint(str(tmp_path / name))
        assert engine_train(one, data[SAVE_AT:]) == pytest.approx(got["after"], abs=1e-5)
        assert_close_state(one.full_state_dict(), got["state"], atol=2e-5)
