"""Shared by the engine tests (engine, distributed, gpu): a plain-PyTorch reference trainer and
the engine trainer over the same model and data, so parity is checked against torch.optim.AdamW;
the engine configs the tests use; a LoRA-like model; exact state-dict comparison.

The reference is the textbook mixed-precision recipe: fp32 master parameters stepped by
``torch.optim.AdamW``; forward/backward on a copy in the compute dtype; gradients moved to fp32
after every micro-batch and summed there; ``clip_grad_norm_`` on the fp32 gradients.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Callable

import pytest
import torch
from torch import nn

import infinity
from infinity.models.gpt import GPT, GPTConfig, synthetic_batch

# fp32: the same math in another order (flat buffers, fused Adam kernel): element-wise 2e-5.
# bf16/fp16: relative L2 distance of all parameters. Measured spread between two equivalent bf16
# reference runs (each micro-batch as 1 or 2 backward chunks, 10 steps, gas 4): 0.020; bf16 vs
# fp32 training: 0.057. The bound 0.03 sits between the two.
TOL = {"fp32": dict(loss=1e-5, param=2e-5), "bf16": dict(loss=2e-2, param=0.03),
       "fp16": dict(loss=5e-3, param=0.03)}
PER_PARAM_REL, PARAM_FLOOR = 0.5, 1e-3
# bf16/fp16, each parameter: the relative L2 distance to its own norm (near-zero ones: to a floor
# of 1e-3 an element). Between two equivalent bf16 reference runs (1 or 2 backward chunks a
# micro-batch, 10 steps; gas 1, 4, and 2 with clipping) it reached 0.24 (the attention's qkv
# weight and bias), above the median bf16-vs-fp32 distance (0.06-0.15): a per-parameter bound
# cannot tell small errors from that noise, only gross ones (a parameter not stepped: 1.0).
TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LR, WD, BETAS, EPS = 3e-2, 0.01, (0.9, 0.95), 1e-5
# eps: the gradient of the attention's key bias is mathematically zero (softmax ignores a shift),
# so what arrives there is rounding noise, which Adam with a tiny eps turns into O(lr) steps in a
# random direction. eps = 1e-5 keeps that noise from dominating the comparison.


def tiny_gpt(seed: int = 0, config: GPTConfig = TINY) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


def batches(num_steps: int, gas: int, batch_size: int = 8, seq_len: int = 16,
            config: GPTConfig = TINY) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """num_steps x gas micro-batches (global: every rank takes its slice)."""
    return [[synthetic_batch(config, batch_size, seq_len, seed=1000 * s + m) for m in range(gas)]
            for s in range(num_steps)]


def engine_config(*, stage: int, dtype: str = "fp32", gas: int = 1, clip: float = 0.0,
                  unit_class_names: tuple[str, ...] = ("Block",), unit_min_numel: int = 1,
                  persistence_threshold_numel: int = 40, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "zero": {"stage": stage, "unit_class_names": list(unit_class_names),
                 "unit_min_numel": unit_min_numel,
                 "persistence_threshold_numel": persistence_threshold_numel},
        "precision": {"dtype": dtype},
        "optimizer": {"type": "adamw", "lr": LR, "betas": list(BETAS), "eps": EPS,
                      "weight_decay": WD},
        "gradient_clipping": clip,
        "gradient_accumulation_steps": gas,
    }
    for key, value in extra.items():
        cfg.setdefault(key, {}).update(value) if isinstance(value, dict) else cfg.update({key: value})
    return cfg


def offload_config(swap_dir: str | os.PathLike[str], *, stage: int, dtype: str = "fp32",
                   gas: int = 1, clip: float = 0.0, opt: str = "none", param: str = "none",
                   host: int | str = "auto", sub_group_numel: int = 300,
                   **extra: Any) -> dict[str, Any]:
    """engine_config with the optimizer offloaded to ``opt`` and the parameters to ``param``
    ('none', 'cpu', 'nvme'), swap files under ``swap_dir``, a host budget and small sub-groups
    (several per unit of TINY, so the NVMe pipeline has work to overlap)."""
    swap = os.fspath(swap_dir)
    zero = {"sub_group_numel": sub_group_numel, **extra.pop("zero", {})}
    memory = {"host_budget_bytes": host, **extra.pop("memory", {})}
    return engine_config(stage=stage, dtype=dtype, gas=gas, clip=clip,
                         offload_optimizer={"device": opt, "nvme_path": swap},
                         offload_param={"device": param, "nvme_path": swap},
                         memory=memory, zero=zero, **extra)


def rank_config(root: str, name: str, rank: int, *, stage: int, dtype: str, offload: str,
                gas: int = 1) -> dict[str, Any]:
    """engine_config for one rank of a 2-process case: parameters and optimizer offloaded to
    ``offload`` ('none', 'cpu', 'nvme') with a swap directory of its own under ``root``."""
    if offload == "none":
        return engine_config(stage=stage, dtype=dtype, gas=gas)
    return offload_config(os.path.join(root, "swap", f"{name}-r{rank}"), stage=stage, dtype=dtype,
                          gas=gas, opt=offload, param=offload)


def lora_like(seed: int = 0) -> GPT:
    """TINY with its blocks' weight matrices frozen (biases and norms train): LoRA's shape of the
    problem, units with frozen and trainable flat groups."""
    model = tiny_gpt(seed)
    for name, p in model.named_parameters():
        if "blocks" in name and name.endswith("weight") and "ln" not in name:
            p.requires_grad_(False)
    return model


def assert_exactly_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                         what: str = "") -> None:
    """The same keys in the same order, and per key the same dtype and bitwise the same values."""
    assert list(got) == list(want), (what, sorted(set(got) ^ set(want)))
    for k in want:
        assert got[k].dtype == want[k].dtype, (what, k, got[k].dtype, want[k].dtype)
        assert torch.equal(got[k].cpu(), want[k].cpu()), (what, k)


def reference_train(model: nn.Module, data, *, dtype: str = "fp32", clip: float = 0.0,
                    loss_fn: Callable | None = None, loss_scale: float = 1.0, splits: int = 1,
                    device: torch.device | str = "cpu",
                    param_groups: Callable[[nn.Module], list[dict]] | None = None,
                    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
                    ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train ``model`` (fp32) on ``data`` with plain PyTorch and ``torch.optim.AdamW``; returns
    per-step losses and the final fp32 state dict. ``loss_scale``: static fp16 loss scale
    (gradients unscaled in fp32). ``splits``: run each micro-batch as that many equal chunks
    whose fp32 gradients are averaged (what ``splits`` data-parallel ranks compute; in bf16 the
    rounding then matches too). ``param_groups(model)``: AdamW's groups (what a group leaves
    out is LR, BETAS, EPS, WD); ``scheduler(optimizer)``: an LR scheduler stepped after each
    optimizer step."""
    loss_fn = loss_fn or (lambda m, batch: m(*batch))
    master = model.to(device)
    work = master if dtype == "fp32" else copy.deepcopy(master).to(DTYPES[dtype])
    params = [p for p in master.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params if param_groups is None else param_groups(master), lr=LR,
                            betas=BETAS, eps=EPS, weight_decay=WD)
    sched = None if scheduler is None else scheduler(opt)
    losses = []  # parameters without a gradient in a step keep grad None: AdamW skips them
    for micro in data:
        total = 0.0
        for batch in micro:
            for part in zip(*(t.to(device).chunk(splits) for t in batch)):
                loss = loss_fn(work, part)
                (loss * loss_scale / len(micro) / splits).backward()
                total += loss.item() / len(micro) / splits
                if work is not master:
                    for pm, pw in zip(master.parameters(), work.parameters()):
                        if pw.grad is not None:
                            g = pw.grad.float() / loss_scale
                            pm.grad = g if pm.grad is None else pm.grad + g
                            pw.grad = None
        losses.append(total)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
        if work is not master:
            with torch.no_grad():
                for pm, pw in zip(master.parameters(), work.parameters()):
                    pw.copy_(pm)
                for bm, bw in zip(master.buffers(), work.buffers()):
                    bm.copy_(bw)
    return losses, {k: v.detach().float().cpu() for k, v in master.state_dict().items()}


