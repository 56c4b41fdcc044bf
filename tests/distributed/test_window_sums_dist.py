"""[Note: one all-reduce per window at stages 0-1] (infinity/zero/_grad_reducer.py) on 2 gloo
ranks: at stages 0-1 each rank sums its own gradients over an accumulation window and the
ranks all-reduce the sum once, in the window's last backward, or at the step where a caller
ends the window early (``step(boundary=True)``). Training equals one process of plain PyTorch +
AdamW on the global batch (fp32, clipping by the global norm), over windows of 3, 2 (ended
early) and 3 micro-batches; each window's gradient crosses the ranks once."""

from __future__ import annotations

import pytest

from tests._support.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread")]

GAS = 3
WINDOWS = (3, 2, 3, 1)
"""Micro-batches per optimizer step: full windows, one ended early after 2, one after 1."""
CLIP = 0.05


def _data():
    """The global micro-batches of each window (each rank takes its half of every one)."""
    from infinity.models.gpt import synthetic_batch
    from tests._support.engine import TINY

    return [[synthetic_batch(TINY, 8, 16, seed=100 * w + m) for m in range(n)]
            for w, n in enumerate(WINDOWS)]


def worker(rank: int, world_size: int, out_dir: str) -> dict:
    import infinity
    from tests._support.engine import engine_config, tiny_gpt

    out = {}
    for stage in (0, 1):
        engine = infinity.initialize(tiny_gpt(), engine_config(stage=stage, gas=GAS, clip=CLIP))
        losses = []
        for window in _data():
            total = 0.0
            for i, batch in enumerate(window):
                local = tuple(t.chunk(world_size)[rank] for t in batch)
                loss = engine(*local)
                # The reference averages over the window's own length (a short one included).
                engine.backward(loss / len(window), scale_wrt_gas=False)
                engine.step(boundary=i == len(window) - 1)
                total += loss.item() / len(window)
            losses.append(total)
        trainable = sum(g.padded_numel for u in engine.manager.units for g in u.groups
                        if g.requires_grad)
        out[stage] = {"losses": losses, "state": engine.full_state_dict(),
                      "sent": engine.stats()["collective_bytes_sent"], "trainable": trainable}
        engine.close()
    return out


def test_each_window_crosses_the_ranks_once_and_trains_as_plain_pytorch():
    import torch

    from tests._support.engine import assert_close_run, reference_train, tiny_gpt

    ref_losses, ref_state = reference_train(tiny_gpt(), _data(), clip=CLIP)
    results = launch(__file__, "worker", timeout_s=240)
    for stage in (0, 1):
        losses = [sum(pair) / 2 for pair in zip(*(r[stage]["losses"] for r in results))]
        for r in results:
            assert_close_run(losses, r[stage]["state"], ref_losses, ref_state, "fp32")
        for name in ref_state:
            assert torch.equal(results[0][stage]["state"][name], results[1][stage]["state"][name])
        got = results[0][stage]
        # Once per window: the trainable buffer's fp32 bytes, not once per micro-batch.
        assert got["sent"]["reduce-grad"] == len(WINDOWS) * got["trainable"] * 4, (stage, got["sent"])
