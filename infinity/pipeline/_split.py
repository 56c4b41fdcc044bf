"""Where a sequential model is cut into pipeline stages.

[Note: the pipeline split]
A model given as an ``nn.Sequential`` is cut between its children (each child holds whole units:
the cut never splits a unit's flat buffer). Each child costs two things a stage must balance: its
bytes of model state, which the ledger prices per parameter (every parameter of one engine pays
the same bytes per parameter, so a stage's share of the states is its share of the parameters),
and its compute, the matrix products' 6 FLOPs per parameter per token in training (parameters of
``nn.Embedding`` are a lookup: their FLOPs are none). A child's cost is the mean of its two
shares, and the split is the contiguous one whose largest stage cost is the least (the linear
partition problem, solved exactly by dynamic programming: n children, P stages, O(P n^2)).
Attention's sequence-squared FLOPs are not in this cost (equal per layer: it moves no cut of a
model of equal blocks).

A split the caller gives (``split_points``: the first child index of each stage after the first)
is checked against it: no stage may be empty, and no stage's bytes may pass
``pipeline.max_stage_imbalance`` times the balanced split's largest stage; the error names the
stage, its bytes and the balanced split. A parameter shared by children of two stages (tied
embeddings across the pipeline) is refused: each stage's engine owns its parameters. A model cut
by torch's tracer (``split_spec``) has no children to balance: its stages' bytes are checked
against an even share of the model's instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

__all__ = ["StageSplit", "balanced_split", "check_split", "check_stage_bytes", "child_costs",
           "shared_across_stages"]


@dataclass(frozen=True)
class ChildCost:
    numel: int
    flops_numel: int
    """Parameters that take part in matrix products (6 FLOPs per token each in training)."""


@dataclass(frozen=True, kw_only=True)
class StageSplit:
    """Stage k runs children ``bounds[k]:bounds[k + 1]`` of the sequential model."""

    bounds: tuple[int, ...]
    numel: tuple[int, ...]
    """Parameters per stage."""
    cost: tuple[float, ...]
    """Each stage's share of the model's cost ([Note: the pipeline split]): its share of the
    parameters and of the FLOPs, averaged (summing to 1, or 0.5 for a model with no matrix
    product)."""

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    def children(self, stage: int) -> range:
        return range(self.bounds[stage], self.bounds[stage + 1])

    def describe(self, bytes_per_param: float) -> str:
        return ", ".join(f"stage {k}: children {self.bounds[k]}..{self.bounds[k + 1] - 1} "
                         f"({self.numel[k] * bytes_per_param / 2**20:.1f} MiB)"
                         for k in range(self.num_stages))


def child_costs(model: nn.Sequential) -> list[ChildCost]:
    costs = []
    for child in model:
        seen: set[int] = set()
        numel = flops = 0
        for module in child.modules():
            for p in module.parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                numel += p.numel()
                if not isinstance(module, nn.Embedding):
                    flops += p.numel()
        costs.append(ChildCost(numel, flops))
    return costs


def _shares(costs: list[ChildCost]) -> list[float]:
    total_n = sum(c.numel for c in costs) or 1
    total_f = sum(c.flops_numel for c in costs) or 1
    return [0.5 * c.numel / total_n + 0.5 * c.flops_numel / total_f for c in costs]


def _make(costs: list[ChildCost], bounds: tuple[int, ...]) -> StageSplit:
    shares = _shares(costs)
    pieces = [range(bounds[k], bounds[k + 1]) for k in range(len(bounds) - 1)]
    return StageSplit(bounds=bounds, numel=tuple(sum(costs[i].numel for i in r) for r in pieces),
                      cost=tuple(sum(shares[i] for i in r) for r in pieces))


def balanced_split(costs: list[ChildCost], num_stages: int) -> StageSplit:
    """The contiguous split into ``num_stages`` non-empty stages whose largest cost is least."""
    n = len(costs)
    if num_stages > n:
        raise ValueError(f"pipeline: {num_stages} stages for a model of {n} children "
                         f"(nn.Sequential entries); every stage needs at least one: use at most "
                         f"{n} stages (mesh.pipeline), or a model cut finer")
    shares = _shares(costs)
    prefix = [0.0]
    for s in shares:
        prefix.append(prefix[-1] + s)
    # best[k][i]: least largest cost of the first i children in k stages; cut[k][i]: its last cut
    best = [[math.inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-15:
                    best[k][i], cut[k][i] = value, j
    bounds = [n]
    for k in range(num_stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return _make(costs, tuple(reversed(bounds)))


def check_split(costs: list[ChildCost], split_points: list[int] | tuple[int, ...],
                num_stages: int, *, max_imbalance: float, bytes_per_param: float) -> StageSplit:
    """The caller's split, checked ([Note: the pipeline split])."""
    n = len(costs)
    points = list(split_points)
    if len(points) != num_stages - 1:
        raise ValueError(f"pipeline: split_points {points} gives {len(points) + 1} stages, the "
                         f"mesh has {num_stages} (mesh.pipeline); give {num_stages - 1} child "
                         f"indices, each the first child of a stage after the first")
    bounds = (0, *points, n)
    for k in range(num_stages):
        if bounds[k + 1] <= bounds[k]:
            raise ValueError(f"pipeline: split_points {points} leave stage {k} empty (children "
                             f"{bounds[k]}..{bounds[k + 1] - 1} of {n}); give increasing indices "
                             f"between 1 and {n - 1}")
    split = _make(costs, bounds)
    balanced = balanced_split(costs, num_stages)
    limit = max(balanced.numel) * max_imbalance
    for k, numel in enumerate(split.numel):
        if numel > limit:
            raise ValueError(
                f"pipeline: stage {k} holds {numel * bytes_per_param / 2**20:.1f} MiB of model "
                f"state ({numel:,} parameters), more than pipeline.max_stage_imbalance "
                f"({max_imbalance:g}) x the balanced split's largest stage "
                f"({max(balanced.numel) * bytes_per_param / 2**20:.1f} MiB); the balanced split "
                f"is split_points {list(balanced.bounds[1:-1])} "
                f"({balanced.describe(bytes_per_param)}); leave split_points out to use it")
    return split


