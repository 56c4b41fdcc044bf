"""Gradients summed across ranks once per step against once per micro-batch, on a modeled link.

Reproduce::

    .venv/bin/python benchmarks/replicas_per_step.py --layout hsdp-s3
    .venv/bin/python benchmarks/replicas_per_step.py --layout dp4-s1

4 gloo processes train the ``small`` GPT preset, gradient accumulation ``--gas``, the optimizer on
the device, every collective under a modeled link of ``--link-gbps`` ([Note: the modeled link] in
infinity/_modeled_link.py): ZeRO-3 over 2 replicas of a 2-rank shard group (``hsdp-s3``), or
stage 1 over 4 ranks (``dp4-s1``). Two arms, interleaved round by round in the same processes on
the same data: ``per-step`` (the engine: [Note: replicas summed once per step] and [Note: one
all-reduce per window at stages 0-1] in infinity/zero/_grad_reducer.py) and ``per-micro-batch``
(what the engine did before: the replicas' sum and the stage 0-1 all-reduce run for each
micro-batch's gradient). Per arm: the median step time, the bytes each rank sent per step by phase, the
link's busy seconds per step, and the losses, which must agree between the arms (the same sums,
added in another order: fp32 rounding).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ARMS = ("per-step", "per-micro-batch")


LAYOUTS = {
    "hsdp-s3": {"zero": {"stage": 3}, "mesh": {"replicate": 2, "shard": 2}},
    "dp4-s1": {"zero": {"stage": 1}},
}
"""``--layout``: ZeRO-3 over 2 replicas of 2 shards ([Note: replicas summed once per step]), or
stage 1 over 4 ranks ([Note: one all-reduce per window at stages 0-1])."""


def _engine(layout: str, gas: int, link_gbps: float, per_micro_batch: bool):
    import infinity
    from infinity._modeled_link import LinkModel
    from infinity.models.gpt import GPT, PRESETS

    torch.manual_seed(0)
    model = GPT(PRESETS["small"])
    config = {**LAYOUTS[layout], "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
              "optimizer": {"type": "adamw", "lr": 1e-3}, "precision": {"dtype": "fp32"}}
    engine = infinity.initialize(model, config,
                                 comm_link=LinkModel(bandwidth_gbytes_per_s=link_gbps))
    if per_micro_batch:  # the engine before the two Notes: every micro-batch crosses
        reducer = engine.manager.reducer
        reducer._replicas_at_step = False
        before = engine._before_backward

        def no_window_sums() -> None:
            before()
            reducer.sums_locally = False

        engine._before_backward = no_window_sums
    return engine


def _step(engine, batches) -> tuple[float, float, dict[str, int], float]:
    """One optimizer step of ``len(batches)`` micro-batches: seconds, mean loss, bytes sent by
    phase, the link's busy seconds."""
    sent0 = dict(engine.stats()["collective_bytes_sent"])
    link = engine.collectives.lane.link
    busy0 = link.busy_s if link is not None else 0.0
    dist.barrier()
    start = time.perf_counter()
    loss_sum = 0.0
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        loss_sum += loss.item()
    elapsed = time.perf_counter() - start
    sent = {k: v - sent0.get(k, 0) for k, v in engine.stats()["collective_bytes_sent"].items()}
    busy = (link.busy_s if link is not None else 0.0) - busy0
    return elapsed, loss_sum / len(batches), sent, busy


def _worker(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    from infinity.models.gpt import PRESETS, synthetic_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    engines = {arm: _engine(args.layout, args.gas, args.link_gbps, arm == "per-micro-batch")
               for arm in ARMS}
    record: dict[str, dict] = {arm: {"step_s": [], "loss": [], "sent": [], "link_busy_s": []}
                               for arm in ARMS}
    for step in range(args.warmup + args.steps):
        batches = [synthetic_batch(PRESETS["small"], args.batch_size, args.seq_len,
                                   seed=(step * args.gas + m) * world + rank)
                   for m in range(args.gas)]
        order = ARMS if step % 2 == 0 else ARMS[::-1]  # interleaved: neither arm always first
        for arm in order:
            elapsed, loss, sent, busy = _step(engines[arm], batches)
            if step >= args.warmup:
                r = record[arm]
                r["step_s"].append(elapsed)
                r["loss"].append(loss)
                r["sent"].append(sent)
                r["link_busy_s"].append(busy)
    for engine in engines.values():
        engine.close()
    torch.save(record, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="hsdp-s3")
    parser.add_argument("--gas", type=int, default=4)
    parser.add_argument("--link-gbps", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    world = 4
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        mp.spawn(_worker, args=(world, init, args, tmp), nprocs=world, join=True)
        records = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
    rows = []
    for arm in ARMS:
        r0 = records[0][arm]
        sent = r0["sent"][-1]
        rows.append({"arm": arm, "median_step_s": statistics.median(
                         max(rec[arm]["step_s"][i] for rec in records)
                         for i in range(len(r0["step_s"]))),
                     "sent_bytes_per_step": sent,
                     "link_busy_s_per_step": statistics.median(r0["link_busy_s"]),
                     "losses": r0["loss"]})
    a, b = rows
    result = {
        "benchmark": "replicas_per_step",
        "environment": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                        "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
                        "cores": os.cpu_count()},
        "args": vars(args), "rows": rows,
        "x_step_per_micro_batch_over_per_step": b["median_step_s"] / a["median_step_s"],
        "max_abs_loss_difference": max(abs(x - y) for x, y in zip(a["losses"], b["losses"])),
    }
    print(json.dumps(result, indent=1))
    if not args.no_save:
        os.makedirs(RESULTS, exist_ok=True)
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = f"replicas-per-step-{args.layout}-gas{args.gas}-{stamp}.json"
        with open(os.path.join(RESULTS, name), "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
