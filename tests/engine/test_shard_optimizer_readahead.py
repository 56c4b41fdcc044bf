"""The NVMe optimizer's read-ahead ([Note: optimizer read-ahead] in infinity/optim/_offloaded.py):
sub-group reads issued during backward and ahead in the step complete before the update reads
them (reads are made slow so that a missing wait shows up as a wrong number), the step's order
does not change the result, reads dropped without a step leave nothing pinned, and the host
budget holds."""

from __future__ import annotations

import pytest
import torch

import infinity
from infinity.config import OptimizerConfig, SwapperConfig
from infinity.errors import TierCapacityError
from infinity.io import Swapper
from infinity.optim import OffloadedShardOptimizer
from infinity.optim._sub_group import SubGroupState
from infinity.tiers import Residency, StoreConfig, Tier, TieredStore
from tests._support.engine import (assert_close_run, batches, engine_config, engine_train,
                                   mark_backward, reference_train, tiny_gpt)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

def _adamw_reference(masters, grads_per_step, config: OptimizerConfig):
    """torch.optim.AdamW over the same flat fp32 tensors (the independent reference)."""
    params = [torch.nn.Parameter(m.clone()) for m in masters]
    opt = torch.optim.AdamW(params, lr=config.lr, betas=config.betas, eps=config.eps,
                            weight_decay=config.weight_decay)
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


def _store(tmp_path, host_budget_bytes: int):
    swapper = Swapper(str(tmp_path / "swap"), SwapperConfig())
    store = TieredStore("cpu", StoreConfig(device_budget_bytes=2 ** 20,
                                           host_budget_bytes=host_budget_bytes), swapper=swapper)
    return store, swapper


@pytest.mark.parametrize("prefetch_order", [(), ("b", "a"), ("c", "b"), ("a", "b", "c")])
def test_reads_ahead_complete_before_use_in_any_order(tmp_path, slow_reads, prefetch_order):
    config = OptimizerConfig(lr=0.01, weight_decay=0.1)
    sizes = {"a": 1000, "b": 2500, "c": 700}  # sub-groups of 512: 2 + 5 + 2
    # A sub-group is 512 x 12 B (an 8 KiB extent); the arena holds 6 of the 9: reads are real.
    store, swapper = _store(tmp_path, host_budget_bytes=6 * 8192)
    try:
        opt = OffloadedShardOptimizer(config, store, home=Tier.NVME, sub_group_numel=512,
                                      window_sub_groups=4)  # 4 sub-groups pinned at most
        gen = torch.Generator().manual_seed(0)
        masters = {k: torch.randn(n, generator=gen) for k, n in sizes.items()}
        outs = {k: torch.zeros(n, dtype=torch.bfloat16) for k, n in sizes.items()}
        for k in sizes:
            opt.add(k, masters[k], outs[k])
        assert opt.window_sub_groups == 4
        grads_per_step = [[torch.randn(n, generator=gen) for n in sizes.values()]
                          for _ in range(3)]
        for grads in grads_per_step:
            for key in prefetch_order:  # as backward would: the state is read before the step
                opt.prefetch(key)
            opt.step(dict(zip(sizes, grads)))
        want = _adamw_reference(list(masters.values()), grads_per_step, config)
        for (key, w) in zip(sizes, want):
            torch.testing.assert_close(opt.master_values(key), w, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(outs[key], w.to(torch.bfloat16), rtol=0, atol=0)
        assert store.stats()["host_peak_bytes"] <= store.stats()["host_budget_bytes"]
    finally:
        store.close()
        swapper.close()


def test_cancelled_reads_leave_nothing_pinned(tmp_path, slow_reads):
    store, swapper = _store(tmp_path, host_budget_bytes=6 * 8192)
    try:
        opt = OffloadedShardOptimizer(OptimizerConfig(lr=0.01), store, home=Tier.NVME,
                                      sub_group_numel=512, window_sub_groups=3)
        opt.add("a", torch.randn(2000), None)
        store.flush()
        for sk in store.keys():
            store.evict(sk, Tier.HOST)  # the reads below really go to the swap files
        opt.prefetch("a")
        assert len(slow_reads["reads"]) == 3  # the window's three sub-groups were being read
        opt.cancel_prefetch()
        assert all(sg.state is SubGroupState.AT_REST for sg in opt.sub_groups("a"))
        for sk in store.keys():  # a pinned copy cannot be evicted (ValueError "acquired")
            store.evict(sk, Tier.HOST)
            assert store.state(sk, Tier.HOST) is Residency.ABSENT
    finally:
        store.close()
        swapper.close()


_HOMED = 16 * 4096
"""The tiny GPT's host-homed bytes below (parameter shards and gradient accumulators, 4 KiB
extents); the slot is one 4 KiB extent (300 fp32 elements x 3)."""


@pytest.mark.parametrize("host, resident", [("auto", False), (_HOMED + 4 * 4096, False),
                                            (_HOMED + 14 * 4096, True)])
def test_engine_reads_state_during_backward_with_parity(tmp_path, slow_reads, host, resident):
    """Slow NVMe reads, clipping by the global norm, gradient accumulation: the same run as
    plain PyTorch + AdamW, with optimizer reads issued while backward runs. The third budget
    leaves room beyond the window (one spare + 3 slots): 10 sub-groups are homed on HOST
    ([Note: host-resident sub-groups]) and never read from NVMe; the others still are."""
    data = batches(4, 2)
    ref_losses, ref_state = reference_train(tiny_gpt(), data, dtype="bf16", clip=0.05)
    path = str(tmp_path / "swap")
    engine = infinity.initialize(tiny_gpt(), engine_config(
        stage=3, dtype="bf16", gas=2, clip=0.05,
        offload_optimizer={"device": "nvme", "nvme_path": path},
        offload_param={"device": "cpu"}, memory={"host_budget_bytes": host},
        zero={"sub_group_numel": 300}))
    mark_backward(engine, slow_reads)
    try:
        engine.store.flush()
        for sk in engine.store.keys():  # the first step reads from NVMe too
            if sk.startswith("opt/") and engine.store.home(sk) is Tier.NVME:
                engine.store.evict(sk, Tier.HOST)
        losses = engine_train(engine, data)
        assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "bf16")
        stats = engine.stats()
        assert stats["bytes"]["HOST"]["peak"] <= stats["bytes"]["HOST"]["budget"]
        in_backward = [k for k, bwd in slow_reads["reads"] if bwd and k.startswith("opt/")]
        assert in_backward, "optimizer state is read while backward runs"
        homes = {k: engine.store.home(k) for k in engine.store.keys() if k.startswith("opt/")}
        on_host = {k for k, home in homes.items() if home is Tier.HOST}
        assert len(on_host) == (10 if resident else 0) < len(homes)
        opt = engine.shard_optimizer
        assert stats["optimizer_host_resident_bytes"] == sum(
            12 * sg.numel for key in opt.keys() for sg in opt.sub_groups(key)
            if sg.store_key in on_host)
        assert not on_host & {k for k, _bwd in slow_reads["reads"]}
    finally:
        engine.close()


