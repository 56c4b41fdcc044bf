"""DeepSpeed's LR schedules (infinity.optim.schedulers) against their formulas, written out here.

Each test records the lr every optimizer step runs with, stepping the schedule after the
optimizer as DeepSpeed's engine does. DeepSpeed's iteration counts from -1 (the value set when
the schedule is made), so optimizer step k (from 1) runs at iteration k - 2.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from infinity.config import (SchedulerConfig, config_from_deepspeed, config_to_deepspeed,
                             load_config)
from infinity.optim.schedulers import (LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR,
                                       WarmupLR, build_scheduler)


def _optimizer(kind: str = "adamw", lrs=(0.3,)) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    if kind == "sgd":
        return torch.optim.SGD(groups, momentum=0.5)
    return torch.optim.AdamW(groups, betas=(0.9, 0.999))


def _run(optimizer, schedule, steps: int, key: str = "lr") -> list[list]:
    """Per optimizer step, every group's ``key`` as that step reads it."""
    seen = []
    for _ in range(steps):
        seen.append([g[key] for g in optimizer.param_groups])
        optimizer.step()
        schedule.step()
    return seen


def _close(got: list[list], want: list[list]) -> None:
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want), start=1):
        assert g == pytest.approx(w, rel=1e-12, abs=1e-15), f"optimizer step {k}: {g} != {w}"


# ------------------------------------------------------------------------------------- WarmupLR


def test_warmup_lr_log_rises_to_max_then_holds():
    lo, hi, n = 0.01, 0.1, 10
    opt = _optimizer()
    got = _run(opt, WarmupLR(opt, warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=n), 14)

    def lr(k):  # iteration k - 2; before the start: the minimum
        it = k - 2
        if it < 0:
            return lo
        return lo + (hi - lo) * (math.log(it + 1) / math.log(n) if it < n else 1.0)

    _close(got, [[lr(k)] for k in range(1, 15)])
    assert got[0] == got[1] == [lo]  # DeepSpeed holds the minimum for two steps
    assert got[10] == [pytest.approx(hi)]  # iteration 9 = n - 1: log(n)/log(n) = 1
    assert got[13] == [hi]


def test_warmup_lr_linear_literal_values_and_default_max_is_the_group_lr():
    opt = _optimizer(lrs=(0.1, 0.2))
    got = _run(opt, WarmupLR(opt, warmup_min_lr=0.01, warmup_num_steps=4, warmup_type="linear"), 7)
    # Iterations -1..5: min, 0/4, 1/4, 2/4, 3/4 of the way, then the max (each group's lr).
    want = [[0.01 + (hi - 0.01) * f for hi in (0.1, 0.2)] for f in (0, 0, .25, .5, .75, 1, 1)]
    _close(got, want)
    assert got[2][0] == pytest.approx(0.0325)


def test_warmup_steps_below_two_count_as_two_and_zero_means_no_warmup():
    opt = _optimizer()
    got = _run(opt, WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=1), 4)
    _close(got, [[0.0], [0.0], [math.log(2) / math.log(2)], [1.0]])
    opt = _optimizer()
    got = _run(opt, WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=0), 3)
    _close(got, [[1.0], [1.0], [1.0]])


# -------------------------------------------------------------------------------- WarmupDecayLR


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_decay_lr_decays_linearly_to_zero_at_total(warmup_type):
    lo, hi, n, total = 0.0, 0.1, 5, 12
    opt = _optimizer()
    got = _run(opt, WarmupDecayLR(opt, total, warmup_min_lr=lo, warmup_max_lr=hi,
                                  warmup_num_steps=n, warmup_type=warmup_type), 16)

    def lr(k):
        it = k - 2
        if it < 0:
            return lo
        if it < n:
            rise = math.log(it + 1) / math.log(n) if warmup_type == "log" else it / n
            return lo + (hi - lo) * rise
        return lo + (hi - lo) * max(0.0, (total - it) / (total - n))

    _close(got, [[lr(k)] for k in range(1, 17)])
    assert got[n + 1] == [pytest.approx(hi)]  # iteration n: the decay starts at the peak
    assert got[total + 1] == [0.0] and got[15] == [0.0]  # iteration total and after: 0


