"""The same DeepSpeed-style training loop under real DeepSpeed and under ``infinity.deepspeed``
(issue #32): same losses.

    python benchmarks/deepspeed_dropin.py --deepspeed-python /root/dsvenv/bin/python

runs :func:`loop` twice, each in a fresh interpreter: once with ``import deepspeed`` in DeepSpeed's
own venv (``DS_ACCELERATOR=cpu pip install deepspeed`` there; README 'Benchmarks'), once with
``import infinity.deepspeed as deepspeed`` in this one; prints both losses per step and their
largest difference, and writes ``benchmarks/results/deepspeed-dropin-<time>.json``. The loop is
written from DeepSpeed's documented API (its getting-started tutorial's shape), the model is
infinity/models/gpt.py loaded by path (plain PyTorch: DeepSpeed's venv needs nothing of
infinity), fp32, ZeRO stage 3 on one process, the config's defaults otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STEPS, MICRO = 8, 4
CONFIG = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95],
                                                    "eps": 1e-8, "weight_decay": 0.01}},
          "zero_optimization": {"stage": 3}}


def _gpt():
    spec = importlib.util.spec_from_file_location("gpt", os.path.join(ROOT, "infinity", "models",
                                                                     "gpt.py"))
    gpt = importlib.util.module_from_spec(spec)
    sys.modules["gpt"] = gpt  # dataclasses look their module up here
    spec.loader.exec_module(gpt)
    return gpt


def loop(deepspeed) -> list[float]:
    """The tutorial's loop: initialize with model_parameters, forward, backward, step."""
    import torch

    gpt = _gpt()
    torch.manual_seed(0)
    model = gpt.GPT(gpt.PRESETS["tiny"])
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(STEPS):
        x = torch.randint(0, 256, (MICRO, 32), generator=g)
        data.append((x, torch.roll(x, -1, dims=1)))
    model_engine, _optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=CONFIG)
    losses = []
    for x, y in data:
        loss = model_engine(x, y)
        model_engine.backward(loss)
        model_engine.step()
        losses.append(float(loss.item()))
    return losses


def _child(which: str) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29541", "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    if which == "deepspeed":
        import deepspeed
    else:
        sys.path.insert(0, ROOT)
        import infinity.deepspeed as deepspeed
    print(json.dumps({"losses": loop(deepspeed)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed-python", default="/root/dsvenv/bin/python")
    parser.add_argument("--child", choices=["deepspeed", "infinity"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child)
        return
    runs = {}
    for which, python in (("deepspeed", args.deepspeed_python), ("infinity", sys.executable)):
        out = subprocess.run([python, os.path.abspath(__file__), "--child", which],
                             capture_output=True, text=True, timeout=900, cwd=ROOT,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        if out.returncode != 0:
            sys.exit(f"{which} run failed:\n{out.stderr[-3000:]}")
        runs[which] = json.loads(out.stdout.strip().splitlines()[-1])["losses"]
    diff = max(abs(a - b) for a, b in zip(runs["deepspeed"], runs["infinity"]))
    for step, (a, b) in enumerate(zip(runs["deepspeed"], runs["infinity"])):
        print(f"step {step}: deepspeed {a:.6f}  infinity.deepspeed {b:.6f}")
    print(f"largest |difference| = {diff:.2e}")
    record = {"config": CONFIG, "steps": STEPS, **runs, "max_abs_diff": diff,
              "time": time.strftime("%Y%m%d-%H%M%S")}
    path = os.path.join(HERE, "results", f"deepspeed-dropin-{record['time']}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    print(f"saved {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    main()
