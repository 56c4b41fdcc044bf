"""The parts of [Note: embedding rows cross ranks as rows] (infinity/zero/_embedding_rows.py) in
one process: the rows a tapped embedding hands over against torch's own embedding gradient, the
payload the ranks exchange, and the reduction order the taps give."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from infinity.models.gpt import GPT, GPTConfig
from infinity.tiers import Tier
from infinity.zero._collectives import Collectives
from infinity.zero._embedding_rows import EmbeddingRows, RowsPayload
from infinity.zero._reduce_order import backward_order
from infinity.zero._unit_builder import BuildSettings, UnitBuilder
from infinity.zero._unit_choice import choose_units


@pytest.mark.parametrize("padding_idx", [None, 2])
def test_the_rows_sum_to_torchs_embedding_gradient_and_the_weight_gets_none(padding_idx):
    torch.manual_seed(0)
    table = nn.Embedding(4096, 8, padding_idx=padding_idx)
    head = nn.Linear(8, 4096, bias=False)
    head.weight = table.weight  # tied: autograd accumulates the head's gradient alone
    ids = torch.randint(0, 6, (3, 5))  # many repeats, and the padding index
    got: list = []
    taps = EmbeddingRows(nn.ModuleList([table, head]), {id(table.weight)},
                         lambda w, i, r: got.append((w, i, r)), unit_of=lambda p: 0)
    assert taps.modules == [table] and not taps.rows_only  # the head holds the weight too
    taps.install()
    head(table(ids)).square().sum().backward()
    head_only = table.weight.grad.clone()
    taps.remove()
    assert "forward" not in table.__dict__

    table.weight.grad = None
    head(table(ids)).square().sum().backward()  # plain torch: both uses in one gradient
    (weight, unique, rows), = got
    assert weight is table.weight
    dense = torch.zeros_like(head_only)
    dense[unique] = rows
    torch.testing.assert_close(head_only + dense, table.weight.grad)
    assert padding_idx is None or padding_idx not in unique.tolist()
    assert unique.tolist() == sorted(set(ids.flatten().tolist()) - {padding_idx})


def test_small_tables_alone_and_what_changes_the_weight_are_not_tapped():
    model = nn.ModuleDict({"small": nn.Embedding(100, 4), "normed": nn.Embedding(5000, 4,
                                                                                   max_norm=1.0),
                           "sparse": nn.Embedding(5000, 4, sparse=True)})
    managed = {id(p) for p in model.parameters()}
    assert EmbeddingRows(model, managed, lambda *a: None, unit_of=lambda p: 0).modules == []
    model["vocab"] = nn.Embedding(5000, 4)  # a vocabulary in the same unit takes the small along
    taps = EmbeddingRows(model, managed | {id(model["vocab"].weight)}, lambda *a: None,
                         unit_of=lambda p: 0)
    assert taps.modules == [model["small"], model["vocab"]]
    assert taps.rows_only == {id(model["small"].weight), id(model["vocab"].weight)}


def test_the_payload_gives_back_every_row_at_its_flat_index():
    rows_a = torch.arange(6, dtype=torch.float32).view(2, 3)
    rows_b = torch.arange(10, 14, dtype=torch.float32).view(1, 4)
    payload, sizes = RowsPayload.pack([(0, 100, torch.tensor([0, 5]), rows_a),
                                       (1, 8, torch.tensor([2]), rows_b)], 0.5,
                                      torch.device("cpu"), shard_numel=[200, 50], world=1)
    assert payload.dtype == torch.uint8 and sizes == [payload.numel()]
    assert payload.numel() % 8 == 0
    padded = torch.zeros(payload.numel() + 16, dtype=torch.uint8)  # padded as the all-gather
    padded[:payload.numel()] = payload
    number, index, values = RowsPayload.unpack(padded)
    assert number.tolist() == [0] * 6 + [1] * 4
    assert index.tolist() == [100, 101, 102, 115, 116, 117, 16, 17, 18, 19]
    assert values.tolist() == [v / 2 for v in range(6)] + [v / 2 for v in range(10, 14)]
    empty = RowsPayload.unpack(RowsPayload.pack([], 1.0, torch.device("cpu"), shard_numel=[],
                                                world=1)[0])
    assert [t.numel() for t in empty] == [0, 0, 0]


def _units(model):
    choice = choose_units(model, unit_class_names=("Block",), persistence_threshold_numel=100)
    settings = BuildSettings(stage=0, device=torch.device("cpu"), compute_dtype=torch.float32,
                             param_home=Tier.DEVICE, optimizer_offloaded=False)
    return UnitBuilder(settings, collectives=Collectives(), store=None,
                       initial_values=None).build(choice, None)


def test_a_root_whose_vocabulary_is_tapped_is_reduced_first():
    model = GPT(GPTConfig(vocab_size=5000, block_size=16, n_layer=3, n_head=2, n_embd=8))
    units = _units(model)
    names = {u.index: u.name for u in units}
    # Untapped: the backward's usual order, the root (the embeddings) near the end.
    assert [names[i] for i in backward_order(model, units)] == [
        "blocks.2", "blocks.1", "blocks.0", "<persistent>", "<root>"]
    managed = {id(p) for p in model.parameters()}
    slot_unit = {id(s.param): u.index for u in units for g in u.groups for s in g.slots}
    taps = EmbeddingRows(model, managed, lambda *a: None, unit_of=lambda p: slot_unit[id(p)])
    assert taps.rows_only == {id(model.wpe.weight)}  # the tied table's head is not a tap
    for u in units:
        u.rows_only = frozenset(i for i in taps.rows_only if slot_unit[i] == u.index)
    # Tapped: the root's only other gradient is the head's, which the backward makes first.
    assert [names[i] for i in backward_order(model, units, skip_modules=taps.tapped_modules)] == [
        "<root>", "blocks.2", "blocks.1", "blocks.0", "<persistent>"]


def test_no_grad_and_frozen_tables_run_torchs_embedding():
    table = nn.Embedding(5000, 4)
    calls: list = []
    taps = EmbeddingRows(table, {id(table.weight)}, lambda *a: calls.append(a),
                         unit_of=lambda p: 0)
    taps.install()
    ids = torch.tensor([[1, 2]])
    with torch.no_grad():
        torch.testing.assert_close(table(ids), F.embedding(ids, table.weight))
    table.weight.requires_grad_(False)
    assert not table(ids).requires_grad
    assert calls == []


def test_a_unit_much_larger_than_the_others_is_spread_over_the_units_after_it():
    """[Note: a large reduction spread over the backward]: one piece for it and for each unit
    reduced after it, none smaller than MIN_PIECE_NUMEL; a unit not SPREAD_RATIO times every
    other, or reduced last, goes whole."""
    from infinity.zero._reduce_order import MIN_PIECE_NUMEL, spread_pieces

    blocks = {u: 7 * MIN_PIECE_NUMEL for u in range(2, 6)}
    assert spread_pieces([1, 5, 4, 3, 2, 0], {1: 39 * MIN_PIECE_NUMEL, **blocks, 0: 10}) == {1: 6}
    assert spread_pieces([1, 5, 4, 3, 2, 0], {1: 3 * MIN_PIECE_NUMEL, **blocks, 0: 10}) == {}
    assert spread_pieces([5, 4, 3, 2, 1], {1: 39 * MIN_PIECE_NUMEL, **blocks}) == {}  # last
    assert spread_pieces([1, 5, 4], {1: 3 * MIN_PIECE_NUMEL + 5, 5: 100, 4: 100}) == {1: 3}


def test_routed_rows_go_to_the_shard_that_holds_them_split_at_its_end():
    """Three shards of 10 elements, rows of 4 from offset 2: the row of id 4 ([18, 22)) is cut
    at 20; every chunk unpacks to its own shard's indices, and together to the rows."""
    ids = torch.tensor([0, 2, 1, 5, 4])
    rows = torch.arange(20, dtype=torch.float32).view(5, 4)
    payload, sizes = RowsPayload.pack([(0, 2, ids, rows)], 0.5, torch.device("cpu"),
                                      shard_numel=[10], world=3)
    assert sum(sizes) == payload.numel() and all(n % 8 == 0 for n in sizes)
    want = torch.zeros(30)
    for r, i in enumerate(ids.tolist()):
        want[2 + 4 * i:6 + 4 * i] = rows[r] / 2
    got, at = torch.zeros(30), 0
    for dest, n in enumerate(sizes):
        number, index, values = RowsPayload.unpack(payload[at:at + n])
        at += n
        assert bool(((index // 10) == dest).all()) and bool((number == 0).all())
        got.index_add_(0, index, values)
    assert torch.equal(got, want)
