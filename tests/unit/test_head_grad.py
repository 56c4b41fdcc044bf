"""The parts of [Note: the head's gradient reduced as it is made] (infinity/zero/_head_grad.py)
in one process: which pieces a head's backward may issue, the rows it computes against
autograd's weight gradient, and the tap's calls."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from infinity.zero._reduction import piece_bounds
from infinity.zero._head_grad import HeadTaps, head_candidates, plan_head, weight_rows_grad

LAYOUTS = [  # (world, shard numel, pieces, head offset, rows, width, late flat ranges)
    (2, 32920, 4, 0, 4099, 16, []),  # the tied table first, only zeros after it
    (2, 32936, 4, 0, 4099, 16, [(65840, 65872)]),  # a norm after the table: its piece waits
    (4, 9000, 3, 12000, 1500, 16, [(11990, 12000)]),  # an untied head after a norm and tables
    (2, 700, 5, 3, 100, 13, [(0, 3)]),  # rows straddling every slice's ends
]


@pytest.mark.parametrize("world,shard,pieces,offset,rows,width,late", LAYOUTS)
def test_early_pieces_hold_the_head_and_zeros_only_and_every_row_is_computed(
        world, shard, pieces, offset, rows, width, late):
    plan = plan_head(world=world, shard_numel=shard, pieces=pieces, offset=offset, rows=rows,
                     width=width, late=late)
    start, end = offset, offset + rows * width
    bounds = piece_bounds(shard, pieces)
    early = {number for number, _, _ in plan.early}
    for number, (lo, hi) in enumerate(bounds):
        slices = [(r * shard + lo, r * shard + hi) for r in range(world)]
        touches_late = any(a < y and x < b for a, b in slices for x, y in late)
        assert (number in early) == (not touches_late), number
    computed = torch.zeros(rows, dtype=torch.bool)
    for number, row_ranges, zeros in plan.early:
        lo, hi = bounds[number]
        covered = torch.zeros(world * shard, dtype=torch.bool)  # what the piece's copy reads
        for r in range(world):
            covered[r * shard + lo:r * shard + hi] = True
        made = torch.zeros(world * shard, dtype=torch.bool)  # written before it is issued
        for a, b in row_ranges:
            computed[a:b] = True
            made[max(0, start + a * width):min(world * shard, start + b * width)] = True
        for a, b in zeros:
            assert not (a < end and start < b)  # never zeroes the head's rows
            made[a:b] = True
        assert bool(made[covered].all()), number  # every element it sends was written
    for a, b in plan.rest:
        assert not computed[a:b].any()  # computed once, after the early pieces
        computed[a:b] = True
    assert bool(computed.all())


def test_a_layout_with_a_late_parameter_in_every_piece_has_no_early_piece():
    plan = plan_head(world=2, shard_numel=100, pieces=4, offset=0, rows=10, width=10,
                     late=[(100 + i * 25, 101 + i * 25) for i in range(4)])
    assert plan.early == () and plan.rest == ((0, 10),)


def test_rows_of_the_weight_gradient_are_autograds():
    torch.manual_seed(0)
    head = nn.Linear(12, 4099, bias=False)
    x = torch.randn(3, 5, 12, requires_grad=True)
    grad_out = torch.randn(3, 5, 4099)
    head(x).backward(grad_out)
    inputs, grads = x.detach().reshape(-1, 12), grad_out.reshape(-1, 4099)
    plan = plan_head(world=2, shard_numel=24600, pieces=3, offset=0, rows=4099, width=12,
                     late=[])
    table = torch.full((4099, 12), float("nan"))
    for _, row_ranges, _ in plan.early:
        for lo, hi in row_ranges:
            table[lo:hi] = weight_rows_grad(grads, inputs, lo, hi)
    for lo, hi in plan.rest:
        table[lo:hi] = weight_rows_grad(grads, inputs, lo, hi)
    torch.testing.assert_close(table, head.weight.grad)


def test_the_tap_hands_its_backward_to_the_sink_once_and_later_calls_go_plain():
    torch.manual_seed(0)
    table = nn.Embedding(4096, 6)
    head = nn.Linear(6, 4096, bias=False)
    head.weight = table.weight
    model = nn.ModuleList([table, head])
    managed = {id(table.weight)}
    assert head_candidates(model, managed, set()) == []  # the table's own use: not tapped
    assert head_candidates(model, managed, {id(table)}) == [head]
    seen = []

    def sink(module, x, grad_out):
        seen.append(module)
        return grad_out @ module.weight
    taps = HeadTaps([head], sink)
    taps.install()
    x = torch.randn(4, 6, requires_grad=True)
    head(x).sum().backward()
    assert seen == [head] and table.weight.grad is None  # autograd accumulated nothing
    torch.testing.assert_close(x.grad, torch.ones(4, 4096) @ table.weight.detach())
    assert taps.end_backward() == []
    x.grad = None
    (head(x) + head(2 * x)).sum().backward()  # the second call is plain nn.Linear
    assert seen == [head, head] and table.weight.grad is not None
    assert taps.end_backward() == [head]
    taps.remove()
    assert "forward" not in head.__dict__ and taps.modules == []