def _add_random_keys(opt, sizes: dict[str, int], *, seed: int, steps: int):
    """Random fp32 masters added under ``sizes``' keys (no parameter copy-out), and ``steps``
    lists of random gradients in the same key order."""
    gen = torch.Generator().manual_seed(seed)
    masters = [torch.randn(n, generator=gen) for n in sizes.values()]
    for key, m in zip(sizes, masters):
        opt.add(key, m, None)
    grads = [[torch.randn(n, generator=gen) for n in sizes.values()] for _ in range(steps)]
    return masters, grads


def _assert_adamw(opt, sizes: dict[str, int], masters, grads_per_step, config) -> None:
    """Every key's master after the steps is torch's AdamW's on the same gradients."""
    for key, want in zip(sizes, _adamw_reference(masters, grads_per_step, config)):
        torch.testing.assert_close(opt.master_values(key), want, rtol=1e-6, atol=1e-6)


def test_next_step_starts_with_the_sub_groups_still_cached(tmp_path, slow_reads):
    """The arena holds 6 of the 9 sub-groups: a step in a fixed order would evict the ones the
    previous step left cached before reaching them and read all 9 again; taking those first reads
    fewer (counted at the swapper), with the same result as torch's AdamW."""
    config = OptimizerConfig(lr=0.01)
    sizes = {"a": 1000, "b": 2500, "c": 700}
    store, swapper = _store(tmp_path, host_budget_bytes=6 * 8192)
    try:
        opt = OffloadedShardOptimizer(config, store, home=Tier.NVME, sub_group_numel=512)
        masters, grads_per_step = _add_random_keys(opt, sizes, seed=1, steps=3)
        reads_per_step = []
        for grads in grads_per_step:
            before = len(slow_reads["reads"])
            opt.step(dict(zip(sizes, grads)))
            reads_per_step.append(len(slow_reads["reads"]) - before)
        assert max(reads_per_step[1:]) < 9, reads_per_step
        _assert_adamw(opt, sizes, masters, grads_per_step, config)
    finally:
        store.close()
        swapper.close()


def test_a_window_larger_than_the_room_reads_less_ahead_and_steps_right(tmp_path, slow_reads):
    """Read-ahead is optional: a window the arena cannot hold (3 extents, 6 asked) holds what the
    room allows (the reads beyond it fail on the store's room lane, [Note: a read ahead never
    waits for room on its caller]), in backward and in the step, instead of failing the step."""
    config = OptimizerConfig(lr=0.01)
    sizes = {"a": 1000, "b": 2500}
    store, swapper = _store(tmp_path, host_budget_bytes=3 * 8192)
    try:
        opt = OffloadedShardOptimizer(config, store, home=Tier.NVME, sub_group_numel=512,
                                      window_sub_groups=6)
        masters, grads_per_step = _add_random_keys(opt, sizes, seed=2, steps=2)
        for grads in grads_per_step:
            opt.prefetch("b")
            opt.prefetch("a")
            held = 0  # reads ahead that got their room (pinned until their update)
            for key in sizes:
                for sg in opt.sub_groups(key):
                    if sg.read is not None:
                        try:
                            sg.read.settle(timeout=60)
                            held += 1
                        except TierCapacityError:  # no room: read again at its update
                            pass
            assert 1 <= held <= 3, held  # the arena's three extents, not the window's six
            opt.step(dict(zip(sizes, grads)))
        _assert_adamw(opt, sizes, masters, grads_per_step, config)
    finally:
        store.close()
        swapper.close()


