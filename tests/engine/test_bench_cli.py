"""``infinity bench io|adam|step|all`` through ``infinity.cli.main``: one output style.

Tiny sizes, in process; no speed is asserted, only the record's shape, the formulas that tie its
columns together, where files land, and that stdout stays one JSON document (progress on stderr).
"""

from __future__ import annotations

import builtins
import datetime as dt
import importlib.util
import json
import statistics
import types

import pytest
import torch

from infinity.bench import adam as bench_adam
from infinity.bench import io as bench_io
from infinity.bench import step as bench_step
from infinity.bench.report import Report
from infinity.cli import main

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RECORD_KEYS = {"benchmark", "title", "environment", "params", "rows", "notes"}
ENV_KEYS = {"date", "command", "python", "platform", "cpu_count", "memory_bytes", "torch", "infinity"}
INSTALL_HINT = "pip install 'infinity[plot]'"


def adam_argv(*extra: str) -> list[str]:
    return ["bench", "adam", "--numel", "4096", "--repeats", "1", "--threads", "1",
            "--no-deepspeed", *extra]


def io_argv(tmp_path, *extra: str) -> list[str]:
    return ["bench", "io", "--dir", str(tmp_path / "io"), "--size-bytes", str(2 * 2**20 + 4096),
            "--repeats", "1", "--no-fio", "--no-deepspeed", *extra]


def step_argv(tmp_path, *extra: str) -> list[str]:
    return ["bench", "step", "--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--steps", "2",
            "--warmup", "0", "--modes", "plain", "--dir", str(tmp_path / "step"), *extra]


def check_record(record: dict, name: str) -> None:
    assert RECORD_KEYS <= record.keys()
    assert record["benchmark"] == name
    env = record["environment"]
    assert ENV_KEYS <= env.keys()
    assert env["torch"] == torch.__version__
    assert isinstance(env["command"], str) and env["command"]
    date = dt.datetime.fromisoformat(env["date"])
    assert date.utcoffset() == dt.timedelta(0)
    assert abs(dt.datetime.now(dt.timezone.utc) - date) < dt.timedelta(hours=1)
    assert record["rows"]


def parse_single_json(out: str) -> dict:
    return json.loads(out)  # raises if anything but one JSON document reached stdout


@pytest.fixture
def no_matplotlib(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)


def test_adam_json_record_columns_and_saved_file(tmp_path, capsys):
    results = tmp_path / "results"
    assert main(adam_argv("--json", "--results-dir", str(results))) == 0
    out, err = capsys.readouterr()
    record = parse_single_json(out)
    check_record(record, "adam")
    assert "bench adam:" in err  # the progress bar, on stderr only
    assert record["params"]["numel"] == 4096
    assert {"ratios", "deepspeed"} <= record.keys()
    variants = {r["variant"] for r in record["rows"]}
    assert {bench_adam.PROBE_VARIANT, "torch AdamW fused", "ours fp32", "ours bf16 states"} <= variants
    for row in record["rows"]:
        # the columns are one measurement seen three ways: time, updates/s, bytes/s
        assert row["Gupdates/s"] * 1e9 * row["time_ms"] * 1e-3 == pytest.approx(4096, rel=1e-9)
        assert row["GB/s"] == pytest.approx(row["Gupdates/s"] * row["bytes/param"], rel=1e-9)
    saved = list(results.glob("adam-*.json"))
    assert len(saved) == 1
    on_disk = json.loads(saved[0].read_text())
    check_record(on_disk, "adam")
    assert on_disk["rows"] == record["rows"] and on_disk["params"] == record["params"]


def test_adam_table_and_no_save(tmp_path, capsys):
    results = tmp_path / "results"
    assert main(adam_argv("--no-save", "--results-dir", str(results))) == 0
    out, _ = capsys.readouterr()
    assert "CPU Adam, 4096 params" in out and "Gupdates/s" in out and "ours fp32" in out
    assert "saved" not in out
    assert not results.exists()


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib not installed (pip install 'infinity[plot]')")
def test_adam_plot_writes_png(tmp_path, capsys):
    png = tmp_path / "pics" / "adam.png"
    assert main(adam_argv("--json", "--no-save", "--plot", str(png))) == 0
    out, err = capsys.readouterr()
    record = parse_single_json(out)
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert record["plot"] == str(png)
    assert str(png) in err


