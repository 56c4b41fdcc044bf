"""The roofline's arithmetic and the model sizing behind `infinity train --params` (pure logic).

References: the roofline formula of issue #16 written out here, and the exact parameter count
of :class:`GPTConfig` (checked against ``sum(p.numel())`` elsewhere)."""

from __future__ import annotations

import argparse

import pytest

from infinity.bench.roofline import DiskBandwidth, init_roofline, nvme_minimum_bytes, roofline
from infinity.cli import _train
from infinity.models.gpt import PRESETS, gpt_for_params


def test_roofline_is_the_slower_of_compute_and_summed_disk_time():
    disk = DiskBandwidth(read_bytes_per_s=2e9, write_bytes_per_s=4e9, direct=True)
    line = roofline(cpu_s=1.0, read_bytes=3e9, write_bytes=2e9, disk=disk)
    assert line["disk_read_s"] == pytest.approx(1.5) and line["disk_write_s"] == pytest.approx(0.5)
    assert line["disk_s"] == pytest.approx(2.0) and line["roofline_s"] == pytest.approx(2.0)
    assert line["bound"] == "disk"
    assert roofline(cpu_s=3.0, read_bytes=3e9, write_bytes=2e9, disk=disk)["bound"] == "cpu"


def test_nvme_minimum_is_every_resident_byte_once_each_way():
    stats = {"bytes": {"NVME": {"current": 123456, "peak": 123456}}}
    assert nvme_minimum_bytes(stats) == {"read_bytes": 123456, "write_bytes": 123456}


@pytest.mark.parametrize("numel", [1e8, 3e8, 1e9, 3.3e9, 7e9])
def test_gpt_for_params_lands_near_the_asked_size(numel):
    config = gpt_for_params(numel)
    assert config.num_params == pytest.approx(numel, rel=0.06)
    assert config.n_embd % 128 == 0 and config.n_embd // config.n_head == 128


def test_the_3b_preset_is_the_issue_model():
    c = PRESETS["3b"]
    assert (c.n_embd, c.n_layer, c.vocab_size) == (2560, 40, 32000)
    assert c.num_params * 16 > 2 * 24 * 2**30  # its state is twice a 24 GiB machine's RAM
    assert gpt_for_params(3.3e9) == c


def _args(**kw):
    base = dict(model="demo", params=None, state_ram_multiple=None)
    return argparse.Namespace(**{**base, **kw})


def test_state_ram_multiple_sizes_by_the_machine_ram(monkeypatch):
    class Mem:
        total = 24 * 2**30

    monkeypatch.setattr(_train.psutil, "virtual_memory", lambda: Mem)
    args = _args(state_ram_multiple=2.0)
    config = _train._model_config(args)
    assert config.num_params * 16 == pytest.approx(2 * Mem.total, rel=0.06)
    assert args.model.startswith("gpt-") and args.model.endswith("b")
    with pytest.raises(ValueError, match="--state-ram-multiple"):
        _train._model_config(_args(state_ram_multiple=0))
    with pytest.raises(ValueError, match="--params"):
        _train._model_config(_args(params=10))
    with pytest.raises(ValueError, match="--model"):
        _train._model_config(_args(model="nope"))


def test_gpt_compute_is_measured_per_unit_and_summed():
    import torch

    from infinity.bench.roofline import gpt_compute_s

    c = gpt_compute_s(PRESETS["tiny"], batch_size=2, seq_len=16, dtype=torch.float32, repeats=1)
    assert c["forward_backward_s"] > 0 and c["adam_s"] > 0
    assert c["cpu_s"] == pytest.approx(c["forward_backward_s"] + c["adam_s"])


def test_gpt_compute_runs_on_the_engines_devices(monkeypatch):
    """[#31 item 4] A GPU run's roofline is the GPU's compute: the units run on ``device`` (here
    'meta', standing in for one: the work is placed there, not on the CPU), the optimizer on
    ``optimizer_device`` (the host, for an offloaded one)."""
    import torch

    from infinity.bench import roofline as rl

    ran = []

    def spy(fn, repeats, device):
        fn()  # the work really runs where it was put (meta tensors: no data, shapes checked)
        ran.append(device)
        return 1.0

    monkeypatch.setattr(rl, "_median_s", spy)
    c = rl.gpt_compute_s(PRESETS["tiny"], batch_size=2, seq_len=16, dtype=torch.float32,
                         repeats=1, device="meta", optimizer_device="cpu")
    # a block's step and forward, the ends' step and forward, then Adam
    assert [d.type for d in ran] == ["meta"] * 4 + ["cpu"]
    assert c["forward_backward_s"] == PRESETS["tiny"].n_layer + 1.0
    assert c["forward_s"] + c["backward_s"] == c["forward_backward_s"]
    ran.clear()
    rl.gpt_compute_s(PRESETS["tiny"], batch_size=2, seq_len=16, dtype=torch.float32, repeats=1,
                     device="meta")
    assert [d.type for d in ran] == ["meta"] * 5  # not offloaded: on the device


def test_gpt_for_params_at_a_fixed_width_varies_the_layers_alone():
    small, large = gpt_for_params(1e9, width=2560), gpt_for_params(3.3e9, width=2560)
    assert small.n_embd == large.n_embd == 2560 and small.n_head == 20
    assert small.n_layer < large.n_layer == gpt_for_params(3.3e9).n_layer
    assert abs(small.num_params - 1e9) < 0.1e9
    with pytest.raises(ValueError, match="multiple of 128"):
        gpt_for_params(1e9, width=1000)