def test_warmup_decay_lr_max_defaults_to_deepspeeds_0_001_not_the_group_lr():
    opt = _optimizer(lrs=(0.5,))
    got = _run(opt, WarmupDecayLR(opt, 10, warmup_num_steps=2, warmup_type="linear"), 4)
    _close(got, [[0.0], [0.0], [0.0005], [0.001]])


# ------------------------------------------------------------------------------- WarmupCosineLR


def test_warmup_cosine_lr_scales_each_group_and_ends_at_cos_min_ratio():
    n, total, wmin, cmin = 4, 14, 0.1, 0.05
    base = (0.2, 0.4)
    opt = _optimizer(lrs=base)
    got = _run(opt, WarmupCosineLR(opt, total, warmup_min_ratio=wmin, warmup_num_steps=n,
                                   cos_min_ratio=cmin, warmup_type="linear"), 18)

    def ratio(k):
        it = k - 2
        if it < 0:
            return 0.0  # DeepSpeed: lr 0 before the schedule starts
        if it < n:
            return wmin + (it / n) * (1 - wmin)
        progress = min(1.0, (it - n + 1) / (total - n))
        return cmin + (1 - cmin) * (1 + math.cos(math.pi * progress)) / 2

    _close(got, [[b * ratio(k) for b in base] for k in range(1, 19)])
    assert got[0] == [0.0, 0.0]
    assert got[1] == [pytest.approx(b * wmin) for b in base]
    assert got[total + 1] == [pytest.approx(b * cmin) for b in base]  # the end, and it stays
    assert got[17] == got[total + 1]


def test_warmup_cosine_lr_without_warmup_starts_at_the_peak():
    opt = _optimizer(lrs=(1.0,))
    got = _run(opt, WarmupCosineLR(opt, 4, warmup_num_steps=0, cos_min_ratio=0.0), 6)
    cos = [(1 + math.cos(math.pi * p)) / 2 for p in (0, .25, .5, .75, 1, 1)]
    _close(got, [[c] for c in cos])


# ------------------------------------------------------------------------------------ OneCycle


def test_one_cycle_lr_and_momentum_cycle_then_decay():
    lo, hi, up, down, mlo, mhi = 0.01, 0.1, 4, 2, 0.8, 0.9
    decay_size, lr_rate, mom_rate = 3, 0.5, 0.1
    opt = _optimizer()
    sched = OneCycle(opt, lo, hi, decay_lr_rate=lr_rate, cycle_first_step_size=up,
                     cycle_second_step_size=down, decay_step_size=decay_size,
                     cycle_min_mom=mlo, cycle_max_mom=mhi, decay_mom_rate=mom_rate)
    seen = []
    for _ in range(12):
        g = opt.param_groups[0]
        seen.append((g["lr"], g["betas"]))
        opt.step()
        sched.step()

    def scale(it):  # up over `up` batches, down over `down`
        b = it + 1
        return b / up if b <= up else (up + down - b) / down

    for k, (lr, betas) in enumerate(seen, start=1):
        it = k - 2
        if it < up + down:
            want_lr, want_mom = lo + (hi - lo) * scale(it), mhi - (mhi - mlo) * scale(it)
        else:
            intervals = (it - (up + down) + 1) / decay_size
            want_lr, want_mom = lo / (1 + lr_rate * intervals), mhi * (1 + mom_rate * intervals)
        assert lr == pytest.approx(want_lr), k
        assert betas[0] == pytest.approx(want_mom), k
        assert betas[1] == 0.999, "beta2 is the group's own"
    # the top: batch up, iteration up - 1, optimizer step up + 1
    assert seen[up][0] == pytest.approx(hi) and seen[up][1][0] == pytest.approx(mlo)
    assert seen[0][0] == lo and seen[0][1][0] == pytest.approx(mhi)


