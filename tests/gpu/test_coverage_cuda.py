"""What only CPU tests covered, on CUDA (issue #31, item 7: "tests/gpu cannot see a missing wait").

On a CPU engine every copy is synchronous, so a wait missing between the compute stream and a
copy stream, or a kernel that only the CUDA path runs, passes every CPU test. Each test here runs
the engine on the GPU against an independent reference on the GPU (plain PyTorch +
``torch.optim.AdamW``, the plain ``transformers.Trainer``, plain peft, or the fp32-moment Adam
step) so that such a defect shows as a wrong number:

* gradients on NVMe ([Note: gradients on NVMe] in infinity/zero/_grad_reducer.py): copied down
  from the device into NVMe-homed slices at the least host budget;
* fp16 with a static loss scale, parameters and optimizer offloaded to the host and to NVMe;
* bf16 Adam moments stored with stochastic rounding by the device step
  (``adam_step_flat_reference`` on CUDA tensors), and an engine with ``optimizer.state_dtype``
  'bf16' training on the GPU;
* ``InfinityTrainer`` and peft LoRA on a CUDA engine;
* a Hugging Face Llama built under ``infinity.init`` and materialised into CUDA shards;
* a slow compute stream: every block sleeps on the compute stream after its forward and before
  its backward, so the copies that read what compute wrote (gradients copied down on a side
  stream, shards evicted under a tight device budget) land wrong unless they wait for it.

Inputs are given on the CPU ([Note: the engine moves inputs] in infinity/zero/_inputs.py).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import infinity
from tests._support.engine import (TINY, assert_close_run, batches, engine_config, engine_train,
                                   offload_config, reference_train, tiny_gpt,
                                   train_and_check_nvme_gradients)
from tests._support.models import FOUR, four_gpt, unit_numels
from tests.gpu._cuda import CUDA, exact_fp32, set_cuda_tolerance

pytestmark = pytest.mark.gpu

SLEEP_CYCLES = 5_000_000
"""A few milliseconds of GPU time on the compute stream per block and pass: far longer than a
tiny block's kernels or its copies, so the compute stream runs well behind the host."""


@pytest.fixture(autouse=True)
def _tolerance(monkeypatch):
    set_cuda_tolerance(monkeypatch)


def _assert_on_cuda(engine) -> None:
    assert engine.device == CUDA
    assert all(p.is_cuda for p in engine.module.parameters())


# ------------------------------------------------------------------ gradients on NVMe

DEEP = dataclasses.replace(TINY, n_layer=6)
"""As in tests/engine/test_grads_on_nvme.py: deep enough that its gradients take more host room
than the slices' staging, so the least host budget puts them on NVMe."""


def _deep():
    return tiny_gpt(config=DEEP)


@pytest.mark.parametrize("stage, gas, clip", [(3, 2, 0.05), (3, 1, 0.0), (2, 2, 0.05)])
def test_gradients_on_nvme_on_cuda_train_like_pytorch(tmp_path, stage, gas, clip):
    """The CPU test's least-host-budget config on a CUDA engine: each micro-batch's gradients
    come down from the GPU into NVMe slices (read back and added at gas 2), and training matches
    plain PyTorch on the GPU, clipping by the exact global norm included."""
    from infinity.zero import host_needs_of, least_host_budget_bytes

    exact_fp32()
    param = "nvme" if stage == 3 else "none"
    probe = offload_config(tmp_path, stage=stage, gas=gas, clip=clip, opt="nvme", param=param,
                           device="cuda")
    least = least_host_budget_bytes(_deep(), infinity.load_config(probe))
    assert least < host_needs_of(_deep(), infinity.load_config(probe), 300).least_bytes
    config = offload_config(tmp_path, stage=stage, gas=gas, clip=clip, opt="nvme", param=param,
                            host=least, device="cuda")
    data = batches(4, gas)
    ref_losses, ref_state = reference_train(_deep(), data, clip=clip, device=CUDA)
    engine = infinity.initialize(_deep(), config)
    _assert_on_cuda(engine)
    train_and_check_nvme_gradients(engine, data, gas, (ref_losses, ref_state))


# ------------------------------------------------------------------ fp16 with offload

FP16_CASES = [("cpu", 1), ("cpu", 2), ("nvme", 1), ("nvme", 2)]


