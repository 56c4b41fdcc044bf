"""The device mesh section: how the ranks of the world split into pipeline stages, replicas,
shard groups and tensor-parallel slices (HSDP / MiCS: shard inside a group of ``shard`` ranks,
replicate across ``replicate`` such groups; ``tensor``: the tensor-parallel degree, innermost in
rank order; ``pipeline``: the stages, outermost).

[Note: mesh dimensions]
World size W = P * R * S * T (P = ``pipeline``, R = ``replicate``, S = ``shard``, T =
``tensor``). Rank order is ``rank = ((p * R + r) * S + s) * T + t``: tensor innermost, then shard,
then replicate, then the pipeline stage, as ``torchrun`` with ``DeviceMesh(("pipeline",
"replicate", "shard", "tensor"))`` gives (torchtitan's order: pipeline outermost). So a shard
group's ranks are contiguous (up to the tensor stride) and, with S * T ranks per node, a node's
ranks share a shard group: the all-gathers and reduce-scatters stay on the fast links, and only
the replicate all-reduce of the gradient shards (1/S of the gradient bytes) and the pipeline's
point-to-point activations cross nodes. Each pipeline stage is an engine of its own over its
R * S * T ranks; inside it, parameters and optimizer state are sharded over S ("the shard
degree", what every per-rank size divides by) and replicated over R; gradients are averaged over
R * S ("the data-parallel size"). The sizes below are per stage: ``resolve`` divides the world
by P first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from infinity.config._checks import AUTO, check_int, fail


@dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """``mesh``: the device mesh the engine builds from the world ([Note: mesh dimensions]).
    The defaults ('auto', 'auto', 1) are the flat layout: one shard group of every rank."""

    replicate: int | Literal["auto"] = AUTO
    """Replicas (R): shard groups holding the same shards, whose gradient shards are summed
    across them. 'auto': world / (shard * tensor), or 1 when shard is 'auto' too."""
    shard: int | Literal["auto"] = AUTO
    """Shard degree (S): ranks one unit's shards are spread over (DeepSpeed's
    ``mics_shard_size``); put one node's ranks here. 'auto': world / (replicate * tensor)."""
    tensor: int = 1
    """Tensor-parallel degree (T), the innermost dimension; the ZeRO dimensions are within each
    tensor slice."""
    pipeline: int = 1
    """Pipeline stages (P), the outermost dimension: each stage's R * S * T ranks run one engine
    over that stage's layers (:mod:`infinity.pipeline`)."""

    def __post_init__(self) -> None:
        check_int("mesh.replicate", self.replicate, minimum=1, allow_auto=True)
        check_int("mesh.shard", self.shard, minimum=1, allow_auto=True)
        check_int("mesh.tensor", self.tensor, minimum=1)
        check_int("mesh.pipeline", self.pipeline, minimum=1)

    def resolve(self, world_size: int) -> tuple[int, int, int]:
        """``(replicate, shard, tensor)`` of one pipeline stage at ``world_size`` (all stages);
        ValueError naming the keys and the world size when they do not multiply to it."""
        if world_size % self.pipeline:
            fail("mesh.pipeline", f"a divisor of the world size {world_size}", self.pipeline,
                 "each stage runs on world / pipeline ranks")
        world_size //= self.pipeline
        r, s, t = self.replicate, self.shard, self.tensor
        if r == AUTO and s == AUTO:
            r = 1
        fixed = t * (1 if r == AUTO else r) * (1 if s == AUTO else s)
        if world_size % fixed:
            fail("mesh", f"replicate * shard * tensor to divide the world size {world_size}",
                 {"replicate": self.replicate, "shard": self.shard, "tensor": self.tensor},
                 f"choose sizes whose product is {world_size} (or leave one of replicate / "
                 f"shard 'auto')")
        if r == AUTO:
            r = world_size // fixed
        elif s == AUTO:
            s = world_size // fixed
        if r * s * t != world_size:
            fail("mesh", f"replicate * shard * tensor == world size {world_size}",
                 {"replicate": r, "shard": s, "tensor": t},
                 f"their product is {r * s * t}; set sizes whose product is {world_size} (or "
                 f"leave one of replicate / shard 'auto')")
        return int(r), int(s), int(t)
