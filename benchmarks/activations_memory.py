"""Where the memory of offloaded activations goes (#34): the live heap at the end of a forward, the
heap's size and the process's peak RSS, with the checkpointed blocks' inputs kept in memory and on
NVMe, parameters and optimizer on NVMe in both.

Reproduce::

    .venv/bin/python benchmarks/activations_memory.py --model deep --seq-len 1024 --batch-size 12

Each mode runs in a fresh process (``--child``), one training step at a time; a thread samples the
RSS every 5 ms and glibc's ``mallinfo2`` gives the heap's bytes in use and its size at the end of
each forward (when every saved input is held). Why both: glibc keeps the pages of freed heap chunks
resident, so the peak RSS is the heap's high-water mark, set by the forward's and the recompute's
transient buffers, while the bytes in use say what the process holds.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _heap() -> dict[str, int]:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return {"heap_bytes": info.arena, "in_use_bytes": info.uordblks, "mmapped_bytes": info.hblkhd}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(args: argparse.Namespace) -> dict:
    import torch

    import infinity
    from infinity.models.gpt import GPT, PRESETS, synthetic_batch

    torch.manual_seed(0)
    gpt = dataclasses.replace(PRESETS[args.model], block_size=max(args.seq_len,
                                                                    PRESETS[args.model].block_size))
    swap = tempfile.mkdtemp(dir=args.dir)
    engine = infinity.initialize(GPT(gpt), {
        "zero": {"stage": 3, "unit_class_names": ["Block"], "sub_group_numel": "auto"},
        "precision": {"dtype": "bf16"}, "optimizer": {"type": "adamw", "lr": 1e-3},
        "offload_param": {"device": "nvme", "nvme_path": swap},
        "offload_optimizer": {"device": "nvme", "nvme_path": swap},
        "memory": {"host_budget_bytes": args.host_budget},
        "activation_checkpointing": {"units": ["Block"], "offload": args.child}})
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    forward_ends = []
    for step in range(args.steps):
        x, y = synthetic_batch(gpt, args.batch_size, args.seq_len, seed=step)
        loss = engine(x, y)
        forward_ends.append({**_heap(), "rss_bytes": _rss()})
        engine.backward(loss)
        engine.step()
    engine.finish_step()
    stop.set()
    sampler.join()
    acts = engine.stats()["activations"]
    engine.close()
    return {"peak_rss_bytes": peak[0], "forward_end": forward_ends, "activations": acts,
            "final_loss": float(loss.detach())}


def main() -> int:
    parser = argparse.ArgumentParser(prog="activations_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deep")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--host-budget", type=int, default=44040192)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--child", choices=("none", "nvme"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    rows = {}
    for mode in ("none", "nvme"):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", mode] + sys.argv[1:]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        run = json.loads(out.strip().splitlines()[-1])
        ends = run["forward_end"]
        rows[mode] = {"peak_rss_bytes": run["peak_rss_bytes"],
                      "forward_end_in_use_bytes": statistics.median(
                          e["in_use_bytes"] for e in ends),
                      "forward_end_heap_bytes": statistics.median(e["heap_bytes"] for e in ends),
                      "forward_end_rss_bytes": statistics.median(e["rss_bytes"] for e in ends),
                      "final_loss": run["final_loss"], "activations": run["activations"]}
        print(f"{mode}: {json.dumps({k: v for k, v in rows[mode].items() if k != 'activations'})}",
              file=sys.stderr)
    saved = rows["nvme"]["activations"]["NVME"]["peak"]
    record = {
        "benchmark": "activations-memory",
        "title": f"GPT {args.model}, {args.batch_size} x {args.seq_len} tokens, bf16, states on "
                 f"NVMe, host budget {args.host_budget}: checkpointed inputs kept vs on NVMe",
        "environment": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                        "command": " ".join([os.path.relpath(sys.executable)] + sys.argv),
                        "platform": platform.platform(), "cpu_count": os.cpu_count()},
        "params": vars(args), "rows": rows,
        "activations_per_step_bytes": saved,
        "in_use_drop_bytes": rows["none"]["forward_end_in_use_bytes"]
        - rows["nvme"]["forward_end_in_use_bytes"],
        "notes": ["forward_end_*: glibc mallinfo2 at the end of each forward (median over the "
                  "steps): in_use = uordblks, heap = arena; peak_rss_bytes: sampled every 5 ms",
                  "in_use_drop_bytes: what offloading took out of the process's live heap; "
                  "activations_per_step_bytes: the inputs saved to NVMe in one step"]}
    os.makedirs(RESULTS, exist_ok=True)
    name = f"activations-memory-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    with open(os.path.join(RESULTS, name), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    print(json.dumps({k: record[k] for k in ("activations_per_step_bytes", "in_use_drop_bytes")}))
    print(f"wrote benchmarks/results/{name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
