"""Pipeline parallelism with ZeRO inside each stage (issue #36), on gloo processes: losses and
weights against one process of plain PyTorch (``torch.optim.AdamW``) on the global batch, fp32,
within 1e-5, over 10 steps; GPipe and 1F1B; PP=2 x DP=2 (ZeRO-3 in each stage), PP=2 x DP=1 with
parameters and optimizer on NVMe under a host budget smaller than the stage, PP=4; a checkpoint
saved at PP=2 x DP=2 and loaded at PP=2 x DP=1.

CI runs the PP=2 x DP=2 case with 1F1B (and the NVMe and checkpoint tests); ``INFINITY_SLOW=1``
runs the whole matrix (``test_pipeline_matrix_matches_plain_pytorch``).
"""

from __future__ import annotations

import os

import pytest

from tests._support.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread")]

SLOW = os.environ.get("INFINITY_SLOW") == "1"
STEPS, MICRO, CLIP, ATOL = 10, 4, 0.05, 1e-5
HOST_BUDGET = 640 * 1024  # the least with room to prefetch for these stages (~830 KiB of state)
LR = 1e-3
# The shared tests' LR (3e-2) turns this 8-block model's rounding noise into 2e-4 by step 10
# (Adam's normalised steps on near-zero gradients), without a pipeline too; at 1e-3 the engine
# with and without stages stays within 1e-6 of AdamW.
# Global batch: MICRO micro-batches of 8 sequences; each data-parallel rank of a stage takes its
# slice, which the schedule cuts into MICRO micro-batches of its own.


def _model(layers: int = 4):
    from infinity.models.gpt import GPTConfig
    from tests._support.engine import tiny_gpt

    # Untied: the embedding and the LM head are in different stages. 4 blocks: PP=4 has one
    # block (or the embedding / head with one) per stage.
    return tiny_gpt(config=GPTConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=2,
                                     n_embd=32, tie_weights=False))


def _loss(logits, targets):
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _data():
    from tests._support.engine import batches

    return batches(STEPS, MICRO, config=_model().config)


def _config(case: dict, rank: int, swap_root: str | None) -> dict:
    from tests._support.engine import engine_config, offload_config

    pipeline = {"schedule": case["schedule"]}
    if case["schedule"] == "interleaved-1f1b":
        pipeline["stages_per_rank"] = 2
    extra = {"mesh": {"pipeline": case["pp"]}, "pipeline": pipeline, "optimizer": {"lr": LR}}
    if case.get("nvme"):
        return offload_config(os.path.join(swap_root, f"rank{rank}"), stage=3, gas=MICRO,
                              clip=CLIP, opt="nvme", param="nvme", host=case["host"], **extra)
    return engine_config(stage=case["zero"], gas=MICRO, clip=CLIP,
                         dtype=case.get("dtype", "fp32"), **extra)


def _rank_batch(step_batches, rank: int, world_size: int, pp: int):
    """This rank's slice of the step's global batch (its place in its stage's data-parallel
    group: pipeline outermost in rank order)."""
    import torch

    dp = world_size // pp
    d = rank % dp
    x = torch.cat([b[0] for b in step_batches])
    y = torch.cat([b[1] for b in step_batches])
    n = x.shape[0] // dp
    return x[d * n:(d + 1) * n], y[d * n:(d + 1) * n]


def _train(pipe, data, rank, world_size, pp, steps):
    return [float(pipe.train_batch(x, target=y))
            for x, y in (_rank_batch(data[s], rank, world_size, pp) for s in steps)]


def _gpt_state(pipe, names) -> dict:
    return {names[k]: v for k, v in pipe.full_state_dict().items()}


