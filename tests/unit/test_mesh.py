"""The device mesh's pure parts: the rank lists of each group ([Note: mesh dimensions] in
infinity/config/_mesh.py) against hand-written layouts and the coordinate formula, and the
``mesh`` config section's resolution and errors."""

from __future__ import annotations

import itertools

import pytest

from infinity.config import MeshConfig, config_from_deepspeed, config_to_deepspeed, load_config
from infinity.zero._mesh import mesh_ranks


def test_hsdp_2x2_groups_are_contiguous_shard_groups_and_strided_replicas():
    m = mesh_ranks(world_size=4, replicate=2, shard=2)
    assert m.shard_groups == ((0, 1), (2, 3))
    assert m.replicate_groups == ((0, 2), (1, 3))
    assert m.tensor_groups == ((0,), (1,), (2,), (3,))
    assert m.data_parallel_groups == ((0, 1, 2, 3),)


def test_two_nodes_of_four_ranks_share_a_shard_group_per_node():
    m = mesh_ranks(world_size=8, replicate=2, shard=4)
    assert m.shard_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert m.replicate_groups == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_tensor_is_innermost_and_zero_dims_live_within_a_tensor_slice():
    # torchrun + DeviceMesh(("replicate", "shard", "tensor")) with sizes (2, 2, 2).
    m = mesh_ranks(world_size=8, replicate=2, shard=2, tensor=2)
    assert m.tensor_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert m.shard_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert m.replicate_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert m.data_parallel_groups == ((0, 2, 4, 6), (1, 3, 5, 7))


@pytest.mark.parametrize("r,s,t", [(1, 4, 1), (4, 1, 1), (2, 3, 2), (3, 2, 1), (1, 1, 4)])
def test_every_group_kind_partitions_the_world_by_the_coordinate_formula(r, s, t):
    world = r * s * t
    m = mesh_ranks(world_size=world, replicate=r, shard=s, tensor=t)
    coords = {(ri * s + si) * t + ti: (ri, si, ti)
              for ri, si, ti in itertools.product(range(r), range(s), range(t))}
    for groups, size, varies in ((m.shard_groups, s, 1), (m.replicate_groups, r, 0),
                                 (m.tensor_groups, t, 2), (m.data_parallel_groups, r * s, None)):
        assert sorted(x for g in groups for x in g) == list(range(world))  # a partition
        for g in groups:
            assert len(g) == size
            fixed = [i for i in range(3) if i != varies and not (varies is None and i < 2)]
            assert len({tuple(coords[x][i] for i in fixed) for x in g}) == 1


def test_mesh_ranks_rejects_sizes_that_do_not_multiply_to_the_world():
    with pytest.raises(ValueError, match="world size 6"):
        mesh_ranks(world_size=6, replicate=2, shard=2)


@pytest.mark.parametrize("mesh,world,want", [
    (MeshConfig(), 8, (1, 8, 1)),
    (MeshConfig(tensor=2), 8, (1, 4, 2)),
    (MeshConfig(shard=4), 8, (2, 4, 1)),
    (MeshConfig(replicate=2), 8, (2, 4, 1)),
    (MeshConfig(replicate=2, shard=2, tensor=2), 8, (2, 2, 2)),
    (MeshConfig(shard=1), 4, (4, 1, 1)),
    (MeshConfig(), 1, (1, 1, 1)),
])
def test_mesh_config_resolves_auto_sizes(mesh, world, want):
    assert mesh.resolve(world) == want


@pytest.mark.parametrize("mesh,world", [
    (MeshConfig(replicate=2, shard=2), 8),
    (MeshConfig(shard=3), 4),
    (MeshConfig(tensor=3), 4),
])
def test_mesh_config_names_the_keys_and_the_world_size_when_they_do_not_fit(mesh, world):
    with pytest.raises(ValueError, match=rf"mesh.*world size {world}"):
        mesh.resolve(world)


@pytest.mark.parametrize("field,value", [("replicate", 0), ("shard", "two"), ("tensor", "auto"),
                                         ("shard", True)])
def test_mesh_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"mesh\.{field}"):
        MeshConfig(**{field: value})


def test_native_config_reads_and_writes_the_mesh_section():
    config = load_config({"mesh": {"replicate": 2, "shard": 4}})
    assert config.mesh == MeshConfig(replicate=2, shard=4)
    assert load_config(config.to_dict()).mesh == config.mesh
    with pytest.raises(ValueError, match="did you mean 'shard'"):
        load_config({"mesh": {"shards": 4}})


def test_deepspeed_mics_shard_size_maps_onto_the_mesh_shard_degree():
    ds = {"zero_optimization": {"stage": 3, "mics_shard_size": 8}}
    config = config_from_deepspeed(ds)
    assert config.mesh == MeshConfig(shard=8)
    assert config.mesh.resolve(32) == (4, 8, 1)
    assert config_to_deepspeed(config)["zero_optimization"]["mics_shard_size"] == 8
    off = config_from_deepspeed({"zero_optimization": {"stage": 3, "mics_shard_size": -1}})
    assert off.mesh == MeshConfig()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_ledger_prices_sharded_terms_with_the_shard_degree_not_the_world(stage):
    from infinity.ledger import estimate_from_config, paper_bytes_per_device

    numel = 10**9
    flat = load_config({"zero": {"stage": stage}, "precision": {"dtype": "bf16"}})
    hsdp = flat.replace(mesh=MeshConfig(replicate=4, shard=8))
    at_32 = estimate_from_config(hsdp, numel, 32)
    at_8 = estimate_from_config(flat, numel, 8)
    assert at_32.states == at_8.states  # a replica of 8 ranks holds what 8 flat ranks hold
    assert at_32.to_dict()["shard_size"] == 8 and at_32.world_size == 32
    assert at_32.total_bytes == pytest.approx(
        paper_bytes_per_device(numel, stage, 8, k=12.0, param_bytes=2, grad_bytes=4), rel=1e-6)
    with pytest.raises(ValueError, match="world size 12"):
        estimate_from_config(hsdp, numel, 12)


def test_a_device_mesh_and_a_mesh_section_together_are_refused():
    from infinity.zero._mesh import mesh_collectives

    with pytest.raises(ValueError, match="pass one of them"):
        mesh_collectives(MeshConfig(shard=2), device_mesh=object())


def test_offload_budgets_price_fp32_accumulators_when_only_replicas_reduce():
    """Shard degree 1 over 4 replicas, bf16, fp32 reduction: the gradients are summed across
    ranks, so the host accumulators are fp32 (ledger.host_grad_dtype), and the 'auto' host budget
    must hold 2 more bytes per trainable parameter than on one rank."""
    import torch

    from infinity.ledger import host_grad_dtype
    from infinity.zero._offload import offload_inputs, resolve_offload
    from infinity.zero._unit_choice import units_of
    from tests._support.engine import engine_config, tiny_gpt

    config = load_config(engine_config(stage=2, dtype="bf16", offload_optimizer={"device": "cpu"}))
    model = tiny_gpt()
    cpu = torch.device("cpu")
    budget = {dp: resolve_offload(units_of(model, config.zero),
                                  offload_inputs(config, world_size=1, device=cpu,
                                                 data_parallel_size=dp), device=cpu
                                  ).host_budget_bytes for dp in (1, 4)}
    assert host_grad_dtype(config, 1) == "bf16" and host_grad_dtype(config, 4) == "fp32"
    assert budget[4] - budget[1] >= 2 * sum(p.numel() for p in model.parameters())
