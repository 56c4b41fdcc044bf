"""One mode of ``infinity bench step`` in a fresh process; prints one JSON line (see step.py)."""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import sys
import time
from typing import Any

import torch

from infinity.models.gpt import GPT, PRESETS, synthetic_batch


def _peak_rss_bytes() -> int:
    """This process's own high-water mark (VmHWM). Not ru_maxrss: Linux carries the parent's
    high-water mark over into a child at fork, so every mode would read at least the parent's."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _plain(model: GPT, spec: dict[str, Any]):
    """Plain PyTorch mixed precision as a user writes it: low-precision model, fp32 masters, fused AdamW."""
    dtype = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32
    params = [p for p in model.parameters()]
    if dtype != torch.float32:
        masters = [p.detach().float() for p in params]
        model.to(dtype)
    else:
        masters = params
    opt = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.01, fused=True)

    def step(x, y) -> float:
        loss = model(x, y)
        loss.backward()
        if masters is not params:
            for m, p in zip(masters, params):
                m.grad = p.grad.float()
                p.grad = None
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if masters is not params:
            with torch.no_grad():
                for m, p in zip(masters, params):
                    p.copy_(m)
        return loss.item()

    return step, lambda: {}, lambda: None


def _cpu_device_budget(model: GPT, spec: dict[str, Any]) -> int:
    """The host-budget fraction of the parameter bytes, but at least what a step needs on the
    device: the largest unit gathered and two shards in flight (DESIGN: units are Blocks here)."""
    param_bytes = 2 if spec["dtype"] == "bf16" else 4
    blocks = [m for m in model.modules() if type(m).__name__ == "Block"]
    rest = sum(p.numel() for p in model.parameters()) - sum(p.numel() for b in blocks for p in b.parameters())
    largest = max([rest] + [sum(p.numel() for p in b.parameters()) for b in blocks]) * param_bytes
    total = sum(p.numel() for p in model.parameters()) * param_bytes
    return max(int(total * spec["host_budget_fraction"]), 3 * largest + 2 ** 20)


def _ours(model: GPT, spec: dict[str, Any]):
    import infinity

    mode = spec["mode"]
    config: dict[str, Any] = {
        "zero": {"stage": 3, "unit_class_names": ["Block"]},
        "precision": {"dtype": spec["dtype"]},
        "optimizer": {"type": "adamw", "lr": 1e-4, "weight_decay": 0.01},
        "gradient_clipping": 1.0,
    }
    if mode == "stage3-cpu":
        config["offload_param"] = {"device": "cpu"}
        config["offload_optimizer"] = {"device": "cpu"}
    elif mode == "stage3-nvme":
        path = os.path.abspath(spec["dir"])
        os.makedirs(path, exist_ok=True)
        config["offload_param"] = {"device": "nvme", "nvme_path": path}
        config["offload_optimizer"] = {"device": "nvme", "nvme_path": path}
        numel = sum(p.numel() for p in model.parameters())
        state_bytes = numel * (2 + 2 + 12 if spec["dtype"] == "bf16" else 16)
        config["memory"] = {"host_budget_bytes": int(state_bytes * spec["host_budget_fraction"])}
        if not torch.cuda.is_available():
            # Without a GPU the DEVICE tier is host RAM too: left 'auto' it caches every parameter
            # shard after the first step and nothing is read from NVMe again. Bound it like the host.
            config["memory"]["device_budget_bytes"] = _cpu_device_budget(model, spec)
    engine = infinity.initialize(model, config)

    def step(x, y) -> float:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.item()

    return step, engine.stats, engine.close


def _timed(after: dict[str, Any], before: dict[str, Any], times: list[float]) -> dict[str, Any]:
    """Prefetch figures over the timed steps only (the first step records the trace: all misses):
    hit rate = hits / unit fetches, stall fraction = seconds waited for parameters / step time."""
    pa, pb = after.get("prefetch") or {}, before.get("prefetch") or {}
    if not pa.get("enabled"):
        return {"hit_rate": None, "stall_fraction": 0.0}
    needs = pa["needs"] - pb["needs"]
    return {"hit_rate": (pa["hits"] - pb["hits"]) / needs if needs else None,
            "stall_fraction": (pa["stall_s_total"] - pb["stall_s_total"]) / max(sum(times), 1e-9),
            "late": pa["late"] - pb["late"], "misses": pa["misses"] - pb["misses"], "needs": needs}


def main() -> None:
    spec = json.loads(sys.argv[1])
    torch.manual_seed(0)
    cfg = PRESETS[spec["model"]]
    model = GPT(cfg)
    runner, stats, close = (_plain if spec["mode"] == "plain" else _ours)(model, spec)
    times, opt_times, loss, warm = [], [], float("nan"), {}
    for i in range(spec["warmup"] + spec["steps"]):
        before = stats() or {}
        if i == spec["warmup"]:
            warm = before
        x, y = synthetic_batch(cfg, spec["batch_size"], spec["seq_len"], seed=i)
        t0 = time.perf_counter()
        loss = runner(x, y)
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
            # The optimizer step's share (NVMe optimizer state is read and written there, which
            # the parameter prefetcher does not hide): step minus it is forward + backward.
            after = stats() or {}
            opt_times.append(after.get("optimizer_step_s", 0.0) - before.get("optimizer_step_s", 0.0))
    s = stats() or {}
    timed = _timed(s, warm, times)
    out = {"mode": spec["mode"], "step_s": statistics.median(times), "step_times_s": times,
           "fwd_bwd_s": statistics.median(t - o for t, o in zip(times, opt_times)),
           "peak_rss_bytes": _peak_rss_bytes(), "final_loss": loss,
           "num_params": sum(p.numel() for p in model.parameters()),
           "stall_fraction": timed["stall_fraction"], "hit_rate": timed["hit_rate"], "prefetch_timed": timed,
           "io_wait_fraction": (s.get("stall_s", 0.0) - warm.get("stall_s", 0.0)) / max(sum(times), 1e-9)
           if s else 0.0,
           "bytes_moved": sum(s.get("bytes_moved", {}).values()) if isinstance(
               s.get("bytes_moved"), dict) else 0,
           "stats": s}
    print(json.dumps(out, default=str), flush=True)
    close()  # prefetches may be in flight: stop the store's threads before the interpreter does
    if spec["mode"] == "stage3-nvme":
        shutil.rmtree(os.path.abspath(spec["dir"]), ignore_errors=True)


if __name__ == "__main__":
    main()
