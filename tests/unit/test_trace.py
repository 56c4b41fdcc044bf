"""Trace recording, phases and variants, next-use distances (against brute force), the follower."""

from __future__ import annotations

import itertools
import math

import pytest

from infinity.prefetch import (Follow, Level, Trace, TraceEntry, TraceFollower, TraceRecorder,
                               TraceStore)


def entries(units, *, nbytes=100, compute_s=1.0, home=Level.HOST):
    return [TraceEntry(unit=u, shard_bytes=nbytes, gathered_bytes=2 * nbytes, home=home, compute_s=compute_s)
            for u in units]


def test_recorder_times_from_hooks():
    rec = TraceRecorder("train")
    a = TraceEntry(unit="a", shard_bytes=10, gathered_bytes=20, home=Level.NVME)
    b = TraceEntry(unit="b", shard_bytes=30, gathered_bytes=60, home=Level.HOST)
    # a: pre at 0, stall until 0.5 (not compute), post at 2.0; b's pre at 2.25.
    rec.on_pre(a, pre_s=0.0, start_s=0.5)
    rec.on_post("a", now_s=2.0)
    rec.on_pre(b, pre_s=2.25, start_s=2.25)
    rec.on_pre(a, pre_s=3.0, start_s=3.0)  # b had no post-hook: all of it counts as compute
    rec.on_post("a", now_s=3.5)
    got = rec.finish()
    assert [(e.unit, e.shard_bytes, e.gathered_bytes, e.home) for e in got] == [
        ("a", 10, 20, Level.NVME), ("b", 30, 60, Level.HOST), ("a", 10, 20, Level.NVME)]
    assert [e.compute_s for e in got] == pytest.approx([1.5, 0.75, 0.5])
    assert [e.gap_s for e in got] == pytest.approx([0.25, 0.0, 0.0])
    assert len(rec) == 0


def test_trace_indexes():
    t = Trace(entries(["a", "b", "c", "b", "a"], compute_s=2.0))
    assert t.find("b", 0) == 1 and t.find("b", 2) == 3 and t.find("b", 4) is None
    assert t.find("b", 2, 3) is None
    assert t.next_use_distance("a", 1) == 3.0
    assert t.next_use_distance("zz", 0) == math.inf
    assert t.next_use_s("b", 2) == pytest.approx(2.0)
    assert t.time_between_s(0, 5) == pytest.approx(10.0)


def test_phases_kept_side_by_side():
    store = TraceStore()
    train = entries(["e", "l0", "l1", "l1", "l0", "e"])
    store.commit("train", train)
    store.commit("eval", entries(["e", "l0", "l1"]))
    assert store.latest("train").units() == ["e", "l0", "l1", "l1", "l0", "e"]
    assert store.latest("eval").units() == ["e", "l0", "l1"]
    # A re-recorded train step replaces the train trace, leaves eval alone.
    store.commit("train", entries(["e", "l0", "l1", "l1", "l0", "e"], compute_s=3.0))
    assert len(store.variants("train")) == 1
    assert store.latest("train")[0].compute_s == 3.0
    assert store.latest("eval").units() == ["e", "l0", "l1"]
    assert set(store.phases()) == {"train", "eval"}


def test_dissimilar_recording_becomes_a_variant_not_a_replacement():
    store = TraceStore(max_variants=2)
    full = list("abcddcba")
    store.commit("train", entries(full))
    store.commit("train", entries(list("abcd")))  # a forward-only run under the train name
    assert [v.units() for v in store.variants("train")] == [list("abcd"), full]
    store.commit("train", entries(list("xyzw")))  # a third shape evicts the oldest variant
    assert [v.units() for v in store.variants("train")] == [list("xyzw"), list("abcd")]
    assert store.num_new_variants == 2


def belady_misses(seq, capacity):
    """Simulate a cache evicting the item whose next use is farthest (Trace.next_use_distance)."""
    t = Trace(entries(seq))
    cache, misses = set(), 0
    for i, u in enumerate(seq):
        if u in cache:
            continue
        misses += 1
        if len(cache) >= capacity:
            victim = max(sorted(cache), key=lambda c: t.next_use_distance(c, i + 1))
            cache.remove(victim)
        cache.add(u)
    return misses


def optimal_misses(seq, capacity):
    """Brute force over every eviction choice (independent of the trace code)."""
    best = math.inf

    def go(i, cache, misses):
        nonlocal best
        if misses >= best:
            return
        if i == len(seq):
            best = misses
            return
        u = seq[i]
        if u in cache:
            go(i + 1, cache, misses)
        elif len(cache) < capacity:
            go(i + 1, cache | {u}, misses + 1)
        else:
            for v in sorted(cache):
                go(i + 1, (cache - {v}) | {u}, misses + 1)

    go(0, frozenset(), 0)
    return best


