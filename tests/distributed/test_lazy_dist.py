"""``infinity.init`` on 2 ranks (gloo): each rank builds the model lazily from its own seed; the
engine ends up with rank 0's values on every rank (as for an eager model, which is broadcast from
rank 0), equal bitwise to the model built eagerly from rank 0's seed, and trains like plain
PyTorch from it. One spawn runs every case.
"""

from __future__ import annotations

import pytest

from tests._support.launch import launch

pytestmark = pytest.mark.distributed

CASES = [("s3-fp32", 3, "fp32", "none"), ("s3-fp32-nvme", 3, "fp32", "nvme"),
         ("s1-bf16", 1, "bf16", "none")]
STEPS = 2


def worker(rank: int, world_size: int, out_dir: str, root: str) -> dict:
    import torch

    import infinity
    from infinity.models.gpt import GPT
    from tests._support.engine import TINY, batches, engine_train, rank_config

    out = {}
    for name, stage, dtype, offload in CASES:
        config = rank_config(root, name, rank, stage=stage, dtype=dtype, offload=offload)
        torch.manual_seed(rank)  # ranks disagree; rank 0's values must win
        with infinity.init(config):
            model = GPT(TINY)
        engine = infinity.initialize(model)
        first = {k: v.detach().cpu().clone() for k, v in engine.full_state_dict().items()}
        losses = engine_train(engine, batches(STEPS, 1), rank=rank, world_size=world_size)
        final = {k: v.detach().cpu().clone() for k, v in engine.full_state_dict().items()}
        engine.close()
        out[name] = {"first": first, "losses": losses, "final": final}
    return out


def test_lazy_model_on_two_ranks_equals_rank0_eager_model(tmp_path):
    import torch

    from tests._support.engine import assert_close_run, batches, reference_train, tiny_gpt

    results = launch(__file__, "worker", world_size=2, timeout_s=240,
                     args={"root": str(tmp_path)})
    eager = {k: v.detach() for k, v in tiny_gpt(seed=0).state_dict().items()}
    for name, _, dtype, _ in CASES:
        ref_losses, ref_state = reference_train(tiny_gpt(seed=0), batches(STEPS, 1),
                                                dtype=dtype, splits=2)
        for r in results:
            got = r[name]["first"]
            for k, v in eager.items():
                assert torch.equal(got[k], v), (name, k)
            assert_close_run(r[name]["losses"], r[name]["final"], ref_losses, ref_state, dtype)