def check_stage_bytes(numel: list[int], *, max_imbalance: float, bytes_per_param: float) -> None:
    """A traced split (``split_spec``: no children to balance): no stage empty, none over
    ``max_imbalance`` x an even share of the model's bytes."""
    total = sum(numel)
    for k, n in enumerate(numel):
        if n == 0:
            raise ValueError(f"pipeline: split_spec leaves stage {k} without parameters; move "
                             f"its split points")
    for k, n in enumerate(numel):
        if n > max_imbalance * total / len(numel):
            raise ValueError(
                f"pipeline: stage {k} holds {n * bytes_per_param / 2**20:.1f} MiB of model state "
                f"({n:,} parameters), more than pipeline.max_stage_imbalance ({max_imbalance:g}) "
                f"x an even share ({total * bytes_per_param / len(numel) / 2**20:.1f} MiB); "
                f"stages: {[round(x * bytes_per_param / 2**20, 1) for x in numel]} MiB")


def shared_across_stages(model: nn.Sequential, split: StageSplit) -> str | None:
    """The name of a parameter used by children of two stages, or None."""
    owner: dict[int, tuple[int, str]] = {}
    names = [name for name, _ in model.named_children()]
    for k in range(split.num_stages):
        for i in split.children(k):
            for name, p in model[i].named_parameters(remove_duplicate=False):
                first = owner.setdefault(id(p), (k, f"{names[i]}.{name}"))
                if first[0] != k:
                    return f"{first[1]} (stage {first[0]}) is also {names[i]}.{name} (stage {k})"
    return None