@pytest.mark.parametrize("home, gas", FP16_CASES, ids=[f"{h}-gas{g}" for h, g in FP16_CASES])
def test_fp16_static_loss_scale_with_offload_matches_plain_pytorch(tmp_path, home, gas):
    """fp16 with a static loss scale of 128, parameters and optimizer homed on ``home``: the
    scaled fp16 gradients come down to the host (fp16 accumulators at gas 1, fp32 at gas 2) and
    the offloaded Adam unscales them; the reference scales its loss by the same and unscales its
    fp32 gradients (plain PyTorch on the GPU)."""
    scale = 128.0
    data = batches(6, gas)
    ref_losses, ref_state = reference_train(tiny_gpt(), data, dtype="fp16", loss_scale=scale,
                                            device=CUDA)
    config = offload_config(tmp_path / "swap", stage=3, dtype="fp16", gas=gas, opt=home,
                            param=home, device="cuda", precision={"loss_scale": scale})
    engine = infinity.initialize(tiny_gpt(), config)
    try:
        _assert_on_cuda(engine)
        losses = engine_train(engine, data)
        state = engine.full_state_dict()
        stats = engine.stats()
        assert engine.loss_scale == scale and engine.skipped_steps == 0
    finally:
        engine.close()
    assert_close_run(losses, state, ref_losses, ref_state, "fp16")
    assert stats["bytes_moved"]["HOST->DEVICE"] > 0
    if home == "nvme":
        assert stats["bytes_moved"]["HOST->NVME"] > 0


# ------------------------------------------------------------------ bf16 moments

def _adam_hp(**overrides):
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True,
              bias_correction=True)
    hp.update(overrides)
    return hp


def test_the_device_step_rounds_bf16_moments_stochastically_on_cuda():
    """``adam_step_flat_reference`` is the step a GPU runs (``adam_kernel_for``); here on CUDA
    tensors, as tests/unit/test_cpu_adam.py checks it on CPU ones. bf16 moments stored with
    stochastic rounding track the fp32-moment run of the same step on the GPU over 1500 noisy
    steps, unbiased (round-to-nearest stalls ``exp_avg_sq`` at beta2 = 0.999: a one-sided error
    > 0.1); one step from zero moments gives both bf16 neighbours of 0.1 * g, averaging to it."""
    from infinity.optim import adam_step_flat_reference

    n, steps = 512, 1500
    gen = torch.Generator().manual_seed(7)
    p0 = torch.randn(n, generator=gen).to(CUDA)
    drift = torch.randn(n, generator=gen) * 0.3
    grads = [(drift + torch.randn(n, generator=gen)).to(CUDA) for _ in range(steps)]
    hp = _adam_hp(lr=1e-3, weight_decay=0.01)
    p32, m32, v32 = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    p, m = p0.clone(), torch.zeros(n, dtype=torch.bfloat16, device=CUDA)
    v = torch.zeros(n, dtype=torch.bfloat16, device=CUDA)
    out = torch.empty(n, dtype=torch.bfloat16, device=CUDA)
    for t, g in enumerate(grads, start=1):
        adam_step_flat_reference(p32, g, m32, v32, step=t, **hp)
        adam_step_flat_reference(p, g, m, v, step=t, out=out, **hp)
    assert m.dtype == v.dtype == torch.bfloat16 and m.is_cuda and v.is_cuda
    assert torch.equal(out, p.to(torch.bfloat16))
    assert torch.isfinite(p).all() and torch.isfinite(v.float()).all()
    rel_v = (v.double() - v32.double()) / v32.double()
    assert abs(rel_v.mean().item()) < 0.005  # round-to-nearest: a one-sided stall, > 0.1
    assert rel_v.abs().mean().item() < 0.06
    moved = (p32 - p0).abs().mean().item()
    assert moved > 0.1  # the run went somewhere, so the relative bound below means something
    assert (p - p32).abs().mean().item() < 0.015 * moved

    k = 1 << 16
    g = torch.full((k,), 1.0 / 3.0, device=CUDA)  # 0.1 * g = 0.0333...: not a bf16 value
    m1 = torch.zeros(k, dtype=torch.bfloat16, device=CUDA)
    v1 = torch.zeros(k, dtype=torch.bfloat16, device=CUDA)
    adam_step_flat_reference(torch.zeros(k, device=CUDA), g, m1, v1, step=1, **_adam_hp())
    exact = (torch.tensor(0.1, dtype=torch.float32) * torch.tensor(1.0 / 3.0)).item()
    assert len(torch.unique(m1)) == 2  # both neighbours occur
    assert abs(m1.double().mean().item() - exact) < 1e-3 * exact


