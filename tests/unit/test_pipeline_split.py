"""The pipeline split ([Note: the pipeline split] in infinity/pipeline/_split.py) against an
independent reference: the balanced split against a brute force over every contiguous split
(the least largest stage cost, the cost written out here), the children's costs counted by hand,
a given split's errors, and a parameter shared by two stages."""

from __future__ import annotations

import itertools
import random

import pytest
from torch import nn

from infinity.pipeline import balanced_split, check_split, child_costs
from infinity.pipeline._split import ChildCost, shared_across_stages


def _shares(costs: list[ChildCost]) -> list[float]:
    """The reference cost: the mean of a child's share of the parameters and of the FLOPs."""
    total_n = sum(c.numel for c in costs) or 1
    total_f = sum(c.flops_numel for c in costs) or 1
    return [(c.numel / total_n + c.flops_numel / total_f) / 2 for c in costs]


def _all_splits(n: int, p: int):
    """Every contiguous split of n children into p non-empty stages, as bounds (0, ..., n)."""
    for cuts in itertools.combinations(range(1, n), p - 1):
        yield (0, *cuts, n)


def _largest(shares: list[float], bounds: tuple[int, ...]) -> float:
    return max(sum(shares[bounds[k]:bounds[k + 1]]) for k in range(len(bounds) - 1))


@pytest.mark.parametrize("seed", range(40))
def test_balanced_split_is_the_least_largest_stage(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    p = rng.randint(1, min(4, n))
    costs = []
    for _ in range(n):
        numel = rng.choice([0, rng.randint(1, 10), rng.randint(1, 10_000)])
        costs.append(ChildCost(numel, rng.choice([0, numel, rng.randint(0, numel)])))
    shares = _shares(costs)
    best = min(_largest(shares, b) for b in _all_splits(n, p))
    split = balanced_split(costs, p)
    assert split.num_stages == p
    bounds = split.bounds
    assert bounds[0] == 0 and bounds[-1] == n
    assert all(bounds[k] < bounds[k + 1] for k in range(p)), bounds  # no stage empty
    assert _largest(shares, bounds) == pytest.approx(best, abs=1e-12), (costs, p, bounds)
    # The split's own figures are its bounds' sums.
    assert split.numel == tuple(sum(c.numel for c in costs[bounds[k]:bounds[k + 1]])
                                for k in range(p))
    assert max(split.cost) == pytest.approx(best, abs=1e-12)
    assert sum(split.cost) == pytest.approx(sum(shares))


def test_balanced_split_of_equal_blocks_is_even():
    """8 equal blocks in 4 stages: two each (nothing else is least)."""
    costs = [ChildCost(100, 100)] * 8
    assert balanced_split(costs, 4).bounds == (0, 2, 4, 6, 8)


def test_more_stages_than_children_is_refused():
    with pytest.raises(ValueError, match=r"5 stages for a model of 3 children"):
        balanced_split([ChildCost(1, 1)] * 3, 5)


def test_child_costs_counted_by_hand():
    """An embedding's parameters have no FLOPs (a lookup); a parameter used twice in one child
    counts once; a child without parameters costs nothing."""
    emb = nn.Embedding(10, 4)                      # 40, no FLOPs
    lin = nn.Linear(4, 3)                          # 12 + 3 = 15
    twice = nn.Linear(3, 3, bias=False)            # 9, used twice below
    norm = nn.LayerNorm(3)                         # 6 (not an embedding: FLOPs counted)
    model = nn.Sequential(
        nn.Sequential(emb, nn.Linear(4, 4)),       # 40 + 20, FLOPs 20
        lin,
        nn.Sequential(twice, nn.ReLU(), twice, norm),
        nn.ReLU())
    costs = child_costs(model)
    assert [(c.numel, c.flops_numel) for c in costs] == [(60, 20), (15, 15), (15, 15), (0, 0)]


def test_child_costs_shared_embedding_and_linear_in_one_child():
    """A weight an Embedding and a Linear share inside one child counts once (numel)."""
    emb = nn.Embedding(6, 4)
    head = nn.Linear(4, 6, bias=False)
    head.weight = emb.weight
    costs = child_costs(nn.Sequential(nn.Sequential(emb, head)))
    assert costs[0].numel == 24


BYTES_PER_PARAM = 16.0


def _mib(numel: int) -> str:
    return f"{numel * BYTES_PER_PARAM / 2**20:.1f} MiB"


def test_check_split_wrong_number_of_points():
    costs = [ChildCost(10, 10)] * 6
    with pytest.raises(ValueError, match=r"split_points \[2, 4\] gives 3 stages, the mesh has 2"):
        check_split(costs, [2, 4], 2, max_imbalance=1.5, bytes_per_param=BYTES_PER_PARAM)
    with pytest.raises(ValueError, match=r"gives 1 stages, the mesh has 4"):
        check_split(costs, [], 4, max_imbalance=1.5, bytes_per_param=BYTES_PER_PARAM)


@pytest.mark.parametrize("points,empty", [([3, 3], 1), ([0, 3], 0), ([3, 6], 2), ([4, 2], 1),
                                          ([2, 9], 2)])
def test_check_split_names_the_empty_stage(points, empty):
    costs = [ChildCost(10, 10)] * 6
    with pytest.raises(ValueError, match=rf"leave stage {empty} empty"):
        check_split(costs, points, 3, max_imbalance=1.5, bytes_per_param=BYTES_PER_PARAM)


def test_check_split_refuses_a_stage_over_the_imbalance():
    """Ten equal blocks of 1000 in 2 stages: balanced 5 + 5. A stage of 8 is 1.6 x 5: refused at
    1.5, naming the stage, its MiB and the balanced split points; 7 (1.4 x) passes."""
    costs = [ChildCost(1000, 1000)] * 10
    assert balanced_split(costs, 2).bounds == (0, 5, 10)
    with pytest.raises(ValueError) as err:
        check_split(costs, [8], 2, max_imbalance=1.5, bytes_per_param=BYTES_PER_PARAM)
    msg = str(err.value)
    assert "stage 0 holds " + _mib(8000) in msg, msg
    assert "8,000 parameters" in msg and _mib(5000) in msg, msg
    assert "split_points [5]" in msg, msg
    with pytest.raises(ValueError, match=r"stage 1 holds " + _mib(8000).replace(".", r"\.")):
        check_split(costs, [2], 2, max_imbalance=1.5, bytes_per_param=BYTES_PER_PARAM)
    split = check_split(costs, [7], 2, max_imbalance=1.5, bytes_per_param=BYTES_PER_PARAM)
    assert split.bounds == (0, 7, 10) and split.numel == (7000, 3000)
    # Exactly at the limit (1.6 x) is accepted.
    assert check_split(costs, [8], 2, max_imbalance=1.6,
                       bytes_per_param=BYTES_PER_PARAM).bounds == (0, 8, 10)


def _tied_gpt_sequential():
    from infinity.models.gpt import GPT, GPTConfig, as_sequential

    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32,
                          tie_weights=True))
    return as_sequential(model)


