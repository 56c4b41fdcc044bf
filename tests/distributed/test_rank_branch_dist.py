"""A branch that one rank runs and the other does not ([Note: every rank reduces every unit in one
order] in infinity/zero/_reduce_order.py), and ``loss.backward()`` without ``engine.backward``
([Note: the end of backward] in infinity/zero/_param_manager.py), on 2 gloo ranks, against one
process of plain PyTorch (``torch.optim.AdamW``) on the global batch.

Before the fixed order, a unit complete on rank 0 was reduced in its hooks there and at the end
of backward on rank 1, and gloo aborted the job ("Received data size doesn't match").
"""

from __future__ import annotations

import pytest

from tests._support.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread")]

STEPS = 5
EXTRA_UNIT = dict(unit_class_names=("Experts", "Linear"), unit_min_numel=1,
                  persistence_threshold_numel=0)
"""The branch (``extra``, a Linear) is a unit of its own: stages 0-2 (no gathers)."""
EXTRA_IN_ROOT = dict(unit_class_names=("Experts",), unit_min_numel=1,
                     persistence_threshold_numel=0)
"""The branch is part of the root unit, which every rank gathers: stage 3 (a unit that one
rank gathers and the other does not cannot be all-gathered, under FSDP2 either)."""
CONFIGS = [  # name, stage, gradient accumulation steps, units, engine.backward or loss.backward
    ("s0", 0, 1, EXTRA_UNIT, "engine"),
    ("s1", 1, 1, EXTRA_UNIT, "engine"),
    ("s2", 2, 1, EXTRA_UNIT, "engine"),
    ("s3", 3, 1, EXTRA_IN_ROOT, "engine"),
    ("s2-gas2", 2, 2, EXTRA_UNIT, "engine"),
    ("s3-gas2", 3, 2, EXTRA_IN_ROOT, "engine"),
    ("s2-loss.backward", 2, 2, EXTRA_UNIT, "loss"),
    ("s3-loss.backward", 3, 2, EXTRA_IN_ROOT, "loss"),
]


def uses_extra(rank: int, step: int, micro: int) -> bool:
    """Rank 0 runs the branch in even steps' first micro-batch; rank 1 never does. So in odd
    steps no rank runs it: it gets no gradient anywhere and is not stepped (torch's rule)."""
    return rank == 0 and step % 2 == 0 and micro == 0


def worker(rank: int, world_size: int, out_dir: str) -> dict:
    import infinity
    from tests._support.engine import engine_config
    from tests._support.sometimes import Sometimes, batch, run_record, set_use

    out = {}
    for name, stage, gas, units, backward in CONFIGS:
        model = Sometimes()
        engine = infinity.initialize(model, engine_config(stage=stage, gas=gas, **units))
        losses = []
        for t in range(STEPS):
            for m in range(gas):
                set_use(engine.module, ("x", "y", "z"), uses_extra(rank, t, m))
                idx, targets = batch(t, m)
                loss = engine(idx.chunk(world_size)[rank], targets.chunk(world_size)[rank])
                if backward == "engine":
                    engine.backward(loss)
                else:  # as a trainer that scales the loss itself does
                    (loss / gas).backward()
                engine.step()
                losses.append(loss.item())
        out[name] = run_record(engine, model, losses)
        engine.close()
    return out


def _reference(gas: int):
    import torch

    from tests._support.engine import BETAS, EPS, LR, WD
    from tests._support.sometimes import Sometimes, batch, set_use

    model = Sometimes()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = [[], []]
    for t in range(STEPS):
        for m in range(gas):
            idx, targets = batch(t, m)
            halves = []
            for rank, (i, y) in enumerate(zip(idx.chunk(2), targets.chunk(2))):
                set_use(model, ("x", "y", "z"), uses_extra(rank, t, m))
                halves.append(model(i, y))
            ((halves[0] + halves[1]) / (2 * gas)).backward()  # averaged over ranks and micros
            for rank in range(2):
                losses[rank].append(halves[rank].item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    steps = {n: int(opt.state[p]["step"]) if p in opt.state else 0
             for n, p in model.named_parameters()}
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, steps


def test_a_branch_one_rank_runs_trains_as_plain_pytorch_on_the_global_batch():
    from tests._support.engine import assert_close_state

    references = {gas: _reference(gas) for gas in {c[2] for c in CONFIGS}}
    for _losses, _state, steps in references.values():  # the branch: stepped in even steps only
        assert steps["extra.weight"] == (STEPS + 1) // 2 and steps["head.weight"] == STEPS
    results = launch(__file__, "worker", timeout_s=300)
    for name, _stage, gas, _units, _backward in CONFIGS:
        ref_losses, ref_state, ref_steps = references[gas]
        for rank, res in enumerate(results):
            got = res[name]
            assert got["losses"] == pytest.approx(ref_losses[rank], abs=1e-5), name
            assert_close_state(got["state"], ref_state, atol=2e-5)
            assert got["steps"] == ref_steps, name
