"""``infinity bench step``: training-step time, stall fraction, hit rate and peak RSS per offload mode.

Reproduce: ``infinity bench step --model 135m --batch-size 4 --seq-len 256 --dtype bf16``

Every mode runs in its own fresh process (peak RSS is per process), one after another, on the same
GPT model and synthetic tokens: plain PyTorch (the reference every ratio is taken against), ours at
stage 3 without offload, with CPU offload, with parameters and optimizer on NVMe, and DeepSpeed
ZeRO-3 with the same settings when ``--deepspeed-python`` points at an interpreter with DeepSpeed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from infinity.bench.plot import save_plot
from infinity.bench.progress import Progress
from infinity.bench.report import Report, add_common_arguments

OURS_MODES = ("stage3", "stage3-cpu", "stage3-nvme")
DS_MODES = ("ds-stage3", "ds-stage3-cpu", "ds-stage3-nvme")
DEFAULT_DS_PYTHON = "/root/dsvenv/bin/python"
# `infinity bench all --quick`: the tiny preset, plain PyTorch against ours, a few steps.
QUICK_ARGS = ("--model", "tiny", "--seq-len", "64", "--steps", "3", "--warmup", "1",
              "--modes", "plain,stage3")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="small", help="GPT preset (tiny, small, medium, 135m, "
                        "gpt2-124m, 350m, 1b); default small")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per mode (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--modes", default="plain," + ",".join(OURS_MODES) + "," + ",".join(DS_MODES),
                        help="comma-separated subset of plain, " + ", ".join(OURS_MODES + DS_MODES))
    parser.add_argument("--dir", default="./infinity-data/bench-step", help="NVMe swap directory")
    parser.add_argument("--host-budget-fraction", type=float, default=0.5,
                        help="NVMe modes: host budget as a fraction of the model's training state")
    parser.add_argument("--deepspeed-python", default=DEFAULT_DS_PYTHON,
                        help="interpreter with DeepSpeed for the ds-* references (skipped if missing)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="draw a per-step timeline (compute, I/O, stall) per mode "
                        "(needs pip install 'infinity[plot]')")
    add_common_arguments(parser)


def _worker_args(args: argparse.Namespace) -> dict[str, Any]:
    return {"model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "dtype": args.dtype, "steps": args.steps, "warmup": args.warmup, "dir": args.dir,
            "host_budget_fraction": args.host_budget_fraction}


def _run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    spec = json.dumps({"mode": mode, **_worker_args(args)})
    env = dict(os.environ)
    if mode.startswith("ds-"):
        if not os.path.exists(args.deepspeed_python):
            return {"mode": mode, "error": f"DeepSpeed interpreter {args.deepspeed_python} not found"}
        script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "ds_step_worker.py")
        cmd = [args.deepspeed_python, os.path.abspath(script), spec]
        env["DS_ACCELERATOR"] = "cpu"
    else:
        cmd = [sys.executable, "-m", "infinity.bench._step_worker", spec]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr or proc.stdout)[-2000:]
    return {"mode": mode, "error": f"exit {proc.returncode}: {tail.strip().splitlines()[-1] if tail.strip() else ''}",
            "stderr": tail}


def run(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    results = []
    bar = Progress(len(modes), desc="bench step")
    for mode in modes:
        bar.update(0, running=mode)  # modes take minutes: say which one is running
        results.append(_run_mode(mode, args))
        bar.update(1, done=mode, step_s=results[-1].get("step_s", float("nan")))
    bar.close()
    plain = next((r for r in results if r["mode"] == "plain" and "error" not in r), None)
    rows = []
    for r in results:
        row: dict[str, Any] = {"mode": r["mode"]}
        if "error" in r:
            row["note"] = r["error"][:120]
            rows.append(row)
            continue
        row["step_s"] = r["step_s"]
        row["x_plain"] = r["step_s"] / plain["step_s"] if plain else None
        row["peak_rss_mib"] = r["peak_rss_bytes"] / 2**20
        row["rss_x_plain"] = r["peak_rss_bytes"] / plain["peak_rss_bytes"] if plain else None
        row["stall_frac"] = r.get("stall_fraction")
        row["hit_rate"] = r.get("hit_rate")
        row["moved_mib"] = r.get("bytes_moved", 0) / 2**20
        row["final_loss"] = r.get("final_loss")
        rows.append(row)
    report = Report(name="step", title=f"infinity bench step: GPT {args.model}, {args.dtype}, "
                    f"batch {args.batch_size} x {args.seq_len}, median of {args.steps} steps",
                    rows=rows, params=_worker_args(args), extra={"raw": results},
                    notes=["x_plain: step time / plain PyTorch step time (same run)",
                           "rss_x_plain: peak RSS / plain PyTorch's peak RSS"])
    if args.plot:
        written, message = _plot(results, args.plot)
        print(message, file=sys.stderr)  # stderr: keeps --json stdout one document
        report.extra["plot"] = args.plot if written else None
    report.emit(as_json=args.json, results_dir=args.results_dir, save=not args.no_save)
    return 0 if all("error" not in r for r in results if not r["mode"].startswith("ds-")) else 1


def _plot(results: list[dict[str, Any]], path: str) -> tuple[bool, str]:
    """One row per mode, one segment per step: compute (with overlapped I/O) then stall.

    The worker reports the stall as a fraction of the whole run, so each step's stall segment is
    that fraction of the step: the per-step split is an even spread, the total is measured.
    """
    ok = [r for r in results if "error" not in r and r.get("step_times_s")]
    if not ok:
        return False, f"--plot {path}: no mode finished, nothing to draw"

    def draw(plt):
        fig, ax = plt.subplots(figsize=(9, 0.6 * len(ok) + 1.8))
        for i, r in enumerate(ok):
            left = 0.0
            stall_frac = r.get("stall_fraction") or 0.0
            for k, t in enumerate(r["step_times_s"]):
                stall = t * stall_frac
                ax.barh(i, t - stall, left=left, color="tab:blue", edgecolor="white",
                        label="compute + overlapped I/O" if i == k == 0 else None)
                ax.barh(i, stall, left=left + t - stall, color="tab:red",
                        label="stall (waiting for I/O)" if i == k == 0 else None)
                left += t
            moved = (r.get("bytes_moved") or 0) / 2**20
            if moved:
                ax.text(left, i, f"  {moved:.0f} MiB moved", va="center", fontsize=8)
        ax.set_yticks(range(len(ok)), [r["mode"] for r in ok])
        ax.invert_yaxis()
        ax.set_xlabel("seconds since the first timed step")
        ax.set_title("per-step timeline (one segment per step)")
        ax.legend(loc="lower right", fontsize=8)
        return fig

    return save_plot(path, draw, what="step timeline")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
