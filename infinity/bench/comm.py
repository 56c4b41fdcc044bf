"""``infinity bench comm``: collective bytes and time per step for flat ZeRO-3, HSDP, hpZ and
qwZ + qgZ, measured on gloo processes here, and the planner's predicted step time past one node.

Reproduce: ``infinity bench comm`` (part A on 4 gloo processes, part B for 7B and 70B on 4 nodes
x 8 GPUs, NVLink 900 GB/s, InfiniBand 50 GB/s per node); ``--no-measure`` for part B alone;
``--inter-node-gbps 50,12.5`` adds the 100 Gb/s cluster of ZeRO++'s low-bandwidth figure.

Part A: each mode runs in its own set of ``--ranks`` fresh processes (gloo, file rendezvous), a
tiny GPT (the ``tiny`` preset) for ``--warmup`` + ``--steps`` steps, and reports the collective
bytes one rank sends per step by kind (``engine.stats()["collective_bytes_sent"]``: forward-gather,
backward-gather, reduce-grad, replicate-reduce, ...), their ratio to flat's, and the median step
time (on shared CPU cores: the bytes are the figure, the time is indicative). A mode whose config
fields the engine does not have yet is reported "not available".

Part B: the planner's time model ([Note: mesh time model] in infinity/ledger/_mesh_plan.py, on
[Note: collective cost over nodes] in infinity/ledger/_comm_time.py) for Llama-2-7B and -70B shapes
per candidate (flat, HSDP, hpZ, qwZ + qgZ, ZeRO++ = hpZ + qwZ + qgZ, the planner's choice), next to
ZeRO++'s published figures (:data:`ZEROPP_PUBLISHED`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from infinity._common import GiB
from infinity.bench.report import Report, add_common_arguments, format_table
from infinity.ledger import (DEFAULT_MFU, EXPOSED_FRACTION, GB, Cluster, MeshCandidate,
                             MeshRequest, ModelShape, make_mesh_plan)

MODES = ("flat", "hsdp", "hpz", "qwz-qgz")
"""flat ZeRO-3 over all ranks; HSDP 2 x (ranks/2); hpZ partition 2; qwZ + qgZ (int8)."""
MODELS = {
    "llama-7b": ModelShape(kind="llama", num_layers=32, hidden_size=4096, num_heads=32,
                           vocab_size=32000, intermediate_size=11008, seq_len=2048,
                           tie_word_embeddings=False),
    "llama-70b": ModelShape(kind="llama", num_layers=80, hidden_size=8192, num_heads=64,
                            num_kv_heads=8, vocab_size=32000, intermediate_size=28672,
                            seq_len=2048, tie_word_embeddings=False),
}
"""Llama-2's shapes (their Hugging Face config.json values)."""
ZEROPP_PUBLISHED = {
    "source": "Wang et al., ZeRO++ (arXiv 2306.10209, 2023) and the DeepSpeed ZeRO++ blog",
    "cross_node_volume": "ZeRO-3 3M per step (forward gather M, backward gather M, gradient "
                         "reduce-scatter M; fp16) -> ZeRO++ 0.75M (qwZ 0.5M, hpZ 0, qgZ 0.25M): "
                         "4x less",
    "low_bandwidth": "384 V100 GPUs, 100 Gb/s inter-node: up to 2.16x the throughput of ZeRO-3 "
                     "(2.2x in the blog), about 2x on average",
    "high_bandwidth": "384 V100 GPUs, 400 Gb/s (4 x 100 Gb/s) inter-node: +28-36% at 1k tokens "
                      "per GPU, +24-29% at 2k tokens per GPU",
    "equivalence": "ZeRO++ at 200 Gb/s matches ZeRO-3 at 800 Gb/s (18B and 138B models)",
}
ZEROPP_SETTING = {
    "nodes": 24, "gpus_per_node": 16, "intra_node_gbps": 150.0, "device_tflops": 125.0,
    "gpu_memory_gb": 32.0, "device_mem_gbs": 900.0, "numel": 18_000_000_000,
    "published": {(50.0, 1024): "1.28-1.36x", (50.0, 2048): "1.24-1.29x",
                  (12.5, 1024): "up to 2.16x (~2x average)", (12.5, 2048): "up to 2.16x (~2x average)"},
}
"""ZeRO++'s own evaluation, priced by our model: 384 V100 (24 DGX-2 nodes of 16, NVSwitch: 6 NVLinks
x 25 GB/s per GPU; 125 TFLOP/s fp16 peak; 32 GB), an 18B GPT (shape assumed from the count), 1k
or 2k tokens per GPU, 4 x 100 Gb/s (50 GB/s) or 1 x 100 Gb/s (12.5 GB/s) per node; fp16
gradients for the baseline and int4 for qgZ, as the paper compares."""
PLANNED = (  # part B rows: (label, layout kind, qwZ, qgZ)
    ("flat ZeRO-3", "flat", False, False),
    ("HSDP (shard = node)", "hsdp", False, False),
    ("hpZ (partition = node)", "hpz", False, False),
    ("flat + qwZ + qgZ", "flat", True, True),
    ("ZeRO++ (hpZ + qwZ + qgZ)", "hpz", True, True),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument_group("part A: measured on gloo processes here")
    a.add_argument("--ranks", type=int, default=4, help="gloo processes per mode (default 4)")
    a.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated subset of {', '.join(MODES)}")
    a.add_argument("--steps", type=int, default=3, help="timed steps per mode")
    a.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    a.add_argument("--batch-size", type=int, default=2, help="sequences per rank")
    a.add_argument("--seq-len", type=int, default=64)
    a.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    a.add_argument("--mode-timeout-s", type=float, default=300.0,
                   help="stop a mode's processes after this many seconds (reported as an error)")
    a.add_argument("--no-measure", action="store_true", help="skip part A")
    b = parser.add_argument_group("part B: the planner's prediction past one node")
    b.add_argument("--nodes", type=int, default=4)
    b.add_argument("--gpus-per-node", type=int, default=8)
    b.add_argument("--intra-node-gbps", type=float, default=900.0, help="per GPU (NVLink)")
    b.add_argument("--inter-node-gbps", default="50",
                   help="per node, comma-separated to compare clusters (e.g. 50,12.5)")
    b.add_argument("--gpu-memory-gb", type=float, default=80.0)
    b.add_argument("--device-tflops", type=float, default=989.0, help="peak bf16 dense, per GPU")
    b.add_argument("--device-mem-gbs", type=float, default=3350.0)
    b.add_argument("--mfu", type=float, default=DEFAULT_MFU)
    b.add_argument("--models", default=",".join(MODELS), help=f"subset of {', '.join(MODELS)}")
    add_common_arguments(parser)


def _list(value: str, known: tuple[str, ...] | None, flag: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in items if known is not None and v not in known]
    if unknown or not items:
        raise ValueError(f"{flag}: expected a comma-separated subset of {', '.join(known or ())}, "
                         f"got {value!r}")
    return items


# ----------------------------------------------------------------------------------------------
# Part A


def measure_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One mode in ``args.ranks`` fresh gloo processes; rank 0's record, or an error record."""
    with tempfile.TemporaryDirectory(prefix="infinity-bench-comm-") as tmp:
        spec = {"mode": mode, "world_size": args.ranks, "init_file": os.path.join(tmp, "rdzv"),
                "pg_timeout_s": args.mode_timeout_s, "steps": args.steps, "warmup": args.warmup,
                "batch_size": args.batch_size, "seq_len": args.seq_len, "dtype": args.dtype}
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump(spec, f)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = []
        for rank in range(args.ranks):
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w+", encoding="utf-8")
            procs.append((subprocess.Popen(
                [sys.executable, "-m", "infinity.bench._comm_worker", spec_path, str(rank)],
                stdout=log, stderr=subprocess.STDOUT, env=env), log))
        deadline = time.monotonic() + args.mode_timeout_s
        timed_out = False
        for proc, _ in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        tails = []
        for proc, log in procs:
            log.seek(0)
            tails.append(log.read()[-1500:])
            log.close()
        result_path = os.path.join(tmp, "result.json")
        if not timed_out and all(p.returncode == 0 for p, _ in procs) and os.path.exists(result_path):
            with open(result_path, encoding="utf-8") as f:
                return json.load(f)
        why = (f"timed out after {args.mode_timeout_s:g} s (--mode-timeout-s)" if timed_out else
               "exit codes " + ",".join(str(p.returncode) for p, _ in procs))
        last = next((t.strip().splitlines()[-1] for t in tails if t.strip()), "")
        return {"mode": mode, "status": "error", "reason": f"{why}: {last}", "logs": tails}


def measured_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per mode: bytes per step by kind, their total and its ratio to flat's, time."""
    flat = next((r for r in results if r["mode"] == "flat" and r["status"] == "ok"), None)
    rows = []
    for r in results:
        row: dict[str, Any] = {"mode": r["mode"], "status": r["status"]}
        if r["status"] != "ok":
            row["note"] = r.get("reason", "")[:160]
            rows.append(row)
            continue
        for kind, nbytes in r["bytes_per_step"].items():
            row[f"{kind}_bytes"] = int(nbytes)
        row["total_bytes"] = int(r["total_bytes_per_step"])
        row["bytes_x_flat"] = (r["total_bytes_per_step"] / flat["total_bytes_per_step"]
                               if flat and flat["total_bytes_per_step"] else None)
        row["step_s"] = r["step_s"]
        row["final_loss"] = r["final_loss"]
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------
# Part B


def _pick(candidates: list[MeshCandidate], kind: str, qw: bool, qg: bool) -> MeshCandidate | None:
    """The fastest fitting (else fastest) candidate of a layout kind, without tensor or pipeline
    parallelism."""
    pool = [c for c in candidates if c.layout.kind == kind and c.layout.tensor == 1
            and c.layout.pipeline == 1
            and c.layout.quantized_weights == qw and c.layout.quantized_gradients == qg]
    pool = [c for c in pool if c.fits] or pool
    return min(pool, key=lambda c: c.step_s) if pool else None


def predicted_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for model in _list(args.models, tuple(MODELS), "--models"):
        shape = MODELS[model]
        req = MeshRequest(numel=shape.num_params(), shape=shape,
                          device_memory_bytes=int(args.gpu_memory_gb * GiB),
                          device_flops=args.device_tflops * 1e12, mfu=args.mfu,
                          device_memory_bytes_per_s=args.device_mem_gbs * GB)
        for inter in _list(args.inter_node_gbps, None, "--inter-node-gbps"):
            cluster = Cluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                              intra_node_bytes_per_s=args.intra_node_gbps * GB,
                              inter_node_bytes_per_s=float(inter) * GB)
            plan = make_mesh_plan(req, cluster)
            base = plan.baseline()
            picked = [(label, _pick(plan.candidates, kind, qw, qg)) for label, kind, qw, qg in PLANNED]
            picked.append(("planner's choice", plan.best))
            for label, c in picked:
                if c is None:
                    continue
                rows.append({
                    "model": model, "inter_gbps": float(inter), "candidate": label,
                    "layout": c.layout.name, "checkpointing": c.checkpointing, "fits": c.fits,
                    "mem_per_rank_gib": c.need_bytes / GiB, "intra_gb_per_step": c.intra_bytes / 1e9,
                    "inter_gb_per_step": c.inter_bytes / 1e9, "step_s": c.step_s,
                    "x_flat": base.step_s / c.step_s if base else None,
                    "inter_x_flat": c.inter_bytes / base.inter_bytes if base and base.inter_bytes
                    else None, "bound": c.bound})
    return rows


