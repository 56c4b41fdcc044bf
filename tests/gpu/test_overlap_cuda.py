"""Copies that complete late on the GPU (issue #30): every host->device copy of the store waits
``torch.cuda._sleep`` on its copy stream before it runs, so it lands long after it was issued, and
its completion is waited on the copy lane ([Note: device copies complete on the copy lane] in
infinity/tiers/_copy_lane.py) while the reader's stream waits on its event. A missing wait shows
as a wrong number against plain PyTorch on the GPU, not as luck.

The copies down of gradients to an offloaded optimizer's host accumulators and its copy-out of
new parameters run on side streams ([Note: copies on a side stream] in infinity/_async_copy.py):
delayed the same way, a missing ``synchronize``/``join`` is a wrong number too.

One GPU has one rank: the collectives' stream (NCCL, ``async_op``) is not exercised here; the
2-rank tests on gloo under a poisoned modeled link cover their waits
(tests/distributed/test_overlap_dist.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import infinity
from infinity.tiers._mover import Mover
from tests._support.engine import (assert_close_run, batches, engine_train, offload_config,
                                   reference_train)
from tests._support.models import FOUR, four_gpt, unit_numels
from tests.gpu._cuda import CUDA, exact_fp32, set_cuda_tolerance

pytestmark = pytest.mark.gpu

SLEEP_CYCLES = 5_000_000
"""A few milliseconds of GPU time before each copy: far longer than a tiny block's compute."""


@pytest.fixture(autouse=True)
def _tolerance(monkeypatch):
    set_cuda_tolerance(monkeypatch)


@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_late_copies_on_the_copy_stream_train_as_plain_pytorch(home, tmp_path, monkeypatch):
    exact_fp32()
    issue = Mover._issue_copy

    def late(self, dst, src, ready):
        with torch.cuda.device(self.device), torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(ready)
            torch.cuda._sleep(SLEEP_CYCLES)  # the copy below runs this much later
        return issue(self, dst, src, ready)

    monkeypatch.setattr(Mover, "_issue_copy", late)
    steps = 4
    data = batches(steps, 1, config=FOUR)
    ref_losses, ref_state = reference_train(four_gpt(), data, device=CUDA)
    numels = unit_numels(four_gpt())
    config = offload_config(tmp_path / "swap", stage=3, opt=home, param=home, device="cuda",
                            memory={"device_budget_bytes": 3 * max(numels) * 4 * 2})
    engine = infinity.initialize(four_gpt(), config)
    try:
        losses = engine_train(engine, data)
        assert engine.stats()["bytes_moved"]["HOST->DEVICE"] > 0
        assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    finally:
        engine.close()


@pytest.mark.parametrize("dtype,gas", [("fp32", 1), ("bf16", 2)])
def test_late_side_stream_copies_train_as_plain_pytorch(dtype, gas, tmp_path, monkeypatch):
    """Gradients copied down to host accumulators (and added there over 2 micro-batches) and the
    optimizer's copy-out to the GPU shards, each copy behind a sleep on its side stream."""
    from infinity._async_copy import SideStream

    if dtype == "fp32":
        exact_fp32()
    issue = SideStream.issue

    @contextlib.contextmanager
    def late(self, *reads):
        with issue(self, *reads):
            torch.cuda._sleep(SLEEP_CYCLES)  # on the side stream: the copies below land late
            yield

    monkeypatch.setattr(SideStream, "issue", late)
    steps = 4
    data = batches(steps, gas, config=FOUR)
    ref_losses, ref_state = reference_train(four_gpt(), data, device=CUDA, dtype=dtype)
    config = offload_config(tmp_path / "swap", stage=3, dtype=dtype, gas=gas, opt="cpu",
                            param="none", device="cuda")
    engine = infinity.initialize(four_gpt(), config)
    try:
        losses = engine_train(engine, data)
        assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, dtype)
    finally:
        engine.close()
