"""The pure parts of overlap (issue #30): the modeled link's queue, the order gathers are
predicted in ([Note: gathers issued ahead]) and the fixed reduction order ([Note: every
rank reduces every unit in one order])."""

from __future__ import annotations

import pytest

from infinity import LinkModel
from infinity._modeled_link import ModeledLink
from infinity.zero._gather_ahead import GatherAhead
from infinity.zero._reduce_order import ReduceOrder


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_link_queues_transfers_at_its_bandwidth_and_latency():
    clock = Clock()
    link = ModeledLink(LinkModel(bandwidth_gbytes_per_s=1.0, latency_us=10.0), clock=clock)
    assert link.reserve(1_000_000) == pytest.approx(100.0 + 1e-5 + 1e-3)  # idle: starts now
    assert link.reserve(2_000_000) == pytest.approx(100.0 + 2 * 1e-5 + 3e-3)  # queued behind
    clock.now = 200.0  # idle again: the next starts when issued
    assert link.reserve(0) == pytest.approx(200.0 + 1e-5)
    assert link.busy_s == pytest.approx(3 * 1e-5 + 3e-3)
    assert (link.transfers, link.bytes) == (3, 3_000_000)


@pytest.mark.parametrize("field,value", [("bandwidth_gbytes_per_s", 0), ("bandwidth_gbytes_per_s", -1.0),
                                         ("bandwidth_gbytes_per_s", True), ("latency_us", -1.0)])
def test_link_settings_are_checked(field, value):
    kwargs = {"bandwidth_gbytes_per_s": 1.0, field: value}
    with pytest.raises(ValueError, match=field):
        LinkModel(**kwargs)


def test_gathers_are_predicted_from_the_last_step_into_the_backward_not_past_it():
    ahead = GatherAhead()
    ahead.begin_step()
    assert ahead.first() is None and ahead.ahead(1, False) == []  # nothing recorded
    step = [(0, False), (1, False), (2, False), (3, False), (0, True), (3, True), (2, True),
            (1, True)]
    for unit, backward in step:
        ahead.use(unit, backward)
    ahead.begin_step()
    assert ahead.first() == 0
    ahead.use(0, False)
    assert ahead.ahead(0, False) == [(1, False), (2, False)]  # LOOKAHEAD_UNITS of the forward
    ahead.use(1, False)
    ahead.use(2, False)
    # The forward's last units gather the backward's first ones (the root computing: skipped).
    assert ahead.ahead(2, False, busy={0}) == [(3, False), (1, True)]
    ahead.use(3, False)
    assert ahead.ahead(3, False, busy={0}) == [(2, True), (1, True)]
    assert not ahead.used_next(3)  # the root's backward first, then its own: kept while the
    assert ahead.used_next(3, busy={0})  # root computes (its forward spans the whole forward)
    assert ahead.used_next(0)  # the root: its forward ends the forward, its backward is next
    ahead.use(0, True)
    assert ahead.ahead(0, True) == [(3, True), (2, True)]
    # A use the last step did not have at the cursor: resynchronised within the window.
    ahead.use(2, True)
    assert ahead.ahead(2, True) == [(1, True)]
    ahead.use(1, True)
    assert ahead.ahead(1, True) == []  # the backward's end: the next forward is not predicted
    ahead.begin_step()
    ahead.use(5, False)  # never seen: lost for the step
    assert ahead.ahead(5, False) == [] and not ahead.used_next(1)


def test_a_unit_used_twice_in_a_row_is_kept():
    ahead = GatherAhead()
    ahead.begin_step()
    for unit in (1, 1, 2):
        ahead.use(unit, False)
    ahead.begin_step()
    ahead.use(1, False)
    assert ahead.used_next(1) and ahead.ahead(1, False) == [(2, False)]


