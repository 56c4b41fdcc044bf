"""Parameters without a gradient on 2 ranks (gloo) ([Note: parameters without a gradient] in
infinity/zero/_grad_presence.py): a parameter that one rank uses and the other does not is
updated, one that neither uses is skipped, against single-process ``torch.optim.AdamW`` on the
global batch (each half with its rank's choice of experts)."""

from __future__ import annotations

import pytest

from tests._support.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread")]

STEPS = 7
CONFIGS = [("s0", 0, "none"), ("s3", 3, "none"), ("s3-opt-cpu", 3, "cpu")]


def pattern(rank: int, step: int) -> tuple[tuple[str, ...], bool]:
    """Experts: x on rank 0 every other step and on rank 1 every third (neither at steps 1 and
    5), y on rank 1 only, z on neither; the extra Linear (a unit of its own) on both ranks every
    other step, on neither between (a unit reduced in hooks is used by all ranks or none)."""
    experts = ("x",) if rank == 0 and step % 2 == 0 else ()
    if rank == 1:
        experts = ("x", "y") if step % 3 == 0 else ("y",)
    return experts, step % 2 == 0


def worker(rank: int, world_size: int, out_dir: str) -> dict:
    import infinity
    from tests._support.engine import engine_config, offload_config
    from tests._support.sometimes import UNITS, Sometimes, batch, run_record, set_use

    out = {}
    for name, stage, offload in CONFIGS:
        if offload == "none":
            config = engine_config(stage=stage, **UNITS)
        else:
            units = dict(UNITS)
            config = offload_config(f"{out_dir}/swap-{name}-r{rank}", stage=stage, opt=offload,
                                    sub_group_numel=200,
                                    zero={"unit_class_names": list(units.pop("unit_class_names")),
                                          **units})
        model = Sometimes()
        engine = infinity.initialize(model, config)
        losses = []
        for t in range(STEPS):
            set_use(engine.module, *pattern(rank, t))
            idx, targets = batch(t, 0)
            loss = engine(idx.chunk(world_size)[rank], targets.chunk(world_size)[rank])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[name] = run_record(engine, model, losses)
        engine.close()
    return out


def _reference():
    import torch

    from tests._support.engine import BETAS, EPS, LR, WD
    from tests._support.sometimes import Sometimes, batch, set_use

    model = Sometimes()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = []
    for t in range(STEPS):
        idx, targets = batch(t, 0)
        halves = []
        for rank, (i, y) in enumerate(zip(idx.chunk(2), targets.chunk(2))):
            set_use(model, *pattern(rank, t))
            halves.append(model(i, y))
        loss = (halves[0] + halves[1]) / 2  # the ranks' gradients are averaged
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append([h.item() for h in halves])
    steps = {n: int(opt.state[p]["step"]) if p in opt.state else 0
             for n, p in model.named_parameters()}
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, steps


def test_two_ranks_skip_only_what_no_rank_used():
    from tests._support.engine import assert_close_state

    ref_losses, ref_state, ref_steps = _reference()
    assert ref_steps["experts.x.weight"] == 5 and ref_steps["experts.y.weight"] == STEPS
    assert ref_steps["experts.z.weight"] == 0 and ref_steps["extra.weight"] == 4
    results = launch(__file__, "worker", timeout_s=240)
    for name, _stage, _offload in CONFIGS:
        for rank, res in enumerate(results):
            got = res[name]
            assert got["losses"] == pytest.approx([h[rank] for h in ref_losses], abs=1e-5), name
            assert_close_state(got["state"], ref_state, atol=2e-5)
            assert got["steps"] == ref_steps, name
