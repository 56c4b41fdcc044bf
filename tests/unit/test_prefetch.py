"""Planner (pure, plain data) and executor (fake handles: simulated time, instant, threaded)."""

from __future__ import annotations

import random
import threading
import time

import pytest

from infinity.prefetch import (Bandwidths, FetchAction, FetchQuery, Level, PrefetchConfig,
                               PrefetchExecutor, Trace, TraceEntry, UnitSizes, plan_fetches)

G = Level.GATHERED


def mk_trace(specs, compute_s=1.0):
    return Trace([TraceEntry(unit=u, shard_bytes=sb, gathered_bytes=gb, home=h, compute_s=compute_s)
                  for u, sb, gb, h in specs])


def bw(nvme=1000.0, h2d=1000.0, gather=1000.0):
    return Bandwidths({(Level.NVME, Level.HOST): nvme, (Level.HOST, Level.DEVICE): h2d,
                       (Level.DEVICE, Level.GATHERED): gather})


# ---- planner: lookahead --------------------------------------------------------------------------
@pytest.mark.parametrize("position", [0, 1, 2, 4])
@pytest.mark.parametrize("delta_s", [-0.01, 0.01])
def test_lookahead_issues_exactly_when_deferring_would_be_late(position, delta_s):
    """One unit X (all-gather only) among gathered units; compute 1 s each; next plan in 0.2 s."""
    time_to_cursor_s, next_plan_in_s = 0.5, 0.2
    deadline_s = time_to_cursor_s + position * 1.0  # independent formula: uses start at 1 s per entry
    transfer_s = deadline_s - next_plan_in_s + delta_s  # just over / under the slack
    if transfer_s <= 0:
        pytest.skip("no positive transfer time at this position")
    gathered_bytes = round(transfer_s * 1000)
    units = [f"u{i}" for i in range(8)]
    units[position] = "X"
    t = mk_trace([(u, gathered_bytes // 2, gathered_bytes, Level.DEVICE) for u in units])
    levels = {u: G for u in units if u != "X"}
    req = FetchQuery(trace=t, cursor=0, time_to_cursor_s=time_to_cursor_s, next_plan_in_s=next_plan_in_s,
                      levels=levels, inflight={}, bandwidth=bw(gather=1000.0), plans_at_post=False)
    got = plan_fetches(req)
    if delta_s > 0:  # deferring to the next plan point would finish late: issue now
        assert got == [FetchAction(unit="X", src=Level.DEVICE, dst=G, nbytes=gathered_bytes,
                                   position=position, needed_in_s=pytest.approx(deadline_s))]
    else:  # it can still start at the next plan point and be on time: not yet
        assert got == []


def test_lookahead_multi_hop_from_nvme_sums_the_hops():
    # X homed on NVMe at position 3 (needed in 3 s): 100 B at 100 B/s + 100 B at 200 B/s + 200 B at 400 B/s
    # = 1 + 0.5 + 0.5 = 2 s. Plan points every 0.5 s (pre and post of 1 s units with 0.5 s compute).
    units = ["a", "b", "c", "X", "d"]
    t = Trace([TraceEntry(unit=u, shard_bytes=100, gathered_bytes=200, home=Level.NVME, compute_s=0.5,
                          gap_s=0.5) for u in units])
    levels = {u: G for u in units if u != "X"}
    b = bw(nvme=100.0, h2d=200.0, gather=400.0)

    def planned(cursor, time_to_cursor_s, next_plan_in_s):
        req = FetchQuery(trace=t, cursor=cursor, time_to_cursor_s=time_to_cursor_s,
                          next_plan_in_s=next_plan_in_s, levels=levels, inflight={}, bandwidth=b)
        return [a.unit for a in plan_fetches(req)]

    # Plan points fall every 0.5 s (pre- and post-hooks); a later hop starts at the first point
    # after the previous one landed. Deferring X to the next point (0.5 s from now) lands:
    # at a's pre-hook (needed in 3.0 s): 0.5+1 = 1.5 -> 2.0 -> 2.5 <= 3.0: wait;
    assert planned(1, 1.0, 0.5) == []
    # at a's post-hook (needed in 2.5 s): the same 2.5 <= 2.5: still on time, wait;
    assert planned(1, 0.5, 0.5) == []
    # at b's pre-hook (needed in 2.0 s): 2.5 > 2.0, so issue now (lands 1.0 -> 1.5 -> 2.0, on time).
    assert planned(2, 1.0, 0.5) == ["X"]


def test_nothing_beyond_the_trace_end_and_gathered_units_skipped():
    t = mk_trace([("a", 10, 20, Level.HOST), ("b", 10, 20, Level.HOST)])
    req = FetchQuery(trace=t, cursor=2, time_to_cursor_s=0.0, next_plan_in_s=0.0, levels={}, inflight={},
                      bandwidth=bw())
    assert plan_fetches(req) == []


# ---- planner: budgets ----------------------------------------------------------------------------
def test_budget_never_exceeded_and_demand_first():
    units = [f"u{i}" for i in range(10)]
    t = mk_trace([(u, 100, 400, Level.HOST) for u in units], compute_s=0.01)  # all needed almost now
    req = FetchQuery(trace=t, cursor=0, time_to_cursor_s=0.0, next_plan_in_s=0.005, levels={}, inflight={},
                      bandwidth=bw(h2d=1000.0), inflight_free_bytes={Level.DEVICE: 250},
                      free_bytes={Level.DEVICE: 10_000, Level.GATHERED: 10_000})
    got = plan_fetches(req)
    assert got[0].demand and got[0].unit == "u0"
    prefetch_bytes = sum(a.nbytes for a in got if not a.demand and a.dst is Level.DEVICE)
    assert prefetch_bytes <= 250 - 100  # the demand hop is charged first
    assert [a.unit for a in got] == ["u0", "u1"]  # in need order, none leapfrogging


def test_free_bytes_of_later_rungs_are_reserved_and_lookahead_cap():
    units = [f"u{i}" for i in range(6)]
    t = mk_trace([(u, 100, 400, Level.HOST) for u in units], compute_s=0.01)
    base = dict(trace=t, cursor=0, time_to_cursor_s=0.5, next_plan_in_s=0.005, levels={}, inflight={},
                bandwidth=bw(h2d=100.0))
    got = plan_fetches(FetchQuery(**base, free_bytes={Level.DEVICE: 10_000, Level.GATHERED: 900}))
    assert [a.unit for a in got] == ["u0", "u1"]  # 2 x 400 gathered bytes fit 900, a third would not
    got = plan_fetches(FetchQuery(**base, lookahead_bytes=350))
    assert sum(a.nbytes for a in got) <= 350 and [a.unit for a in got] == ["u0", "u1", "u2"]


def _belady_reference(free, evictable, positions, nbytes):
    """Independent reference for [Note: prefetch never displaces a sooner use]: walking the units
    in need order, a prefetch for position j may use free bytes and copies used after j, the
    furthest first; the first that does not fit blocks the level."""
    pool, planned = sorted(evictable), []
    for j in positions:
        later = [c for c in pool if c[0] > j]
        if free + sum(b for _, b in later) < nbytes:
            break
        planned.append(j)
        free -= nbytes
        while free < 0:
            free += pool.pop()[1]  # the furthest next use first, as the store evicts
    return planned


@pytest.mark.parametrize("free,evictable", [
    (0, [(float("inf"), 100), (10, 100), (2, 100)]),
    (50, [(1, 100), (4, 60), (5, 60), (3, 100)]),
    (0, []),
    (300, [(0, 100)]),
])
def test_prefetch_never_displaces_a_copy_used_sooner(free, evictable):
    units = [f"u{i}" for i in range(6)]
    t = mk_trace([(u, 100, 400, Level.NVME) for u in units], compute_s=0.01)  # every read is late
    base = dict(trace=t, cursor=0, time_to_cursor_s=0.01, next_plan_in_s=0.005, levels={}, inflight={},
                bandwidth=bw(nvme=100.0))
    unlimited = plan_fetches(FetchQuery(**base))
    assert [a.unit for a in unlimited] == units  # without budgets every read starts now
    got = plan_fetches(FetchQuery(**base, free_bytes={Level.HOST: free}, evictable={Level.HOST: evictable}))
    expected = _belady_reference(free, evictable, range(6), 100)
    assert [a.position for a in got] == expected
    assert all(a.src is Level.NVME and a.dst is Level.HOST for a in got)


def test_all_gathers_planned_in_trace_order():
    # u1 is on the device already (gather only), u0 still on the host: u1's gather must wait for u0's.
    t = mk_trace([("u0", 100, 200, Level.HOST), ("u1", 100, 200, Level.DEVICE)], compute_s=0.01)
    req = FetchQuery(trace=t, cursor=0, time_to_cursor_s=0.5, next_plan_in_s=0.005, levels={},
                      inflight={}, bandwidth=bw(h2d=100.0, gather=100.0))
    assert [(a.unit, a.dst) for a in plan_fetches(req)] == [("u0", Level.DEVICE)]


def test_next_step_entries_get_shard_hops_only_never_on_demand():
    """[Note: predicting past an evaluation step] in infinity/prefetch/_trace.py: past the trace's
    ``step_end`` the planner moves shards up within the budgets, but issues no all-gather and
    nothing on demand."""
    step = mk_trace([("a", 100, 200, Level.HOST), ("b", 100, 200, Level.HOST)], compute_s=0.01)
    following = mk_trace([("c", 100, 200, Level.HOST), ("d", 100, 200, Level.NVME),
                          ("b", 100, 200, Level.HOST)], compute_s=0.01)
    levels = {"a": G, "b": G, "c": Level.DEVICE, "d": Level.NVME}
    base = dict(cursor=2, time_to_cursor_s=0.0, next_plan_in_s=0.0, levels=levels, inflight={},
                bandwidth=bw(nvme=100.0, h2d=100.0, gather=100.0))
    joined = step.followed_by(following)
    assert joined.step_end == 2 and joined.units() == ["a", "b", "c", "d", "b"]
    got = plan_fetches(FetchQuery(trace=joined, **base))
    # c is on the device already: its all-gather is the next step's; d's first hop starts now.
    assert got == [FetchAction(unit="d", src=Level.NVME, dst=Level.HOST, nbytes=100, position=3,
                               needed_in_s=pytest.approx(0.01), demand=False)]
    assert plan_fetches(FetchQuery(trace=joined, **base, free_bytes={Level.HOST: 50})) == []
    # The same entries as one step: c's all-gather is due now (demand), and d's read too.
    plain = Trace(joined.entries)
    assert [(a.unit, a.dst, a.demand) for a in plan_fetches(FetchQuery(trace=plain, **base))] == [
        ("c", G, True), ("d", Level.HOST, False)]


# ---- executor in simulated time ------------------------------------------------------------------
class SimClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class SimHandle:
    def __init__(self, clock, end_s, on_done):
        self.clock, self.end_s, self._on_done, self._fired = clock, end_s, on_done, False

    def done(self):
        return self.clock.now >= self.end_s

    def wait(self):
        self.clock.now = max(self.clock.now, self.end_s)
        if not self._fired:
            self._fired = True
            self._on_done()


class SimStore:
    """FIFO links with fixed bandwidths in simulated time; residency known only at completion."""

    def __init__(self, clock, bps):
        self.clock, self.bps, self.link_free = clock, bps, {}
        self.level = {}
        self.log = []  # (unit, src, dst, issued_s, end_s)

    def issue(self, a):
        hop = (a.src, a.dst)
        start = max(self.clock.now, self.link_free.get(hop, 0.0))
        end = start + a.nbytes / self.bps[hop]
        self.link_free[hop] = end
        self.log.append((a.unit, a.src, a.dst, self.clock.now, end))
        return SimHandle(self.clock, end, lambda: self.level.__setitem__(a.unit, a.dst))


def run_sim_step(ex, store, clock, seq, compute_s, phase="train"):
    ex.begin_step(phase)
    need_s = {}
    for i, u in enumerate(seq):
        ex.pre_hook(u)
        assert store.level.get(u) is G, f"{u} used before its all-gather completed"
        need_s[i] = clock.now
        clock.now += compute_s
        if not ex.keep_gathered(u):
            store.level[u] = Level.DEVICE  # release: the shard copy stays on the device
            ex.on_evicted(u, 400, G)
        ex.post_hook(u)
    ex.end_step()
    return need_s


def _sim(*, host_to_device_bps: float = 1000.0, locate=None):
    """(clock, store, executor) over a simulated store: 500 B/s NVMe -> host, ``host_to_device_bps``
    host -> device, 2000 B/s all-gather, the planner told those rates exactly (no safety factor).
    ``locate(store) -> callable``: where the executor looks units up (None: its own bookkeeping)."""
    clock = SimClock()
    bps = {(Level.NVME, Level.HOST): 500.0, (Level.HOST, Level.DEVICE): host_to_device_bps,
           (Level.DEVICE, Level.GATHERED): 2000.0}
    store = SimStore(clock, bps)
    cfg = PrefetchConfig(nvme_to_host_bytes_per_s=500.0, host_to_device_bytes_per_s=host_to_device_bps,
                         all_gather_bytes_per_s=2000.0, transfer_time_safety_factor=1.0)
    ex = PrefetchExecutor(issue=store.issue, config=cfg, clock=clock,
                          locate=None if locate is None else locate(store))
    return clock, store, ex


def test_sim_prefetch_hides_transfers_and_fetches_no_earlier_than_needed():
    clock, store, ex = _sim()
    units = [f"l{i}" for i in range(6)]
    for u in units:  # NVMe homed: 100 B at 500 B/s (0.2 s), 100 B at 1000 (0.1 s), 400 B at 2000 (0.2 s)
        ex.register_unit(UnitSizes(unit=u, shard_bytes=100, gathered_bytes=400, home=Level.NVME))
    seq = units + units[::-1]
    run_sim_step(ex, store, clock, seq, 1.0)
    first = ex.stats()
    assert first["demand_misses"] == len(seq)  # no trace yet: everything fetched on demand
    store.log.clear()
    need_s = run_sim_step(ex, store, clock, seq, 1.0)
    s = ex.stats()
    # Step 2 stalls only on the first unit's all-gather (0.2 s), which no compute precedes.
    assert s["stall_s_total"] - first["stall_s_total"] == pytest.approx(0.2)
    assert s["prefetch_late"] - first["prefetch_late"] == 1
    assert s["demand_misses"] == first["demand_misses"]
    # Not more than needed: the all-gathers (0.2 s) ran while the previous unit computed (1 s), so
    # each was issued at the last plan point before its use: exactly one unit (1 s) ahead.
    t0 = min(need_s.values())
    assert store.log
    for unit, _src, _dst, issued_s, _end in store.log[1:]:  # [0]: the step's first unit, at begin_step
        use_s = min(t for i, t in need_s.items() if seq[i] == unit and t >= issued_s)
        assert use_s - issued_s == pytest.approx(1.0), (unit, issued_s - t0, use_s - t0)


def test_evaluation_step_moves_the_next_steps_first_shards_up_during_its_last_units():
    """[Note: predicting past an evaluation step] in infinity/prefetch/_trace.py. Every release
    drops the device copy. An evaluation forward begun with ``then="train"`` copies the training
    step's first shard to the device while its own last unit computes, never all-gathering it
    (released at the step's end, it would be wasted), so the training step after it stalls only on
    that unit's all-gather."""
    def run(then):
        clock, store, ex = _sim(host_to_device_bps=200.0,
                                locate=lambda store: lambda u: store.level.get(u, Level.HOST))
        units = [f"l{i}" for i in range(4)]
        for u in units:  # 100 B at 200 B/s to the device (0.5 s), 400 B all-gathered (0.2 s)
            ex.register_unit(UnitSizes(unit=u, shard_bytes=100, gathered_bytes=400, home=Level.HOST))

        def step(seq, phase, then=None):
            stalls_s = []
            ex.begin_step(phase, then=then)
            for u in seq:
                before_s = ex.stats()["stall_s_total"]
                ex.pre_hook(u)
                stalls_s.append(ex.stats()["stall_s_total"] - before_s)
                assert store.level.get(u) is G, f"{u} used before its all-gather completed"
                clock.now += 1.0
                store.level[u] = Level.HOST  # released, and its device copy dropped
                ex.on_evicted(u, 400, None)
                ex.post_hook(u)
            ex.end_step()
            return stalls_s

        train = units + units[::-1]
        for seq, phase in ((train, "train"), (train, "train"), (units, "eval")):
            step(seq, phase)
        start = len(store.log)
        step(units, "eval", then=then)
        during_eval = [(u, dst) for u, _src, dst, _issued, _end in store.log[start:]]
        ex.drain()
        return during_eval, step(train, "train")

    plain, plain_stalls_s = run(None)
    ahead, ahead_stalls_s = run("train")
    assert [d for _, d in plain].count(G) == 4  # one all-gather per use
    assert ahead == plain + [("l0", Level.DEVICE)]  # at the last unit's pre-hook: 0.5 s < 1 s
    assert plain_stalls_s[0] == pytest.approx(0.5 + 0.2)  # l0: copy to the device, all-gather
    assert ahead_stalls_s[0] == pytest.approx(0.2)  # l0's all-gather only
    assert ahead_stalls_s[1:] == pytest.approx(plain_stalls_s[1:])


# ---- executor: divergence with instant handles ---------------------------------------------------
class Instant:
    def __init__(self, cb):
        self.cb = cb
        cb()

    def done(self):
        return True

    def wait(self):
        return None


def make_instant_executor(**cfg):
    levels = {}
    ex = PrefetchExecutor(issue=lambda a: Instant(lambda: levels.__setitem__(a.unit, a.dst)),
                          config=PrefetchConfig(**cfg), clock=time.perf_counter,
                          locate=lambda u: levels.get(u, Level.HOST))
    return ex, levels


def run_instant_step(ex, levels, seq, phase="train"):
    before = ex.stats()
    ex.begin_step(phase)
    for u in seq:
        ex.pre_hook(u)
        assert levels[u] is G
        if not ex.keep_gathered(u):  # the manager's order: decide, release, then post_hook plans
            levels[u] = Level.DEVICE
            ex.on_evicted(u, 400, G)
        ex.post_hook(u)
    ex.end_step()
    after = ex.stats()
    needs = after["needs"] - before["needs"]
    hits = after["prefetch_hits"] + after["resident_hits"] - before["prefetch_hits"] - before["resident_hits"]
    return hits / needs


def moe_sequence(routing):
    fwd = ["embed"]
    for layer, expert in enumerate(routing):
        fwd += [f"attn{layer}", f"expert{layer}.{expert}"]
    return fwd + fwd[::-1]


def test_changing_control_flow_never_raises_and_hit_rate_recovers():
    ex, levels = make_instant_executor()
    for u in ["embed"] + [f"attn{i}" for i in range(4)] + [f"expert{i}.{e}" for i in range(4) for e in range(4)]:
        ex.register_unit(UnitSizes(unit=u, shard_bytes=100, gathered_bytes=400, home=Level.HOST))
    rng = random.Random(0)
    rates = []
    for pattern in range(6):
        routing = [rng.randrange(4) for _ in range(4)]
        for _ in range(3):  # control flow changes every 3 steps
            rates.append(run_instant_step(ex, levels, moe_sequence(routing)))
    # From the second step of each pattern on, every unit was prefetched in time.
    for p in range(6):
        assert rates[3 * p + 1] == 1.0 and rates[3 * p + 2] == 1.0, rates
    s = ex.stats()
    assert s["trace_divergences"] > 0 and s["demand_misses"] > 0


def test_activation_checkpoint_recompute_pattern():
    ex, levels = make_instant_executor()
    units = [f"l{i}" for i in range(4)]
    for u in units:
        ex.register_unit(UnitSizes(unit=u, shard_bytes=100, gathered_bytes=400, home=Level.HOST))
    plain = units + units[::-1]
    recompute = units + [u for u in units[::-1] for _ in (0, 1)]  # forward re-run inside backward
    assert run_instant_step(ex, levels, plain) < 1.0  # first step: no trace
    assert run_instant_step(ex, levels, plain) == 1.0
    run_instant_step(ex, levels, recompute)  # checkpointing switched on: diverges, must not raise
    assert run_instant_step(ex, levels, recompute) == 1.0
    assert ex.stats()["trace_repeats"] > 0 or ex.stats()["trace_divergences"] > 0


def test_eval_phase_between_train_steps_does_not_clobber_train_trace():
    ex, levels = make_instant_executor()
    units = [f"l{i}" for i in range(5)]
    for u in units:
        ex.register_unit(UnitSizes(unit=u, shard_bytes=100, gathered_bytes=400, home=Level.HOST))
    train = units + units[::-1]
    run_instant_step(ex, levels, train)
    run_instant_step(ex, levels, train)
    train_trace = ex.store.latest("train")
    run_instant_step(ex, levels, units, phase="eval")
    assert ex.store.latest("train") is train_trace
    assert run_instant_step(ex, levels, train) == 1.0
    # An eval forward under the train name lands beside the train trace and does not break it.
    run_instant_step(ex, levels, units, phase="train")
    assert run_instant_step(ex, levels, train) == 1.0


# ---- executor: handles completing on threads -----------------------------------------------------
class ThreadStore:
    """Completes each fetch on a timer thread after ``delay_s``; tracks its own in-flight bytes."""

    def __init__(self, delay_s):
        self.delay_s = delay_s
        self.lock = threading.Lock()
        self.level = {}
        self.inflight = {Level.HOST: 0, Level.DEVICE: 0, G: 0}
        self.max_inflight = dict(self.inflight)
        self.threads = []

    def issue(self, a):
        ev = threading.Event()
        with self.lock:
            self.inflight[a.dst] += a.nbytes
            self.max_inflight[a.dst] = max(self.max_inflight[a.dst], self.inflight[a.dst])

        def complete():
            time.sleep(self.delay_s)
            with self.lock:
                self.level[a.unit] = a.dst  # the bytes become valid only now
                self.inflight[a.dst] -= a.nbytes
            ev.set()

        th = threading.Thread(target=complete, daemon=True)
        th.start()
        self.threads.append(th)

        class H:
            def done(self_inner):
                return ev.is_set()

            def wait(self_inner):
                ev.wait()

        return H()


def test_need_waits_for_inflight_prefetch_and_bounds_hold():
    store = ThreadStore(delay_s=0.02)  # transfers slow against compute: a missing wait shows up
    cfg = PrefetchConfig(host_inflight_budget_bytes=250, device_inflight_budget_bytes=250,
                         gathered_inflight_budget_bytes=900, nvme_to_host_bytes_per_s=1e3,
                         host_to_device_bytes_per_s=1e3, all_gather_bytes_per_s=1e3)
    ex = PrefetchExecutor(issue=store.issue, config=cfg)
    units = [f"l{i}" for i in range(6)]
    for u in units:
        ex.register_unit(UnitSizes(unit=u, shard_bytes=100, gathered_bytes=400, home=Level.NVME))
    plain = units + units[::-1]
    changed = ["l0", "l2", "l1", "l3", "l5", "l5", "l3", "l1", "l2", "l0"]  # l4 skipped, order changed
    for seq in (plain, plain, changed, plain):
        ex.begin_step("train")
        for u in seq:
            ex.pre_hook(u)
            with store.lock:
                assert store.level.get(u) is G, f"{u} used before its fetch completed"
            ex.post_hook(u)
            with store.lock:
                store.level[u] = Level.DEVICE
            ex.on_evicted(u, 400, G)
        ex.end_step()
    ex.drain()
    for th in store.threads:
        th.join()
    s = ex.stats()
    assert store.max_inflight[Level.HOST] <= 250 and store.max_inflight[Level.DEVICE] <= 250
    assert store.max_inflight[G] <= 900
    assert s["max_inflight_bytes"]["HOST"] <= 250 and s["max_inflight_bytes"]["GATHERED"] <= 900
    assert s["prefetch_late"] + s["prefetch_hits"] > 0  # prefetches were issued and used


def test_generate_loop_between_train_steps():
    """Many forward passes in one 'generate' step: never raises, later passes hit, train intact."""
    ex, levels = make_instant_executor()
    units = [f"l{i}" for i in range(5)]
    for u in units:
        ex.register_unit(UnitSizes(unit=u, shard_bytes=100, gathered_bytes=400, home=Level.HOST))
    train = units + units[::-1]
    run_instant_step(ex, levels, train)
    run_instant_step(ex, levels, train)
    train_trace = ex.store.latest("train")
    first = run_instant_step(ex, levels, units * 7, phase="generate")  # no generate trace yet
    again = run_instant_step(ex, levels, units * 7, phase="generate")
    # The first time, only each pass's first unit is a miss (nothing recorded says a pass repeats).
    assert first == pytest.approx(1 - 7 / 35) and again == 1.0
    assert ex.store.latest("train") is train_trace
    assert run_instant_step(ex, levels, train) == 1.0


def test_no_prefetch_past_the_end_of_the_step():
    """The next step's units are updated by the optimizer step first: fetching them early is wrong."""
    issued = []
    levels = {}

    def issue(a):
        issued.append(a.unit)
        return Instant(lambda: levels.__setitem__(a.unit, a.dst))

    ex = PrefetchExecutor(issue=issue, locate=lambda u: levels.get(u, Level.HOST))
    for u in ("a", "b", "c"):
        ex.register_unit(UnitSizes(unit=u, shard_bytes=100, gathered_bytes=400, home=Level.HOST))
    seq = ["a", "b", "c", "c", "b", "a"]  # the last unit has a known successor (a -> b)
    for _ in range(3):
        run_instant_step(ex, levels, seq)
        issued.clear()
    ex.begin_step("train")
    for u in seq:
        mark = len(issued)
        ex.pre_hook(u)
        levels[u] = Level.DEVICE
        ex.on_evicted(u, 400, G)
        ex.post_hook(u)
    assert set(issued[mark:]) <= {"a"}  # from the last unit's pre-hook on: only that unit itself
    ex.end_step()
    assert issued


class _Gates:
    """Hops that complete only when waited for, or when ``land()`` says the I/O thread finished
    (a completed hop sets its unit's level in ``levels``)."""

    def __init__(self):
        self.pending = []

    def issue(self, levels):
        pending = self.pending

        class Gate:
            def __init__(self, a):
                self.a, self.landed = a, False
                pending.append(self)

            def done(self):
                return self.landed

            def wait(self):
                if not self.landed:
                    self.landed = True
                    levels[self.a.unit] = self.a.dst
        return Gate

    def land(self):
        for h in self.pending:
            h.wait()
        self.pending.clear()


def test_prefetch_that_lands_between_planning_and_use_is_late_not_a_miss():
    """[Note: a need is classified before the reap] in infinity/prefetch/_executor.py: a prefetch
    that lands on an I/O thread after the last planning point (its all-gather left to the use)
    counts as late, as it does while still in flight: the count must not depend on which thread
    wins that race."""
    levels, gates = {}, _Gates()
    ex = PrefetchExecutor(issue=gates.issue(levels), locate=lambda u: levels.get(u, Level.HOST))
    for u in ("a", "b"):
        ex.register_unit(UnitSizes(unit=u, shard_bytes=100, gathered_bytes=400, home=Level.HOST))
    for landed_before_use in (False, True, True, False):
        ex.begin_step("train")
        for u in ("a", "b"):
            if landed_before_use:
                gates.land()  # every hop issued so far lands before this use
            ex.pre_hook(u)
            levels[u] = Level.HOST  # released, and its device copy dropped: each use climbs again
            ex.on_evicted(u, 400, None)
            ex.post_hook(u)
        ex.end_step()
        gates.land()
    s = ex.stats()
    assert s["needs"] == 8
    assert s["demand_misses"] == 2, s  # the first step's, recorded without a trace
    assert s["prefetch_late"] == 6, s  # every later use: prefetched, landed or not
    assert s["prefetches_issued"] >= 6


def test_demand_hop_waits_for_inflight_room_instead_of_being_dropped():
    """A hop the planner says is needed now is issued even when older prefetches fill its
    destination's in-flight bound: the executor waits for room (as need() would), where it used to
    drop it, leaving the use a demand miss. Here a skipped unit's prefetch holds the room."""
    levels, gates = {}, _Gates()
    ex = PrefetchExecutor(issue=gates.issue(levels), locate=lambda u: levels.get(u, Level.HOST),
                          config=PrefetchConfig(device_inflight_budget_bytes=100))
    for u in "abc":
        ex.register_unit(UnitSizes(unit=u, shard_bytes=100, gathered_bytes=400, home=Level.HOST))

    def step(seq, landing):
        ex.begin_step("train")
        for u in seq:
            if landing:
                gates.land()
            ex.pre_hook(u)
            levels[u] = Level.HOST  # released, and its device copy dropped
            ex.on_evicted(u, 400, None)
            ex.post_hook(u)
        ex.end_step()

    step("abc", landing=True)
    gates.land()
    step("ab", landing=False)  # c is skipped: its prefetch stays in flight
    assert [f.action.dst for f in ex._inflight.values()] == [Level.DEVICE]
    before = ex.stats()
    step("abc", landing=False)  # begin_step: a is needed now, the room is c's
    s = ex.stats()
    assert s["demand_misses"] == before["demand_misses"]
    assert s["prefetch_late"] - before["prefetch_late"] == 3
    assert s["max_inflight_bytes"]["DEVICE"] <= 100


def test_evicted_unused_prefetch_bytes_counted():
    ex, levels = make_instant_executor()
    for u in ("a", "b", "c"):
        ex.register_unit(UnitSizes(unit=u, shard_bytes=100, gathered_bytes=400, home=Level.HOST))
    run_instant_step(ex, levels, ["a", "b", "c"])
    ex.begin_step("train")  # prefetches "a" (needed first)
    assert levels["a"] is G
    levels["a"] = Level.DEVICE
    ex.on_evicted("a", 400, G)
    assert ex.stats()["prefetched_evicted_unused_bytes"] == 400


def test_next_use_distance_and_lru_fallback():
    ex, levels = make_instant_executor()
    for u in ("a", "b", "c"):
        ex.register_unit(UnitSizes(unit=u, shard_bytes=100, gathered_bytes=400, home=Level.HOST))
    ex.begin_step("train")
    assert ex.next_use_distance("a") is None  # no trace yet: the store falls back to LRU
    ex.end_step()
    run_instant_step(ex, levels, ["a", "b", "c", "b", "a"])
    ex.begin_step("train")
    ex.pre_hook("a")
    assert ex.next_use_distance("b") == 0.0 and ex.next_use_distance("a") == 3.0
    assert ex.next_use_distance("zz") == float("inf")


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="prefetch.host_inflight_budget_bytes"):
        PrefetchConfig(host_inflight_budget_bytes=-1)
    with pytest.raises(ValueError, match="home"):
        UnitSizes(unit="x", shard_bytes=1, gathered_bytes=1, home="GATHERED")


def test_sim_multi_hop_from_nvme_after_full_eviction():
    """Every release drops all copies (back to NVMe): each use needs swap-in, copy and all-gather."""
    clock, store, ex = _sim(locate=lambda store: lambda u: store.level.get(u, Level.NVME))
    units = [f"l{i}" for i in range(6)]
    for u in units:
        ex.register_unit(UnitSizes(unit=u, shard_bytes=100, gathered_bytes=400, home=Level.NVME))
    seq = units + units[::-1]

    def step():
        ex.begin_step("train")
        for u in seq:
            ex.pre_hook(u)
            assert store.level.get(u) is G
            clock.now += 1.0
            store.level[u] = Level.NVME
            ex.on_evicted(u, 400, None)
            ex.post_hook(u)
        ex.end_step()

    step()
    first = ex.stats()
    step()
    s = ex.stats()
    # Every use of step 2 was prefetched (hits or late, none on demand). Hops advance only at hooks,
    # so the step's first unit, the unit re-run at the turnaround (released to NVMe in between) and
    # the next one wait partly; step 1, all on demand, waited 0.5 s on each of its 12 uses.
    assert first["stall_s_total"] == pytest.approx(12 * 0.5)
    assert s["demand_misses"] == first["demand_misses"]
    assert s["prefetch_hits"] - first["prefetch_hits"] >= len(seq) // 2
    assert s["stall_s_total"] - first["stall_s_total"] < first["stall_s_total"] / 3


def test_random_plans_respect_every_budget():
    """Property check on random traces, residencies and budgets (sums computed here, independently)."""
    rng = random.Random(1)
    homes = [Level.NVME, Level.HOST, Level.DEVICE]
    for _ in range(300):
        n = rng.randint(1, 12)
        units = [f"u{rng.randrange(8)}" for _ in range(n)]
        sizes = {u: (rng.randint(1, 50), rng.randint(50, 200), rng.choice(homes)) for u in set(units)}
        t = Trace([TraceEntry(unit=u, shard_bytes=sizes[u][0], gathered_bytes=sizes[u][1], home=sizes[u][2],
                              compute_s=rng.uniform(0.0, 0.2)) for u in units])
        levels = {u: rng.choice([*homes, G]) for u in sizes if rng.random() < 0.5}
        room = {lvl: rng.choice([None, rng.randint(0, 300)]) for lvl in (Level.HOST, Level.DEVICE, G)}
        free = {lvl: rng.choice([None, rng.randint(0, 600)]) for lvl in (Level.HOST, Level.DEVICE, G)}
        look = rng.choice([None, rng.randint(0, 400)])
        req = FetchQuery(trace=t, cursor=rng.randint(0, n), time_to_cursor_s=rng.choice([0.0, 0.05]),
                          next_plan_in_s=0.05, levels=levels, inflight={}, bandwidth=bw(100.0, 200.0, 400.0),
                          inflight_free_bytes=room, free_bytes=free, lookahead_bytes=look)
        got = plan_fetches(req)
        assert len({a.unit for a in got}) == len(got)
        assert all(a.demand for a in got[:sum(a.demand for a in got)])  # demand hops come first
        pre = [a for a in got if not a.demand]
        demand_bytes = {lvl: sum(a.nbytes for a in got if a.demand and a.dst is lvl) for lvl in room}
        for lvl in (Level.HOST, Level.DEVICE, G):
            inflight_planned = sum(a.nbytes for a in pre if a.dst is lvl)
            if room[lvl] is not None:
                assert inflight_planned <= max(0, room[lvl] - demand_bytes[lvl])
            if free[lvl] is not None and inflight_planned:
                assert inflight_planned <= free[lvl]
        if look is not None:
            assert sum(a.nbytes for a in pre) <= look
        gathers = [a.position for a in got if a.dst is G]
        assert gathers == sorted(gathers)


def test_fuzzed_hook_sequences_never_raise():
    """Random control flow, missing/foreign post-hooks, stray evictions, phases, unbalanced steps."""
    rng = random.Random(7)
    ex, levels = make_instant_executor(host_inflight_budget_bytes=150, device_inflight_budget_bytes=150,
                                       lookahead_bytes=600)
    units = [f"u{i}" for i in range(10)]
    for u in units:
        ex.register_unit(UnitSizes(unit=u, shard_bytes=100, gathered_bytes=400, home=Level.NVME))
    base = units[:6] + units[:6][::-1]
    for step in range(40):
        ex.begin_step(rng.choice(["train", "train", "eval"]))
        seq = list(base)
        for _ in range(rng.randrange(4)):  # mutate the control flow
            i = rng.randrange(len(seq))
            op = rng.randrange(3)
            if op == 0:
                seq.insert(i, rng.choice(units))
            elif op == 1 and len(seq) > 1:
                del seq[i]
            else:
                seq[i] = rng.choice(units)
        for u in seq:
            ex.pre_hook(u)
            assert levels[u] is G
            if rng.random() < 0.8:
                ex.post_hook(u if rng.random() < 0.95 else rng.choice(units))
            if rng.random() < 0.3:  # the store evicts something at random
                v = rng.choice(units)
                levels[v] = rng.choice([Level.NVME, Level.HOST, Level.DEVICE])
                ex.on_evicted(v, 400, rng.choice([None, G, Level.DEVICE]))
            ex.next_use_distance(rng.choice(units))
            if not ex.keep_gathered(u):
                levels[u] = Level.DEVICE
                ex.on_evicted(u, 400, G)
        if rng.random() < 0.9:
            ex.end_step()
    s = ex.stats()
    assert s["needs"] > 300 and s["max_inflight_bytes"]["HOST"] <= 150


def test_bandwidth_ema_from_handle_timings():
    b = Bandwidths({(Level.HOST, Level.DEVICE): 100.0}, ema_weight=0.5)
    b.observe(Level.HOST, Level.DEVICE, 300, 1.0)
    assert b.get("HOST", "DEVICE") == pytest.approx(0.5 * 100.0 + 0.5 * 300.0)

    class Timed(Instant):
        elapsed_s = 0.5

    levels = {}
    ex = PrefetchExecutor(issue=lambda a: Timed(lambda: levels.__setitem__(a.unit, a.dst)),
                          config=PrefetchConfig(host_to_device_bytes_per_s=100.0, all_gather_bytes_per_s=800.0,
                                                bandwidth_ema_weight=0.5),
                          locate=lambda u: levels.get(u, Level.HOST))
    ex.register_unit(UnitSizes(unit="a", shard_bytes=100, gathered_bytes=400, home=Level.HOST))
    ex.begin_step("train")
    ex.pre_hook("a")  # demand: HOST->DEVICE 100 B and all-gather 400 B, each measured at 0.5 s
    assert ex.bandwidth.get(Level.HOST, Level.DEVICE) == pytest.approx(0.5 * 100.0 + 0.5 * 200.0)
    assert ex.bandwidth.get(Level.DEVICE, G) == pytest.approx(0.5 * 800.0 + 0.5 * 800.0)


def test_store_reporting_evictions_from_inside_wait_is_safe():
    """A store may evict (and report it) while a handle completes; nested reaping must not double-book."""
    levels = {}
    holder = {}

    class Evicting(Instant):
        def __init__(self, cb, unit):
            self.unit = unit
            super().__init__(cb)

        def wait(self):
            holder["ex"].on_evicted("z", 0, G)  # reaps the other landed hops from inside this wait()

    # Slow links against compute: many hops are issued, and land, between two hooks.
    ex = PrefetchExecutor(issue=lambda a: Evicting(lambda: levels.__setitem__(a.unit, a.dst), a.unit),
                          config=PrefetchConfig(host_to_device_bytes_per_s=1e3, all_gather_bytes_per_s=1e3),
                          locate=lambda u: levels.get(u, Level.HOST))
    holder["ex"] = ex
    units = [f"u{i}" for i in range(6)]
    for u in units + ["z"]:
        ex.register_unit(UnitSizes(unit=u, shard_bytes=100, gathered_bytes=400, home=Level.HOST))
    for _ in range(3):
        run_instant_step(ex, levels, units + units[::-1])
    assert ex.stats()["needs"] == 36


@pytest.mark.parametrize("limit, free_bytes, expected", [
    (400, None, True),    # b (400 gathered bytes) runs before a comes back: within the distance
    (399, None, False),   # one byte short
    (400, 400, True),     # b still fits beside a
    (400, 300, False),    # b would not fit while a stays gathered
    (0, None, False),     # default: only an immediate reuse
])
def test_keep_gathered_reuse_distance_and_budget(limit, free_bytes, expected):
    ex, levels = make_instant_executor(max_reuse_distance_bytes=limit)
    for u in ("a", "b", "c"):
        ex.register_unit(UnitSizes(unit=u, shard_bytes=100, gathered_bytes=400, home=Level.HOST))
    seq = ["a", "b", "a", "c"]
    run_instant_step(ex, levels, seq)
    ex.begin_step("train")
    ex.pre_hook("a")
    levels["b"] = Level.HOST  # make sure b still has to be gathered
    ex.on_evicted("b", 400, None)
    assert ex.keep_gathered("a", free_bytes=free_bytes) is expected
    assert ex.keep_gathered("c", free_bytes=free_bytes) is (limit >= 800 and expected)  # a, b in between


def run_rank(cfg_kwargs, bps_scale, compute_s, sequences, device_homed=False, phases=None):
    """One simulated rank; returns the order in which it issued all-gathers. ``phases``: a
    (phase, then) per sequence (default: all 'train')."""
    clock = SimClock()
    bps = {(Level.NVME, Level.HOST): 500.0 * bps_scale, (Level.HOST, Level.DEVICE): 1000.0 * bps_scale,
           (Level.DEVICE, Level.GATHERED): 2000.0 * bps_scale}
    store = SimStore(clock, bps)
    ex = PrefetchExecutor(issue=store.issue, clock=clock, locate=lambda u: store.level.get(u, homes[u]),
                          config=PrefetchConfig(nvme_to_host_bytes_per_s=500.0 * bps_scale,
                                                host_to_device_bytes_per_s=1000.0 * bps_scale,
                                                all_gather_bytes_per_s=2000.0 * bps_scale, **cfg_kwargs))
    homes = {}
    for i, u in enumerate(sorted({u for seq in sequences for u in seq})):
        homes[u] = Level.DEVICE if device_homed else Level.NVME if i % 2 else Level.HOST
        ex.register_unit(UnitSizes(unit=u, shard_bytes=100, gathered_bytes=400, home=homes[u]))
    for seq, (phase, then) in zip(sequences, phases or [("train", None)] * len(sequences)):
        ex.begin_step(phase, then=then)
        for u in seq:
            ex.pre_hook(u)
            assert store.level.get(u) is G
            clock.now += compute_s
            if not ex.keep_gathered(u):
                store.level[u] = homes[u]
                ex.on_evicted(u, 400, None)
            ex.post_hook(u)
        ex.end_step()
    return [unit for unit, _src, dst, _issued, _end in store.log if dst is G], ex.stats()


def test_all_gathers_issue_in_the_same_order_on_ranks_with_different_timing():
    rng = random.Random(3)
    sequences = []
    for pattern in range(5):
        routing = [rng.randrange(3) for _ in range(3)]
        sequences += [moe_sequence(routing)] * 2  # the control flow changes every two steps
    fixed = dict(gather_lead_entries=2)
    order_fast, stats_fast = run_rank(fixed, bps_scale=4.0, compute_s=0.5, sequences=sequences)
    order_slow, stats_slow = run_rank(fixed, bps_scale=0.5, compute_s=1.0, sequences=sequences)
    assert order_fast == order_slow  # same collectives in the same order: no hang, no mixed-up buffers
    assert stats_fast["prefetch_hits"] > stats_fast["needs"] // 2  # and still prefetched


def test_evaluation_steps_keep_all_gathers_in_the_same_order_on_ranks():
    """[Note: predicting past an evaluation step] in infinity/prefetch/_trace.py: the shard hops
    past an evaluation's end are timed per rank; the all-gathers stay inside each step, at fixed
    positions, alike on every rank."""
    train = moe_sequence([0, 1, 2])
    forward = train[:len(train) // 2]
    sequences = [train, train, forward, train, forward, forward, train]
    phases = [("train", None)] * 2 + [("eval", "train"), ("train", None)] + [("eval", "train")] * 2 \
        + [("train", None)]
    fixed = dict(gather_lead_entries=2)
    order_fast, _ = run_rank(fixed, bps_scale=4.0, compute_s=0.5, sequences=sequences, phases=phases)
    order_slow, _ = run_rank(fixed, bps_scale=0.5, compute_s=1.0, sequences=sequences, phases=phases)
    assert order_fast == order_slow



def test_fixed_position_gathers_survive_skipped_units_that_timed_planning_does_not():
    """A slow rank gathers further ahead; when later units are skipped its collectives differ."""
    sequences = [list("ABCDE")] * 2 + [list("ADE")]  # B and C skipped in the last step
    for cfg, same in (({}, False), ({"gather_lead_entries": 2}, True)):
        fast, _ = run_rank(cfg, bps_scale=8.0, compute_s=1.0, sequences=sequences, device_homed=True)
        slow, _ = run_rank(cfg, bps_scale=0.1, compute_s=1.0, sequences=sequences, device_homed=True)
        assert (fast == slow) is same, (cfg, fast, slow)


def test_reaped_hops_are_settled_and_the_reader_waits_where_it_reads():
    """Issue #30 item 3: reaping a finished hop must not run what ``wait()`` adds for a reader
    (on CUDA, the caller's stream waits for the copy): the executor reaps at whichever hook comes
    next, so a stream wait there let a prefetched copy overlap one unit at best. Handles with
    ``settle()`` are settled; the store's own ``acquire``/``get`` waits where the shard is read."""
    calls = []

    class Recorded(Instant):
        def wait(self):
            calls.append("wait")

        def settle(self):
            calls.append("settle")

    levels = {}
    ex = PrefetchExecutor(issue=lambda a: Recorded(lambda: levels.__setitem__(a.unit, a.dst)),
                          clock=time.perf_counter, locate=lambda u: levels.get(u, Level.HOST))
    for u in ("a", "b", "c"):
        ex.register_unit(UnitSizes(unit=u, shard_bytes=100, gathered_bytes=400, home=Level.HOST))
    for _ in range(3):
        run_instant_step(ex, levels, ["a", "b", "c", "c", "b", "a"])
    assert ex.stats()["prefetches_issued"] > 0
    assert calls and set(calls) == {"settle"}, calls