def test_gathers_ahead_fill_the_largest_units_bytes_not_a_count():
    """The root (unit 0) is five blocks: two of its size ahead are ten blocks."""
    ahead = GatherAhead({0: 500, **{u: 100 for u in range(1, 13)}, 13: 300})
    ahead.begin_step()
    step = [(0, False), *[(u, False) for u in range(1, 14)], (0, True),
            *[(u, True) for u in range(13, 0, -1)]]
    for unit, backward in step:
        ahead.use(unit, backward)
    ahead.begin_step()
    ahead.use(0, False)
    forward = [(u, False) for u in range(1, 14)]
    assert ahead.ahead(0, False, busy={0}) == forward[:10]  # 1000 bytes
    for u in range(1, 11):
        ahead.use(u, False)
    # To the end of the forward, and on into the backward's first units (the root computing;
    # a unit gathered for the forward already, or computing, is not gathered again for it).
    assert ahead.ahead(10, False, busy={0}) == forward[10:] + [(u, True) for u in range(9, 4, -1)]
    for u in (11, 12, 13):
        ahead.use(u, False)
    assert ahead.ahead(13, False, busy={0}) == [(u, True) for u in range(12, 2, -1)]
    ahead.use(0, True)
    assert ahead.ahead(0, True) == [(u, True) for u in (13, 12, 11, 10, 9, 8, 7, 6)]
    ahead.use(13, True)
    assert ahead.ahead(13, True) == [(u, True) for u in range(12, 2, -1)]


def test_reductions_follow_the_fixed_order_whatever_the_completion_order():
    order = ReduceOrder([3, 2, 1, 0])
    assert order.order == [3, 2, 1, 0]
    assert order.complete(2) == []  # 3 first
    assert order.complete(3) == [3, 2]
    assert order.complete(3) == []  # a gradient after its reduction: not reduced again here
    assert order.complete(0) == []
    assert order.rest() == [1, 0]  # the end of backward: the rest, in order
    assert order.complete(3) == [3]  # the next backward starts over


def test_schedule_bound_puts_an_overlapped_after_step_gather_in_the_forward():
    """[Note: the schedule bound] in infinity/bench/overlap.py: stage2-overlap waits its after-step
    all-gather in the next forward, so that link time bounds the forward, not engine.step()."""
    from infinity.bench.overlap import schedule_bound_s

    free = {"phase_s": {"forward": 1.0, "backward": 2.0, "optimizer": 0.2}}
    linked = {"comm_link_busy_s_by_phase_per_step": {"reduce-grad": 2.5, "step-gather": 0.9}}
    assert schedule_bound_s(free, linked) == pytest.approx(1.0 + 2.5 + 0.9)
    assert schedule_bound_s(free, linked, step_gather_in_forward=True) == pytest.approx(
        1.0 + 2.5 + 0.2)
    linked["comm_link_busy_s_by_phase_per_step"]["step-gather"] = 1.4  # longer than the forward
    assert schedule_bound_s(free, linked, step_gather_in_forward=True) == pytest.approx(
        1.4 + 2.5 + 0.2)


def test_schedule_bound_of_the_copies_puts_updated_shards_between_step_and_forward():
    """[Note: the schedule bound]: with a host<->device copy link, the updated shards cross
    between their update (the step) and their read (the forward), the gradients come down in the
    backward, and the busier direction bounds the whole step."""
    from infinity.bench.overlap import schedule_bound_s

    free = {"phase_s": {"forward": 1.0, "backward": 2.0, "optimizer": 0.5}}
    linked = {"copy_link_busy_s_per_step": 4.0, "copy_link_bytes_per_step": 4e9,  # 1 ns a byte
              "updated_shard_bytes": 3e9, "copy_bytes_to_host_per_step": 2.5e9}
    assert schedule_bound_s(free, linked) == pytest.approx(3.0 + 2.5)
    linked["updated_shard_bytes"] = 1e9  # fits in the step and the forward: compute bounds them
    assert schedule_bound_s(free, linked) == pytest.approx(max(0.5 + 1.0 + 2.5, 4.0))
    linked["copy_link_busy_s_per_step"], linked["copy_link_bytes_per_step"] = 8.0, 8e9
    assert schedule_bound_s(free, linked) == pytest.approx(8.0)  # the link is busier than all


