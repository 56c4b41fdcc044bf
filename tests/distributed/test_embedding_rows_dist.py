"""Embedding gradients crossing ranks as rows ([Note: embedding rows cross ranks as rows] in
infinity/zero/_embedding_rows.py), on 2 gloo ranks, against one process of plain PyTorch
(``torch.optim.AdamW``) on the global batch: a tied GPT with a vocabulary large enough to be
tapped at every stage, with gradient accumulation, clipping, an offloaded optimizer and bf16;
and a model whose second embedding one rank uses in some steps, with an untied head and a
padding index."""

from __future__ import annotations

import pytest

from tests._support.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread")]

STEPS = 4
VOCAB = 4099  # at least MIN_VOCABULARY_ROWS, and not a multiple of anything convenient
CONFIGS = [  # (name, stage, dtype, gradient accumulation steps, clip, extra engine settings)
    *[(f"s{s}-fp32", s, "fp32", 1, 0.0, {}) for s in (0, 1, 2, 3)],
    ("s3-fp32-gas2-clip", 3, "fp32", 2, 0.05, {}),
    ("s2-fp32-gas2-cpu-adam", 2, "fp32", 2, 0.05, {"opt": "cpu"}),
    ("s3-fp32-cpu-adam", 3, "fp32", 1, 0.0, {"opt": "cpu"}),
    ("s3-fp32-gas2-nvme", 3, "fp32", 2, 0.05, {"opt": "nvme", "param": "nvme",
                                               "host": 4 << 20}),
    ("s3-bf16-gas2-clip", 3, "bf16", 2, 0.05, {}),
    # The root in pieces ([Note: a large reduction spread over the backward]): pieces of 8000
    # elements instead of a million, so that this small root is cut.
    ("s3-fp32-pieces", 3, "fp32", 1, 0.0, {"min_piece_numel": 8000}),
    ("s2-fp32-gas2-clip-pieces", 2, "fp32", 2, 0.05, {"min_piece_numel": 8000}),
]


def _gpt_config():
    from infinity.models.gpt import GPTConfig

    return GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=16)


def worker_gpt(rank: int, world_size: int, out_dir: str) -> dict:
    import os

    import infinity
    from infinity.zero import _grad_reducer, _reduce_order
    from tests._support.engine import (batches, engine_config, engine_train, offload_config,
                                       tiny_gpt)

    out = {}
    default_piece = _reduce_order.MIN_PIECE_NUMEL
    for name, stage, dtype, gas, clip, extra in CONFIGS:
        extra = dict(extra)
        _reduce_order.MIN_PIECE_NUMEL = extra.pop("min_piece_numel", default_piece)
        if extra:  # the stored gradient slices too: [Note: gradients on NVMe]
            config = offload_config(os.path.join(out_dir, f"swap-{name}-r{rank}"), stage=stage,
                                    dtype=dtype, gas=gas, clip=clip, sub_group_numel=5000,
                                    **extra)
        else:
            config = engine_config(stage=stage, dtype=dtype, gas=gas, clip=clip)
        engine = infinity.initialize(tiny_gpt(config=_gpt_config()), config)
        reduced: list[str] = []  # the units' reductions, in issue order
        issue = engine.manager.storage.issue_reduce

        def logged(unit, phase, step, *, pieces=1, issue=issue, reduced=reduced):
            reduced.append(f"{phase.value}:{unit.name}" + (f"/{pieces}" if pieces > 1 else ""))
            issue(unit, phase, step, pieces=pieces)
        engine.manager.storage.issue_reduce = logged
        piece = _grad_reducer._PiecewiseReduction.issue_piece

        def logged_piece(self, i, piece=piece, reduced=reduced):
            reduced.append(f"piece:{self.group.key}")
            piece(self, i)
        _grad_reducer._PiecewiseReduction.issue_piece = logged_piece
        losses = engine_train(engine, batches(STEPS, gas, config=_gpt_config()), rank=rank,
                              world_size=world_size)
        root = next(u for u in engine.manager.units if u.name == "<root>")
        out[name] = {"losses": losses, "state": engine.full_state_dict(),
                     "sent": engine.stats()["collective_bytes_sent"], "reduced": reduced,
                     "root_padded_numel": sum(g.padded_numel for g in root.groups),
                     "trainable_padded_numel": sum(g.padded_numel for u in engine.manager.units
                                                   for g in u.groups if g.requires_grad)}
        engine.close()
        _grad_reducer._PiecewiseReduction.issue_piece = piece
    return out