def test_adam_plot_without_matplotlib_says_how(tmp_path, capsys, no_matplotlib):
    png = tmp_path / "adam.png"
    assert main(adam_argv("--json", "--no-save", "--plot", str(png))) == 0  # exit code unchanged
    out, err = capsys.readouterr()
    record = parse_single_json(out)
    assert record["plot"] is None and record["rows"]
    assert not png.exists()
    hint_lines = [line for line in err.splitlines() if INSTALL_HINT in line]
    assert len(hint_lines) == 1 and str(png) in hint_lines[0]


def _check_plot(record, png, err) -> None:
    """--plot wrote a PNG (matplotlib installed) or nothing and the install hint (not)."""
    if HAVE_MPL:
        assert png.read_bytes()[:8] == PNG_MAGIC and record["plot"] == str(png)
    else:
        assert not png.exists() and record["plot"] is None and INSTALL_HINT in err


def test_io_json_sweep_plot_and_saved_file(tmp_path, capsys):
    results, png = tmp_path / "results", tmp_path / "io.png"
    assert main(io_argv(tmp_path, "--json", "--results-dir", str(results), "--plot", str(png))) == 0
    out, err = capsys.readouterr()
    record = parse_single_json(out)
    check_record(record, "io")
    assert "bench io:" in err and "bench io sweep:" in err
    assert [r["engine"] for r in record["rows"]] == ["infinity swapper", "raw direct I/O probe",
                                                     "raw, reads and writes at once"]
    mixed = record["rows"][-1]  # [Note: the mixed disk roofline]
    assert mixed["read_GBps"] > 0 and mixed["write_GBps"] > 0
    assert record["mixed_GBps"] == {"read": mixed["read_GBps"], "write": mixed["write_GBps"]}
    grid = {(r["block_size_bytes"], r["queue_depth"]) for r in record["sweep"]}
    assert grid == {(b, q) for b in bench_io.SWEEP_BLOCK_BYTES for q in bench_io.SWEEP_QUEUE_DEPTHS}
    assert all(r["write_GBps"] > 0 and r["read_GBps"] > 0 for r in record["sweep"])
    _check_plot(record, png, err)
    assert len(list(results.glob("io-*.json"))) == 1


def test_step_json_timeline_plot(tmp_path, capsys):
    results, png = tmp_path / "results", tmp_path / "step.png"
    assert main(step_argv(tmp_path, "--json", "--results-dir", str(results), "--plot", str(png))) == 0
    out, err = capsys.readouterr()
    record = parse_single_json(out)
    check_record(record, "step")
    assert "bench step:" in err
    (row,), (raw,) = record["rows"], record["raw"]
    assert row["mode"] == "plain" and row["x_plain"] == 1.0
    assert len(raw["step_times_s"]) == 2
    assert row["step_s"] == pytest.approx(statistics.median(raw["step_times_s"]))
    _check_plot(record, png, err)
    assert len(list(results.glob("step-*.json"))) == 1


def test_every_plot_without_matplotlib_returns_the_hint(tmp_path, no_matplotlib):
    io_rows = [{"block_size_bytes": 2**20, "queue_depth": 2, "write_GBps": 1.0, "read_GBps": 1.0}]
    adam_rows = [{"variant": bench_adam.PROBE_VARIANT, "Gupdates/s": 1.0, "GB/s": 8.0}]
    steps = [{"mode": "plain", "step_times_s": [0.1, 0.1], "stall_fraction": 0.0}]
    outcomes = [bench_io._plot_sweep(io_rows, str(tmp_path / "a.png")),
                bench_adam._plot(adam_rows, str(tmp_path / "b.png"), title="t"),
                bench_step._plot(steps, str(tmp_path / "c.png"))]
    for written, message in outcomes:
        assert not written and INSTALL_HINT in message and "\n" not in message
    assert list(tmp_path.iterdir()) == []


