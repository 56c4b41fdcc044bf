"""A/B of ``infinity bench step`` between two checkouts of this repository, interleaved.

Reproduce (the refactor of issue #13 against its parent)::

    git worktree add /tmp/before 8325e71 && git worktree add /tmp/after HEAD
    .venv/bin/python benchmarks/ab_step.py /tmp/before /tmp/after --rounds 3 --dtype fp32 \\
        --host-budget-fraction 0.8

Each round runs every mode once from each checkout, each run in a fresh process (the bench's own
``infinity.bench._step_worker``, imported from that checkout), the order of the two checkouts
alternating from mode to mode and round to round, so that drift of the machine falls on both
alike. Reports per mode the median step time of each checkout, each checkout's x_plain (the median
of the per-round ratios to its own plain run) and the median of the paired B/A step-time ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def main() -> int:
    parser = argparse.ArgumentParser(prog="ab_step", description=__doc__.splitlines()[0])
    parser.add_argument("a", help="checkout A (the reference)")
    parser.add_argument("b", help="checkout B")
    parser.add_argument("--modes", default="plain,stage3,stage3-cpu,stage3-nvme")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="135m")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--host-budget-fraction", type=float, default=0.5)
    parser.add_argument("--json", metavar="PATH", help="also write the raw step times here")
    args = parser.parse_args()
    checkouts = {"A": os.path.abspath(args.a), "B": os.path.abspath(args.b)}
    modes = args.modes.split(",")
    times: dict[str, dict[str, list[float]]] = {v: {m: [] for m in modes} for v in checkouts}
    for r in range(args.rounds):
        for i, mode in enumerate(modes):
            order = ["A", "B"] if (r + i) % 2 == 0 else ["B", "A"]
            for v in order:
                spec = {"mode": mode, "model": args.model, "batch_size": args.batch_size,
                        "seq_len": args.seq_len, "dtype": args.dtype, "steps": args.steps,
                        "warmup": args.warmup, "dir": f"./infinity-data/ab-{v}",
                        "host_budget_fraction": args.host_budget_fraction}
                proc = subprocess.run([sys.executable, "-m", "infinity.bench._step_worker",
                                       json.dumps(spec)], capture_output=True, text=True,
                                      cwd=checkouts[v], env=dict(os.environ,
                                                                 PYTHONPATH=checkouts[v]))
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
                if proc.returncode or not lines:
                    print(f"round {r} {mode} {v}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
                    return 1
                step_s = json.loads(lines[-1])["step_s"]
                times[v][mode].append(step_s)
                print(f"round {r} {mode:12s} {v}: {step_s:.3f} s", file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "checkouts": checkouts, "step_s": times}, f, indent=1)
    print("mode          A step_s  B step_s  A x_plain  B x_plain  B/A (paired)")
    for mode in modes:
        a, b = times["A"][mode], times["B"][mode]
        row = [statistics.median(a), statistics.median(b)]
        if "plain" in times["A"]:
            row += [statistics.median(x / p for x, p in zip(t, times[v]["plain"]))
                    for v, t in (("A", a), ("B", b))]
        else:
            row += [float("nan")] * 2
        row.append(statistics.median(y / x for x, y in zip(a, b)))
        print(f"{mode:12s} " + "  ".join(f"{x:8.3f}" for x in row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