def test_the_first_gather_and_the_last_reduction_are_read_from_the_link_log():
    """[Note: what cannot hide] in infinity/bench/overlap.py: from one step's transfers, the
    first unit's forward gather (all its collectives, not the next unit's) and the reductions
    from that unit's last run on (not the earlier units', nor its own earlier micro-step's); a
    real link records the transfers between two takes, with the collectives' contexts."""
    from infinity.bench.overlap import comm_edges_s, copy_edges_s

    ctx = "{} of unit {} 'u{}' (micro-step 0)"
    log = [("forward-gather", ctx.format("forward-gather", 0, 0), 0.3),
           ("forward-gather", ctx.format("forward-gather", 0, 0), 0.1),  # its second group
           ("forward-gather", ctx.format("forward-gather", 1, 1), 0.2),
           ("backward-gather", ctx.format("backward-gather", 1, 1), 0.2),
           ("reduce-grad", ctx.format("reduce-grad", 0, 0), 0.05),  # an earlier micro-step's
           ("reduce-grad", ctx.format("reduce-grad", 1, 1), 0.2),
           ("reduce-grad", ctx.format("reduce-grad", 0, 0), 0.5),
           ("replicate-reduce", ctx.format("replicate-reduce", 0, 0), 0.25),
           ("step-gather", ctx.format("step-gather", 2, 2), 0.7)]
    assert comm_edges_s(log) == pytest.approx({"head_s": 0.4, "tail_s": 0.75})
    # An always-gathered unit reduced after it, at the end of backward: in the tail too.
    log.insert(-1, ("reduce-grad", ctx.format("reduce-grad", 9, 9), 0.01))
    assert comm_edges_s(log) == pytest.approx({"head_s": 0.4, "tail_s": 0.76})
    assert comm_edges_s([]) == {"head_s": 0.0, "tail_s": 0.0}
    up = [("HOST->DEVICE", "param/u0.bfloat16.0", 0.3), ("HOST->DEVICE", "param/u0.float32.1", 0.1),
          ("HOST->DEVICE", "param/u1.bfloat16.0", 0.2), ("HOST->DEVICE", "param/u0.bfloat16.0", 0.3)]
    down = [("grad DEVICE->HOST", "u1.bfloat16.0", 0.2), ("DEVICE->HOST", "param/u2.bfloat16.0", 1.0),
            ("grad DEVICE->HOST", "u0.bfloat16.0", 0.5), ("grad DEVICE->HOST", "u0.float32.1", 0.1)]
    assert copy_edges_s(up, down) == pytest.approx({"head_s": 0.4, "tail_s": 0.6})
    assert copy_edges_s([], down) == pytest.approx({"head_s": 0.0, "tail_s": 0.6})  # the last

    clock = iter(range(100)).__next__
    link = ModeledLink(LinkModel(bandwidth_gbytes_per_s=1.0, latency_us=0.0), clock=clock)
    link.reserve(1000, "forward-gather", "a")
    assert link.take_log() == []  # not recording
    link.record()
    link.reserve(2000, "reduce-grad", "b")
    assert link.take_log() == [("reduce-grad", "b", pytest.approx(2e-6))]
    assert link.take_log() == []


def test_schedule_bound_adds_what_cannot_hide():
    """[Note: what cannot hide]: the forward cannot start computing before its first gather, the
    step cannot start before the last reduction, whatever else the link carries."""
    from infinity.bench.overlap import schedule_bound_s

    free = {"phase_s": {"forward": 1.0, "backward": 3.0, "optimizer": 0.1}}
    linked = {"comm_link_busy_s_by_phase_per_step": {"forward-gather": 1.1,
                                                     "backward-gather": 0.8, "reduce-grad": 2.2}}
    assert schedule_bound_s(free, linked) == pytest.approx(0.1 + 1.1 + 3.0)
    linked["comm_link_edges_s_per_step"] = {"head_s": 0.3, "tail_s": 0.6}
    assert schedule_bound_s(free, linked) == pytest.approx((1.0 + 0.3) + (3.0 + 0.6))
    linked["copy_link_edges_s_per_step"] = {"head_s": 0.2, "tail_s": 0.9}  # the larger of each
    assert schedule_bound_s(free, linked) == pytest.approx((1.0 + 0.3) + (3.0 + 0.9))