@pytest.mark.parametrize("capacity", [2, 3])
def test_belady_by_next_use_distance_is_optimal(capacity):
    checked = 0
    for length in (6, 7, 8):
        # Every sequence over 4 units would be 4^8; a deterministic sample keeps this fast.
        for k, seq in enumerate(itertools.product("abcd", repeat=length)):
            if k % (37 if length == 8 else 7):
                continue
            assert belady_misses(list(seq), capacity) == optimal_misses(list(seq), capacity), seq
            checked += 1
    assert checked > 500


def test_follower_matches_skips_and_repeats():
    store = TraceStore()
    store.commit("train", entries(list("abcdef")))
    f = TraceFollower(store, window_entries=8)
    f.begin("train")
    assert f.advance("a") is Follow.MATCH
    assert f.advance("c") is Follow.RESYNC  # b skipped
    assert f.cursor == 3
    assert f.advance("c") is Follow.REPEAT  # recomputation of the unit just run
    assert f.cursor == 3 and f.synced
    assert f.advance("d") is Follow.MATCH


def test_follower_substitution_keeps_predicting_and_insertion_resyncs():
    store = TraceStore()
    store.commit("train", entries(["l0", "x1", "l1", "x2", "l2", "ins", "l3"]))
    f = TraceFollower(store)
    f.begin("train")
    f.advance("l0")
    assert f.advance("y1") is Follow.DIVERGED  # another expert instead of x1
    trace, cursor = f.view()
    assert trace[cursor].unit == "l1"  # still predicts what follows
    assert f.advance("l1") is Follow.RESYNC and f.synced and f.cursor == 3
    f.advance("x2")
    f.advance("l2")
    assert f.advance("new") is Follow.DIVERGED  # inserted unit (ins) replaced
    assert f.advance("ins") is Follow.RESYNC and f.synced


def test_follower_switches_variant_by_history():
    store = TraceStore()
    store.commit("train", entries(list("abcddcba")))
    store.commit("train", entries(list("pqrs")))  # most recent variant, wrong for this step
    f = TraceFollower(store)
    f.begin("train")
    assert f.trace.units() == list("pqrs")
    assert f.advance("a") is Follow.RESYNC
    assert f.trace.units() == list("abcddcba") and f.cursor == 1


def test_follower_continues_past_the_end_of_a_forward_only_variant():
    store = TraceStore()
    store.commit("train", entries(list("abcddcba")))
    store.commit("train", entries(list("abcd")))
    f = TraceFollower(store)
    f.begin("train")
    for u in "abcd":
        assert f.advance(u) is Follow.MATCH
    trace, cursor = f.view()
    assert [e.unit for e in trace.entries[cursor:]] == list("dcba")


def test_follower_of_an_evaluation_step_goes_on_into_the_next_step():
    """[Note: predicting past an evaluation step] in infinity/prefetch/_trace.py: begun with
    ``then``, the follower plans and gives next uses past the step's end into the next step of that
    phase; without it, nothing."""
    store = TraceStore()
    store.commit("train", entries(list("abccba")))
    store.commit("eval", entries(list("abc")))
    for then in (None, "train"):
        f = TraceFollower(store)
        f.begin("eval", then=then)
        for u in "abc":
            assert f.advance(u) is Follow.MATCH
        if then is None:
            assert f.view() is None  # the step ended as recorded
            assert f.horizon().next_use_distance("a", f.cursor) == math.inf
            continue
        trace, cursor = f.view()
        assert cursor == trace.step_end == 3
        assert [e.unit for e in trace.entries[cursor:]] == list("abccba")
        assert f.horizon() is trace  # built once, not at every call
        assert trace.next_use_distance("b", cursor) == 1.0  # the training step's second unit
    # A step of phase ``then`` that was never recorded: nothing past the end, as without it.
    f = TraceFollower(store)
    f.begin("eval", then="generate")
    for u in "abc":
        f.advance(u)
    assert f.view() is None


def test_successor_statistics_predict_without_a_matching_trace():
    store = TraceStore()
    store.commit("train", entries(list("abcd")))
    f = TraceFollower(store)
    f.begin("other-phase")  # no trace of its own: the first unit adopts the train trace
    assert f.advance("zz") is Follow.UNTRACED
    assert f.view() is None
    assert f.advance("b") is Follow.UNTRACED  # history (zz, b) is in no trace
    trace, cursor = f.view()
    assert [e.unit for e in trace.entries[cursor:]][:2] == ["c", "d"]
