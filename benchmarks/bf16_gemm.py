"""bf16 against fp32 on this CPU: matrix products by layout and size, and the main job's model's
forward and backward ([Note: bf16 where the device computes it] in infinity/_compute_dtype.py).

    .venv/bin/python benchmarks/bf16_gemm.py [--json OUT.json]

Prints GFLOP/s of ``torch.mm`` in the four layouts at 512x512 @ 512x2048, the bf16/fp32 time
ratio of A @ B at growing sizes, the forward+backward seconds of the main job's GPT (the demo
preset, batch 4 x 128) in each dtype, and what ``infinity train --dtype auto`` chooses. Medians
of 3 repetitions after a warm-up, both dtypes side by side in one process.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from infinity._compute_dtype import auto_compute_dtype
from infinity.bench.report import median_time_s
from infinity.models.gpt import GPT, PRESETS, synthetic_batch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _median_s(fn, repeats: int = 3) -> float:
    return median_time_s(fn, repeats=repeats)[0]


def layouts(m: int = 512, k: int = 512, n: int = 2048) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, dtype in DTYPES.items():
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(m, k, generator=g).to(dtype), torch.randn(k, n, generator=g).to(dtype)
        at, bt = a.t().contiguous().t(), b.t().contiguous().t()  # same values, transposed storage
        cases = {"A @ B": (a, b), "A^T @ B": (at, b), "A @ B^T": (a, bt), "A^T @ B^T": (at, bt)}
        out[name] = {case: 2 * m * k * n / _median_s(lambda x=x, y=y: torch.mm(x, y)) / 1e9
                     for case, (x, y) in cases.items()}
    return out


def sizes() -> dict[str, float]:
    out = {}
    for m, k, n in ((128, 256, 256), (256, 256, 256), (512, 256, 256), (512, 512, 512)):
        s = {}
        for name, dtype in DTYPES.items():
            a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
            s[name] = _median_s(lambda: torch.mm(a, b))
        out[f"{m}x{k}x{n}"] = s["bf16"] / s["fp32"]
    return out


def main_job_model() -> dict[str, float]:
    config = PRESETS["demo"]
    x, y = synthetic_batch(config, 4, 128, seed=0)
    out = {}
    for name, dtype in DTYPES.items():
        torch.manual_seed(0)
        model = GPT(config).to(dtype)

        def step():
            model(x, y).backward()
        out[name] = _median_s(step, repeats=1 if name == "bf16" else 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    record = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
              "capability": torch.backends.cpu.get_cpu_capability(),
              "threads": torch.get_num_threads()}
    record["gflops_512x512x2048"] = layouts()
    record["bf16_over_fp32_time_A_at_B"] = sizes()
    record["main_job_forward_backward_s"] = main_job_model()
    record["auto"] = auto_compute_dtype("cpu")
    print(json.dumps(record, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
