"""One accelerate script, run with ``accelerate.Accelerator`` and with infinity's (only the import
differs): AdamW with two parameter groups, a cosine schedule with warmup built on the optimizer
before ``prepare``, gradient accumulation 4 over a dataloader of 14 batches (so each epoch ends
with a short window of 2), ``clip_grad_norm_`` on sync steps. Same losses, grad norms, lrs and
final weights, in one process and on 2 ranks (gloo); ``save_state`` after epoch 1 and
``load_state`` into fresh objects end where the uninterrupted run does."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState  # noqa: E402
from transformers import get_cosine_schedule_with_warmup  # noqa: E402

from infinity.integrations import accelerate as infinity_accelerate  # noqa: E402
from tests._support.launch import launch  # noqa: E402
from tests.integrations._hf import UNITS, Tokens, tiny  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = {"zero": {"stage": 3, "unit_class_names": [UNITS["llama"]], "unit_min_numel": 1,
                   "persistence_threshold_numel": 64}}
GA, BATCH, SAMPLES = 4, 2, 28


def script(accelerator_cls: type, *, epochs: tuple[int, ...] = (0, 1), seed: int = 0,
           save_to: str | None = None, load_from: str | None = None, **accelerator_kwargs: Any
           ) -> dict[str, Any]:
    """The training script; returns what it saw (per micro-batch losses, per step grad norms
    and lrs) and the final weights. ``epochs``: which of the 2 epochs this run trains."""
    model = tiny("llama", seed=seed)
    no_decay = [p for n, p in model.named_parameters() if "norm" in n]
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-3, betas=(0.9, 0.95), eps=1e-6)
    loader = torch.utils.data.DataLoader(Tokens(SAMPLES), batch_size=BATCH)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2,
                                                num_training_steps=8)
    accelerator = accelerator_cls(gradient_accumulation_steps=GA, cpu=True, **accelerator_kwargs)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if load_from is not None:
        accelerator.load_state(load_from)
    seen: dict[str, Any] = {"loss": [], "grad_norm": [], "lr": []}
    for _ in epochs:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    seen["grad_norm"].append(
                        accelerator.clip_grad_norm_(model.parameters(), 0.5).item())
                    seen["lr"].append(scheduler.get_last_lr())
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            seen["loss"].append(accelerator.gather(loss.detach()).mean().item())
    if save_to is not None:
        accelerator.save_state(save_to)
    state = accelerator.get_state_dict(model)
    seen["weights"] = {k: v.detach().float().cpu().clone() for k, v in state.items()}
    if getattr(accelerator, "engine", None) is not None:
        accelerator.engine.close()
    AcceleratorState._reset_state(reset_partial_state=False)
    return seen


def assert_same(ours: dict[str, Any], reference: dict[str, Any], *, steps: int = 8,
                loss_tol: float = 1e-4, weight_tol: float = 1e-3) -> None:
    assert len(ours["loss"]) == len(reference["loss"]) > 0
    for i, (a, b) in enumerate(zip(ours["loss"], reference["loss"])):
        assert abs(a - b) <= loss_tol, f"micro-batch {i}: loss {a} vs {b}"
    assert len(ours["grad_norm"]) == len(reference["grad_norm"]) == steps
    for i, (a, b) in enumerate(zip(ours["grad_norm"], reference["grad_norm"])):
        assert abs(a - b) <= 1e-4 * max(1.0, b), f"step {i}: grad_norm {a} vs {b}"
    assert ours["lr"] == reference["lr"]
    worst = max((ours["weights"][k] - v).abs().max().item()
                for k, v in reference["weights"].items())
    assert worst <= weight_tol, f"final weights differ by {worst}"


def test_script_matches_accelerate():
    reference = script(accelerate.Accelerator)
    ours = script(infinity_accelerate.Accelerator, infinity_config=CONFIG)
    assert_same(ours, reference)  # 14 batches per epoch: windows of 4, 4, 4 and 2
    initial = tiny("llama").state_dict()
    moved = max((reference["weights"][k] - v).abs().max().item() for k, v in initial.items())
    assert moved > 1e-2, moved  # the comparison above can fail


def test_save_state_after_epoch_1_then_load_state_equals_uninterrupted(tmp_path):
    full = script(infinity_accelerate.Accelerator, infinity_config=CONFIG)
    first = script(infinity_accelerate.Accelerator, epochs=(0,), save_to=str(tmp_path / "state"),
                   infinity_config=CONFIG)
    assert (tmp_path / "state" / "infinity").is_dir()
    second = script(infinity_accelerate.Accelerator, epochs=(1,), seed=1,
                    load_from=str(tmp_path / "state"), infinity_config=CONFIG)
    assert first["loss"] + second["loss"] == full["loss"]
    assert second["lr"] == full["lr"][4:]
    for k, v in full["weights"].items():
        torch.testing.assert_close(second["weights"][k], v, rtol=0, atol=1e-6, msg=k)


def _two_ranks(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    # accelerate on CPU reads the launcher's variables; the process group exists already.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1")
    reference = script(accelerate.Accelerator)
    ours = script(infinity_accelerate.Accelerator, infinity_config=CONFIG)
    return {"reference": reference, "ours": ours}


@pytest.mark.distributed
def test_script_matches_accelerate_on_two_ranks():
    results = launch(__file__, "_two_ranks", world_size=2, timeout_s=240)
    for r in results:  # 7 batches per rank and epoch: windows of 4 and 3
        assert_same(r["ours"], r["reference"], steps=4)
    # Each rank saw its own half of the data: the gathered losses agree across ranks.
    assert results[0]["ours"]["loss"] == results[1]["ours"]["loss"]


def test_an_auto_clip_in_a_config_object_means_the_same_to_the_engine_and_clip_grad_norm():
    """An ``InfinityConfig`` object whose ``gradient_clipping`` is 'auto' (a plain Accelerator
    fills nothing) takes the trainer default, 1.0, for the engine and for ``clip_grad_norm_``'s
    check alike: clipping to 1.0 runs, another max_norm is refused naming 1.0."""
    from infinity.config import config_from_native

    config = config_from_native({**CONFIG, "gradient_clipping": "auto"})
    assert config.gradient_clipping == "auto"
    model = tiny("llama")
    accelerator = infinity_accelerate.Accelerator(cpu=True, infinity_config=config)
    try:
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
        assert accelerator.engine.config.gradient_clipping == 1.0
        ids = torch.randint(0, 50, (1, 8), generator=torch.Generator().manual_seed(0))
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        with pytest.raises(ValueError, match="gradient_clipping=1.0"):
            accelerator.clip_grad_norm_(model.parameters(), 0.5)
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        assert norm is not None and float(norm) > 0
    finally:
        accelerator.engine.close()
        AcceleratorState._reset_state(reset_partial_state=False)


def test_errors_name_the_fix():
    model = tiny("llama")
    accelerator = infinity_accelerate.Accelerator(cpu=True, infinity_config=CONFIG)
    with pytest.raises(ValueError, match="runs Adam/AdamW"):
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="same prepare"):
        accelerator.prepare(torch.optim.AdamW(model.parameters()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mismatched = {**CONFIG, "optimizer": {"lr": 1e-2}}
    with pytest.raises(ValueError, match="optimizer.lr is 0.01 in the infinity_config"):
        infinity_accelerate.Accelerator(cpu=True, infinity_config=mismatched).prepare(
            model, optimizer)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.zeros(1, 4, dtype=torch.long)
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    with pytest.raises(ValueError, match="norm_type=2"):
        accelerator.clip_grad_norm_(model.parameters(), 1.0, norm_type=1)
    with pytest.raises(ValueError, match="pass model.parameters"):
        accelerator.clip_grad_norm_(list(model.parameters())[:1], 1.0)
    accelerator.engine.close()
    AcceleratorState._reset_state(reset_partial_state=False)
