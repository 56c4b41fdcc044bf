"""Activation checkpointing and its host offload on CUDA (skipped without a GPU).

After the forward, before backward, the device holds the kept activations. With checkpointing
they are the blocks' inputs (b*s*h per block); with ``offload_to_host`` those move to pinned host
memory, so the allocated device bytes drop by at least that much (torch.cuda.memory_allocated,
an independent measurement), and training still matches plain PyTorch.
"""

from __future__ import annotations

import pytest
import torch

import infinity
from infinity.models.gpt import GPT, GPTConfig, synthetic_batch
from tests._support import engine as support
from tests._support.engine import (assert_close_run, batches, engine_config, engine_train,
                                   reference_train, tiny_gpt)

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)
SMALL = GPTConfig(vocab_size=512, block_size=256, n_layer=6, n_head=4, n_embd=256)
BATCH = 16


def _allocated_after_forward(activation_checkpointing: dict, **extra) -> int:
    torch.manual_seed(0)
    engine = infinity.initialize(GPT(SMALL), engine_config(
        stage=3, dtype="bf16", device="cuda:0", activation_checkpointing=activation_checkpointing,
        **extra))
    idx, targets = synthetic_batch(SMALL, BATCH, SMALL.block_size, seed=1, device=CUDA)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(CUDA)
    loss = engine(idx, targets)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated(CUDA) - before
    engine.backward(loss)
    engine.step()
    engine.close()
    return held


def test_offload_frees_the_block_inputs_from_the_device():
    inputs = SMALL.n_layer * BATCH * SMALL.block_size * SMALL.n_embd * 2  # bf16, 2sbh per block
    plain = _allocated_after_forward({})
    ckpt = _allocated_after_forward({"units": ["Block"]})
    offload = _allocated_after_forward({"units": ["Block"], "offload_to_host": True})
    assert ckpt < plain
    assert ckpt - offload >= 0.9 * inputs, (plain, ckpt, offload, inputs)


@pytest.mark.parametrize("offload", [False, True])
def test_parity_on_cuda(offload, monkeypatch):

    monkeypatch.setitem(support.TOL, "fp32", dict(loss=1e-5, param=1e-4))  # see test_engine_cuda
    torch.backends.cuda.matmul.allow_tf32 = False
    data = batches(5, 1)
    ref_losses, ref_state = reference_train(tiny_gpt(), data, device=CUDA)
    engine = infinity.initialize(tiny_gpt(), engine_config(
        stage=3, device="cuda:0",
        activation_checkpointing={"units": "all", "offload_to_host": offload}))
    losses = engine_train(engine, data)
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    engine.close()


@pytest.mark.parametrize("mode", ["host", "nvme"])
def test_stored_activations_free_the_device_and_train_like_plain_pytorch(tmp_path, mode,
                                                                         monkeypatch):
    """[Note: saved activations are shards of the store]: on CUDA the blocks' inputs go to the
    arena (pinned) or to swap files and come back for the recompute; the device drops them and
    training matches plain PyTorch."""
    import infinity.zero._stored_activations as stored_module
    monkeypatch.setattr(stored_module, "MIN_STORED_BYTES", 4096)
    inputs = SMALL.n_layer * BATCH * SMALL.block_size * SMALL.n_embd * 2
    section = {"units": ["Block"], "offload": mode, "nvme_path": str(tmp_path)}
    ckpt = _allocated_after_forward({"units": ["Block"]})
    stored = _allocated_after_forward(section, memory={"host_budget_bytes": 256 << 20})
    assert ckpt - stored >= 0.9 * inputs, (ckpt, stored, inputs)
    monkeypatch.setitem(support.TOL, "fp32", dict(loss=1e-5, param=1e-4))
    torch.backends.cuda.matmul.allow_tf32 = False
    data = batches(4, 1)
    ref_losses, ref_state = reference_train(tiny_gpt(), data, device=CUDA)
    engine = infinity.initialize(tiny_gpt(), engine_config(
        stage=3, device="cuda:0", memory={"host_budget_bytes": 64 << 20},
        activation_checkpointing=section))
    losses = engine_train(engine, data)
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    engine.close()


def test_auto_keeps_the_inputs_on_a_gpu_with_room(tmp_path, monkeypatch):
    """[Note: the device's room]: a GPU with free memory keeps the inputs where torch keeps them
    (nothing crosses PCIe); with none left beyond the reserve they go to the arena."""
    import infinity.zero._stored_activations as stored_module
    monkeypatch.setattr(stored_module, "MIN_STORED_BYTES", 4096)
    torch.manual_seed(0)
    engine = infinity.initialize(GPT(SMALL), engine_config(
        stage=3, dtype="bf16", device="cuda:0", memory={"host_budget_bytes": 256 << 20},
        activation_checkpointing={"units": ["Block"], "offload": "auto",
                                  "nvme_path": str(tmp_path)}))
    idx, targets = synthetic_batch(SMALL, BATCH, SMALL.block_size, seed=1, device=CUDA)
    engine.backward(engine(idx, targets))
    engine.step()
    acts = engine.stats()["activations"]
    assert acts["DEVICE"]["saved"] == SMALL.n_layer * BATCH * SMALL.block_size * SMALL.n_embd * 2
    engine.stored_activations.device_room = lambda: 0
    engine.backward(engine(idx, targets))
    engine.step()
    assert engine.stats()["activations"]["HOST"]["saved"] == acts["DEVICE"]["saved"]
    engine.close()


def test_a_backward_with_the_arena_pinned_full_reads_through_a_host_buffer(tmp_path, monkeypatch):
    """[Note: no room to read back is not an error] on CUDA: with every arena extent pinned by
    the test during each backward, every input is read from its file into a host buffer of its
    own and copied to the GPU; training matches plain PyTorch."""
    import infinity.zero._stored_activations as stored_module
    from tests._support.store import train_with_the_arena_pinned_in_backward
    monkeypatch.setattr(stored_module, "MIN_STORED_BYTES", 4096)
    monkeypatch.setitem(support.TOL, "fp32", dict(loss=1e-5, param=1e-4))
    torch.backends.cuda.matmul.allow_tf32 = False
    data = batches(3, 1)
    ref_losses, ref_state = reference_train(tiny_gpt(), data, device=CUDA)
    engine = infinity.initialize(tiny_gpt(), engine_config(
        stage=3, device="cuda:0", memory={"host_budget_bytes": 1 << 20},
        activation_checkpointing={"units": "all", "offload": "nvme",
                                  "nvme_path": str(tmp_path)}))
    losses = train_with_the_arena_pinned_in_backward(engine, data)
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    acts = engine.stats()["activations"]
    assert acts["over_budget_read_bytes"] == acts["NVME"]["saved"] > 0
    engine.close()