def worker_cases(rank: int, world_size: int, out_dir: str, cases: list[dict]) -> dict:
    import infinity.pipeline
    from infinity.models.gpt import as_sequential, sequential_names

    out = {}
    data = _data()
    for case in cases:
        model = _model(case.get("layers", 4))
        names = sequential_names(model)
        pipe = infinity.pipeline.initialize(as_sequential(model), _config(case, rank, out_dir),
                                            loss_fn=_loss)
        losses = _train(pipe, data, rank, world_size, case["pp"], range(STEPS))
        out[case["name"]] = {"losses": losses, "state": _gpt_state(pipe, names),
                             "stats": pipe.stats()}
        pipe.close()
    return out


def _reference(layers: int = 4, dtype: str = "fp32"):
    """Plain PyTorch on the global batch. bf16: each of the data's 8-sequence micro-batches runs
    as two 4-sequence backwards, the pieces the 2 x 2 pipeline's micro-batches are, so that the
    bf16 rounding is the same."""
    from tests._support.engine import reference_train

    return reference_train(_model(layers), _data(), clip=CLIP, dtype=dtype,
                           splits=1 if dtype == "fp32" else 2,
                           param_groups=lambda m: [{"params": list(m.parameters()), "lr": LR}])


def _check(results: list[dict], cases: list[dict], ref_losses, ref_state, *,
           by_name: bool = True) -> None:
    """``by_name``: each rank's result holds one entry per case name (else the result itself)."""
    from tests._support.engine import TOL, assert_close_state

    for case in cases:
        dtype = case.get("dtype", "fp32")
        merged: dict = {}
        for res in results:
            got = res[case["name"]] if by_name else res
            assert got["losses"] == pytest.approx(
                ref_losses, abs=ATOL if dtype == "fp32" else TOL[dtype]["loss"]), case["name"]
            merged.update(got["state"])  # the stages' layers; replicas hold the same values
            pipe = got["stats"]["pipeline"]
            assert pipe["num_ranks"] == case["pp"] and pipe["schedule"] == case["schedule"]
        if dtype == "fp32":
            assert_close_state(merged, ref_state, atol=ATOL)
        else:
            assert_close_state(merged, ref_state, global_rel=TOL[dtype]["param"])


CI_CASES = [{"name": "pp2-dp2-zero3-1f1b", "pp": 2, "zero": 3, "schedule": "1f1b"},
            {"name": "pp4-dp1-zero3-gpipe", "pp": 4, "zero": 3, "schedule": "gpipe"}]
BF16_CASES = [{"name": "pp2-dp2-zero3-1f1b-bf16", "pp": 2, "zero": 3, "schedule": "1f1b",
               "dtype": "bf16"}]
"""bf16: the stages send bf16 activations (the shapes' pass gives the compute dtype)."""
MATRIX_4 = [{"name": f"pp{pp}-dp{4 // pp}-zero{z}-{s}", "pp": pp, "zero": z, "schedule": s}
            for s in ("gpipe", "1f1b") for pp, z in ((2, 3), (4, 3), (2, 1), (4, 0))] + [
    {"name": f"pp2-dp2-zero{z}-interleaved", "pp": 2, "zero": z, "schedule": "interleaved-1f1b"}
    for z in (3, 2)]


def test_pipeline_2x2_zero3_matches_plain_pytorch():
    """PP=2 x DP=2, ZeRO-3 inside each stage, 1F1B, clipping by the global norm over both
    stages: every rank's losses and the stages' weights equal plain PyTorch's; PP=4 with GPipe
    and PP=2 x DP=2 in bf16 in the same processes."""
    results = launch(__file__, "worker_cases", world_size=4, timeout_s=300,
                     args={"cases": CI_CASES + BF16_CASES})
    ref_losses, ref_state = _reference()
    _check(results, CI_CASES, ref_losses, ref_state)
    _check(results, BF16_CASES, *_reference(dtype="bf16"))
    # The activations each stage sends: per micro-batch the forward's one way (each of the 2
    # data-parallel ranks has 8 x MICRO / 2 sequences a step, MICRO micro-batches of 4 x 16
    # tokens x 32 fp32), its gradient the other.
    per_step = MICRO * 4 * 16 * 32 * 4
    first = results[0][CI_CASES[0]["name"]]["stats"]["pipeline"]
    assert first["send_bytes"] == first["recv_bytes"] == STEPS * per_step
    assert first["bubble_fraction"] == pytest.approx(1 / (MICRO + 1))


