"""Activations on NVMe (#34): one GPT trained with its checkpointed blocks' inputs on the device,
in the host arena and on NVMe, side by side, parameters and optimizer on NVMe in every run.

Reproduce::

    .venv/bin/python benchmarks/activations_nvme.py --model deep --seq-len 1024 --batch-size 12 \\
        --host-budget 16MiB --rounds 2

Each run is ``infinity train --json`` in a fresh process (its own peak RSS), the modes interleaved
round by round. ``--host-budget`` is raised by ``infinity train`` to the least the states' NVMe
pipeline needs (that is the host budget the NVMe mode runs under); the host mode gets that plus
twice the activations, so that they fit beside the states' copies in flight. Per mode, medians over
the rounds: the step, the step against its roofline (max(compute with the recompute, the disk time
of every NVMe byte, activations included)), the peak RSS, and the activations' NVMe bytes per step
against the least (each saved byte written once and read once).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _train(args: argparse.Namespace, mode: str, host_budget: str) -> dict:
    with tempfile.TemporaryDirectory(dir=args.dir) as swap:
        cmd = [sys.executable, "-m", "infinity", "train", "--json", "--model", args.model,
               "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
               "--steps", str(args.steps), "--activations", mode, "--host-budget", host_budget,
               "--dir", swap]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def _row(summary: dict) -> dict:
    acts = summary["activations"] or {}
    measured = acts.get("measured", {})
    roof = summary.get("roofline", {})
    saved = measured.get("nvme_saved_bytes_per_step", 0)
    moved = measured.get("nvme_written_bytes_per_step", 0) + measured.get(
        "nvme_read_bytes_per_step", 0)
    return {"step_s": summary["median_step_s"], "x_roofline": roof.get("x_roofline"),
            "roofline_s": roof.get("roofline_s"), "bound": roof.get("bound"),
            "cpu_s": roof.get("cpu_s"), "disk_s": roof.get("disk_s"),
            "peak_rss_bytes": summary["peak_rss_bytes"],
            "host_budget_bytes": summary["tiers"]["HOST"]["budget_bytes"],
            "host_peak_bytes": summary["tiers"]["HOST"]["measured_peak_bytes"],
            "activations_stored_bytes": acts.get("ledger", {}).get("stored_bytes"),
            "activations_nvme_saved_bytes_per_step": saved,
            "activations_nvme_moved_bytes_per_step": moved,
            "activations_x_minimum": moved / (2 * saved) if saved else None,
            "activations_host_peak_bytes": measured.get("host_peak_bytes"),
            "nvme_read_bytes_per_step": summary["nvme_per_step"]["read_bytes"],
            "nvme_write_bytes_per_step": summary["nvme_per_step"]["write_bytes"],
            "final_loss": summary["final_loss"]}


def main() -> int:
    parser = argparse.ArgumentParser(prog="activations_nvme", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deep")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--host-budget", default="16MiB",
                        help="the NVMe mode's host budget (raised to the least that works)")
    parser.add_argument("--modes", default="device,host,nvme")
    parser.add_argument("--dir", default=".", help="where the swap directories go")
    args = parser.parse_args()
    modes = args.modes.split(",")
    # The host mode's budget: the NVMe mode's (as raised) plus twice the activations (the arena
    # is shared with the states' copies in flight: a margin of a quarter was too fragmented).
    probe = _train(argparse.Namespace(**{**vars(args), "steps": 1}), "nvme", args.host_budget)
    least = probe["tiers"]["HOST"]["budget_bytes"]
    stored = probe["activations"]["ledger"]["stored_bytes"]
    budgets = {"nvme": str(least), "host": str(least + 2 * stored),
               "device": str(least)}
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            rows[mode].append(_row(_train(args, mode, budgets[mode])))
            print(f"round {r} {mode}: {rows[mode][-1]['step_s']:.2f} s, peak RSS "
                  f"{rows[mode][-1]['peak_rss_bytes'] / 2**20:.0f} MiB", file=sys.stderr)
    medians = {}
    for mode, runs in rows.items():
        medians[mode] = {k: (statistics.median(r[k] for r in runs)
                             if all(isinstance(r[k], (int, float)) for r in runs) else runs[0][k])
                         for k in runs[0]}
    record = {
        "benchmark": "activations-nvme",
        "title": f"GPT {args.model}, {args.batch_size} x {args.seq_len} tokens, bf16, parameters "
                 f"and optimizer on NVMe; activations on the device / in the host arena / on NVMe",
        "environment": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                        "command": " ".join([os.path.relpath(sys.executable)] + sys.argv),
                        "platform": platform.platform(), "cpu_count": os.cpu_count()},
        "params": vars(args), "host_budgets": budgets, "medians": medians, "runs": rows,
        "notes": ["x_roofline: step / max(compute with the recompute, disk time of the step's "
                  "NVMe bytes, activations included, at the probed mixed bandwidth)",
                  "activations_x_minimum: the activations' NVMe bytes written + read per step / "
                  "(2 x the bytes saved to NVMe per step)",
                  "peak_rss_bytes: the train process's peak RSS (ru_maxrss)"]}
    os.makedirs(RESULTS, exist_ok=True)
    name = f"activations-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    with open(os.path.join(RESULTS, name), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(medians, indent=1))
    print(f"wrote benchmarks/results/{name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