def engine_train(engine, data, *, rank: int = 0, world_size: int = 1,
                 loss_fn: Callable | None = None) -> list[float]:
    """Train with the engine; each rank takes its contiguous slice of every micro-batch. Returns
    the per-step loss averaged over micro-batches and ranks (the reference's global loss)."""
    loss_fn = loss_fn or (lambda m, batch: m(*batch))
    losses = []
    for micro in data:
        total = torch.zeros(1, dtype=torch.float64)
        for batch in micro:
            # CPU tensors whatever the engine's device: it moves its inputs itself
            # ([Note: the engine moves inputs] in infinity/zero/_inputs.py).
            local = tuple(t.chunk(world_size)[rank] for t in batch)
            loss = loss_fn(engine, local)
            engine.backward(loss)
            engine.step()
            total += loss.item() / len(micro) / world_size
        if world_size > 1:
            torch.distributed.all_reduce(total)
        losses.append(float(total))
    return losses


def assert_close_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *,
                       atol: float | None = None, global_rel: float | None = None) -> None:
    """fp32: every element within ``atol``. bf16/fp16: the relative L2 distance over all entries
    within ``global_rel`` (one flipped bf16 rounding early on is amplified by Adam into
    element-wise differences of the same size as those between two equivalent bf16 runs, so
    element-wise bounds would only measure that noise; see TOL in test_engine.py)."""
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))
    if atol is not None:
        for key in want:
            torch.testing.assert_close(got[key].float().cpu(), want[key].float().cpu(), atol=atol,
                                       rtol=0.0, msg=lambda m, key=key: f"{key}: {m}")
    if global_rel is not None:
        diff = sum(float(((got[k].float().cpu() - want[k].float()) ** 2).sum()) for k in want)
        norm = sum(float((want[k].float() ** 2).sum()) for k in want)
        assert (diff / norm) ** 0.5 <= global_rel, f"relative L2 distance {(diff / norm) ** 0.5:.4f}"
        # Each parameter too, against its own norm: a bias or a norm's weight is a sliver of
        # the global one, so a bug confined to it (not stepped: 1.0) passes the bound above.
        for k in want:
            rel = (float((got[k].float().cpu() - want[k].float()).norm())
                   / max(float(want[k].float().norm()), PARAM_FLOOR * want[k].numel() ** 0.5))
            assert rel <= PER_PARAM_REL, f"{k}: relative L2 distance {rel:.4f}"


