"""One rank of ``infinity bench comm``'s measured part: a tiny GPT trained a few steps under one
mode's config on gloo, reporting the collective bytes per kind per step (``engine.stats()``) and
the step time.

Run by :mod:`infinity.bench.comm` as ``python -m infinity.bench._comm_worker SPEC.json RANK``;
rank 0 writes ``result.json`` beside the spec. A config the engine does not know yet (its fields
come with other parts of issue #17) raises ``ValueError`` on every rank alike, so every rank
reports the mode "not available" and exits cleanly, never leaving a peer in a collective.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
from typing import Any

from infinity._process_exit import exit_after_distributed


def mode_config(mode: str, world_size: int, dtype: str) -> dict[str, Any]:
    """The engine config of a mode: flat ZeRO-3, HSDP (2 replicas), hpZ (partition 2), qwZ + qgZ."""
    zero: dict[str, Any] = {"stage": 3, "unit_class_names": ["Block"],
                            "persistence_threshold_numel": 0}
    cfg: dict[str, Any] = {"zero": zero, "precision": {"dtype": dtype},
                           "optimizer": {"type": "adamw", "lr": 1e-3}}
    if mode == "hsdp":
        cfg["mesh"] = {"replicate": 2, "shard": world_size // 2}
    elif mode == "hpz":
        zero["hpz_partition_size"] = 2
    elif mode == "qwz-qgz":
        zero.update(quantized_weights=True, quantized_gradients=True)
    elif mode != "flat":
        raise ValueError(f"unknown mode {mode!r}")
    return cfg


def _delta(after: dict[str, int], before: dict[str, int], steps: int) -> dict[str, float]:
    return {k: (after.get(k, 0) - before.get(k, 0)) / steps for k in sorted(after)
            if after.get(k, 0) != before.get(k, 0)}


def run_mode(spec: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from infinity.config import load_config
    from infinity.models.gpt import GPT, PRESETS, synthetic_batch
    from infinity.zero import initialize

    mode = spec["mode"]
    try:
        config = load_config(mode_config(mode, world_size, spec["dtype"]))
    except ValueError as e:  # a field another part of issue #17 adds: not merged here yet
        return {"mode": mode, "status": "not available", "reason": str(e)}
    model_cfg = PRESETS["tiny"]
    torch.manual_seed(0)
    model = GPT(model_cfg)
    try:
        engine = initialize(model, config)
    except (ValueError, NotImplementedError) as e:  # raised alike on every rank, before any step
        return {"mode": mode, "status": "not available", "reason": str(e)}
    per_rank, seq = spec["batch_size"], spec["seq_len"]
    times, losses, before = [], [], None
    try:
        for step in range(spec["warmup"] + spec["steps"]):
            if step == spec["warmup"]:
                before = dict(engine.stats()["collective_bytes_sent"])
            x, y = synthetic_batch(model_cfg, per_rank * world_size, seq, seed=step)
            x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
            dist.barrier()
            start = time.perf_counter()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            dist.barrier()
            if step >= spec["warmup"]:
                times.append(time.perf_counter() - start)
            losses.append(float(loss.detach()))
        after = dict(engine.stats()["collective_bytes_sent"])
    finally:
        engine.close()
    by_kind = _delta(after, before or {}, spec["steps"])
    return {"mode": mode, "status": "ok", "step_s": statistics.median(times),
            "bytes_per_step": by_kind, "total_bytes_per_step": sum(by_kind.values()),
            "final_loss": losses[-1], "world_size": world_size}


def main(spec_path: str, rank: int) -> None:
    import torch
    import torch.distributed as dist

    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    torch.set_num_threads(1)
    world_size = spec["world_size"]
    dist.init_process_group("gloo", init_method=f"file://{spec['init_file']}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=spec["pg_timeout_s"]))
    try:
        result = run_mode(spec, rank, world_size)
        if rank == 0:
            path = os.path.join(os.path.dirname(spec_path), "result.json")
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                json.dump(result, f)
            os.replace(path + ".tmp", path)
    except BaseException:
        dist.destroy_process_group()
        raise
    # The result is written: leave without finalization ([Note: gloo teardown at exit] in
    # infinity/_process_exit.py). An error above still raises and exits 1.
    exit_after_distributed(0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