def test_a_tied_vocabulary_reduced_as_rows_trains_as_plain_pytorch():
    from tests._support.engine import assert_close_run, batches, reference_train, tiny_gpt

    results = launch(__file__, "worker_gpt", timeout_s=300)
    for name, _stage, dtype, gas, clip, _extra in CONFIGS:
        ref_losses, ref_state = reference_train(
            tiny_gpt(config=_gpt_config()), batches(STEPS, gas, config=_gpt_config()),
            dtype=dtype, clip=clip, splits=1 if dtype == "fp32" else 2)
        for res in results:
            got = res[name]
            assert_close_run(got["losses"], got["state"], ref_losses, ref_state, dtype)
        got = results[0][name]
        # The root (the tied table and the position table) is complete at the head's backward,
        # so it is reduced first in every backward, ahead of the blocks. In pieces (stages
        # 2-3), every piece holds the tied table only (and the position table's zeros): the
        # head's backward issues them all, before the root's turn ([Note: the head's gradient
        # reduced as it is made]).
        backwards = STEPS * gas
        root = (["piece:u1.float32.train"] * 4 + ["reduce-grad:<root>/4"] if "pieces" in name
                else ["reduce-grad:<root>"])
        assert got["reduced"] == (root + ["reduce-grad:blocks.1", "reduce-grad:blocks.0",
                                          "reduce-grad:<persistent>"]) * backwards, name
        # Each trainable element is reduced densely once per backward (the tables' slots hold
        # the head's gradient, and zeros for the position table); the tokens' rows on top, in
        # far fewer bytes than the tables.
        sent = got["sent"]
        assert sent["reduce-grad"] == backwards * got["trainable_padded_numel"] * 4, name
        assert 0 < sent["reduce-rows"] < backwards * got["root_padded_numel"] * 4 / 10, name
        assert "flush" not in sent, name


BRANCH_CASES = [(0, False, False), (1, False, False), (2, False, False), (3, False, False),
                (3, True, False), (2, False, True)]
"""(stage, the head called twice a forward, under autocast to bf16)."""


def worker_branch(rank: int, world_size: int, out_dir: str) -> dict:
    import infinity
    from infinity.zero import _reduce_order
    from tests._support.engine import engine_config
    from tests._support.rows_model import (RowsModel, batch, maybe_autocast, run_record,
                                           uses_extra)

    # The root (three tables and the untied head) in pieces at stages 2-3: the head is tapped.
    _reduce_order.MIN_PIECE_NUMEL = 8000
    out = {}
    for stage, twice, autocast in BRANCH_CASES:
        model = RowsModel()
        model.head_twice = twice
        engine = infinity.initialize(model, engine_config(stage=stage, gas=2, clip=0.05,
                                                          unit_class_names=("Layer",)))
        tapped = engine.manager.grads.heads_tapped
        losses = []
        for t in range(STEPS):
            for m in range(2):
                engine.module.use_extra = uses_extra(rank, t, m)
                idx, targets = batch(t, m)
                with maybe_autocast(autocast):
                    loss = engine(idx.chunk(world_size)[rank], targets.chunk(world_size)[rank])
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        record = out[stage, twice, autocast] = run_record(engine, model, losses)
        record.update(sent=engine.stats()["collective_bytes_sent"], tapped=tapped,
                      tapped_after=engine.manager.grads.heads_tapped)
        engine.close()
    return out


