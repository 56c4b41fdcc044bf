"""A pipeline's checkpoint on disk and its refusals (``PipelineEngine.save_checkpoint`` /
``load_checkpoint``), and one-stage pipelines against plain PyTorch: a checkpoint saved at PP=2
on 2 gloo ranks has ``pipeline-stage-KK-of-02/pipeline.json`` per stage holding the stage's
children and parameters (checked against the model here); loading it at mesh.pipeline 1 on one
rank, or at PP=2 with other split_points, is refused naming what was saved. A one-stage
pipeline whose micro-batches are not the accumulation steps trains as plain PyTorch on the
mean of the micro-batches; a step whose loss raises leaves nothing behind for the next one."""

from __future__ import annotations

import json
import os

import pytest

from tests._support.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread")]

MICRO, LAYERS = 4, 4
LR = 1e-3


def _model():
    from infinity.models.gpt import GPTConfig
    from tests._support.engine import tiny_gpt

    return tiny_gpt(config=GPTConfig(vocab_size=64, block_size=16, n_layer=LAYERS, n_head=2,
                                     n_embd=32, tie_weights=False))


def _loss(logits, targets):
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _data(steps: int):
    from tests._support.engine import batches

    return batches(steps, MICRO, config=_model().config)


def _whole(step_batches):
    import torch

    return torch.cat([b[0] for b in step_batches]), torch.cat([b[1] for b in step_batches])


def _config(pp: int, gas: int = MICRO, **extra):
    from tests._support.engine import engine_config

    return engine_config(stage=3, gas=gas, mesh={"pipeline": pp}, optimizer={"lr": LR}, **extra)


def worker_save(rank: int, world_size: int, out_dir: str, root: str, pp: int = 2) -> dict:
    import infinity.pipeline
    from infinity.models.gpt import as_sequential

    pipe = infinity.pipeline.initialize(as_sequential(_model()), _config(pp), loss_fn=_loss)
    for batch in _data(2):
        x, y = _whole(batch)
        pipe.train_batch(x, target=y)
    pipe.save_checkpoint(root, tag="t2")
    out = {"children": list(pipe.split.children(pipe.stage_index))}
    pipe.close()
    return out


def worker_load(rank: int, world_size: int, out_dir: str, root: str, pp: int,
                split_points: list[int] | None) -> dict:
    import infinity.pipeline
    from infinity.models.gpt import as_sequential

    pipe = infinity.pipeline.initialize(as_sequential(_model()), _config(pp), loss_fn=_loss,
                                        split_points=split_points)
    try:
        pipe.load_checkpoint(root, tag="t2")
        out = {"error": None}
    except (ValueError, FileNotFoundError) as e:
        out = {"error": f"{type(e).__name__}: {e}"}
    pipe.close()
    return out


def test_checkpoint_layout_on_disk_and_refusals(tmp_path):
    from infinity.models.gpt import as_sequential
    from infinity.pipeline import balanced_split, child_costs

    root = str(tmp_path / "ckpt")
    saved = launch(__file__, "worker_save", world_size=2, timeout_s=240, args={"root": root})
    seq = as_sequential(_model())
    bounds = balanced_split(child_costs(seq), 2).bounds
    assert sorted(os.listdir(root)) == ["pipeline-stage-00-of-02", "pipeline-stage-01-of-02"]
    names = [n for n, _ in seq.named_children()]
    for stage in range(2):
        stage_dir = os.path.join(root, f"pipeline-stage-{stage:02d}-of-02")
        assert "pipeline.json" in os.listdir(stage_dir)
        assert len(os.listdir(stage_dir)) > 1, os.listdir(stage_dir)  # the engine's save beside it
        with open(os.path.join(stage_dir, "pipeline.json")) as f:
            layout = json.load(f)
        children = list(range(bounds[stage], bounds[stage + 1]))
        assert saved[stage]["children"] == children
        want_params = sorted(f"{names[i]}.{n}" for i in children
                             for n, _ in seq[i].named_parameters())
        assert layout == {"num_stages": 2, "stage": stage, "children": children,
                          "parameters": want_params}
    # mesh.pipeline 1 on one rank: no save of a one-stage pipeline; the saved stages are named.
    [one] = launch(__file__, "worker_load", world_size=1, timeout_s=240,
                   args={"root": root, "pp": 1, "split_points": None})
    assert one["error"] is not None and "FileNotFoundError" in one["error"], one
    assert "stage 0 of 1" in one["error"] and "[2] stages" in one["error"], one["error"]
    # PP=2 with the cut one child earlier: each stage is told what it was saved with.
    other = [bounds[1] - 1]
    moved = launch(__file__, "worker_load", world_size=2, timeout_s=240,
                   args={"root": root, "pp": 2, "split_points": other})
    for stage, res in enumerate(moved):
        msg = res["error"]
        assert msg is not None and msg.startswith("ValueError"), res
        saved_children = list(range(bounds[stage], bounds[stage + 1]))
        mine = list(range(*((0, other[0]) if stage == 0 else (other[0], len(names)))))
        assert f"stage {stage} of 2 holding children {saved_children}" in msg, msg
        assert f"this stage holds children {mine}" in msg, msg


