"""benchmarks/gpu_check.sh without CUDA (issue #14, defect 13): it must pick no CPU-only Python,
install nothing, and stop within a minute with a clear "no CUDA" message and its own exit status.

The run is as on a machine whose Pythons all have a CPU torch: this test's interpreter (CPU torch
here; CUDA hidden by CUDA_VISIBLE_DEVICES="" on a GPU machine) is given as $PYTHON and stands in
for ``python3`` on PATH too, through a wrapper that logs every call; fake ``pip``, ``pip3``, ``uv``
and ``conda`` first on PATH record any install attempt."""

from __future__ import annotations

import os
import pathlib
import stat
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def _executable(path: pathlib.Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_without_cuda_it_exits_3_quickly_and_installs_nothing(tmp_path):
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for tool in ("pip", "pip3", "uv", "conda"):
        _executable(bin_dir / tool, f"#!/bin/sh\necho \"{tool} $*\" >> {log}\nexit 1\n")
    _executable(bin_dir / "python3",
                f"#!/bin/sh\necho \"python3 $*\" >> {log}\nexec {sys.executable} \"$@\"\n")
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env,
                          timeout=120, cwd=tmp_path)
    elapsed_s = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert elapsed_s < 60, (elapsed_s, out)
    assert "gpu_check: no CUDA" in out, out
    assert f"skipping {sys.executable}: its torch sees no CUDA" in out, out
    assert "skipping python3: its torch sees no CUDA" in out, out
    assert "== gpu_check: python:" not in out  # no Python was picked
    assert "pytest" not in proc.stdout and "bench step" not in proc.stdout  # nothing ran
    calls = log.read_text().splitlines() if log.exists() else []
    assert not [c for c in calls if not c.startswith("python3 ")], calls  # no installer ran
    assert not [c for c in calls if "pip" in c or "install" in c], calls


def test_the_script_has_no_install_step():
    text = SCRIPT.read_text()
    assert "pip install" not in text and "-m pip" not in text


def test_the_fallback_runs_no_file_that_imports_pytest():
    """Without pytest nothing of tests/gpu can run (every file imports pytest): the script says
    so instead of running one of them as a module."""
    text = SCRIPT.read_text()
    assert "-m tests.gpu" not in text
    assert "the GPU tests (which import pytest) were not run" in text


DISK_BYTES_PER_S = 1e9
"""An ordinary NVMe drive's sustained rate, the slow end (the lent GPU machine's is unknown)."""
START_S = 15.0
"""A mode's process: torch and CUDA start-up, building the model, the first step's compilation."""
DISK_BYTES = 64 * 2**30
"""The lent GPU machine's disk."""


def test_the_benchmark_is_sized_to_finish_in_the_time_it_is_left():
    """[#31 item 6] The script's plan (GPU_CHECK_PLAN_ONLY=1) fits its 8 minutes: picking, the
    build and the tests at their limits leave the bench its share, and each mode fits its part
    of that share at ordinary disk speed: the NVMe mode writes the state once at set-up and
    moves about the state each step (half of it read, half written: the host budget holds the
    other half). The state fits the disk with room to spare."""
    from infinity.models.gpt import PRESETS

    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, GPU_CHECK_PLAN_ONLY="1"))
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert line.startswith("plan: "), line
    plan = dict(item.split("=", 1) for item in line[len("plan: "):].split())
    n = {k: int(v) for k, v in plan.items() if v.isdigit()}
    assert n["total_s"] <= 480  # 8 minutes
    assert n["pick_max_s"] + n["build_max_s"] + n["tests_max_s"] + n["bench_min_s"] + 10 \
        <= n["total_s"]
    modes = plan["modes"].split(",")
    assert "stage3-nvme" in modes and "plain" in modes
    assert n["mode_min_s"] * len(modes) + 20 <= n["bench_min_s"]
    numel = PRESETS[plan["model"]].num_params
    state_bytes = numel * (2 + 2 + 12)  # bf16 parameters and gradients, fp32 master and moments
    steps = n["steps"] + n["warmup"]
    nvme_s = START_S + state_bytes * (1 + steps) / DISK_BYTES_PER_S
    assert nvme_s <= n["mode_min_s"], (plan["model"], nvme_s, n["mode_min_s"])
    assert state_bytes <= DISK_BYTES / 4
    assert n["steps"] >= 2  # a median of something
