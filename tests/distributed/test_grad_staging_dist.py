"""[Note: staging in the accumulator's dtype] on 2 ranks (gloo): gradients crossing ranks in the
compute dtype (``precision.reduce_dtype`` 'compute') into bf16 host accumulators are staged in
bf16, and training is bitwise what fp32 staging gave (the division by the ranks rounds once
either way, the wire was bf16 already), at stages 1, 2 and 3."""

from __future__ import annotations

import pytest

from tests._support.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread")]

STAGES = (1, 2, 3)


def worker(rank: int, world_size: int, out_dir: str) -> dict:
    import torch

    import infinity
    from infinity.zero._grad_reducer import GradientReducer
    from tests._support.engine import batches, engine_train, offload_config, tiny_gpt

    real_new_staging, real_dtype = GradientReducer._new_staging, GradientReducer.staging_dtype
    out = {}
    for stage in STAGES:
        for staging in ("bf16", "fp32"):
            made = set()

            def new_staging(self, g):
                buf = real_new_staging(self, g)
                made.add(str(buf.dtype))
                return buf

            GradientReducer._new_staging = new_staging
            GradientReducer.staging_dtype = real_dtype if staging == "bf16" else property(
                lambda self: torch.float32)
            try:
                config = offload_config(f"{out_dir}/swap-{stage}-{staging}-r{rank}", stage=stage,
                                        dtype="bf16", opt="cpu")
                config["precision"]["reduce_dtype"] = "compute"
                engine = infinity.initialize(tiny_gpt(), config)
                losses = engine_train(engine, batches(3, 1), rank=rank, world_size=world_size)
                out[stage, staging] = {"losses": losses, "state": engine.full_state_dict(),
                                       "made": made}
                engine.close()
            finally:
                GradientReducer._new_staging = real_new_staging
                GradientReducer.staging_dtype = real_dtype
    return out


def test_bf16_staging_across_ranks_trains_bitwise_as_fp32_staging():
    import torch

    for res in launch(__file__, "worker", timeout_s=240):
        for stage in STAGES:
            got, want = res[stage, "bf16"], res[stage, "fp32"]
            assert got["made"] == {"torch.bfloat16"} and want["made"] == {"torch.float32"}
            assert got["losses"] == want["losses"], stage
            for name, value in want["state"].items():
                assert torch.equal(got["state"][name], value), (stage, name)