def zeropp_setting_rows(mfu: float) -> list[dict[str, Any]]:
    """Flat ZeRO-3 against ZeRO++ (hpZ + qwZ + qgZ int4) at ZeRO++'s own setting
    (:data:`ZEROPP_SETTING`): the model's predicted gain next to the published one."""
    z = ZEROPP_SETTING
    rows = []
    for (inter, tokens), published in z["published"].items():
        shape = ModelShape.assumed(z["numel"], seq_len=tokens)
        cluster = Cluster(nodes=z["nodes"], gpus_per_node=z["gpus_per_node"],
                          intra_node_bytes_per_s=z["intra_node_gbps"] * GB,
                          inter_node_bytes_per_s=inter * GB)
        row: dict[str, Any] = {"setting": f"384 V100, {shape.num_params() / 1e9:.0f}B GPT",
                               "tokens_per_gpu": tokens, "inter_gbps": inter}
        for label, exposed in (("", EXPOSED_FRACTION), ("serial_", 1.0)):
            req = MeshRequest(numel=shape.num_params(), shape=shape, reduce_dtype="compute",
                              gradient_bits=4, max_tensor=1, mfu=mfu, exposed_fraction=exposed,
                              device_memory_bytes=int(z["gpu_memory_gb"] * GiB),
                              device_flops=z["device_tflops"] * 1e12,
                              device_memory_bytes_per_s=z["device_mem_gbs"] * GB)
            plan = make_mesh_plan(req, cluster)
            flat, zpp = plan.baseline(), _pick(plan.candidates, "hpz", True, True)
            if not label:
                row.update(flat_step_s=flat.step_s, flat_bound=flat.bound,
                           zeropp_step_s=zpp.step_s, zeropp_bound=zpp.bound)
            row[f"{label}predicted_x"] = flat.step_s / zpp.step_s
        row["published_x"] = published
        rows.append(row)
    return rows