def test_an_embedding_one_rank_uses_trains_as_plain_pytorch():
    """The second table (tapped: its unit has a vocabulary) is used by rank 0 in even steps'
    first micro-batch only: its rows come from one rank, and in odd steps from none, so it is not
    stepped then (torch's rule). The token table has a padding index and an untied head, tapped
    at stages 2-3 ([Note: the head's gradient reduced as it is made]); called twice a forward,
    the first backward stages its gradient whole and the tap is removed; under autocast its
    input (the sum's fp32) and its output's gradient (bf16) differ in dtype."""
    from tests._support.engine import TOL, assert_close_state
    from tests._support.rows_model import reference

    results = launch(__file__, "worker_branch", timeout_s=300)
    for stage, twice, autocast in BRANCH_CASES:
        ref_losses, ref_state, ref_steps = reference(STEPS, gas=2, head_twice=twice,
                                                     autocast=autocast)
        assert ref_steps["extra.weight"] == (STEPS + 1) // 2
        assert ref_steps["head.weight"] == STEPS
        for rank, res in enumerate(results):
            got = res[stage, twice, autocast]
            if autocast:  # bf16 matmuls: the bf16 tolerances of tests/_support/engine.py
                assert got["losses"] == pytest.approx(ref_losses[rank],
                                                      abs=TOL["bf16"]["loss"]), stage
                assert_close_state(got["state"], ref_state, global_rel=TOL["bf16"]["param"])
            else:
                assert got["losses"] == pytest.approx(ref_losses[rank], abs=1e-5), stage
                assert_close_state(got["state"], ref_state, atol=2e-5)
            assert got["steps"] == ref_steps, stage
            if stage >= 2:
                assert got["sent"]["reduce-rows"] > 0, stage
            else:  # summed in the window's one all-reduce ([Note: one all-reduce per window
                # at stages 0-1] in infinity/zero/_grad_reducer.py), not sent as rows
                assert "reduce-rows" not in got["sent"], stage
            assert got["tapped"] == (stage >= 2), stage
            assert got["tapped_after"] == (stage >= 2 and not twice), stage


FALLBACK_STEPS = 3


def _fallback_config():
    from infinity.models.gpt import GPTConfig

    # 4096 x 4 table: 64 KiB; 128 x 64 tokens a rank touch ~3500 rows (40 B each with their
    # index), half of them sent to the other rank: more bytes than half the table.
    return GPTConfig(vocab_size=4096, block_size=64, n_layer=1, n_head=1, n_embd=4)


def _fallback_data():
    import torch

    def tokens(seed):
        return torch.randint(0, 4096, (256, 64), generator=torch.Generator().manual_seed(seed))
    return [[(tokens(s), tokens(99 + s))] for s in range(FALLBACK_STEPS)]


def worker_fallback(rank: int, world_size: int, out_dir: str) -> dict:
    import infinity
    from tests._support.engine import engine_config, engine_train, tiny_gpt

    engine = infinity.initialize(tiny_gpt(config=_fallback_config()), engine_config(stage=3))
    tapped_at_start = engine.manager.grads.rows_tapped
    losses = engine_train(engine, _fallback_data(), rank=rank, world_size=world_size)
    units = engine.manager.units
    out = {"losses": losses, "state": engine.full_state_dict(), "tapped": tapped_at_start,
           "tapped_after": engine.manager.grads.rows_tapped,
           "sent": engine.stats()["collective_bytes_sent"],
           "trainable": sum(g.padded_numel for u in units for g in u.groups if g.requires_grad),
           "root": sum(g.padded_numel for u in units if u.name == "<root>" for g in u.groups)}
    engine.close()
    return out


def test_rows_larger_than_their_table_are_reduced_densely_and_then_no_longer_tapped():
    from tests._support.engine import assert_close_run, reference_train, tiny_gpt

    ref_losses, ref_state = reference_train(tiny_gpt(config=_fallback_config()), _fallback_data())
    for got in launch(__file__, "worker_fallback", timeout_s=300):
        assert_close_run(got["losses"], got["state"], ref_losses, ref_state, "fp32")
        assert got["tapped"] and not got["tapped_after"]
        # The first backward reduces the root twice (its head's gradient in the hooks, the
        # rows densely at the end); then once a backward, through autograd.
        assert "reduce-rows" not in got["sent"]
        assert got["sent"]["reduce-grad"] == 4 * (FALLBACK_STEPS * got["trainable"] + got["root"])


def _train_gpt(rank: int, world_size: int, config: dict, **initialize) -> dict:
    """The tapped GPT trained for STEPS steps: losses, the full state, the bytes by kind."""
    import infinity
    from tests._support.engine import batches, engine_train, tiny_gpt

    engine = infinity.initialize(tiny_gpt(config=_gpt_config()), config, **initialize)
    losses = engine_train(engine, batches(STEPS, 1, config=_gpt_config()), rank=rank,
                          world_size=world_size)
    out = {"losses": losses, "state": engine.full_state_dict(),
           "sent": engine.stats()["collective_bytes_sent"]}
    engine.close()
    return out