def test_quick_args_are_small_and_parse():
    import argparse

    sizes = {}
    for module in (bench_io, bench_adam, bench_step):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        sizes[module.__name__] = parser.parse_args(list(module.QUICK_ARGS))
    assert sizes["infinity.bench.io"].size_bytes == 256 * 2**20
    assert sizes["infinity.bench.adam"].numel == 2**22
    quick_step = sizes["infinity.bench.step"]
    assert (quick_step.model, quick_step.steps, quick_step.modes) == ("tiny", 3, "plain,stage3")
    assert all(a.no_deepspeed for k, a in sizes.items() if not k.endswith("step"))


def test_all_quick_json_forwards_shared_options(tmp_path, monkeypatch, capsys):
    # the real benches, each shrunk further than --quick so this stays a few seconds
    monkeypatch.setattr(bench_io, "QUICK_ARGS", tuple(io_argv(tmp_path)[2:]))
    monkeypatch.setattr(bench_adam, "QUICK_ARGS", tuple(adam_argv()[2:]))
    monkeypatch.setattr(bench_step, "QUICK_ARGS", tuple(step_argv(tmp_path)[2:]))
    results = tmp_path / "results"
    assert main(["bench", "all", "--quick", "--json", "--results-dir", str(results)]) == 0
    out, err = capsys.readouterr()
    doc = parse_single_json(out)
    assert doc["benchmark"] == "all" and doc["returncode"] == 0
    assert set(doc["results"]) == {"io", "adam", "step"}
    for name, record in doc["results"].items():
        check_record(record, name)
        assert len(list(results.glob(f"{name}-*.json"))) == 1
    assert doc["results"]["adam"]["params"]["numel"] == 4096  # QUICK_ARGS reached the bench
    assert "bench adam:" in err


def _fake_bench(name: str, seen: list, fail: bool = False) -> types.ModuleType:
    module = types.ModuleType(name)
    module.QUICK_ARGS = ("--size", "1")

    def add_arguments(parser):
        parser.add_argument("--size", type=int, default=100)
        parser.add_argument("--json", action="store_true")
        parser.add_argument("--results-dir", default="unused-default")
        parser.add_argument("--no-save", action="store_true")

    def run(args):
        seen.append((name, vars(args)))
        if fail:
            raise RuntimeError(f"{name} could not run")
        Report(name=name, title=name, rows=[{"size": args.size}]).emit(
            as_json=args.json, results_dir=args.results_dir, save=not args.no_save)
        return 0

    module.add_arguments, module.run = add_arguments, run
    return module


def test_all_no_save_isolates_a_failing_bench(tmp_path, monkeypatch, capsys):
    seen: list = []
    monkeypatch.setattr("infinity.cli._main.BENCHES",
                        {"broken": (_fake_bench("fake_broken", seen, True), "x"),
                         "ok": (_fake_bench("fake_ok", seen, False), "y")})
    results = tmp_path / "results"
    rc = main(["bench", "all", "--json", "--no-save", "--results-dir", str(results)])
    out, err = capsys.readouterr()
    assert rc == 2  # the worst exit code, and the next bench still ran
    doc = parse_single_json(out)
    assert "could not run" in doc["results"]["broken"]["error"] and "could not run" in err
    assert doc["results"]["ok"]["rows"] == [{"size": 100}]  # defaults without --quick
    assert [args for _, args in seen] == [{"size": 100, "json": True, "results_dir": str(results),
                                           "no_save": True}] * 2
    assert not results.exists()


