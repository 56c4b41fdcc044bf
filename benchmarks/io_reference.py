"""DeepSpeed aio reference for ``infinity bench io`` (run with DeepSpeed's own interpreter).

Reproduce: ``DS_ACCELERATOR=cpu /root/dsvenv/bin/python benchmarks/io_reference.py --file F
--size-bytes 2147483648 --repeats 3`` prints one JSON line {"write_gbps", "read_gbps", "settings"}.
``infinity bench io`` runs it with ``--serve`` instead and asks for one write or read at a time, in
the same rounds as its own runs, so drift on a shared disk hits DeepSpeed and us alike.

It uses only DeepSpeed's public op (``AsyncIOBuilder().load().aio_handle``) on one locked buffer
allocated up front (``new_cpu_locked_tensor``), tries a small grid of handle settings once each,
and times the best setting per direction (median of ``--repeats`` after one warm-up). The file is
dropped from the page cache between runs (DeepSpeed's handle uses O_DIRECT anyway).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# (block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism)
GRID = [(1 << 20, 128, False, True, 1), (1 << 20, 32, False, True, 4), (8 << 20, 32, False, True, 4),
        (16 << 20, 16, False, True, 8), (1 << 20, 128, False, True, 8)]


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _time(handle, buf, path: str, write: bool) -> float:
    if not write:
        _drop_cache(path)
    t0 = time.perf_counter()
    n = handle.sync_pwrite(buf, path) if write else handle.sync_pread(buf, path)
    dt = time.perf_counter() - t0
    if n < 0:
        raise RuntimeError(f"deepspeed aio {'write' if write else 'read'} returned {n}")
    return buf.numel() / dt / 1e9


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--file", required=True)
    p.add_argument("--size-bytes", type=int, default=2 << 30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--serve", action="store_true",
                   help="after choosing settings, answer 'write'/'read' lines on stdin with one "
                        "JSON line each, so the caller can interleave DeepSpeed with its own runs")
    args = p.parse_args()
    import torch
    from deepspeed.ops.op_builder import AsyncIOBuilder

    ops = AsyncIOBuilder().load()
    handles = [ops.aio_handle(*g) for g in GRID]
    buf = handles[0].new_cpu_locked_tensor(args.size_bytes, torch.empty(0, dtype=torch.uint8))
    buf.random_(0, 255)
    best: dict[str, tuple[float, int]] = {}
    for write in (True, False):  # one pass per setting; the best is then timed again
        name = "write" if write else "read"
        for i, h in enumerate(handles):
            gbps = _time(h, buf, args.file, write)
            if gbps > best.get(name, (0.0, -1))[0]:
                best[name] = (gbps, i)
    settings = {name: dict(zip(("block_size", "queue_depth", "single_submit", "overlap_events",
                                "intra_op_parallelism"), GRID[i])) for name, (_, i) in best.items()}
    if args.serve:
        print(json.dumps({"ready": True, "settings": settings}), flush=True)
        for line in sys.stdin:
            cmd = line.strip()
            if cmd not in ("write", "read"):
                break
            h = handles[best[cmd][1]]
            print(json.dumps({"gbps": _time(h, buf, args.file, cmd == "write")}), flush=True)
    else:
        out: dict = {"settings": settings}
        for name in ("write", "read"):
            h = handles[best[name][1]]
            runs = [_time(h, buf, args.file, name == "write") for _ in range(args.repeats)]
            out[f"{name}_gbps"] = statistics.median(runs)
            out[f"{name}_runs_gbps"] = runs
        print(json.dumps(out))
    handles[0].free_cpu_locked_tensor(buf)
    os.unlink(args.file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
