"""``infinity bench scale``: model size swept at a fixed host budget, one fresh process per size.

Reproduce: ``infinity bench scale [--quick] [--sizes 1e8,3e8,1e9,3.3e9] [--host-budget 4GiB]
[--dir /local/nvme] [--plot scale.png]``. Each row is ``infinity train --params N`` (the 3b
preset's shape, parameters and optimizer on NVMe, bf16, clipping, batch 1 x 64: the I/O-bound
setting of issue #16) in its own process, so each peak RSS is that size's alone: parameters, state
bytes and state / RAM, peak RSS (from ``infinity.init`` to the last step), init time, median step,
the roofline split and ratio, and NVMe bytes per step against the minimum. The claim it checks:
host memory does not grow with the model, and a step runs at the speed of the slower of compute
and disk. ``--quick`` stops at 1B.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

import psutil

from infinity.bench.plot import save_plot
from infinity.bench.report import Report, add_common_arguments

DEFAULT_SIZES = (1e8, 3e8, 1e9, 3.3e9)
QUICK_LIMIT = 1e9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default=",".join(f"{s:g}" for s in DEFAULT_SIZES),
                        help="parameter counts, comma-separated (default 1e8,3e8,1e9,3.3e9)")
    parser.add_argument("--quick", action="store_true", help="stop at 1e9 parameters")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per size")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                        help="as infinity train's --dtype (auto: bf16 where the device computes "
                        "it, else fp32)")
    parser.add_argument("--host-budget", default="4GiB",
                        help="the fixed host budget of every row: 'auto' or a size (default 4GiB)")
    parser.add_argument("--dir", default="./infinity-data/scale", help="swap directory")
    parser.add_argument("--width", type=int, help="every row at this width (a multiple of 128): "
                        "one unit size, so the rows differ in the number of layers alone")
    parser.add_argument("--plot", metavar="FILE.png", help="RSS and step/roofline against size")
    parser.add_argument("--lora-record", metavar="FILE.json",
                        help="add the 7B LoRA row from a benchmarks/lora_7b.py record ('latest': "
                             "the newest lora7b-*.json under --results-dir); that benchmark runs "
                             "plain peft beside us and takes ~15 minutes, so it is run on its own")
    add_common_arguments(parser)


def _sizes(args: argparse.Namespace) -> list[float]:
    try:
        sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--sizes: expected comma-separated numbers such as 1e8,1e9, got "
                         f"{args.sizes!r}") from None
    if args.quick:
        sizes = [s for s in sizes if s <= QUICK_LIMIT]
    if not sizes:
        raise ValueError(f"--sizes {args.sizes!r} leaves no size to run (--quick stops at 1e9)")
    return sizes


def _one(numel: float, args: argparse.Namespace) -> dict[str, Any]:
    """``infinity train --params numel`` in a fresh process; its JSON summary."""
    cmd = [sys.executable, "-m", "infinity", "train", "--params", f"{numel:g}", "--data",
           "synthetic", "--steps", str(args.steps), "--batch-size", str(args.batch_size),
           "--seq-len", str(args.seq_len), "--dtype", args.dtype, "--host-budget", args.host_budget, "--dir",
           os.path.join(os.path.abspath(args.dir), f"p{numel:g}"), "--json",
           *(["--width", str(args.width)] if args.width else [])]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1:] or ["failed"], "cmd": cmd}
    return json.loads(out.stdout[out.stdout.index("{"):])


def _row(numel: float, s: dict[str, Any], ram: int) -> dict[str, Any]:
    if "error" in s:
        return {"params": f"{numel:.3g}", "error": " ".join(s["error"])}
    r, n = s.get("roofline", {}), s["nvme_per_step"]
    return {"params": f"{s['num_params'] / 1e9:.2f}B",
            "state GB": round(s["full_training_state_bytes"] / 1e9, 1),
            "state/RAM": round(s["full_training_state_bytes"] / ram, 2),
            "peak RSS GB": round(s["peak_rss_bytes"] / 1e9, 2),
            "init s": round(s["init_s"], 1),
            "init x min": round(r.get("init_x", 0.0), 2),
            "step s": round(s["median_step_s"], 2),
            "compute s": round(r.get("cpu_s", 0.0), 2),
            "disk read s": round(r.get("disk_read_s", 0.0), 2),
            "disk write s": round(r.get("disk_write_s", 0.0), 2),
            "stall s": round(s["time"]["stall_s"] / max(1, s["steps"]), 2),
            "x roofline": round(r.get("x_roofline", 0.0), 2),
            "NVMe x min": round(n["x_minimum"], 2),
            "mean step s": round(s["mean_step_s"], 2),
            "x roofline (mean)": round(r.get("mean", {}).get("x_roofline", 0.0), 2),
            "x staging bound (mean)": round(r.get("mean", {}).get("x_staging_bound", 0.0), 2),
            "NVMe x min (mean)": round(n["x_minimum_mean"], 2)}


def _lora_record_path(given: str, results_dir: str | None) -> str:
    if given != "latest":
        return given
    folder = results_dir or os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks",
                                         "results")
    found = sorted(f for f in os.listdir(folder) if f.startswith("lora7b-") and f.endswith(".json"))
    if not found:
        raise ValueError(f"--lora-record latest: no lora7b-*.json in {folder}; run "
                         f"benchmarks/lora_7b.py first or pass a record's path")
    return os.path.join(folder, found[-1])


def lora_row(path: str, ram: int) -> dict[str, Any]:
    """The scale table's 7B LoRA row from a ``benchmarks/lora_7b.py`` record: the frozen bf16 base
    on NVMe, adapters and their optimizer in memory, against plain peft with the model in RAM
    (its ``x plain`` is the ratio the scenario targets); records from before the script probed the
    disk have no roofline column."""
    with open(path) as f:
        rec = json.load(f)
    ours = rec["ours"]
    return {"params": f"7B LoRA ({rec['shape']})",
            "peak RSS GB": round(ours["peak_rss_bytes"] / 1e9, 2),
            "peak RSS / RAM": round(ours["peak_rss_bytes"] / ram, 3),
            "init s": round(ours["setup_s"], 1), "step s": round(rec["median_step_s"]["ours"], 2),
            "plain step s": round(rec["median_step_s"]["plain"], 2),
            "x plain": round(rec["x_plain"], 3),
            "NVMe read GB/step": round(ours["nvme_read_per_step_bytes"] / 1e9, 2),
            **({"x roofline": round(rec["roofline"]["x_roofline"], 2)}
               if "roofline" in rec else {}),
            "record": os.path.basename(path)}


def run(args: argparse.Namespace) -> int:
    sizes = _sizes(args)
    ram = psutil.virtual_memory().total
    summaries = [_one(numel, args) for numel in sizes]
    rows = [_row(numel, s, ram) for numel, s in zip(sizes, summaries)]
    if args.lora_record:
        rows.append(lora_row(_lora_record_path(args.lora_record, args.results_dir), ram))
    # --dtype auto: what the rows trained in ([Note: bf16 where the device computes it] in
    # infinity/_compute_dtype.py)
    dtype = "/".join(sorted({str(s["dtype"]) for s in summaries if "dtype" in s})) or args.dtype
    report = Report(name="scale", title=f"model size at a fixed host budget ({args.host_budget}); "
                    f"batch {args.batch_size} x {args.seq_len}, {dtype}, parameters and optimizer on NVMe",
                    rows=rows, params=vars(args) | {"ram_bytes": ram},
                    notes=["x roofline: median step / max(compute, disk), disk the least time "
                           "of the step's reads and writes one after the other or both at once "
                           "(the mixed disk roofline), bandwidths from a raw direct-I/O probe of "
                           "--dir in the same process",
                           "x staging bound: step / the least step with exact clipping, where "
                           "every update falls between the end of a backward and the end of the "
                           "next forward and the host budget stages only so much of the "
                           "optimizer's traffic outside that window ([Note: the staging bound] "
                           "in infinity/bench/roofline.py)",
                           "init x min: init / (the random values eager construction draws, "
                           "once, at the measured normal_ rate + the NVMe state at the probed "
                           "write bandwidth)",
                           "NVMe x min: bytes moved per step / every NVMe-resident byte once each way",
                           "(mean): over every step with the last one's deferred update "
                           "(engine.finish_step): a deferred update may straddle a step boundary, "
                           "so the median of few steps can hold 1.5 updates or 0.5"],
                    extra={"summaries": summaries})
    report.emit(as_json=args.json, results_dir=args.results_dir, save=not args.no_save)
    if args.plot:
        _, message = save_plot(args.plot, lambda plt: _draw(plt, rows, ram), what="scale plot")
        print(message, file=sys.stderr)
    return 1 if any("error" in r for r in rows) else 0


def _draw(plt, rows: list[dict[str, Any]], ram_bytes: int):
    """Two panels against model size: peak RSS with the issue's bound (25% of RAM), and the
    median step over its roofline and NVMe bytes over their minimum, beside the 1.25x bound."""
    # The sweep's rows: the 7B LoRA row (a record of another benchmark, with a roofline since
    # the script probes the disk) has no model size on this axis.
    ok = [r for r in rows if "error" not in r and "x roofline" in r and "record" not in r]
    x = [float(r["params"].rstrip("B")) for r in ok]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(x, [r["peak RSS GB"] for r in ok], marker="o", label="peak RSS")
    a.axhline(0.25 * ram_bytes / 1e9, color="tab:red", linestyle="--", label="25% of RAM")
    a.set(xscale="log", xlabel="parameters (B)", ylabel="GB", title="host memory", ylim=(0, None))
    a.legend(fontsize=8)
    b.plot(x, [r["x roofline"] for r in ok], marker="o", label="step / roofline")
    b.plot(x, [r["NVMe x min"] for r in ok], marker="s", label="NVMe bytes / minimum")
    b.axhline(1.0, color="grey", linestyle=":")
    b.axhline(1.25, color="tab:red", linestyle="--", label="1.25x")
    b.set(xscale="log", xlabel="parameters (B)", ylabel="ratio", title="speed and traffic",
          ylim=(0, None))
    b.legend(fontsize=8)
    for ax in (a, b):  # sizes as plain numbers (0.3, 1, 3.3), not powers of ten
        ax.set_xticks(x, [f"{v:g}" for v in x])
        ax.minorticks_off()
    return fig