@pytest.mark.slow
@pytest.mark.skipif(not SLOW, reason="the full matrix runs with INFINITY_SLOW=1; CI runs "
                                     "test_pipeline_2x2_zero3_matches_plain_pytorch's cases")
def test_pipeline_matrix_matches_plain_pytorch():
    """The full matrix (GPipe and 1F1B; PP=2 x DP=2 and PP=4 at ZeRO-3, ZeRO-1 / ZeRO-0 inside
    the stages; interleaved 1F1B with 2 chunks per rank at ZeRO-2 and 3)."""
    cases = MATRIX_4
    results = launch(__file__, "worker_cases", world_size=4, timeout_s=300 if not SLOW else 900,
                     args={"cases": cases})
    ref_losses, ref_state = _reference()
    _check(results, cases, ref_losses, ref_state)


def test_nvme_stage_paged_under_a_host_budget_smaller_than_the_stage(tmp_path):
    """PP=2 x DP=1, parameters and optimizer on NVMe, each stage's host budget a fraction of its
    state: the stage's units are read from its swap files every step (the trace-driven
    prefetcher following the schedule's order), and the result is plain PyTorch's."""
    cases = [{"name": f"pp2-dp1-nvme-{s}", "pp": 2, "nvme": True, "host": HOST_BUDGET,
              "layers": 8, "schedule": s} for s in (("gpipe", "1f1b") if SLOW else ("1f1b",))]
    results = launch(__file__, "worker_cases", world_size=2, timeout_s=300,
                     args={"cases": cases})
    ref_losses, ref_state = _reference(8)
    _check(results, cases, ref_losses, ref_state)
    for res in results:
        for case in cases:
            stats = res[case["name"]]["stats"]
            stage_bytes = 16 * sum(v.numel() for v in res[case["name"]]["state"].values())
            assert HOST_BUDGET < stage_bytes  # the budget is smaller than the stage's state
            assert stats["bytes"]["HOST"]["peak"] <= HOST_BUDGET
            assert stats["bytes_moved"]["NVME->HOST"] > STEPS * stage_bytes // 4
            prefetch = stats["prefetch"]
            assert prefetch["prefetch_hits"] > 0, prefetch


def _pp2_zero3_1f1b(rank: int, out_dir: str):
    """PP=2 (x the launch's DP) at ZeRO-3 with 1F1B over the 4-block GPT, and the stage names'
    map to the GPT's."""
    import infinity.pipeline
    from infinity.models.gpt import as_sequential, sequential_names

    case = {"pp": 2, "zero": 3, "schedule": "1f1b"}
    model = _model()
    pipe = infinity.pipeline.initialize(as_sequential(model), _config(case, rank, out_dir),
                                        loss_fn=_loss)
    return pipe, sequential_names(model)


def worker_checkpoint(rank: int, world_size: int, out_dir: str, root: str, phase: str) -> dict:
    pipe, names = _pp2_zero3_1f1b(rank, out_dir)
    data = _data()
    if phase == "save":
        before = _train(pipe, data, rank, world_size, 2, range(5))
        pipe.save_checkpoint(root)
        after = _train(pipe, data, rank, world_size, 2, range(5, STEPS))
        out = {"before": before, "after": after}
    else:
        pipe.load_checkpoint(root)
        out = {"after": _train(pipe, data, rank, world_size, 2, range(5, STEPS))}
    out["state"] = _gpt_state(pipe, names)
    pipe.close()
    return out


