"""[Note: masters stream into the optimizer] (infinity/zero/_engine_setup.py): a trainable model
built under ``infinity.init`` with parameters and optimizer on NVMe reaches its first step with a
host peak that does not grow with the model.

Before, every trainable group's fp32 master (4 B per parameter) waited in host memory until the
optimizer was built after the last unit: 13 GB at 3.3B parameters. The peak (VmHWM from before
``infinity.init`` to after one step) of a model with 4x the blocks may grow by a small part of
what those masters alone would add.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import infinity
from infinity.models.gpt import GPT, GPTConfig, synthetic_batch
from tests._support.engine import offload_config
from tests._support.fresh import call_in_fresh_process

WIDE = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=6, n_embd=384)
"""1.8M parameters per block: 7 MB of fp32 master each."""


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _measure(n_layer: int, swap_dir: str, host_budget_bytes: int) -> dict:
    """In a fresh process: peak RSS above the baseline from ``infinity.init`` through one step."""
    torch.set_num_threads(1)
    with infinity.init():  # meta kernels and the first optimizer import their modules once
        GPT(dataclasses.replace(WIDE, n_layer=1))
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak counts from here
    base = _status_bytes("VmRSS")
    config = dataclasses.replace(WIDE, n_layer=n_layer)
    cfg = offload_config(swap_dir, stage=3, dtype="bf16", clip=1.0, opt="nvme", param="nvme",
                         sub_group_numel=2 ** 18, host=host_budget_bytes,
                         memory={"device_budget_bytes": 12 * 2 ** 20},
                         zero={"unit_class_names": ["Block"]})
    with infinity.init(cfg):
        model = GPT(config)
    engine = infinity.initialize(model, cfg)
    try:
        x, y = synthetic_batch(config, 1, 8, seed=0)  # activations: a small part
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return {"peak_above_base_bytes": _status_bytes("VmHWM") - base,
                "trainable_numel": trainable, "finite": bool(torch.isfinite(loss)),
                "grads_on_nvme": engine.offload.grads_on_nvme}
    finally:
        engine.close()


def _measure_in_fresh_process(tmp_path, n_layer: int, host: int) -> dict:
    return call_in_fresh_process(__name__, "_measure", n_layer,
                                 str(tmp_path / str(n_layer)), host)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak reset")
def test_initialize_of_a_trainable_model_on_nvme_keeps_host_memory_flat(tmp_path):
    host = 24 * 2 ** 20  # both sizes keep their gradients as NVMe slices: one plan, two sizes
    small = _measure_in_fresh_process(tmp_path, 4, host)
    large = _measure_in_fresh_process(tmp_path, 16, host)
    assert small["finite"] and large["finite"]
    assert small["grads_on_nvme"] and large["grads_on_nvme"]
    added_master_bytes = 4 * (large["trainable_numel"] - small["trainable_numel"])
    assert added_master_bytes > 80 * 2 ** 20  # 12 blocks' fp32 masters
    grown = large["peak_above_base_bytes"] - small["peak_above_base_bytes"]
    assert grown < 0.25 * added_master_bytes, (small, large, added_master_bytes)


def test_initialize_reports_progress_per_unit_with_the_bytes_written(tmp_path):
    """``initialize(progress=)``: one call per unit, in order, and a last one once the set-up
    writes are done; the NVMe bytes written grow to every parameter shard and optimizer
    sub-group homed there."""
    config = dataclasses.replace(WIDE, n_layer=3, n_embd=48)
    cfg = offload_config(tmp_path, stage=3, dtype="bf16", opt="nvme", param="nvme",
                         sub_group_numel=2 ** 12, zero={"unit_class_names": ["Block"]})
    with infinity.init(cfg):
        model = GPT(config)
    seen = []
    engine = infinity.initialize(model, cfg, progress=seen.append)
    try:
        num_units = len(engine.manager.units)
        assert [p.units_done for p in seen] == list(range(1, num_units + 1)) + [num_units]
        assert {p.num_units for p in seen} == {num_units}
        written = [p.nvme_written_bytes for p in seen]
        assert written == sorted(written)
        # The stored shards (bf16, 2 B) and the optimizer's [master | moments] (fp32, 12 B) of the
        # NVMe-homed units, written at set-up; host-resident sub-groups excepted.
        stats = engine.stats()
        nvme_state = stats["bytes"]["NVME"]["current"]
        assert written[-1] >= nvme_state - stats["optimizer_host_resident_bytes"] > 0, (
            written, stats)
    finally:
        engine.close()