def test_bf16_moments_engine_on_cuda_trains_like_fp32_moments():
    """``optimizer.state_dtype: bf16`` with the optimizer on the GPU (in memory): the moments
    are bf16 CUDA tensors, the losses are finite, and the run stays within the bf16 tolerance of
    plain PyTorch's AdamW (fp32 moments) on the GPU."""
    exact_fp32()
    data = batches(8, 1)
    ref_losses, ref_state = reference_train(tiny_gpt(), data, device=CUDA)
    config = engine_config(stage=3, device="cuda", optimizer={"state_dtype": "bf16"})
    engine = infinity.initialize(tiny_gpt(), config)
    try:
        _assert_on_cuda(engine)
        losses = engine_train(engine, data)
        state = engine.full_state_dict()
        shard_optimizer = engine.shard_optimizer
        assert shard_optimizer.keys()
        for key in shard_optimizer.keys():
            for name, moment in shard_optimizer.state_of(key).items():
                assert moment.dtype == torch.bfloat16 and moment.is_cuda, (key, name)
                assert torch.isfinite(moment.float()).all(), (key, name)
    finally:
        engine.close()
    assert all(math.isfinite(loss) for loss in losses), losses
    assert_close_run(losses, state, ref_losses, ref_state, "bf16")


# ------------------------------------------------------------------ Hugging Face Trainer and peft

TRAINER_CASES = ("llama-stage3", "llama-deepspeed-auto-offload-host")
"""The Llama cases of tests/integrations/test_trainer.py (``TRAINER_CASES`` in its _hf.py)."""


@pytest.mark.parametrize("case", TRAINER_CASES)
def test_infinity_trainer_on_cuda_matches_plain_trainer_on_cuda(tmp_path, case):
    """``InfinityTrainer`` with ``use_cpu=False`` (the engine on the Trainer's device) against
    the plain ``transformers.Trainer`` on the GPU: the same logged losses, grad norms and lrs,
    and the same final weights, over the CPU test's 10 steps (cosine schedule, warmup, HF's
    no-decay groups, clipping, gradient accumulation 2)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import Trainer

    from infinity.integrations.hf import InfinityTrainer
    from tests.integrations._hf import Tokens, assert_same_run, tiny, training_args
    from tests.integrations._hf import TRAINER_CASES as CASES

    kind, infinity_config = CASES[case]
    assert kind == "llama"

    exact_fp32()
    initial = {k: v.clone() for k, v in tiny("llama").state_dict().items()}
    plain = Trainer(model=tiny("llama"),
                    args=training_args(str(tmp_path / "plain"), use_cpu=False),
                    train_dataset=Tokens())
    plain.train()
    assert all(p.is_cuda for p in plain.model.parameters())
    ours = InfinityTrainer(model=tiny("llama"),
                           args=training_args(str(tmp_path / "ours"), use_cpu=False),
                           train_dataset=Tokens(), infinity_config=infinity_config)
    ours.train()
    try:
        _assert_on_cuda(ours.engine)
        assert_same_run(ours, plain, initial=initial)
    finally:
        ours.engine.close()


@pytest.mark.parametrize("param", ["cpu", "nvme"])
def test_peft_lora_on_cuda_matches_plain_peft_on_cuda(tmp_path, param):
    """tests/engine/test_peft.py's LoRA parity on CUDA: the tiny Llama built under
    ``infinity.init``, ``get_peft_model`` after the block, stage 3 with the frozen base homed on
    ``param`` and the adapters' optimizer on the GPU, against eager peft + ``torch.optim.AdamW``
    on the GPU from the same weights: the same losses and adapters, and the frozen base bitwise
    as built."""
    pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from infinity.integrations.peft import adapter_state_dict
    from tests._support.peft_llama import (BETAS, EPS, LR, WD, config, eager_peft, lazy_peft,
                                           token_batches)

    exact_fp32()
    data = token_batches()
    ref = eager_peft()
    initial = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    ref.to(CUDA)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR,
                            betas=BETAS, eps=EPS, weight_decay=WD)
    ref_losses = []
    for ids in data:
        ids = ids.to(CUDA)
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_losses.append(loss.item())
    want = {k: v.detach().cpu() for k, v in peft.get_peft_model_state_dict(ref).items()}

    cfg = config(tmp_path / "swap", param=param)
    cfg["device"] = "cuda"
    engine = infinity.initialize(lazy_peft(cfg))
    try:
        _assert_on_cuda(engine)
        losses = []
        for ids in data:  # CPU ids: the engine moves them
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        got = {k: v.detach().cpu() for k, v in adapter_state_dict(engine).items()}
        full = engine.full_state_dict()
    finally:
        engine.close()
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    assert ref_losses[-1] < ref_losses[0] - 0.01  # the adapters really trained
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-4, rtol=0,
                                   msg=lambda m, key=key: f"{key}: {m}")
    assert min(want[k].abs().max() for k in want if "lora_B" in k) > 1e-3  # far from zero
    for key, value in initial.items():
        if "lora_" not in key:
            assert torch.equal(full[key].cpu(), value), key


# ------------------------------------------------------------------ infinity.init of a HF model

def _llama():
    """A tiny Llama (fp32, seed 0). Eager attention: the same kernels in the engine and the
    reference, where SDPA's memory-efficient fp32 backward accumulates with atomics."""
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=TINY.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=TINY.block_size,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="eager"))