def assert_close_run(losses, state, ref_losses, ref_state, dtype: str) -> None:
    """Losses and final parameters against the reference, with the tolerance of ``dtype``."""
    tol = TOL[dtype]
    assert losses == pytest.approx(ref_losses, abs=tol["loss"])
    if dtype == "fp32":
        assert_close_state(state, ref_state, atol=tol["param"])
    else:
        assert_close_state(state, ref_state, global_rel=tol["param"])


def mark_backward(engine, slow_reads) -> None:
    """Make ``slow_reads`` tell the reads issued while ``engine.backward`` runs."""
    backward = engine.backward

    def marked_backward(loss):
        slow_reads["in_backward"] = True
        try:
            backward(loss)
        finally:
            slow_reads["in_backward"] = False

    engine.backward = marked_backward


def assert_parity(make_model: Callable[[], nn.Module] = tiny_gpt, *, stage: int = 3,
                  dtype: str = "fp32", gas: int = 1, clip: float = 0.0, steps: int = 10,
                  loss_fn: Callable | None = None, data=None, **cfg: Any):
    """Train ``make_model()`` with plain PyTorch and with the engine (``engine_config`` with
    ``cfg``) on the same ``data`` (default: ``steps`` x ``gas`` batches), assert the losses and
    final parameters agree within the tolerance of ``dtype``; returns the engine and the
    reference losses."""
    data = data or batches(steps, gas)
    loss_scale = cfg.get("precision", {}).get("loss_scale", 1)
    ref_losses, ref_state = reference_train(make_model(), data, dtype=dtype, clip=clip,
                                            loss_fn=loss_fn, loss_scale=loss_scale)
    engine = infinity.initialize(make_model(), engine_config(stage=stage, dtype=dtype, gas=gas,
                                                             clip=clip, **cfg))
    losses = engine_train(engine, data, loss_fn=loss_fn)
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, dtype)
    return engine, ref_losses


def train_and_check_nvme_gradients(engine, data, gas: int, ref) -> dict:
    """Train ``engine`` (gradients on NVMe) on ``data``, closing it, against ``ref`` (plain
    PyTorch's losses and state): every micro-batch writes each gradient slice, and the optimizer
    reads each back (at least the gradient's bytes each way per step, on top of the optimizer's
    own traffic); the host stays within its budget. Returns the engine's last stats. Run by
    tests/engine/test_grads_on_nvme.py and its CUDA twin (tests/gpu/test_coverage_cuda.py)."""
    try:
        assert engine.offload.grads_on_nvme
        grad_bytes = engine.manager.grad_accumulator_bytes()
        losses, moved = [], []
        for micro in data:
            before = engine.stats()["bytes_moved"]
            losses += engine_train(engine, [micro])
            after = engine.stats()["bytes_moved"]
            moved.append({k: after[k] - before[k] for k in ("HOST->NVME", "NVME->HOST")})
        state = engine.full_state_dict()
        stats = engine.stats()
    finally:
        engine.close()
    assert_close_run(losses, state, *ref, "fp32")
    assert stats["grads_on_nvme"]
    for m in moved[1:]:
        assert m["HOST->NVME"] >= gas * grad_bytes and m["NVME->HOST"] >= grad_bytes, m
    assert stats["bytes"]["HOST"]["peak"] <= stats["bytes"]["HOST"]["budget"]
    return stats