def test_step_params_modes_ratio_and_same_training(tmp_path, capsys):
    # Issue #5's pair: parameters on NVMe against the same configuration with them in memory.
    argv = step_argv(tmp_path, "--json", "--no-save")
    argv[argv.index("--model") + 1] = "small"  # tiny has no unit large enough to offload
    argv[argv.index("--modes") + 1] = "stage3-mem-params,stage3-nvme-params"
    argv[argv.index("--steps") + 1] = "1"
    assert main(argv) == 0
    record = parse_single_json(capsys.readouterr()[0])
    ref, nvme = record["rows"]
    raw = {r["mode"]: r for r in record["raw"]}
    assert (ref["mode"], nvme["mode"]) == ("stage3-mem-params", "stage3-nvme-params")
    # the same math on the same batches: parameters homed on NVMe train exactly like in memory
    assert nvme["final_loss"] == ref["final_loss"]
    assert ref["x_params_in_memory"] == 1.0
    assert nvme["x_params_in_memory"] == pytest.approx(nvme["step_s"] / ref["step_s"], rel=1e-12)
    assert nvme["compute_s"] == pytest.approx(raw["stage3-mem-params"]["fwd_bwd_s"], rel=1e-12)
    timed = raw["stage3-nvme-params"]["prefetch_timed"]
    # every parameter shard lives in a swap file: the bytes of the offloaded (non-persistent)
    # units in the compute dtype (the default: bf16 where the device computes it, else fp32)
    item = {"bf16": 2, "fp32": 4}[record["params"]["dtype"]]
    assert 0 < timed["param_nvme_bytes"] <= item * raw["stage3-nvme-params"]["num_params"]
    assert nvme["param_read_s"] == pytest.approx(timed["param_nvme_bytes"] / timed["read_bytes_per_s"])
    assert nvme["read_lt_compute"] == (nvme["param_read_s"] < nvme["compute_s"])
    assert not (tmp_path / "step").exists() or not any((tmp_path / "step").iterdir())


ROOFLINE_COLUMNS = ("nvme_read_mib_per_step", "nvme_write_mib_per_step", "disk_s", "cpu_s",
                    "roofline_s", "bound", "x_roofline", "io_threads_cpu_s")