def _hf_loss(model, batch):
    ids = batch[0]
    return model(input_ids=ids, labels=ids).loss


def test_hf_llama_built_under_init_on_cuda_trains_like_eager_plain_pytorch():
    """A transformers Llama built on meta under ``infinity.init`` (device cuda), materialised
    unit by unit into CUDA shards: bitwise the eagerly built model's values, and 4 steps train
    as the eager model does with plain PyTorch + AdamW on the GPU."""
    pytest.importorskip("transformers")
    exact_fp32()
    config = engine_config(stage=3, device="cuda", unit_class_names=("LlamaDecoderLayer",))
    with infinity.init(config):
        lazy = _llama()
    assert any(p.device.type == "meta" for p in lazy.parameters())
    eager = _llama()
    want = {k: v.detach().clone() for k, v in eager.state_dict().items()}
    data = batches(4, 1)
    ref_losses, ref_state = reference_train(eager, data, loss_fn=_hf_loss, device=CUDA)
    engine = infinity.initialize(lazy)
    try:
        _assert_on_cuda(engine)
        first = engine.full_state_dict()
        assert first.keys() == want.keys()
        for key in want:
            assert torch.equal(first[key].cpu(), want[key]), key
        losses = engine_train(engine, data, loss_fn=_hf_loss)
        state = engine.full_state_dict()
    finally:
        engine.close()
    assert_close_run(losses, state, ref_losses, ref_state, "fp32")


# ------------------------------------------------------------------ a slow compute stream

def _slow_blocks(blocks, slept: dict[str, int]) -> list:
    """Each block sleeps SLEEP_CYCLES on the current (compute) stream after its forward and
    before its backward; returns the hook handles."""

    def sleep(phase: str) -> None:
        slept[phase] += 1
        torch.cuda._sleep(SLEEP_CYCLES)

    handles = []
    for block in blocks:
        handles.append(block.register_forward_hook(lambda m, args, out: sleep("forward")))
        handles.append(block.register_full_backward_pre_hook(lambda m, g: sleep("backward")))
    return handles


@pytest.mark.parametrize("dtype, gas", [("fp32", 1), ("bf16", 2)])
def test_slow_compute_stream_trains_as_plain_pytorch(tmp_path, dtype, gas):
    """Parameters and optimizer on the host, a device budget of three of the five units (every
    step evicts and refetches), and every block's compute held back on the compute stream: the
    gradients copied down on a side stream and the shards evicted or refilled must wait for the
    compute stream that wrote or reads them. Against plain PyTorch on the GPU."""
    if dtype == "fp32":
        exact_fp32()
    steps = 4
    item = 4 if dtype == "fp32" else 2
    data = batches(steps, gas, config=FOUR)
    ref_losses, ref_state = reference_train(four_gpt(), data, dtype=dtype, device=CUDA)
    numels = unit_numels(four_gpt())
    budget_bytes = 3 * max(numels) * item
    assert budget_bytes < sum(numels) * item
    config = offload_config(tmp_path / "swap", stage=3, dtype=dtype, gas=gas, opt="cpu",
                            param="cpu", device="cuda",
                            memory={"device_budget_bytes": budget_bytes})
    model = four_gpt()
    engine = infinity.initialize(model, config)
    slept = {"forward": 0, "backward": 0}
    handles = _slow_blocks(model.blocks, slept)
    try:
        _assert_on_cuda(engine)
        losses = engine_train(engine, data[:1])
        first = engine.stats()["bytes_moved"]["HOST->DEVICE"]
        losses += engine_train(engine, data[1:])
        state = engine.full_state_dict()
        refetched = engine.stats()["bytes_moved"]["HOST->DEVICE"] - first
    finally:
        for handle in handles:
            handle.remove()
        engine.close()
    calls = steps * gas * FOUR.n_layer
    assert slept == {"forward": calls, "backward": calls}  # every pass ran behind a sleep
    assert refetched > 0  # shards were evicted and fetched again after the first step
    assert_close_run(losses, state, ref_losses, ref_state, dtype)