def test_checkpoint_saved_at_pp2_dp2_loads_at_pp2_dp1(tmp_path):
    """Saved after 5 of 10 steps by PP=2 x DP=2 (ZeRO-3), loaded by PP=2 x DP=1: its last 5 steps
    are those of the run that went on (same losses and weights, fp32)."""
    root = str(tmp_path / "ckpt")
    saved = launch(__file__, "worker_checkpoint", world_size=4, timeout_s=300,
                   args={"root": root, "phase": "save"})
    assert sorted(os.listdir(root)) == ["pipeline-stage-00-of-02", "pipeline-stage-01-of-02"]
    loaded = launch(__file__, "worker_checkpoint", world_size=2, timeout_s=300,
                    args={"root": root, "phase": "load"})
    from tests._support.engine import assert_close_state

    for res in loaded:
        assert res["after"] == pytest.approx(saved[0]["after"], abs=ATOL)
    want = {}
    for res in saved:
        want.update(res["state"])
    got = {}
    for res in loaded:
        got.update(res["state"])
    assert_close_state(got, want, atol=ATOL)
    ref_losses, ref_state = _reference()
    assert saved[0]["before"] + saved[0]["after"] == pytest.approx(ref_losses, abs=ATOL)
    assert_close_state(got, ref_state, atol=ATOL)


def worker_traced(rank: int, world_size: int, out_dir: str) -> dict:
    import torch
    from torch.distributed.pipelining import SplitPoint

    import infinity.pipeline

    case = {"pp": 2, "zero": 3, "schedule": "1f1b"}
    pipe = infinity.pipeline.initialize(
        _model(), _config(case, rank, out_dir), loss_fn=_loss,
        split_spec={"blocks.2": SplitPoint.BEGINNING},
        example_args=(torch.zeros(8 * MICRO // MICRO, 16, dtype=torch.long),))  # a micro-batch
    losses = _train(pipe, _data(), rank, world_size, 2, range(STEPS))
    out = {"losses": losses, "state": pipe.full_state_dict(), "stats": pipe.stats()}
    pipe.close()
    return out


def test_a_model_cut_by_torchs_tracer_matches_plain_pytorch():
    """A GPT (not an nn.Sequential) cut at ``blocks.2`` by ``split_spec`` (torch.export's
    tracer): its stages keep the model's parameter names, and PP=2 x DP=1 with ZeRO-3 trains as
    plain PyTorch does."""
    results = launch(__file__, "worker_traced", world_size=2, timeout_s=300)
    ref_losses, ref_state = _reference()
    _check(results, [{"name": None, "pp": 2, "schedule": "1f1b"}], ref_losses, ref_state,
           by_name=False)
    assert any(k.startswith("blocks.3.") for k in results[1]["state"])


def worker_eval(rank: int, world_size: int, out_dir: str) -> dict:
    pipe, names = _pp2_zero3_1f1b(rank, out_dir)
    data = _data()
    evals, losses = [], []
    for s in range(STEPS):
        x, y = _rank_batch(data[s], rank, world_size, 2)
        if s % 3 == 0:  # before the step: the loss of the weights the step starts from
            evals.append(float(pipe.eval_batch(x, target=y)))
        losses.append(float(pipe.train_batch(x, target=y)))
    out = {"evals": evals, "losses": losses, "state": _gpt_state(pipe, names),
           "stats": pipe.stats()}
    pipe.close()
    return out


def test_an_evaluation_between_steps_changes_nothing():
    """PP=2 x DP=2, ZeRO-3: ``eval_batch`` before steps 0, 3, 6 and 9 gives the loss plain
    PyTorch's training computes at those steps (the same weights, batch and mean), and the
    training around it is plain PyTorch's still (no gradient, no saved state left behind)."""
    results = launch(__file__, "worker_eval", world_size=4, timeout_s=300)
    ref_losses, ref_state = _reference()
    _check(results, [{"name": None, "pp": 2, "schedule": "1f1b"}], ref_losses, ref_state,
           by_name=False)
    for res in results:
        assert res["evals"] == pytest.approx(ref_losses[::3], abs=ATOL)