def test_step_roofline_columns_tie_to_the_recorded_numbers(tmp_path, capsys):
    # Issue #16: every mode against max(CPU time, disk time), the disk probed on --dir in this run.
    argv = step_argv(tmp_path, "--json", "--no-save")
    argv[argv.index("--modes") + 1] = "plain,stage3-cpu,stage3-nvme"
    argv[argv.index("--warmup") + 1] = "1"
    assert main(argv) == 0
    record = parse_single_json(capsys.readouterr()[0])
    rows = {r["mode"]: r for r in record["rows"]}
    raw = {r["mode"]: r for r in record["raw"]}
    disk = record["disk"]
    assert disk["read_bytes_per_s"] > 0 and disk["write_bytes_per_s"] > 0  # a mode moved bytes
    assert any("x_roofline" in note for note in record["notes"])
    plain = rows["plain"]
    for mode, row in rows.items():
        assert set(ROOFLINE_COLUMNS) <= row.keys(), mode
        moved = raw[mode]["nvme_per_step"]
        assert row["nvme_read_mib_per_step"] == moved["read_bytes"] / 2**20
        assert row["nvme_write_mib_per_step"] == moved["write_bytes"] / 2**20
        serial = (moved["read_bytes"] / disk["read_bytes_per_s"]
                  + moved["write_bytes"] / disk["write_bytes_per_s"])
        # [Note: the mixed disk roofline]: both directions at once where that is sooner
        assert disk["mixed_read_bytes_per_s"] > 0 and disk["mixed_write_bytes_per_s"] > 0
        from infinity.bench.roofline import DiskBandwidth

        assert row["disk_s"] == pytest.approx(DiskBandwidth(
            read_bytes_per_s=disk["read_bytes_per_s"], write_bytes_per_s=disk["write_bytes_per_s"],
            direct=True, mixed_read_bytes_per_s=disk["mixed_read_bytes_per_s"],
            mixed_write_bytes_per_s=disk["mixed_write_bytes_per_s"]).seconds(
                moved["read_bytes"], moved["write_bytes"]))
        assert row["disk_s"] <= serial * (1 + 1e-12)
        assert row["cpu_s"] == plain["step_s"]  # plain PyTorch's step: the model in memory
        assert row["roofline_s"] == max(row["cpu_s"], row["disk_s"])
        assert row["bound"] == ("disk" if row["disk_s"] >= row["cpu_s"] else "cpu")
        assert row["x_roofline"] == pytest.approx(row["step_s"] / row["roofline_s"], rel=1e-12)
        assert row["io_threads_cpu_s"] == pytest.approx(
            statistics.median(raw[mode]["io_threads_cpu_times_s"]))
        assert row["io_threads_cpu_s"] >= 0.0
    for mode in ("plain", "stage3-cpu"):  # nothing on NVMe: the ratio is against CPU time alone
        assert rows[mode]["disk_s"] == 0.0 and rows[mode]["bound"] == "cpu"
    assert plain["x_roofline"] == 1.0 and plain["io_threads_cpu_s"] == 0.0
    nvme = rows["stage3-nvme"]
    assert nvme["nvme_write_mib_per_step"] > 0 and nvme["disk_s"] > 0  # the step writes its state
    assert "infinity-io" in raw["stage3-nvme"]["io_threads_cpu_s_by_group"]
    # [Note: the staging bound]: plain's phases are its step, split; the NVMe optimizer's bytes
    # are the step's (the tiny model's parameters stay in the device tier); its room is the host
    # budget less the gradient accumulators and host-resident sub-groups homed there.
    phases = raw["plain"]["phase_s"]
    assert 0 < sum(phases.values()) <= plain["step_s"] * 1.5
    staging, stats = raw["stage3-nvme"]["staging"], raw["stage3-nvme"]["stats"]
    assert staging["window_read_bytes"] + staging["window_write_bytes"] > 0
    assert staging["window_write_bytes"] <= raw["stage3-nvme"]["nvme_per_step"]["write_bytes"]
    homed = stats["store"]["host_homed_bytes"]
    assert homed >= stats["optimizer_host_resident_bytes"]
    assert staging["staging_room_bytes"] == stats["store"]["host_budget_bytes"] - homed
    for mode in ("plain", "stage3-cpu"):
        assert "x_staging_bound" not in rows[mode]  # no optimizer traffic on NVMe
    if staging["window_read_bytes"]:
        assert nvme["roofline_s"] <= nvme["staging_bound_s"]
        assert nvme["x_staging_bound"] == pytest.approx(nvme["step_s"] / nvme["staging_bound_s"])
    # [Note: disk activity]: the seconds of each phase the disk had reads, writes, both in flight
    busy, phases = raw["stage3-nvme"]["phase_disk_busy_s"], raw["stage3-nvme"]["phase_s"]
    assert set(busy) == set(phases) == {"forward", "backward", "optimizer"}
    for phase, b in busy.items():
        assert set(b) == {"read_busy_s", "write_busy_s", "both_busy_s"}
        assert 0 <= b["both_busy_s"] <= min(b["read_busy_s"], b["write_busy_s"]) + 1e-9
    assert sum(b["write_busy_s"] for b in busy.values()) > 0  # the step writes its state back
    assert "phase_disk_busy_s" not in raw["plain"] and "phase_disk_busy_s" not in raw["stage3-cpu"]
    # the probe's file is gone, and the folder with it where the run created it
    assert not (tmp_path / "step").exists() or not any((tmp_path / "step").iterdir())


