"""One rank of ``infinity bench comm``'s measured part: a tiny GPT trained a few steps under one
mode's config on gloo, reporting the collective bytes per kind per step (``engine.stats()``) and
the step time; a pipeline mode (``pp2``, ``pp4``) also each stage's point-to-point bytes
(``pipe.stats()["pipeline"]``), gathered from every rank.

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


def pipeline_stages(mode: str) -> int:
    """The stages of a mode: K for ``ppK``, 1 for the others."""
    return int(mode[2:]) if mode.startswith("pp") else 1


def mode_config(mode: str, world_size: int, dtype: str, *,
                micro_batches: int = 4) -> dict[str, Any]:
    """The engine config of a mode: flat ZeRO-3, HSDP (2 replicas), hpZ (partition 2), qwZ + qgZ,
    ``ppK``: K pipeline stages (1F1B, ``micro_batches`` per step), ZeRO-3 over each stage's
    world / K ranks."""
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
    elif mode in ("pp2", "pp4"):
        cfg["mesh"] = {"pipeline": pipeline_stages(mode)}
        cfg["pipeline"] = {"schedule": "1f1b", "micro_batches": micro_batches}
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
        config = load_config(mode_config(mode, world_size, spec["dtype"],
                                         micro_batches=spec.get("micro_batches", 4)))
    except ValueError as e:  # a field another part of issue #17 adds: not merged here yet
        return {"mode": mode, "status": "not available", "reason": str(e)}
    if pipeline_stages(mode) > 1:
        return run_pipeline_mode(spec, rank, world_size, config)
    model_cfg = PRESETS["tiny"]
    torch.manual_seed(0)
    model = GPT(model_cfg)
    numel = sum(p.numel() for p in model.parameters())
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
            "final_loss": losses[-1], "world_size": world_size, "numel": numel}


def _loss(logits: Any, targets: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def run_pipeline_mode(spec: dict[str, Any], rank: int, world_size: int,
                      config: Any) -> dict[str, Any]:
    """``ppK``: the tiny GPT untied (its embedding and head land in different stages), cut into
    K stages by the balanced split; the same global batch as the other modes (``batch_size``
    sequences per rank), so each of a stage's world / K data-parallel ranks takes K x
    ``batch_size`` sequences a step, cut into ``micro_batches``. Every rank's record (its
    collective bytes and its stage's send/recv bytes per step) is gathered to rank 0: one per
    stage goes in the result (the first rank of the stage; its data-parallel peers send alike)."""
    import dataclasses

    import torch
    import torch.distributed as dist

    import infinity.pipeline
    from infinity.models.gpt import GPT, PRESETS, as_sequential, synthetic_batch

    stages = config.mesh.pipeline
    dp = world_size // stages
    model_cfg = dataclasses.replace(PRESETS["tiny"], tie_weights=False)
    torch.manual_seed(0)
    model = GPT(model_cfg)
    pipe = infinity.pipeline.initialize(as_sequential(model), config, loss_fn=_loss)
    numel = pipe.split.numel[pipe.stage_index]
    per_rank, seq = spec["batch_size"], spec["seq_len"]
    times, losses = [], []
    before: dict[str, Any] = {}
    try:
        for step in range(spec["warmup"] + spec["steps"]):
            if step == spec["warmup"]:
                before = _pipeline_counts(pipe.stats())
            x, y = synthetic_batch(model_cfg, per_rank * world_size, seq, seed=step)
            x, y = x.chunk(dp)[rank % dp], y.chunk(dp)[rank % dp]
            dist.barrier()
            start = time.perf_counter()
            loss = pipe.train_batch(x, target=y)
            dist.barrier()
            if step >= spec["warmup"]:
                times.append(time.perf_counter() - start)
            losses.append(float(loss))
        stats = pipe.stats()
        after = _pipeline_counts(stats)
    finally:
        pipe.close()
    steps = spec["steps"]
    by_kind = _delta(after["collective"], before.get("collective", {}), steps)
    p2p = {k: (v - before.get("p2p", {}).get(k, 0)) / steps for k, v in after["p2p"].items()}
    mine = {"rank": rank, "stage": stats["pipeline"]["stage"], "numel": numel,
            "bytes_per_step": by_kind, "total_bytes_per_step": sum(by_kind.values()), **p2p,
            "bubble_fraction": stats["pipeline"]["bubble_fraction"], "step_s":
            statistics.median(times)}
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, mine)
    first: dict[int, dict[str, Any]] = {}
    for r in sorted(every, key=lambda r: r["rank"]):
        first.setdefault(r["stage"], r)
    return {"mode": spec["mode"], "status": "ok", "world_size": world_size,
            "pipeline": stages, "data_parallel": dp, "schedule": stats["pipeline"]["schedule"],
            "micro_batches": stats["pipeline"]["micro_batches"],
            "micro_batch": per_rank * stages // stats["pipeline"]["micro_batches"],
            "seq_len": seq, "hidden": model_cfg.n_embd,
            "step_s": mine["step_s"], "final_loss": losses[-1],
            "stages": [first[s] for s in range(stages)], "ranks": every}


def _pipeline_counts(stats: dict[str, Any]) -> dict[str, Any]:
    pipe = stats["pipeline"]
    return {"collective": dict(stats["collective_bytes_sent"]),
            "p2p": {k: v for k, v in pipe.items() if k.startswith(("send_bytes", "recv_bytes"))}}


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