def test_schedule_bound_lets_the_backward_gathers_run_in_the_forward():
    """[Note: the schedule bound]: the backward's gathers may start in the forward's tail, so
    they bound the forward and the backward together, not the backward alone; the link still
    carries every byte of both phases after the step."""
    from infinity.bench.overlap import schedule_bound_s

    free = {"phase_s": {"forward": 1.5, "backward": 2.5, "optimizer": 0.1}}
    linked = {"comm_link_busy_s_by_phase_per_step": {"forward-gather": 1.1,
                                                     "backward-gather": 0.5, "reduce-grad": 2.3}}
    # The forward has 0.4 s of room for them, the backward 0.2 s: the compute bounds both (the
    # backward alone would have to carry them: 0.1 + 1.5 + 2.8).
    assert schedule_bound_s(free, linked) == pytest.approx(0.1 + 1.5 + 2.5)
    for phase in ("backward-gather", "secondary-gather"):  # hpZ's come from the node's group
        by_phase = {"forward-gather": 1.1, phase: 0.9, "reduce-grad": 2.3}
        linked["comm_link_busy_s_by_phase_per_step"] = by_phase
        # Room for 0.6 s of them in both phases: the link's bytes bound the two.
        assert schedule_bound_s(free, linked) == pytest.approx(0.1 + 1.1 + 0.9 + 2.3)


def test_in_memory_step_reports_each_key_once_its_partition_holds_the_update():
    """[Note: the after-step gather overlaps the next forward]: the optimizer calls
    ``on_stepped(key)`` as each key's bf16 parameter partition holds its update (torch's AdamW on
    that parameter, rounded to bf16), in add order, and not for a key the step does not update;
    a later key is not yet updated when an earlier one is reported."""
    import torch

    from infinity.config import OptimizerConfig
    from infinity.optim._in_memory import InMemoryShardOptimizer
    from infinity.optim._runs import AdamRun, config_hyperparameters

    config = OptimizerConfig(lr=1e-2, weight_decay=0.1)
    opt = InMemoryShardOptimizer(config)
    g = torch.Generator().manual_seed(0)
    masters = {k: torch.randn(n, generator=g) for k, n in (("a", 7), ("b", 5), ("c", 3))}
    grads = {k: torch.randn(m.numel(), generator=g) for k, m in masters.items()}
    outs = {k: m.to(torch.bfloat16) for k, m in masters.items()}
    refs = {k: torch.nn.Parameter(m.clone()) for k, m in masters.items()}
    for k in masters:
        opt.add(k, masters[k], outs[k])
    before = {k: o.clone() for k, o in outs.items()}
    hyper = config_hyperparameters(config, config.lr)
    runs = {k: (AdamRun(0, masters[k].numel(), 1, hyper),) for k in ("a", "c")}  # not "b"
    seen = []

    def stepped(key):
        seen.append((key, {k: not torch.equal(outs[k], before[k]) for k in outs}))

    opt.step(grads, runs=runs, on_stepped=stepped)
    assert seen == [("a", {"a": True, "b": False, "c": False}),
                    ("c", {"a": True, "b": False, "c": True})]
    for k in ("a", "c"):
        ref = torch.optim.AdamW([refs[k]], lr=1e-2, weight_decay=0.1)
        refs[k].grad = grads[k].clone()
        ref.step()
        torch.testing.assert_close(outs[k], refs[k].detach().to(torch.bfloat16))