def test_staging_bound_by_hand():
    """[Note: the staging bound] on figures worked out by hand: 1 GB read and written by the
    optimizer per step at 1 GB/s each way, 0.25 GB of host room: 0.75 s + 0.75 s of disk inside
    the window, which outlasts forward + optimizer (0.5 + 0.2): 1.0 (backward) + 1.5 = 2.5 s. With
    room for everything the window's disk time is 0 and the bound is the roofline; on a disk
    that moves both directions at once the window's disk time is the mixed one."""
    from infinity.bench.roofline import DiskBandwidth, staging_bound

    disk = DiskBandwidth(read_bytes_per_s=1e9, write_bytes_per_s=1e9, direct=True)
    line = staging_bound(forward_s=0.5, backward_s=1.0, optimizer_s=0.2, disk=disk,
                         window_read_bytes=1e9, window_write_bytes=1e9,
                         staging_room_bytes=0.25e9, roofline_s=2.0, step_s=3.0)
    assert line["window_disk_s"] == pytest.approx(1.5)
    assert line["staging_bound_s"] == pytest.approx(2.5)
    assert line["x_staging_bound"] == pytest.approx(1.2)
    roomy = staging_bound(forward_s=0.5, backward_s=1.0, optimizer_s=0.2, disk=disk,
                          window_read_bytes=1e9, window_write_bytes=1e9,
                          staging_room_bytes=2e9, roofline_s=2.0)
    assert roomy["window_disk_s"] == 0.0 and roomy["staging_bound_s"] == 2.0
    # Both at once at 0.75 GB/s each way: the window's 0.75 GB each way in 1.0 s, not 1.5 s
    # ([Note: the mixed disk roofline]): 1.0 + 1.0 = 2.0, the roofline again.
    mixed = DiskBandwidth(read_bytes_per_s=1e9, write_bytes_per_s=1e9, direct=True,
                          mixed_read_bytes_per_s=0.75e9, mixed_write_bytes_per_s=0.75e9)
    both = staging_bound(forward_s=0.5, backward_s=1.0, optimizer_s=0.2, disk=mixed,
                         window_read_bytes=1e9, window_write_bytes=1e9,
                         staging_room_bytes=0.25e9, roofline_s=1.5)
    assert both["window_disk_s"] == pytest.approx(1.0)
    assert both["staging_bound_s"] == pytest.approx(2.0)


def test_bench_step_x_plain_pairs_rounds():
    """With --rounds, x_plain is the median of per-round ratios (each round's slowness hits both
    modes), not the ratio of each mode's own median round."""
    from infinity.bench.step import _paired_x

    per_mode = {"plain": [{"step_s": 2.0}, {"step_s": 4.0}, {"step_s": 3.0}],
                "stage3": [{"step_s": 3.0}, {"step_s": 4.0}, {"step_s": 3.3}],
                "broken": [{"error": "x"}, {"step_s": 1.0}, {"error": "y"}]}
    assert _paired_x(per_mode, "stage3", "plain") == pytest.approx(1.1)  # of 1.5, 1.0, 1.1
    assert _paired_x(per_mode, "broken", "plain") is None  # one pair: no median to take
    assert _paired_x({"stage3": per_mode["stage3"]}, "stage3", "plain") is None


def test_adam_across_processes_reports_the_median_ratio(capsys):
    """--processes N: each figure is measured in N fresh processes; every target ratio is the
    median of the N per-process ratios, which the record keeps."""
    assert main(adam_argv("--json", "--no-save", "--processes", "3")) == 0
    out, _err = capsys.readouterr()
    record = parse_single_json(out)
    per = record["ratios_per_process"]
    assert len(per) == 3 and record["params"]["processes"] == 3
    for key, value in record["ratios"].items():
        assert value == statistics.median(p[key] for p in per), key


def _ds_config(tmp_path, **extra) -> str:
    """A plain DeepSpeed ZeRO-3 file as users bring it (no unit classes), with the
    hyperparameters of the bench's plain PyTorch reference so that both train alike."""
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999],
                                                        "eps": 1e-8, "weight_decay": 0.01}},
              **extra}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_step_ds_config_beside_plain(tmp_path, capsys):
    """``--ds-config``: the user's file beside plain PyTorch, its micro-batch size, precision
    and accumulation driving both; both train the same model on the same batches."""
    path = _ds_config(tmp_path)
    argv = ["bench", "step", "--model", "tiny", "--seq-len", "32", "--steps", "2", "--warmup", "0",
            "--ds-config", path, "--json", "--no-save", "--dir", str(tmp_path / "step")]
    assert main(argv) == 0
    record = parse_single_json(capsys.readouterr()[0])
    plain, user = record["rows"]
    assert (plain["mode"], user["mode"]) == ("plain", bench_step.USER_MODE)
    params = record["params"]
    assert (params["batch_size"], params["gradient_accumulation_steps"], params["dtype"]) == (
        2, 2, "fp32")
    assert params["ds_config"] == path and "ds_config.json" in record["title"]
    assert user["x_plain"] == pytest.approx(user["step_s"] / plain["step_s"], rel=1e-12)
    raw = {r["mode"]: r for r in record["raw"]}
    assert raw[bench_step.USER_MODE]["stats"]["global_steps"] == 2  # 4 micro-batches, 2 steps
    # the same fp32 training: the last micro-batch's loss after one optimizer step agrees
    assert user["final_loss"] == pytest.approx(plain["final_loss"], rel=1e-4)


