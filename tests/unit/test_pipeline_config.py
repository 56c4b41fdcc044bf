"""The pipeline's configuration ([Note: mesh dimensions] in infinity/config/_mesh.py): the mesh
with ``pipeline`` outermost against the rank formula written out here, the ``pipeline``
section's checks, the native round trip, DeepSpeed's ``pipeline`` section key by key, the
refusal of a pipeline config by ``infinity.initialize``, and the planner's written config."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

import infinity
from infinity.config import InfinityConfig, MeshConfig, PipelineConfig, load_config
from infinity.zero._mesh import mesh_ranks


def test_mesh_resolve_divides_by_the_pipeline_first():
    assert MeshConfig(pipeline=2).resolve(8) == (1, 4, 1)          # flat ZeRO over a stage
    assert MeshConfig(pipeline=2, shard=2).resolve(8) == (2, 2, 1)  # replicate 'auto'
    assert MeshConfig(pipeline=4, tensor=2).resolve(8) == (1, 1, 2)
    assert MeshConfig(pipeline=2, replicate=2, shard=2).resolve(8) == (2, 2, 1)
    with pytest.raises(ValueError, match=r"mesh\.pipeline.*divisor of the world size 6"):
        MeshConfig(pipeline=4).resolve(6)
    with pytest.raises(ValueError):  # the stage's 4 ranks are not 3 x 2
        MeshConfig(pipeline=2, replicate=3, shard=2).resolve(8)
    with pytest.raises(ValueError, match=r"mesh\.pipeline"):
        MeshConfig(pipeline=0)


@pytest.mark.parametrize("P,R,S,T", [(2, 1, 2, 1), (2, 2, 2, 1), (3, 1, 2, 2), (4, 2, 1, 2),
                                     (2, 2, 2, 2), (1, 2, 3, 1)])
def test_mesh_ranks_against_the_formula(P, R, S, T):
    def at(p, r, s, t):  # [Note: mesh dimensions]: pipeline outermost, tensor innermost
        return ((p * R + r) * S + s) * T + t

    coords = list(itertools.product(range(P), range(R), range(S), range(T)))
    assert sorted(at(*c) for c in coords) == list(range(P * R * S * T))

    def groups(same):
        """The ranks grouped by the coordinates named in ``same`` (each group sorted)."""
        out: dict[tuple, list[int]] = {}
        for p, r, s, t in coords:
            c = {"p": p, "r": r, "s": s, "t": t}
            out.setdefault(tuple(c[k] for k in same), []).append(at(p, r, s, t))
        return sorted(tuple(sorted(g)) for g in out.values())

    m = mesh_ranks(world_size=P * R * S * T, replicate=R, shard=S, tensor=T, pipeline=P)
    assert (m.pipeline, m.replicate, m.shard, m.tensor) == (P, R, S, T)

    def norm(gs):
        return sorted(tuple(sorted(g)) for g in gs)

    assert norm(m.shard_groups) == groups("prt")             # vary s
    assert norm(m.replicate_groups) == groups("pst")         # vary r
    assert norm(m.tensor_groups) == groups("prs")            # vary t
    assert norm(m.data_parallel_groups) == groups("pt")      # vary r and s
    assert norm(m.pipeline_groups) == groups("rst")          # vary p
    assert norm(m.stage_groups) == groups("p")               # vary r, s and t
    # A pipeline group lists its ranks by stage: rank k of it is stage k (the engine's
    # broadcast from the last stage reads it so).
    for g in m.pipeline_groups:
        assert [(x // (R * S * T)) for x in g] == list(range(P))
    with pytest.raises(ValueError, match="expected the world size"):
        mesh_ranks(world_size=P * R * S * T + 1, replicate=R, shard=S, tensor=T, pipeline=P)


def test_pipeline_config_checks():
    assert PipelineConfig().schedule == "1f1b" and PipelineConfig().micro_batches == "auto"
    for schedule in ("gpipe", "1f1b"):
        PipelineConfig(schedule=schedule)
    PipelineConfig(schedule="interleaved-1f1b", stages_per_rank=2)
    with pytest.raises(ValueError, match=r"pipeline\.schedule"):
        PipelineConfig(schedule="zero-bubble")
    with pytest.raises(ValueError, match=r"pipeline\.stages_per_rank"):
        PipelineConfig(schedule="1f1b", stages_per_rank=2)
    with pytest.raises(ValueError, match=r"pipeline\.stages_per_rank"):
        PipelineConfig(schedule="interleaved-1f1b", stages_per_rank=1)
    with pytest.raises(ValueError, match=r"pipeline\.micro_batches"):
        PipelineConfig(micro_batches=0)
    with pytest.raises(ValueError, match=r"pipeline\.max_stage_imbalance"):
        PipelineConfig(max_stage_imbalance=0.5)
    assert PipelineConfig().resolve_micro_batches(6) == 6
    assert PipelineConfig(micro_batches=3).resolve_micro_batches(6) == 3
    with pytest.raises(ValueError, match=r"pipeline\.schedule"):
        load_config({"pipeline": {"schedule": "GPipe"}})
    with pytest.raises(ValueError, match="micro_batch"):  # a misspelt key is named
        load_config({"pipeline": {"micro_batch": 4}})


def test_native_round_trip_keeps_the_pipeline():
    cfg = load_config({"mesh": {"pipeline": 4, "shard": 2},
                       "pipeline": {"schedule": "gpipe", "micro_batches": 8,
                                    "max_stage_imbalance": 2.0},
                       "gradient_accumulation_steps": 8})
    again = load_config(cfg.to_dict())
    assert again == cfg
    assert again.mesh.pipeline == 4 and again.pipeline == PipelineConfig(
        schedule="gpipe", micro_batches=8, max_stage_imbalance=2.0)
    assert load_config(InfinityConfig().to_dict()).mesh.pipeline == 1


def _ds(pipeline: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
            "zero_optimization": {"stage": 1}, "pipeline": pipeline}


def _load_warnings(raw: dict) -> tuple[InfinityConfig, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(raw)
    return cfg, [str(w.message) for w in caught]


def test_deepspeed_pipeline_section_key_by_key():
    cfg, messages = _load_warnings(_ds({"stages": 2, "partition": "parameters",
                                        "activation_checkpoint_interval": 0,
                                        "pipe_partitioned": True, "grad_partitioned": True}))
    assert cfg.mesh.pipeline == 2
    assert cfg.gradient_accumulation_steps == 4
    assert cfg.pipeline.resolve_micro_batches(cfg.gradient_accumulation_steps) == 4
    partition = [m for m in messages if "partition" in m and "pipe_partitioned" not in m]
    assert len(partition) == 1 and "balanced split" in partition[0], messages
    _, again = _load_warnings(_ds({"stages": 2, "partition": "uniform"}))
    assert not [m for m in again if "'pipeline.partition'" in m], "one warning per process"


def test_deepspeed_activation_checkpoint_interval():
    with pytest.raises(ValueError, match="activation_checkpoint_interval"):
        load_config(_ds({"stages": 2, "activation_checkpoint_interval": 1}))
    # The common public form: the interval alone, at 0, no stages: no pipeline.
    cfg = load_config(_ds({"activation_checkpoint_interval": 0}))
    assert cfg.mesh.pipeline == 1
    assert load_config(_ds({"stages": "auto"})).mesh.pipeline == 1
    with pytest.raises(ValueError, match=r"pipeline\.stages"):
        load_config(_ds({"stages": 0}))


def test_initialize_refuses_a_pipeline_config():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"infinity\.pipeline\.initialize"):
        infinity.initialize(model, {"mesh": {"pipeline": 2}})


def test_planner_config_with_a_pipeline_loads():
    """The planner's config of a 2-stage candidate (``mesh_config_dict``, what ``infinity plan
    --nodes ... --write-config`` writes) reads back with its pipeline."""
    from infinity.ledger import Cluster, MeshLayout, MeshRequest, ModelShape, mesh_config_dict, \
        price_mesh

    shape = ModelShape(kind="gpt2", num_layers=2, hidden_size=64, num_heads=2, vocab_size=64,
                       seq_len=100)
    req = MeshRequest(numel=1_000_000, shape=shape, device_memory_bytes=80 * 2**30,
                      device_flops=1e12, mfu=0.5, device_memory_bytes_per_s=1e12,
                      quantization_block_numel=1000, checkpointing=(False,), global_batch=8)
    cluster = Cluster(nodes=2, gpus_per_node=2, intra_node_bytes_per_s=100e9,
                      inter_node_bytes_per_s=10e9)
    cand = price_mesh(req, cluster, MeshLayout(pipeline=2, replicate=1, shard=2),
                      checkpointing=False)
    raw = mesh_config_dict(cand, req)
    cfg = load_config(raw)
    assert cfg.mesh.pipeline == 2 and cfg.mesh.resolve(4) == (1, 2, 1)
    assert cfg.pipeline.schedule == raw["pipeline"]["schedule"]
    assert cfg.pipeline.resolve_micro_batches(cfg.gradient_accumulation_steps) == cand.grad_accum


@pytest.mark.parametrize("pipeline", [{"activation_checkpoint_interval": 0}, {"stages": 2}])
def test_deepspeed_pipeline_keys_make_a_deepspeed_config(pipeline):
    raw = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
           "pipeline": pipeline}
    cfg = load_config(raw)
    assert cfg.mesh.pipeline == pipeline.get("stages", 1)