def test_one_cycle_stairs_hold_flat_steps():
    opt = _optimizer()
    got = _run(opt, OneCycle(opt, 0.0, 1.0, cycle_first_step_size=6, cycle_second_step_size=4,
                             cycle_first_stair_count=3, cycle_second_stair_count=2,
                             cycle_momentum=False), 12)
    # batch b = k - 1; up: floor(b * 3 / 6) / 3; down: floor((10 - b) * 2 / 4) / 2; b = 10 wraps.
    want = [math.floor(b * 3 / 6) / 3 if b <= 6 else math.floor((10 - b) * 2 / 4) / 2
            for b in range(10)] + [0.0, 0.0]
    _close(got, [[w] for w in want])
    assert [g[0] for g in got[:7]] == pytest.approx([0, 0, 1 / 3, 1 / 3, 2 / 3, 2 / 3, 1])


def test_one_cycle_on_sgd_leaves_momentum_and_says_so():
    opt = _optimizer("sgd")
    with pytest.warns(UserWarning, match="no 'betas'.*cycle_momentum"):
        sched = OneCycle(opt, 0.01, 0.1, cycle_first_step_size=2)
    got = _run(opt, sched, 5, key="momentum")
    assert got == [[0.5]] * 5


# --------------------------------------------------------------------------------- LRRangeTest


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase):
    opt = _optimizer()
    got = _run(opt, LRRangeTest(opt, lr_range_test_min_lr=0.01, lr_range_test_step_size=3,
                                lr_range_test_step_rate=2.0, lr_range_test_staircase=staircase), 8)
    intervals = [(k - 1) / 3 for k in range(1, 9)]
    if staircase:
        intervals = [math.floor(i) for i in intervals]
    _close(got, [[0.01 * (1 + 2.0 * i)] for i in intervals])


# ------------------------------------------------------------------- state, config, bad values


def _cycle(opt):
    return OneCycle(opt, [0.01, 0.02], [0.1, 0.2], cycle_first_step_size=3, decay_step_size=2,
                    decay_lr_rate=0.3, decay_mom_rate=0.05)


@pytest.mark.parametrize("make", [
    lambda o: WarmupLR(o, warmup_min_lr=0.0, warmup_max_lr=[0.1, 0.2], warmup_num_steps=4),
    lambda o: WarmupDecayLR(o, 9, warmup_num_steps=3, warmup_type="linear"),
    lambda o: WarmupCosineLR(o, 9, warmup_num_steps=3, warmup_min_ratio=0.2),
    _cycle,
    lambda o: LRRangeTest(o, lr_range_test_step_size=2),
], ids=["warmup", "decay", "cosine", "one_cycle", "range_test"])
def test_state_dict_round_trip_through_json_resumes_the_same_sequence(make):
    def record(opt, sched, steps):
        seen = []
        for _ in range(steps):
            seen.append([(g["lr"], tuple(g["betas"])) for g in opt.param_groups])
            opt.step()
            sched.step()
        return seen

    opt = _optimizer(lrs=(0.1, 0.2))
    full = record(opt, make(opt), 12)
    opt = _optimizer(lrs=(0.1, 0.2))
    sched = make(opt)
    record(opt, sched, 5)
    state = json.loads(json.dumps(sched.state_dict()))  # engine checkpoints keep it as JSON
    fresh = _optimizer(lrs=(0.1, 0.2))  # a new process: groups at their configured values
    resumed = make(fresh)
    resumed.load_state_dict(state)
    rest = record(fresh, resumed, 7)
    for k, (got, want) in enumerate(zip(rest, full[5:]), start=6):
        for (lr, betas), (wlr, wbetas) in zip(got, want):
            assert lr == pytest.approx(wlr, rel=1e-12) and betas == pytest.approx(wbetas), k
    assert rest[0] != full[0], "the resumed run continues, it does not restart"