@pytest.mark.parametrize("extra_argv, message", [
    (["--dtype", "bf16"], "--dtype bf16 contradicts"),
    (["--modes", "plain,nonsense"], "unknown mode 'nonsense'"),
])
def test_step_ds_config_bad_options_fail_before_any_worker(tmp_path, capsys, extra_argv, message):
    argv = ["bench", "step", "--ds-config", _ds_config(tmp_path), "--no-save", *extra_argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_step_user_mode_needs_a_config(capsys):
    assert main(["bench", "step", "--modes", "plain,user-config", "--no-save"]) == 2
    assert "needs --ds-config" in capsys.readouterr().err


def test_step_bad_ds_config_names_the_key(tmp_path, capsys):
    path = _ds_config(tmp_path, zero_optimization={"stage": 3, "stage3_prefetch_bukcet_size": 1})
    assert main(["bench", "step", "--ds-config", path, "--no-save"]) == 2
    assert "stage3_prefetch_bukcet_size" in capsys.readouterr().err


HF_BLOCKS = {"hf-llama-tiny": "model.layers", "hf-gpt2-tiny": "transformer.h"}
"""Where each tiny Hugging Face preset keeps its 2 decoder layers."""


@pytest.mark.parametrize("model", sorted(HF_BLOCKS))
def test_step_hf_model_user_config_beside_native(tmp_path, capsys, model):
    """``--model hf-*``: a Hugging Face model, a plain DeepSpeed file (no unit classes) and the
    tuned native config (the decoder layer class as units) train what plain PyTorch trains, and
    the file's default units are the native config's: one unit per decoder layer."""
    pytest.importorskip("transformers")
    argv = ["bench", "step", "--model", model, "--seq-len", "32", "--steps", "2", "--warmup", "0",
            "--ds-config", _ds_config(tmp_path), "--modes", "plain,user-config,stage3", "--json",
            "--no-save", "--dir", str(tmp_path / "step")]
    assert main(argv) == 0
    record = parse_single_json(capsys.readouterr()[0])
    assert model in record["title"] and "GPT" not in record["title"]
    rows = {r["mode"]: r for r in record["rows"]}
    assert list(rows) == ["plain", bench_step.USER_MODE, bench_step.NATIVE_MODE]
    for mode in (bench_step.USER_MODE, bench_step.NATIVE_MODE):  # after one optimizer step
        assert rows[mode]["final_loss"] == pytest.approx(rows["plain"]["final_loss"], rel=1e-4)
    user, native = rows[bench_step.USER_MODE], rows[bench_step.NATIVE_MODE]
    assert user["x_native"] == pytest.approx(user["step_s"] / native["step_s"], rel=1e-12)
    units = {r["mode"]: r["stats"]["unit_names"] for r in record["raw"] if r["stats"]}
    assert units[bench_step.USER_MODE] == units[bench_step.NATIVE_MODE]
    blocks = HF_BLOCKS[model]
    assert [n for n in units[bench_step.USER_MODE] if n.startswith(blocks)] == [
        f"{blocks}.0", f"{blocks}.1"]


@pytest.mark.parametrize("extra_argv, message", [
    (["--model", "hf-bert"], "unknown model 'hf-bert'"),
    (["--model", "hf-gpt2-tiny", "--seq-len", "65"], "exceeds --model hf-gpt2-tiny's 64"),
    (["--model", "hf-llama-tiny", "--seq-len", "32", "--modes", "plain,ds-stage3"],
     "GPT presets only"),
])
def test_step_bad_model_fails_before_any_worker(capsys, extra_argv, message):
    assert main(["bench", "step", "--no-save", *extra_argv]) == 2
    assert message in capsys.readouterr().err


def test_step_hf_model_default_modes_leave_out_deepspeed():
    """The DeepSpeed reference builds GPT presets only: an HF model's default modes skip it."""
    args = types.SimpleNamespace(model="hf-gpt2-tiny", seq_len=32, modes=None, ds_config=None,
                                 dtype=None, batch_size=None)
    modes = bench_step.resolve_modes(args)
    assert "plain" in modes and bench_step.NATIVE_MODE in modes
    assert not set(modes) & set(bench_step.DS_MODES)


def test_step_over_a_modeled_link_bounds_the_step_with_what_cannot_hide(tmp_path, capsys):
    """``bench step --world-size 2 --link-gbps auto`` end to end ([Note: the schedule bound],
    [Note: what cannot hide] in infinity/bench/overlap.py): the small GPT's root (the tied
    embedding) is gathered first and reduced last, so the linked run reports both edges, and the
    bound holds the forward to at least that gather plus its compute and the backward to its
    compute plus those reductions."""
    argv = step_argv(tmp_path, "--json", "--no-save", "--world-size", "2", "--link-gbps", "auto")
    argv[argv.index("--modes") + 1] = "stage3"
    argv[argv.index("--warmup") + 1] = "1"
    argv[argv.index("--model") + 1] = "small"  # tiny's units are all persistent: no gathers
    assert main(argv) == 0
    row = parse_single_json(capsys.readouterr()[0])["rows"][0]
    assert row["mode"] == "stage3" and row["step_s"] > 0 and row["link_s"] > 0
    edges, phases = row["comm_link_edges_s"], row["phase_s_free"]
    assert edges["head_s"] > 0 and edges["tail_s"] > 0
    assert edges["head_s"] + edges["tail_s"] <= row["comm_link_s"] * (1 + 1e-9)
    assert row["schedule_bound_s"] >= (phases["forward"] + edges["head_s"]
                                       + phases["backward"] + edges["tail_s"]) * (1 - 1e-12)
    assert row["copy_link_edges_s"] is None  # no host<->device link in this mode


def test_step_with_activations_on_nvme_counts_their_bytes_and_trains_like_plain(tmp_path, capsys):
    """``--activations nvme``: plain checkpoints the same blocks (torch.utils.checkpoint) and the
    NVMe mode puts their inputs on NVMe (the small preset: 4 blocks, inputs of 2 x 128 x 256 in
    the compute dtype, 128 KiB each in bf16): its rows carry the activations' NVMe bytes, inside the step's, and its loss is
    plain's; the least traffic counts them once each way."""
    argv = step_argv(tmp_path, "--json", "--no-save", "--activations", "nvme")
    argv[argv.index("--modes") + 1] = "plain,stage3-nvme"
    argv[argv.index("--model") + 1] = "small"
    argv[argv.index("--seq-len") + 1] = "128"
    assert main(argv) == 0
    record = parse_single_json(capsys.readouterr()[0])
    rows = {r["mode"]: r for r in record["rows"]}
    raw = {r["mode"]: r for r in record["raw"]}
    item = {"bf16": 2, "fp32": 4}[record["params"]["dtype"]]  # the default dtype's bytes
    nvme, inputs = rows["stage3-nvme"], 4 * 2 * 128 * 256 * item
    saved = raw["stage3-nvme"]["stats"]["activations"]
    assert saved["NVME"]["saved"] == 2 * inputs  # two steps, every block's input
    assert 0 < nvme["act_nvme_write_mib_per_step"] * 2**20 <= inputs
    assert nvme["act_nvme_write_mib_per_step"] <= nvme["nvme_write_mib_per_step"]
    moved = raw["stage3-nvme"]["nvme_per_step"]
    assert moved["minimum_write_bytes"] == raw["stage3-nvme"]["stats"]["bytes"]["NVME"][
        "current"] + inputs
    assert nvme["final_loss"] == pytest.approx(rows["plain"]["final_loss"], rel=1e-2)