def test_reads_ahead_that_find_no_room_are_read_again_where_needed(tmp_path, slow_reads,
                                                                   monkeypatch):
    """[Note: a read ahead never waits for room on its caller] in infinity/tiers/store.py: a read
    issued ahead may fail on the store's room lane (TierCapacityError through its handle). Here
    every one does: each sub-group is read again at its update, the result is torch's AdamW's,
    and no pin is left behind."""
    from concurrent.futures import Future

    from infinity.tiers import TierHandle

    config = OptimizerConfig(lr=0.01)
    sizes = {"a": 1000, "b": 2500, "c": 700}
    store, swapper = _store(tmp_path, host_budget_bytes=6 * 8192)
    failed = []
    real_acquire = store.acquire

    def acquire(key, tier, *, ahead=False, **kw):
        if not ahead:
            return real_acquire(key, tier, **kw)
        failed.append(key)
        future: Future = Future()
        future.set_exception(TierCapacityError(f"no room for {key!r}", tier=tier.name,
                                               requested_bytes=0, used_bytes=0, budget_bytes=0))
        return TierHandle(future, key, tier, store.counters.add_wait)

    monkeypatch.setattr(store, "acquire", acquire)
    try:
        opt = OffloadedShardOptimizer(config, store, home=Tier.NVME, sub_group_numel=512,
                                      window_sub_groups=4)
        masters, grads_per_step = _add_random_keys(opt, sizes, seed=3, steps=3)
        for grads in grads_per_step:
            opt.prefetch("b")  # the backward's reads ahead, then the step's: each one fails
            opt.step(dict(zip(sizes, grads)))
        assert len(failed) >= 3 * 4, failed
        _assert_adamw(opt, sizes, masters, grads_per_step, config)
        assert all(sg.state is SubGroupState.AT_REST for k in sizes for sg in opt.sub_groups(k))
        for sk in store.keys():  # a pinned copy cannot be evicted (ValueError "acquired")
            store.evict(sk, Tier.HOST)
    finally:
        store.close()
        swapper.close()


def test_a_shard_that_cannot_be_opened_ends_the_step_and_closes_the_open_one_once(tmp_path):
    """Key a's parameter shard is open while its sub-groups step; opening key b's fails: a's
    shard was closed once when b's turn came (every sub-group of a stepped: closed as written),
    the step ends with the error, b's state is not stepped, the optimizer is idle with nothing
    pinned, and the next step, with b's shard back, steps both."""
    store, swapper = _store(tmp_path, host_budget_bytes=6 * 8192)
    try:
        opt = OffloadedShardOptimizer(OptimizerConfig(lr=0.01), store, home=Tier.NVME,
                                      sub_group_numel=512, window_sub_groups=4)
        gen = torch.Generator().manual_seed(0)
        sizes = {"a": 1000, "b": 700}
        outs = {k: torch.zeros(n) for k, n in sizes.items()}
        exits: list[object] = []
        broken = [True]

        class Opened:  # a stored shard's context manager: records how it was closed
            def __init__(self, key):
                self.key = key

            def __enter__(self):
                return outs[self.key]

            def __exit__(self, kind, value, tb):
                exits.append((self.key, kind))

        def opener(key):
            def open_shard(overwrite=False):
                if key == "b" and broken[0]:
                    raise OSError("b's shard is gone")
                return Opened(key)
            return open_shard

        for k, n in sizes.items():
            opt.add(k, torch.randn(n, generator=gen), opener(k))
        # Set-up's writes settled: a key still being written is cached on the host and steps
        # first ([Note: optimizer read-ahead] in infinity/optim/_offloaded.py), so b could open
        # before a, depending on how fast the disk took a's bytes.
        store.flush()
        grads = {k: torch.randn(n, generator=gen) for k, n in sizes.items()}
        with pytest.raises(OSError, match="b's shard is gone"):
            opt.step(grads)
        assert exits == [("a", None)]  # closed once, before b's failed open
        assert torch.equal(outs["b"], torch.zeros(700)) and opt.state.name == "IDLE"
        b_before = opt.master_values("b").clone()
        for sk in store.keys():  # a pinned copy cannot be evicted (ValueError "acquired")
            store.evict(sk, Tier.HOST)
        broken[0] = False
        exits.clear()
        opt.step(grads)
        assert exits == [("a", None), ("b", None)]
        assert not torch.equal(outs["b"], torch.zeros(700))
        assert not torch.equal(opt.master_values("b"), b_before)
    finally:
        store.close()
        swapper.close()
