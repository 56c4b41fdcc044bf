"""bench step's roofline columns from worker records (pure: no worker runs): which rows get them,
and that they are the roofline module's formula on the recorded numbers."""

from __future__ import annotations

import pytest

from infinity.bench._step_roofline import roofline_columns
from infinity.bench.roofline import DiskBandwidth

DISK = DiskBandwidth(read_bytes_per_s=2**30, write_bytes_per_s=2**29, direct=True)
PLAIN = {"mode": "plain", "step_s": 0.5, "nvme_per_step": {"read_bytes": 0, "write_bytes": 0},
         "io_threads_cpu_s": 0.0}


def _record(mode: str, step_s: float, read: int, write: int) -> dict:
    return {"mode": mode, "step_s": step_s, "io_threads_cpu_s": 0.125,
            "nvme_per_step": {"read_bytes": read, "write_bytes": write}}


def test_disk_bound_row_is_the_formula_on_its_bytes():
    cols = roofline_columns(_record("stage3-nvme", 2.0, 2**30, 2**28), PLAIN, DISK)
    assert cols["nvme_read_mib_per_step"] == 1024 and cols["nvme_write_mib_per_step"] == 256
    assert cols["disk_s"] == pytest.approx(1.0 + 0.5)
    assert (cols["cpu_s"], cols["roofline_s"], cols["bound"]) == (0.5, cols["disk_s"], "disk")
    assert cols["x_roofline"] == pytest.approx(2.0 / 1.5)
    assert cols["io_threads_cpu_s"] == 0.125
    assert list(cols)[-1] == "io_threads_cpu_s"  # the table's last roofline column


def test_rows_without_nvme_traffic_are_against_cpu_time_alone():
    for disk in (DISK, None):  # None: nothing moved, so no probe ran
        cols = roofline_columns(_record("stage3-cpu", 0.75, 0, 0), PLAIN, disk)
        assert (cols["disk_s"], cols["bound"], cols["x_roofline"]) == (0.0, "cpu", 1.5)
        assert roofline_columns(PLAIN, PLAIN, disk)["x_roofline"] == 1.0
    ds = roofline_columns({"mode": "ds-stage3-cpu", "step_s": 1.0}, PLAIN, None)
    assert (ds["disk_s"], ds["x_roofline"], ds["io_threads_cpu_s"]) == (0.0, 2.0, None)


def test_unknown_inputs_leave_the_roofline_out():
    # DeepSpeed's NVMe mode counts no bytes; a failed mode has no step
    assert roofline_columns({"mode": "ds-stage3-nvme", "step_s": 1.0}, PLAIN, DISK) == {}
    assert roofline_columns({"mode": "stage3", "error": "exit 1"}, PLAIN, DISK) == {}
    nvme = _record("stage3-nvme", 2.0, 2**20, 0)
    for plain, disk in ((None, DISK), (PLAIN, None)):  # no plain mode; the probe failed
        cols = roofline_columns(nvme, plain, disk)
        assert "x_roofline" not in cols and cols["nvme_read_mib_per_step"] == 1.0


def test_gpu_proxy_rows_are_against_the_disk_alone():
    """[GPU-proxy row] in infinity/bench/step.py: batch 1, a short sequence, the NVMe mode, no
    plain PyTorch run (a 3B state does not fit in memory): the row still has its step against
    its disk time, x_disk (the mixed disk roofline of its bytes)."""
    import argparse

    from infinity.bench.step import GPU_PROXY_MODES, GPU_PROXY_SEQ_LEN, apply_gpu_proxy

    args = argparse.Namespace(gpu_proxy=True, seq_len=None, batch_size=None, modes=None)
    apply_gpu_proxy(args)
    assert (args.batch_size, args.seq_len, args.modes) == (1, GPU_PROXY_SEQ_LEN, GPU_PROXY_MODES)
    kept = argparse.Namespace(gpu_proxy=True, seq_len=64, batch_size=2, modes="stage3-nvme")
    apply_gpu_proxy(kept)
    assert (kept.batch_size, kept.seq_len) == (2, 64)  # what the user gave stays
    normal = argparse.Namespace(gpu_proxy=False, seq_len=None, batch_size=None, modes=None)
    apply_gpu_proxy(normal)
    assert (normal.seq_len, normal.batch_size, normal.modes) == (256, None, None)
    cols = roofline_columns(_record("stage3-nvme", 3.0, 2**30, 2**28), None, DISK)
    assert cols["x_disk"] == pytest.approx(3.0 / 1.5) and "x_roofline" not in cols
    with_plain = roofline_columns(_record("stage3-nvme", 3.0, 2**30, 2**28), PLAIN, DISK)
    assert with_plain["x_disk"] == pytest.approx(3.0 / with_plain["disk_s"])