def test_tied_embeddings_across_two_stages_are_found():
    """A tied GPT cut in two has the token embedding in stage 0 and the same tensor as the LM
    head in stage 1; the finding names both stages. (infinity.pipeline.initialize raises it as a
    ValueError: tests/distributed/test_pipeline_trace_dist.py.)"""
    seq = _tied_gpt_sequential()
    split = balanced_split(child_costs(seq), 2)
    found = shared_across_stages(seq, split)
    assert found is not None
    assert "stage 0" in found and "stage 1" in found and "wte.weight" in found, found
    # One stage keeps both users: nothing shared across stages.
    one = balanced_split(child_costs(seq), 1)
    assert shared_across_stages(seq, one) is None


def test_tied_embeddings_named_as_in_the_model():
    seq = _tied_gpt_sequential()
    names = {n for n, _ in seq.named_parameters(remove_duplicate=False)}
    assert {"embed.wte.weight", "head.lm_head.weight"} <= names
    found = shared_across_stages(seq, balanced_split(child_costs(seq), 2))
    assert "embed.wte.weight" in found and "head.lm_head.weight" in found, found


def test_traced_stage_bytes_checked_against_an_even_share():
    """split_spec's stages (no children to balance): an empty stage and one over
    max_stage_imbalance x an even share are refused, naming the stage and its MiB."""
    from infinity.pipeline import check_stage_bytes

    check_stage_bytes([100, 140], max_imbalance=1.5, bytes_per_param=16)  # 140 < 1.5 x 120
    with pytest.raises(ValueError, match=r"stage 1 without parameters"):
        check_stage_bytes([100, 0], max_imbalance=1.5, bytes_per_param=16)
    n = 2**20  # 16 MiB a million parameters
    with pytest.raises(ValueError, match=r"stage 0 holds 32\.0 MiB .* an even share \(18\.0 MiB\)"):
        check_stage_bytes([2 * n, n // 4], max_imbalance=1.5, bytes_per_param=16)
