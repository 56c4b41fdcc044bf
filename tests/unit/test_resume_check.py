"""``infinity train --resume-check`` (infinity/cli/_resume_check.py): the masters' digest reads a
master living on a GPU (the in-memory optimizer's live tensor), and the check makes a GPU run's
kernels deterministic before it starts, saying so; end to end on the CPU, the resumed steps are
bitwise equal."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from infinity.cli import _resume_check
from infinity.cli._resume_check import deterministic_kernels, masters_digest


class _DeviceTensor:
    """Stands in for a CUDA tensor: ``numpy()`` refuses, as torch does for a device tensor;
    ``cpu()`` gives the host copy."""

    def __init__(self, t: torch.Tensor):
        self.t = t

    def detach(self):
        return self

    def contiguous(self):
        return self

    def view(self, *shape):
        return _DeviceTensor(self.t.view(*shape))

    def cpu(self):
        return self.t.clone()

    def numpy(self):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to "
                        "copy the tensor to host memory first.")


class _Optimizer:
    def __init__(self, masters):
        self.masters = masters

    def drain(self):
        pass

    def keys(self):
        return list(self.masters)

    def master_values(self, key):
        return _DeviceTensor(self.masters[key])


class _Engine:
    def __init__(self, masters):
        self.shard_optimizer = _Optimizer(masters)


def test_the_digest_reads_masters_on_a_device():
    masters = {"u1": torch.arange(6, dtype=torch.float32), "u0": torch.ones(3)}
    want = hashlib.sha256()
    for key in ("u0", "u1"):
        want.update(key.encode())
        want.update(masters[key].numpy().tobytes())
    assert masters_digest(_Engine(masters)) == want.hexdigest()


def test_a_gpu_run_turns_deterministic_kernels_on_first(monkeypatch):
    calls = []
    monkeypatch.setattr(_resume_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_resume_check.torch, "use_deterministic_algorithms",
                        lambda on: calls.append(on))
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    said = deterministic_kernels()
    assert calls == [True] and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert "use_deterministic_algorithms on" in said
    monkeypatch.setattr(_resume_check.torch.cuda, "is_available", lambda: False)
    assert deterministic_kernels().startswith("CPU") and calls == [True]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_resume_check_end_to_end_is_bitwise_and_names_its_kernels(tmp_path, dtype):
    """In fp32 the in-memory master is the parameter's own shard: the digest copies it before
    .numpy() (which pins a storage's size: the reload's re-gather of the root unit failed)."""
    out = subprocess.run([sys.executable, "-m", "infinity", "train", "--model", "tiny",
                          "--seq-len", "32", "--steps", "4", "--offload", "none", "--no-roofline",
                          "--json", "--dtype", dtype,
                          "--resume-check", "--dir", str(tmp_path / "swap")],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr[-2000:]
    check = json.loads(out.stdout[out.stdout.index("{"):])["resume_check"]
    assert check["bitwise_equal"] is True and check["kernels"].startswith("CPU")
    assert len(check["resumed_losses"]) == 2