def test_roofline_ratio_of_a_measured_step_and_a_step_without_nvme_traffic():
    disk = DiskBandwidth(read_bytes_per_s=2e9, write_bytes_per_s=4e9, direct=True)
    line = roofline(cpu_s=1.0, read_bytes=3e9, write_bytes=2e9, disk=disk, step_s=3.0)
    assert line["x_roofline"] == pytest.approx(3.0 / 2.0)
    # no NVMe bytes: disk 0 at any bandwidth (or none probed), the ratio against compute alone
    for d in (disk, None):
        line = roofline(cpu_s=0.5, read_bytes=0, write_bytes=0, disk=d, step_s=0.75)
        assert (line["disk_s"], line["bound"], line["x_roofline"]) == (0.0, "cpu", 1.5)
    with pytest.raises(ValueError, match="probe_disk"):
        roofline(cpu_s=1.0, read_bytes=1, write_bytes=0, disk=None)


def test_nvme_bytes_per_step_from_stats_samples():
    from infinity.bench.roofline import nvme_moved_bytes, nvme_per_step

    before = {"NVME->HOST": 100, "HOST->NVME": 40, "HOST->DEVICE": 7}
    after = {"NVME->HOST": 350, "HOST->NVME": 90, "HOST->DEVICE": 9}
    assert nvme_moved_bytes(before, after) == (250, 50)
    assert nvme_moved_bytes({}, {}) == (0, 0)  # a mode without a store moves nothing
    stats = {"bytes": {"NVME": {"current": 100, "peak": 100}}}
    moved = [(900, 900), (100, 50), (300, 70), (200, 60)]
    cold = nvme_per_step(moved, stats)  # infinity train: the first step reads set-up's cold files
    assert (cold["read_bytes"], cold["write_bytes"], cold["x_minimum"]) == (200, 60, 260 / 200)
    timed = nvme_per_step(moved, stats, warm=True)  # bench step: warm-up steps already left out
    assert (timed["read_bytes"], timed["write_bytes"]) == (250, 65)
    # The mean over every step, the cold one in it: each update counted once wherever it ran.
    assert (cold["mean_read_bytes"], cold["mean_write_bytes"]) == (1500 / 4, 1080 / 4)
    assert cold["x_minimum_mean"] == (1500 + 1080) / 4 / 200


def test_steady_steps_leave_out_the_cold_first_and_the_final_update():
    """[Note: the steady steps]: the 3.3B row's five steps; the median of all five was the cold
    first step's, the steady median is the middle three's. One or two steps keep what they can."""
    import statistics

    from infinity.bench.roofline import steady_steps

    times = [45.7, 51.3, 38.7, 35.9, 50.7]
    assert list(steady_steps(times)) == [51.3, 38.7, 35.9]
    assert statistics.median(steady_steps(times)) == 38.7
    assert list(steady_steps([3.0, 2.0])) == [2.0] and list(steady_steps([3.0])) == [3.0]


def test_init_roofline_is_random_values_once_plus_the_state_written():
    disk = DiskBandwidth(read_bytes_per_s=2e9, write_bytes_per_s=4e9, direct=True)
    line = init_roofline(random_numel=int(1e8), state_bytes=int(8e9), disk=disk, init_s=9.0)
    assert line["init_write_s"] == pytest.approx(2.0)
    assert line["init_rng_s"] == pytest.approx(1e8 / line["rng_numel_per_s"])
    assert line["init_roofline_s"] == pytest.approx(line["init_rng_s"] + 2.0)
    assert line["init_x"] == pytest.approx(9.0 / line["init_roofline_s"])


def test_the_disk_time_is_the_least_of_serial_and_both_at_once():
    """[Note: the mixed disk roofline]: this VM's disk as fio measured it (alone 1.0 read, 1.5
    write GB/s; beside each other 0.8 read, 0.75 write): equal bytes go sooner both at once, a
    step that only reads goes at the lone rate, and a disk that gains nothing from mixing keeps
    the serial sum."""
    import dataclasses

    disk = DiskBandwidth(read_bytes_per_s=1.0e9, write_bytes_per_s=1.5e9, direct=True,
                         mixed_read_bytes_per_s=0.8e9, mixed_write_bytes_per_s=0.75e9)
    serial = 3e9 / 1.0e9 + 3e9 / 1.5e9  # 5.0 s
    # 3 GB each way: both stream until the reads end (3.75 s; 2.8125 GB written by then), then
    # the last 0.1875 GB are written alone (0.125 s).
    assert disk.seconds(3e9, 3e9) == pytest.approx(3.75 + 0.1875e9 / 1.5e9)
    assert disk.seconds(3e9, 0) == pytest.approx(3.0)  # nothing to mix with
    # 4 GB read, 1 GB written: both stream 1.333 s (the writes end), then 2.933 GB read alone.
    assert disk.seconds(4e9, 1e9) == pytest.approx(4 / 3 + (4e9 - 4 / 3 * 0.8e9) / 1.0e9)
    slow_mix = dataclasses.replace(disk, mixed_read_bytes_per_s=0.4e9,
                                   mixed_write_bytes_per_s=0.4e9)
    assert slow_mix.seconds(3e9, 3e9) == pytest.approx(serial)  # serial is sooner
    unprobed = DiskBandwidth(read_bytes_per_s=1.0e9, write_bytes_per_s=1.5e9, direct=True)
    assert unprobed.seconds(3e9, 3e9) == pytest.approx(serial)
    line = roofline(cpu_s=1.0, read_bytes=3e9, write_bytes=3e9, disk=disk, step_s=4.5)
    assert line["disk_serial_s"] == pytest.approx(serial)
    assert line["roofline_s"] == pytest.approx(3.875) and line["bound"] == "disk"
    assert line["x_roofline"] == pytest.approx(4.5 / 3.875)
