"""peft after ``infinity.init`` on 2 gloo ranks (issue #32): each rank builds the tiny Llama under
``infinity.init``, wraps it with ``get_peft_model`` after the block (as recipes write it), and
trains at stage 3 with the frozen base on NVMe on its half of every global batch. The adapters
start as eager peft makes them (bitwise) and the losses follow plain peft + ``torch.optim.AdamW``
in one process on the global batch."""

from __future__ import annotations

import pytest

from tests._support.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread")]
pytest.importorskip("transformers")
pytest.importorskip("peft")

STEPS = 8


def global_batches():
    import torch

    from tests._support.peft_llama import token_batches

    rows = token_batches(2 * STEPS)  # 2 rows each: 4 rows a global batch, 2 per rank
    return [torch.cat([rows[2 * i], rows[2 * i + 1]]) for i in range(STEPS)]


def worker(rank: int, world_size: int, out_dir: str) -> dict:
    import os

    import infinity
    from infinity.integrations.peft import adapter_state_dict
    from tests._support.peft_llama import config, engine_train, lazy_peft

    model = lazy_peft(config(os.path.join(out_dir, f"swap-{rank}")))  # peft after the block
    engine = infinity.initialize(model)
    try:
        initial = adapter_state_dict(engine)
        data = [batch[2 * rank:2 * rank + 2] for batch in global_batches()]
        losses = engine_train(engine, data)
        return {"initial": initial, "losses": losses, "final": adapter_state_dict(engine)}
    finally:
        engine.close()


def test_peft_after_init_trains_on_two_ranks_as_plain_peft_on_the_global_batch():
    import peft
    import torch

    from tests._support.peft_llama import eager_peft, reference_train

    results = launch(__file__, "worker", timeout_s=240)
    ref = eager_peft()
    start = {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(ref).items()}
    ref_losses = reference_train(ref, global_batches())
    want = peft.get_peft_model_state_dict(ref)
    for r in results:
        assert sorted(r["initial"]) == sorted(start)
        for key in start:
            assert torch.equal(r["initial"][key], start[key]), key
    losses = [sum(pair) / 2 for pair in zip(*(r["losses"] for r in results))]
    assert losses == pytest.approx(ref_losses, abs=1e-4)
    assert ref_losses[-1] < ref_losses[0] - 0.01  # the adapters really trained
    for key in want:
        torch.testing.assert_close(results[0]["final"][key], want[key], atol=1e-5, rtol=0)
        assert torch.equal(results[0]["final"][key], results[1]["final"][key]), key