TIME_MODEL_NOTES = [
    "time model ([Note: mesh time model] in infinity/ledger/_mesh_plan.py): ring all-gather / "
    "reduce-scatter of M bytes over k ranks, c per node: (k-1)/k M per rank; time = max((k-1)/k "
    "M / B_in, G x (k-1)/k M / c / B_out) (B_in per GPU, B_out per node); qgZ: hierarchical "
    "all-to-all of int8 + fp32 scales per block, max((c-1)/c Q(M) / B_in, G (n-1)/n Q(M/c) / B_out)",
    "per micro-step: forward + backward gather of P/T x 2 B (qwZ: int8 + scales; hpZ: backward "
    "inside the node), reduce-scatter of P/T x 4 B (fp32; qgZ: int8); HSDP all-reduces its "
    "gradient shard across replicas once per step; compute = 6 (8 with checkpointing) P tokens "
    "/ (W x peak x MFU); step = GA x (max(compute, comm) + 0.25 x min(...) + TP all-reduces) + "
    "replicate all-reduce",
    "bytes: sent per rank per optimizer step; x_flat: flat ZeRO-3's predicted step time / this "
    "one's; inter_x_flat: cross-node bytes / flat's (ZeRO++ publishes 0.25)",
]


def run(args: argparse.Namespace) -> int:
    modes = _list(args.modes, MODES, "--modes")
    if args.ranks < 2:
        raise ValueError(f"--ranks: expected >= 2 (collectives need peers), got {args.ranks}")
    if "hsdp" in modes and args.ranks % 2:
        raise ValueError(f"--modes hsdp: needs an even --ranks (2 replicas), got {args.ranks}")
    predicted = predicted_rows(args)
    measured: list[dict[str, Any]] = []
    if not args.no_measure:
        results = [measure_mode(mode, args) for mode in modes]
        measured = measured_rows(results)
    notes = [*TIME_MODEL_NOTES,
             *(f"ZeRO++ published ({k}): {v}" for k, v in ZEROPP_PUBLISHED.items() if k != "source"),
             f"source: {ZEROPP_PUBLISHED['source']}"]
    if measured:
        notes.insert(0, f"part A: {args.ranks} gloo processes, GPT tiny, {args.dtype}, batch "
                     f"{args.batch_size} x {args.seq_len} per rank, median of {args.steps} steps; "
                     "bytes: per rank per step by kind, as engine.stats() counts them: each "
                     "collective's input (an all-gather: the rank's shard; a reduce-scatter or "
                     "all-reduce: the whole buffer). A ring sends (k-1)/k of the gathered size "
                     "for either, the unit of part B: (k-1) x a gather's count, (k-1)/k x a "
                     "reduce-scatter's")
        if not args.json:
            print(f"\ninfinity bench comm, part A: measured on {args.ranks} gloo processes")
            columns = list(dict.fromkeys(k for row in measured for k in row))
            print(format_table(measured, columns))
    setting = zeropp_setting_rows(args.mfu)
    notes.append("zeropp_setting: ZeRO++'s own evaluation (384 V100, 18B GPT) priced by the same "
                 "model: predicted_x (flat ZeRO-3 step / ZeRO++ step) with the planner's overlap "
                 f"rule (exposed fraction {EXPOSED_FRACTION}), serial_predicted_x with none (the "
                 "serial bound), beside the published gain")
    if not args.json:
        print("\ninfinity bench comm, part B at ZeRO++'s own setting (predicted vs published)")
        print(format_table(setting))
    report = Report(
        name="comm", title=f"infinity bench comm, part B: predicted on {args.nodes} nodes x "
        f"{args.gpus_per_node} GPUs, {args.intra_node_gbps:g} GB/s per GPU inside, "
        f"{args.inter_node_gbps} GB/s per node across", rows=predicted,
        params={k: v for k, v in vars(args).items() if not k.startswith("_")},
        notes=notes, extra={"measured": measured, "zeropp_published": ZEROPP_PUBLISHED,
                                  "zeropp_setting": setting})
    report.emit(as_json=args.json, results_dir=args.results_dir, save=not args.no_save)
    return 0 if all(r["status"] != "error" for r in measured) else 1
