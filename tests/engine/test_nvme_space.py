"""[Note: NVMe space check] (infinity/tiers/_nvme_space.py): before any state is written to NVMe,
``infinity.initialize`` compares the bytes the store will write with the file system's free space.

- The figure is the engine's own: its payload equals ``engine.stats()["bytes"]["NVME"]`` after
  set-up for every way state reaches NVMe (parameter shards, optimizer sub-groups with and
  without host-resident ones, gradient slices), and its on-disk bytes equal the sizes of the swap
  files once every one of them has been written (after a step).
- With the free space (a monkeypatched ``os.statvfs``) one byte short of it, ``initialize`` raises
  ``DiskSpaceError`` naming the path, the bytes needed and free, and writes no swap file; with
  exactly enough it trains. Directories on one file system are summed, ranks on one machine too.
"""

from __future__ import annotations

import dataclasses
import os
import types

import pytest

import infinity
from infinity.errors import DiskSpaceError
from infinity.tiers import NvmeDemand, check_nvme_space
from infinity.zero import _offload
from infinity.zero import host_needs_of, least_host_budget_bytes
from tests._support.engine import TINY, batches, engine_train, offload_config, tiny_gpt

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEEP = dataclasses.replace(TINY, n_layer=6)
"""Deep enough that at the least host budget the gradients go to NVMe (tests/engine/
test_grads_on_nvme.py)."""


@pytest.fixture
def spy(monkeypatch):
    """The NvmeBytes each initialize computed, in order."""
    seen = []
    real = _offload.nvme_bytes

    def record(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(_offload, "nvme_bytes", record)
    return seen


def _free_space(monkeypatch, root, free_bytes: int) -> None:
    """``os.statvfs`` of every path under ``root`` reports ``free_bytes`` free (block size and
    the rest as the real file system says: the swapper reads its alignment from it)."""
    real = os.statvfs
    root = os.path.abspath(root)

    def fake(path):
        st = real(path)
        if not os.path.abspath(os.fspath(path)).startswith(root):
            return st
        fields = {f: getattr(st, f) for f in dir(st) if f.startswith("f_")}
        return types.SimpleNamespace(**{**fields, "f_bavail": free_bytes, "f_frsize": 1})

    monkeypatch.setattr(os, "statvfs", fake)


def _swap_file_bytes(root) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root)
               for f in files if f.endswith(".swp"))


def _cases(tmp_path):
    swap = tmp_path / "swap"
    deep_probe = offload_config(swap, stage=3, opt="nvme", param="nvme")
    least = least_host_budget_bytes(tiny_gpt(config=DEEP), infinity.load_config(deep_probe))
    assert least < host_needs_of(tiny_gpt(config=DEEP), infinity.load_config(deep_probe),
                                 300).least_bytes  # so gradients go to NVMe there
    resident_probe = offload_config(swap, stage=3, opt="nvme", param="cpu")
    # room for six sub-groups beyond the pipeline's: homed on HOST, the rest on NVMe
    resident_host = host_needs_of(tiny_gpt(), infinity.load_config(resident_probe),
                                  300).comfortable_bytes + 6 * 4096
    return {
        "params+optimizer": (TINY, offload_config(swap, stage=3, opt="nvme", param="nvme")),
        "optimizer, host-resident sub-groups": (
            TINY, offload_config(swap, stage=3, opt="nvme", param="cpu", host=resident_host)),
        "optimizer at stage 1": (TINY, offload_config(swap, stage=1, opt="nvme")),
        "params only": (TINY, offload_config(swap, stage=3, opt="cpu", param="nvme")),
        "gradients on NVMe": (DEEP, offload_config(swap, stage=3, opt="nvme", param="nvme",
                                                   host=least)),
    }


CASES = ["params+optimizer", "optimizer, host-resident sub-groups", "optimizer at stage 1",
         "params only", "gradients on NVMe"]


@pytest.mark.parametrize("case", CASES)
def test_checked_bytes_are_the_engines_nvme_bytes(tmp_path, spy, case):
    model_config, config = _cases(tmp_path)[case]
    engine = infinity.initialize(tiny_gpt(config=model_config), config)
    try:
        (need,) = spy
        stats = engine.stats()
        assert need.state_bytes == stats["bytes"]["NVME"]["current"] > 0
        if case == "optimizer, host-resident sub-groups":
            assert stats["optimizer_host_resident_bytes"] > 0 and need.optimizer_bytes > 0
            assert need.param_bytes == 0
        if case == "gradients on NVMe":
            assert stats["grads_on_nvme"] and need.gradient_bytes == (
                engine.manager.grad_accumulator_bytes())
        # one step writes every swap file (gradient slices included): the disk holds exactly
        # what was checked
        engine_train(engine, batches(1, 1, config=model_config))
        engine.store.flush()
        assert _swap_file_bytes(tmp_path / "swap") == need.file_bytes
        assert need.file_bytes > need.state_bytes  # headers and extents
    finally:
        engine.close()


def test_one_byte_short_fails_before_writing_and_exactly_enough_trains(tmp_path, monkeypatch,
                                                                       spy):
    _model_config, config = _cases(tmp_path)["params+optimizer"]
    engine = infinity.initialize(tiny_gpt(), config)  # the need, measured on the real disk
    engine.close()
    needed = spy[0].file_bytes
    swap = str(tmp_path / "swap")

    _free_space(monkeypatch, tmp_path, needed - 1)
    with pytest.raises(DiskSpaceError) as info:
        infinity.initialize(tiny_gpt(), config)
    err = info.value
    assert (err.path, err.needed_bytes, err.free_bytes) == (swap, needed, needed - 1)
    message = str(err)
    for part in (swap, str(needed), str(needed - 1), "nothing was written", "nvme_path",
                 "offload_param and offload_optimizer"):
        assert part in message, part
    assert isinstance(err, RuntimeError)
    assert _swap_file_bytes(tmp_path / "swap") == 0  # no state written

    _free_space(monkeypatch, tmp_path, needed)
    engine = infinity.initialize(tiny_gpt(), config)
    try:
        assert engine_train(engine, batches(1, 1))
    finally:
        engine.close()


def test_ranks_on_one_machine_are_counted(tmp_path, monkeypatch, spy):
    _model_config, config = _cases(tmp_path)["params only"]
    infinity.initialize(tiny_gpt(), config).close()
    needed = spy[0].file_bytes
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    _free_space(monkeypatch, tmp_path, 2 * needed - 1)
    with pytest.raises(DiskSpaceError, match="x 2 ranks on this machine") as info:
        infinity.initialize(tiny_gpt(), config)
    assert info.value.needed_bytes == 2 * needed


def test_directories_on_one_file_system_are_summed(tmp_path, monkeypatch):
    a, b = tmp_path / "params", tmp_path / "optimizer"
    a.mkdir()
    b.mkdir()
    _free_space(monkeypatch, tmp_path, 1000)
    demands = [NvmeDemand(str(a), 600, "parameter shards"), NvmeDemand(str(b), 600, "optimizer")]
    with pytest.raises(DiskSpaceError) as info:
        check_nvme_space(demands)
    assert info.value.needed_bytes == 1200 and info.value.free_bytes == 1000
    assert "600 for parameter shards" in str(info.value) and str(b) in str(info.value)
    check_nvme_space(demands[:1])  # each alone fits
    check_nvme_space([NvmeDemand(str(a), 1000, "all of it")])