def test_saves_at_two_pipeline_sizes_under_one_root(tmp_path):
    """A root holding a one-stage save and a two-stage save: each size loads its own."""
    root = str(tmp_path / "ckpt")
    launch(__file__, "worker_save", world_size=1, timeout_s=240, args={"root": root, "pp": 1})
    launch(__file__, "worker_save", world_size=2, timeout_s=240, args={"root": root, "pp": 2})
    assert sorted(os.listdir(root)) == ["pipeline-stage-00-of-01", "pipeline-stage-00-of-02",
                                        "pipeline-stage-01-of-02"]
    loaded = launch(__file__, "worker_load", world_size=2, timeout_s=240,
                    args={"root": root, "pp": 2, "split_points": None})
    assert [res["error"] for res in loaded] == [None, None], loaded


def worker_one_stage(rank: int, world_size: int, out_dir: str, gas: int, micro: int | str,
                     fail_first: bool, clear_schedule_losses: bool = False) -> dict:
    """mesh.pipeline 1 on one rank; ``fail_first``: the first step's loss raises on its third
    micro-batch (after two backwards), and training goes on from the next batch."""
    import infinity.pipeline
    from infinity.models.gpt import as_sequential, sequential_names

    model = _model()
    names = sequential_names(model)
    calls = {"n": 0, "armed": fail_first}

    def loss_fn(out, target):
        calls["n"] += 1
        if calls["armed"] and calls["n"] == 3:
            calls["armed"] = False
            raise RuntimeError("boom")
        return _loss(out, target)

    pipe = infinity.pipeline.initialize(
        as_sequential(model), _config(1, gas=gas, pipeline={"micro_batches": micro}),
        loss_fn=loss_fn)
    data = _data(4)
    out: dict = {"losses": [], "error": None}
    steps = range(4)
    if fail_first:
        try:
            pipe.train_batch(*_whole(data[0])[:1], target=_whole(data[0])[1])
        except RuntimeError as e:
            out["error"] = str(e)
        out["schedule_state"] = pipe.engine.manager._schedule.value
        out["training_state"] = str(pipe.engine.manager.state)
        if clear_schedule_losses:  # what torch's schedule keeps of the failed step's losses
            pipe.schedule._internal_losses.clear()
        steps = range(1, 4)
    for s in steps:
        x, y = _whole(data[s])
        out["losses"].append(float(pipe.train_batch(x, target=y)))
    out["state"] = {names[k]: v for k, v in pipe.full_state_dict().items()}
    pipe.close()
    return out


def _reference(steps):
    from tests._support.engine import reference_train

    return reference_train(_model(), [_data(4)[s] for s in steps],
                           param_groups=lambda m: [{"params": list(m.parameters()), "lr": LR}])


def test_one_stage_micro_batches_not_the_accumulation_steps():
    """gradient_accumulation_steps 1, pipeline.micro_batches 4: each step is the mean over its 4
    micro-batches, as plain PyTorch computes it (the loss is divided by m, not by the
    accumulation steps)."""
    from tests._support.engine import assert_close_state

    [res] = launch(__file__, "worker_one_stage", world_size=1, timeout_s=240,
                   args={"gas": 1, "micro": MICRO, "fail_first": False})
    ref_losses, ref_state = _reference(range(4))
    assert res["losses"] == pytest.approx(ref_losses, abs=1e-5)
    assert_close_state(res["state"], ref_state, atol=1e-5)


def test_a_step_that_raises_leaves_nothing_behind():
    """The first step's loss raises on its third micro-batch; the schedule step is closed, and
    the next 3 steps are plain PyTorch's on those 3 batches from the initial weights."""
    from tests._support.engine import assert_close_state

    [res] = launch(__file__, "worker_one_stage", world_size=1, timeout_s=240,
                   args={"gas": MICRO, "micro": "auto", "fail_first": True})
    assert res["error"] == "boom"
    assert res["schedule_state"] == "closed"
    ref_losses, ref_state = _reference(range(1, 4))
    assert res["losses"] == pytest.approx(ref_losses, abs=1e-5)
    assert_close_state(res["state"], ref_state, atol=1e-5)


def test_a_step_that_raises_leaves_no_gradients_behind():
    """As above, with torch's stale losses cleared by hand (the defect above set aside): the
    gradients of the failed step's two finished backwards must not reach the next step."""
    from tests._support.engine import assert_close_state

    [res] = launch(__file__, "worker_one_stage", world_size=1, timeout_s=240,
                   args={"gas": MICRO, "micro": "auto", "fail_first": True,
                         "clear_schedule_losses": True})
    assert res["error"] == "boom" and res["schedule_state"] == "closed"
    ref_losses, ref_state = _reference(range(1, 4))
    assert res["losses"] == pytest.approx(ref_losses, abs=1e-5)
    assert_close_state(res["state"], ref_state, atol=1e-5)
