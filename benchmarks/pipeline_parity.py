"""Pipeline parallelism with ZeRO inside each stage (#36): the issue's figure, measured.

Reproduce::

    .venv/bin/python benchmarks/pipeline_parity.py

Each case trains one small GPT (``as_sequential`` of an untied GPT, 8 blocks of width 64) for
``--steps`` steps on gloo processes (``torchrun``-style, a file rendezvous) and compares every
rank's losses and the stages' final weights with one process of plain PyTorch
(``torch.optim.AdamW``, ``clip_grad_norm_``) on the same global batch, fp32: the largest absolute
difference of each. The cases: PP=2 x DP=2 with ZeRO-3 in each stage, PP=2 x DP=1 with parameters
and optimizer on NVMe under a host budget smaller than a stage, and PP=4, each with GPipe and 1F1B.
Per case also: the activation bytes each rank sent and received per step, the bubble, the
prefetcher's demand misses after the first step (NVMe case; the schedule's order is recorded once
and followed), and the median step time (on shared CPU cores: indicative).
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
import torch.nn.functional as F

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
LR, BETAS, EPS, WD, CLIP = 1e-3, (0.9, 0.95), 1e-5, 0.01, 0.5
# eps 1e-5: the attention key bias's gradient is zero in exact arithmetic (softmax ignores a
# shift); with a tiny eps Adam turns its rounding noise into O(lr) steps (tests/_support/engine.py).
MICRO, ROWS, SEQ = 4, 8, 32  # micro-batches a step; sequences per micro-batch (global); tokens
CASES = [(pp, dp, offload, schedule) for schedule in ("gpipe", "1f1b")
         for pp, dp, offload in ((2, 2, "none"), (2, 1, "nvme"), (4, 1, "none"))]


def _model():
    from infinity.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=SEQ, n_layer=8, n_head=4, n_embd=64,
                         tie_weights=False))


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randint(0, 256, (MICRO * ROWS, SEQ + 1), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _reference(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = []
    for x, y in _batches(steps):
        loss = _loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _config(pp: int, offload: str, schedule: str, swap: str) -> dict:
    cfg = {"zero": {"stage": 3, "unit_class_names": ["Block"]},
           "optimizer": {"type": "adamw", "lr": LR, "betas": list(BETAS), "eps": EPS,
                         "weight_decay": WD},
           "gradient_clipping": CLIP, "gradient_accumulation_steps": MICRO,
           "mesh": {"pipeline": pp}, "pipeline": {"schedule": schedule}}
    if offload == "nvme":
        cfg["offload_param"] = {"device": "nvme", "nvme_path": swap}
        cfg["offload_optimizer"] = {"device": "nvme", "nvme_path": swap}
        # about 0.6 of a stage's 16 bytes a parameter: the stage is paged from its swap files
        cfg["memory"] = {"host_budget_bytes": 3 * 2**20}
        cfg["zero"]["sub_group_numel"] = 16384
    return cfg


def _worker(rank: int, world: int, init_file: str, case: tuple, steps: int, out: str) -> None:
    import infinity.pipeline
    from infinity.models.gpt import as_sequential, sequential_names

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    pp, dp, offload, schedule = case
    with tempfile.TemporaryDirectory(dir=os.path.dirname(out)) as swap:
        model = _model()
        names = sequential_names(model)
        pipe = infinity.pipeline.initialize(as_sequential(model), _config(pp, offload, schedule,
                                                                          swap), loss_fn=_loss)
        d, n = rank % dp, MICRO * ROWS // dp
        losses, times, misses = [], [], []
        for x, y in _batches(steps):
            before = pipe.stats()["prefetch"].get("misses", 0)
            t = time.perf_counter()
            mine = slice(d * n, (d + 1) * n)
            losses.append(float(pipe.train_batch(x[mine], target=y[mine])))
            times.append(time.perf_counter() - t)
            misses.append(pipe.stats()["prefetch"].get("misses", 0) - before)
        stats = pipe.stats()
        state = {names[k]: v for k, v in pipe.full_state_dict().items()}
        pipe.close()
    torch.save({"losses": losses, "times": times, "misses": misses, "state": state,
                "pipeline": stats["pipeline"], "host_peak": stats["bytes"]["HOST"]["peak"],
                "nvme_read": stats["bytes_moved"]["NVME->HOST"]}, f"{out}.{rank}")
    dist.destroy_process_group()


def _run(case: tuple, steps: int, tmp: str) -> list[dict]:
    pp, dp = case[0], case[1]
    world = pp * dp
    out = os.path.join(tmp, "case")
    init = os.path.join(tmp, f"rdzv-{time.monotonic_ns()}")
    mp.start_processes(_worker, args=(world, init, case, steps, out), nprocs=world,
                       start_method="spawn")
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dir", default=None, help="swap files' parent (default: a temp dir)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ref_losses, ref_state = _reference(args.steps)
    rows = []
    for case in CASES:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            res = _run(case, args.steps, tmp)
        state: dict[str, torch.Tensor] = {}
        for r in res:
            state.update(r["state"])
        assert set(state) == set(ref_state), sorted(set(state) ^ set(ref_state))
        pp, dp, offload, schedule = case
        row = {
            "pipeline": pp, "data_parallel": dp, "offload": offload, "schedule": schedule,
            "max_abs_loss_diff": max(abs(a - b) for r in res for a, b in
                                     zip(r["losses"], ref_losses)),
            "max_abs_weight_diff": max(float((state[k] - ref_state[k]).abs().max())
                                       for k in ref_state),
            "bubble_fraction": res[0]["pipeline"]["bubble_fraction"],
            "send_bytes_per_step": [r["pipeline"]["send_bytes"] // args.steps for r in res],
            "recv_bytes_per_step": [r["pipeline"]["recv_bytes"] // args.steps for r in res],
            "prefetch_misses_per_step": res[0]["misses"],
            "host_peak_bytes": [r["host_peak"] for r in res],
            "median_step_s": statistics.median(res[0]["times"][1:]),
        }
        rows.append(row)
        print(f"PP={pp} DP={dp} {offload:4} {schedule:5}: |dloss| {row['max_abs_loss_diff']:.1e}  "
              f"|dweight| {row['max_abs_weight_diff']:.1e}  send/recv per step "
              f"{row['send_bytes_per_step']}/{row['recv_bytes_per_step']}  bubble "
              f"{row['bubble_fraction']:.2f}  misses {row['prefetch_misses_per_step']}  "
              f"step {row['median_step_s']:.3f} s", flush=True)
    record = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": "benchmarks/pipeline_parity.py " + " ".join(sys.argv[1:]),
              "machine": {"cpu": platform.processor() or platform.machine(),
                          "cores": os.cpu_count(), "torch": torch.__version__},
              "model": "GPT 8 x 64, vocab 256, untied; fp32; lr 1e-3, clip 0.5",
              "steps": args.steps, "micro_batches": MICRO, "rows": rows}
    path = args.out or os.path.join(
        RESULTS, f"pipeline-parity-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"written {path}")


if __name__ == "__main__":
    main()
