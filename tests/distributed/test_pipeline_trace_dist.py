"""The prefetcher inside a pipeline stage ([Note: one prefetch step per schedule step] in
infinity/zero/_param_manager.py), on 2 gloo processes, PP=2 x DP=1, parameters and optimizer on
NVMe under a host budget with room to prefetch: after 3 steps the latest 'train' trace is one
step holding the schedule's unit uses in order, built here from the schedules' definitions
(1F1B: warm-up forwards, one forward one backward, cool-down backwards; GPipe: every forward,
then every backward), and the prefetch hits grow in steps 2-3. Also: a tied GPT cut between
its two users is refused by ``infinity.pipeline.initialize``; a pipeline checkpoint's layout
on disk and its refusal at another pipeline size or split."""

from __future__ import annotations

import os

import pytest

from tests._support.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread")]

MICRO, STEPS, LAYERS = 4, 3, 4
HOST_BUDGET = 640 * 1024  # tests/distributed/test_pipeline_dist.py's: room to prefetch


def _model(tie: bool = False):
    from infinity.models.gpt import GPTConfig
    from tests._support.engine import tiny_gpt

    return tiny_gpt(config=GPTConfig(vocab_size=64, block_size=16, n_layer=LAYERS, n_head=2,
                                     n_embd=32, tie_weights=tie))


def _loss(logits, targets):
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _batch(step: int):
    import torch

    from tests._support.engine import batches

    micro = batches(STEPS, MICRO, config=_model().config)[step]
    return torch.cat([b[0] for b in micro]), torch.cat([b[1] for b in micro])


def worker_trace(rank: int, world_size: int, out_dir: str, schedule: str) -> dict:
    import infinity.pipeline
    from infinity.models.gpt import as_sequential
    from tests._support.engine import offload_config

    out: dict = {}
    if schedule == "1f1b":  # a tied GPT cut between its users: refused before any engine
        try:
            infinity.pipeline.initialize(as_sequential(_model(tie=True)),
                                         {"mesh": {"pipeline": 2}}, loss_fn=_loss)
        except ValueError as e:
            out["tied_error"] = str(e)
    cfg = offload_config(os.path.join(out_dir, f"swap{rank}"), stage=3, gas=MICRO,
                         opt="nvme", param="nvme", host=HOST_BUDGET,
                         mesh={"pipeline": 2}, pipeline={"schedule": schedule})
    pipe = infinity.pipeline.initialize(as_sequential(_model()), cfg, loss_fn=_loss)
    fetcher = pipe.engine.manager.prefetcher
    hits, steps, traces = [], [], []
    for s in range(STEPS):
        x, y = _batch(s)
        pipe.train_batch(x, target=y)
        stats = fetcher.executor.stats()
        hits.append(stats["prefetch_hits"])
        steps.append(stats["steps"])
        traces.append(list(fetcher.executor.store.latest("train").units()))
    units = pipe.engine.manager.units
    out.update({
        "hits": hits, "steps": steps, "traces": traces,
        "traced_units": [u.index for u in units if not u.always_gathered],
        "unit_names": {u.index: u.name for u in units},
        "variants": len(fetcher.executor.store.variants("train"))})
    pipe.close()
    return out


def _schedule_order(schedule: str, stage: int, stages: int, m: int) -> list[tuple[str, int]]:
    """The (F|B, micro-batch) order one stage runs: GPipe every forward then every backward;
    1F1B ``stages - stage - 1`` warm-up forwards, then m - warm-up times one forward and one
    backward, then the cool-down backwards (Narayanan et al., PipeDream-Flush)."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(stages - stage - 1, m)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    order += [("B", i) for i in range(m - warm, m)]
    return order


def _unit_uses(stage: int, names: dict[int, str]) -> tuple[list[int], list[int]]:
    """The units one micro-batch's forward and backward use, in order, for this GPT cut in two
    (stage 0: embed, block0, block1; stage 1: block2, block3, head).

    Forward: the root unit (the stage's parameters outside its blocks) when the stage's module
    is entered, then the blocks in order. Backward: a unit is used when the gradient of its
    module's output arrives (the hook in infinity/zero/_unit_hooks.py's post_forward), so the
    blocks come in reverse order and the root where the stage's output gets its gradient:
    stage 1 ends in the head (root's own computation): root first. Stage 0 ends in block1,
    whose output *is* the stage's output: that tensor's hooks run in the order they were
    registered, block1's (its forward ended first), then root's, then block0's."""
    by_name = {v: k for k, v in names.items()}
    root = by_name["<root>"]
    blocks = [by_name[f"block{i}"] for i in ((0, 1) if stage == 0 else (2, 3))]
    forward = [root, *blocks]
    backward = [blocks[1], root, blocks[0]] if stage == 0 else [root, blocks[1], blocks[0]]
    return forward, backward


def _expected_trace(schedule: str, stage: int, names: dict[int, str]) -> list[int]:
    """The schedule's order of micro-batches, each use of every unit recorded (a unit used again
    by the next micro-batch is a new entry, never merged with the last)."""
    forward, backward = _unit_uses(stage, names)
    out: list[int] = []
    for kind, _ in _schedule_order(schedule, stage, 2, MICRO):
        out += forward if kind == "F" else backward
    return out


def test_schedule_orders_by_definition():
    """The reference itself: 1F1B on 2 stages, 4 micro-batches (stage 0 holds 2 in flight)."""
    assert _schedule_order("1f1b", 0, 2, 4) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1),
                                                 ("F", 3), ("B", 2), ("B", 3)]
    assert _schedule_order("1f1b", 1, 2, 4) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2),
                                                 ("B", 2), ("F", 3), ("B", 3)]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_trace_is_one_schedule_step_in_its_order(schedule):
    results = launch(__file__, "worker_trace", world_size=2, timeout_s=300,
                     args={"schedule": schedule})
    for stage, res in enumerate(results):
        names = res["unit_names"]
        assert sorted(res["traced_units"]) == sorted(_unit_uses(stage, names)[0]), names
        want = _expected_trace(schedule, stage, names)
        assert len(want) == 2 * MICRO * 3
        assert res["steps"] == [1, 2, 3], res["steps"]  # one prefetch step per schedule step
        for got in res["traces"]:
            assert got == want, (stage, res["unit_names"], got, want)
        assert res["hits"][1] > res["hits"][0] and res["hits"][2] > res["hits"][1], res["hits"]
    if schedule == "1f1b":
        for res in results:
            msg = res.get("tied_error", "")
            assert "shared by two stages" in msg and "wte.weight" in msg, res.get("tied_error")