def test_build_scheduler_from_a_deepspeed_config_uses_deepspeeds_names():
    raw = {"scheduler": {"type": "OneCycle", "params": {
        "cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3,
        "cycle_second_step_size": 2, "decay_step_size": 2, "decay_lr_rate": 0.5,
        "cycle_momentum": False}}}
    config = load_config(raw).scheduler
    assert config == SchedulerConfig(type="one_cycle", cycle_min_lr=0.01, cycle_max_lr=0.1,
                                     cycle_first_num_steps=3, cycle_second_num_steps=2,
                                     decay_interval_num_steps=2, decay_lr_rate=0.5,
                                     cycle_momentum=False)
    opt = _optimizer()
    from_config = _run(opt, build_scheduler(opt, config), 9)
    opt = _optimizer()
    direct = _run(opt, OneCycle(opt, 0.01, 0.1, cycle_first_step_size=3, cycle_second_step_size=2,
                                decay_step_size=2, decay_lr_rate=0.5, cycle_momentum=False), 9)
    assert from_config == direct
    assert build_scheduler(opt, SchedulerConfig()) is None
    again = config_from_deepspeed(config_to_deepspeed(load_config(raw)))  # `infinity plan`'s form
    assert again.scheduler == config


def test_deepspeed_scheduler_params_are_checked_per_schedule():
    with pytest.raises(ValueError, match=r"scheduler.params.warmup_max_lr: DeepSpeed's "
                                         r"WarmupCosineLR takes no such parameter"):
        load_config({"scheduler": {"type": "WarmupCosineLR",
                                   "params": {"total_num_steps": 10, "warmup_max_lr": 0.1}}})
    with pytest.raises(ValueError, match=r"did you mean 'warmup_num_steps'"):
        load_config({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}})
    with pytest.raises(ValueError, match=r"did you mean 'WarmupLR'"):
        load_config({"scheduler": {"type": "WarmupLr", "params": {}}})
    with pytest.raises(ValueError, match=r"torch\.optim\.lr_scheduler\.CosineAnnealingLR"):
        load_config({"scheduler": {"type": "CosineAnnealingLR", "params": {"T_max": 10}}})
    with pytest.raises(ValueError, match=r"scheduler\.total_num_steps"):
        load_config({"scheduler": {"type": "WarmupDecayLR", "params": {}}})


def test_native_scheduler_section_and_its_errors():
    config = load_config({"scheduler": {"type": "warmup_cosine_lr", "total_num_steps": 100,
                                        "warmup_num_steps": 10}}).scheduler
    assert (config.type, config.total_num_steps, config.cos_min_ratio) == (
        "warmup_cosine_lr", 100, 0.0001)
    assert load_config(load_config({"scheduler": config.to_dict()}).to_dict()).scheduler == config
    with pytest.raises(ValueError, match=r"scheduler\.cycle_min_lr: expected its default None "
                                         r"with type 'warmup_lr'"):
        SchedulerConfig(type="warmup_lr", cycle_min_lr=0.1)
    with pytest.raises(ValueError, match=r"scheduler\.warmup_type: expected one of 'log', "
                                         r"'linear'"):
        SchedulerConfig(type="warmup_lr", warmup_type="cosine")
    opt = _optimizer(lrs=(0.1, 0.2))
    with pytest.raises(ValueError, match=r"warmup_min_lr: 3 values for 2 parameter groups"):
        build_scheduler(opt, SchedulerConfig(type="warmup_lr", warmup_min_lr=(0.0, 0.1, 0.2)))


def test_schedules_are_torch_lr_schedulers_with_no_order_warning():
    opt = _optimizer()
    sched = WarmupLR(opt, warmup_num_steps=3)
    assert isinstance(sched, torch.optim.lr_scheduler.LRScheduler)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
        sched.step()
    assert sched.get_last_lr() == [opt.param_groups[0]["lr"]]
