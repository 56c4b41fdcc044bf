"""The README's torchrun example: a small transformers Llama fine-tuned on 2 processes (gloo)."""

from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_example_trains_on_two_processes(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           str(ROOT / "examples" / "finetune_hf.py"), "--steps", "16",
           "--model-dir", str(tmp_path / "tiny-llama"),
           "--config", str(ROOT / "examples" / "ds_config.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 8, proc.stdout  # 16 micro-batches, 2 per step (ds_config.json)
    assert "done: world size 2" in proc.stdout
    assert min(losses[-3:]) < losses[0], losses  # it learns the generated pattern
    assert (tmp_path / "tiny-llama" / "config.json").exists()