LINK = dict(bandwidth_gbytes_per_s=0.2, latency_us=300.0, poison_until_wait=True)
"""A slow link whose transfers land only at their wait (as in test_overlap_dist.py)."""


def worker_link(rank: int, world_size: int, out_dir: str, sabotage: bool) -> dict:
    """Stages 3 and 2, the root in pieces, under the poisoning link; ``sabotage``: the pieces'
    reduction accumulated without waiting for its collectives."""
    from infinity import LinkModel
    from infinity.zero import _grad_reducer, _reduce_order
    from tests._support.engine import engine_config

    _reduce_order.MIN_PIECE_NUMEL = 8000
    if sabotage:
        def no_wait(self):
            while self.issue_next():
                pass
            self.reducer._finish(self.group, self.part.to(self.staging_dtype))
        _grad_reducer._PiecewiseReduction.wait = no_wait
    return {stage: _train_gpt(rank, world_size, engine_config(stage=stage),
                              comm_link=LinkModel(**LINK)) for stage in (3, 2)}


@pytest.mark.parametrize("sabotage", [False, True])
def test_pieces_and_rows_under_a_slow_link_and_a_missing_wait(sabotage):
    import math

    from tests._support.engine import assert_close_run, batches, reference_train, tiny_gpt

    results = launch(__file__, "worker_link", timeout_s=300, args={"sabotage": sabotage})
    ref_losses, ref_state = reference_train(tiny_gpt(config=_gpt_config()),
                                            batches(STEPS, 1, config=_gpt_config()))
    for res in results:
        for stage in (3, 2):
            got = res[stage]
            assert got["sent"]["reduce-rows"] > 0
            if sabotage:  # the pieces' results land at their wait: without it, NaN
                values = got["losses"] + [float(v.abs().sum()) for v in got["state"].values()]
                assert not all(math.isfinite(v) for v in values), stage
            else:
                assert_close_run(got["losses"], got["state"], ref_losses, ref_state, "fp32")


MESH_CASES = [  # (name, stage, mesh section)
    ("shard4-s3", 3, {}),  # each rank's rows go to the three others' shards (an all-to-all)
    ("hsdp-s3", 3, {"replicate": 2, "shard": 2}),
    ("hsdp-s2", 2, {"replicate": 2, "shard": 2}),
    ("ddp4-s1", 1, {"shard": 1}),
]


def worker_mesh(rank: int, world_size: int, out_dir: str) -> dict:
    """4 ranks, the root in pieces: over 4 shards the rows are routed to their shards; over a
    mesh they cross the shard group only (routed at stages 2-3, all-gathered at 0-1), and the
    replicas sum the accumulators, rows and pieces in them, once per step ([Note: replicas
    summed once per step] in infinity/zero/_grad_reducer.py)."""
    from infinity.zero import _reduce_order
    from tests._support.engine import engine_config

    _reduce_order.MIN_PIECE_NUMEL = 8000
    return {name: _train_gpt(rank, world_size, engine_config(stage=stage, clip=0.05, mesh=mesh))
            for name, stage, mesh in MESH_CASES}


def test_rows_and_pieces_over_a_mesh_train_as_plain_pytorch():
    from tests._support.engine import assert_close_run, batches, reference_train, tiny_gpt

    ref_losses, ref_state = reference_train(tiny_gpt(config=_gpt_config()),
                                            batches(STEPS, 1, config=_gpt_config()), clip=0.05)
    results = launch(__file__, "worker_mesh", world_size=4, timeout_s=300)
    for name, _stage, _mesh in MESH_CASES:
        for rank in (0, 3):
            got = results[rank][name]
            assert_close_run(got["losses"], got["state"], ref_losses, ref_state, "fp32")
            if name.startswith("ddp4"):  # a shard group of one: the rows cross no rank
                assert "reduce-rows" not in got["sent"], name
                assert got["sent"]["replicate-reduce"] > 0, name
            else:
                assert got["sent"]["reduce-rows"] > 0, name
