"""``infinity bench comm``: collective bytes and time per step for flat ZeRO-3, HSDP, hpZ,
qwZ + qgZ and pipelines of 2 and 4 stages, measured on gloo processes here, and the planner's
predicted step time past one node.

Reproduce: ``infinity bench comm`` (part A on 4 gloo processes, part B for 7B and 70B on 4 nodes
x 8 GPUs, NVLink 900 GB/s, InfiniBand 50 GB/s per node); ``--no-measure`` for part B alone;
``--inter-node-gbps 50,12.5`` adds the 100 Gb/s cluster of ZeRO++'s low-bandwidth figure.

Part A: each mode runs in its own set of ``--ranks`` fresh processes (gloo, file rendezvous), a
tiny GPT (the ``tiny`` preset) for ``--warmup`` + ``--steps`` steps, and reports the collective
bytes one rank sends per step by kind (``engine.stats()["collective_bytes_sent"]``: forward-gather,
backward-gather, reduce-grad, replicate-reduce, ...), their ratio to flat's, and the median step
time (on shared CPU cores: the bytes are the figure, the time is indicative). A mode whose config
fields the engine does not have yet is reported "not available". A pipeline mode (``pp2``,
``pp4``: K stages, 1F1B, ``--micro-batches`` per step, ZeRO-3 over each stage's ranks / K, the
tiny GPT untied) reports one row per stage: its collective bytes, its send/recv bytes
(``pipe.stats()["pipeline"]``, by neighbour too) beside :func:`pipeline_p2p_bytes`, and the bubble.

Part B: the planner's time model ([Note: mesh time model] in infinity/ledger/_mesh_plan.py, on
[Note: collective cost over nodes] in infinity/ledger/_comm_time.py) for Llama-2-7B and -70B shapes
per candidate (flat, HSDP, hpZ, qwZ + qgZ, ZeRO++ = hpZ + qwZ + qgZ, the best pipeline with its
bubble and send bytes, the planner's choice), next to ZeRO++'s published figures
(:data:`ZEROPP_PUBLISHED`).
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
from infinity.bench._comm_worker import pipeline_stages
from infinity.bench.report import Report, add_common_arguments, format_table
from infinity.ledger import (DEFAULT_MFU, EXPOSED_FRACTION, GB, Cluster, MeshCandidate,
                             MeshRequest, ModelShape, make_mesh_plan)

MODES = ("flat", "hsdp", "hpz", "qwz-qgz", "pp2", "pp4")
"""flat ZeRO-3 over all ranks; HSDP 2 x (ranks/2); hpZ partition 2; qwZ + qgZ (int8); ppK: K
pipeline stages (1F1B) x ZeRO-3 over ranks/K in each (the default runs those the ranks divide)."""
DTYPE_BYTES = {"bf16": 2, "fp32": 4}
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
PIPELINE_LABEL = "best pipeline (PP)"
"""Part B's row of the planner's fastest fitting candidate with K > 1 stages (any tensor degree,
1F1B), with its bubble and point-to-point bytes."""

PIPELINE_COLUMNS = ("data_parallel", "micro_batches", "bubble_fraction")
"""Part A's pipeline-only columns (besides the send/recv bytes), printed in their own table."""
PIPELINE_NOTE = (
    "pipeline rows (ppK stage s): the first rank of stage s (its data-parallel peers send "
    "alike); the tiny GPT untied (its embedding and head in different stages), so numel_x_flat "
    "is the stage's parameters over flat's tied model's. send_bytes / recv_bytes: per step, "
    "from pipe.stats()['pipeline'] (_prev / _next: by neighbour); p2p_formula_bytes = 2 "
    "directions x m micro-batches x micro-batch x seq x hidden x dtype bytes x the boundaries "
    "the stage sits on (1 at either end, 2 between), to equal send + recv. ZeRO-3 inside a "
    "stage gathers and reduce-scatters per micro-batch, as the planner prices it (per "
    "micro-step, [Note: mesh time model]): a step's collective bytes are m times one "
    "micro-batch's, so bytes_x_flat (flat: one micro-batch a step) is about m x "
    "micro_bytes_x_flat. Per micro-batch a stage reduces its own gradients (its share of the "
    "parameters) and gathers a 1/D shard of them: the same count as flat's 1/W shard of all at "
    "D = W/2 (on a ring's wire, (D-1)/D of the gathered size: 1/3 of flat's at W = 4)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument_group("part A: measured on gloo processes here")
    a.add_argument("--ranks", type=int, default=4, help="gloo processes per mode (default 4)")
    a.add_argument("--modes", default=None,
                   help=f"comma-separated subset of {', '.join(MODES)} (default: all; ppK only "
                        f"where K divides --ranks)")
    a.add_argument("--steps", type=int, default=3, help="timed steps per mode")
    a.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    a.add_argument("--batch-size", type=int, default=2, help="sequences per rank")
    a.add_argument("--seq-len", type=int, default=64)
    a.add_argument("--micro-batches", type=int, default=4,
                   help="pipeline modes: micro-batches per step (>= stages; each data-parallel "
                        "rank of a stage takes stages x --batch-size sequences)")
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
                "batch_size": args.batch_size, "seq_len": args.seq_len, "dtype": args.dtype,
                "micro_batches": args.micro_batches}
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


def pipeline_p2p_bytes(*, stage: int, num_stages: int, micro_batches: int, micro_batch: int,
                       seq_len: int, hidden: int, dtype_bytes: int) -> int:
    """Bytes one rank of ``stage`` sends plus receives per step: at each boundary it sits on (one
    for the first and last stage, two in between), every micro-batch's activation crosses one
    way in forward and its gradient the other (2 x m x b x s x h x p per boundary)."""
    boundaries = (stage > 0) + (stage < num_stages - 1)
    return 2 * micro_batches * micro_batch * seq_len * hidden * dtype_bytes * boundaries


def _collective_row(mode: str, r: dict[str, Any], flat: dict[str, Any] | None,
                    micro_batches: int | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {"mode": mode, "status": "ok"}
    for kind, nbytes in r["bytes_per_step"].items():
        row[f"{kind}_bytes"] = int(nbytes)
    row["total_bytes"] = int(r["total_bytes_per_step"])
    row["bytes_x_flat"] = (r["total_bytes_per_step"] / flat["total_bytes_per_step"]
                           if flat and flat["total_bytes_per_step"] else None)
    if micro_batches is not None:  # a pipeline's ZeRO collectives run once per micro-batch
        row["micro_bytes_x_flat"] = (None if row["bytes_x_flat"] is None
                                     else row["bytes_x_flat"] / micro_batches)
    row["numel_x_flat"] = (r["numel"] / flat["numel"] if flat and flat.get("numel")
                           and r.get("numel") else None)
    return row


def _pipeline_rows(r: dict[str, Any], flat: dict[str, Any] | None,
                   dtype_bytes: int) -> list[dict[str, Any]]:
    """One row per stage (its first rank; the stage's data-parallel ranks send alike)."""
    rows = []
    for st in r["stages"]:
        row = _collective_row(f"{r['mode']} stage {st['stage']}", st, flat, r["micro_batches"])
        row.update(
            data_parallel=r["data_parallel"], send_bytes=int(st["send_bytes"]),
            recv_bytes=int(st["recv_bytes"]),
            p2p_bytes=int(st["send_bytes"] + st["recv_bytes"]),
            p2p_formula_bytes=pipeline_p2p_bytes(
                stage=st["stage"], num_stages=r["pipeline"], micro_batches=r["micro_batches"],
                micro_batch=r["micro_batch"], seq_len=r["seq_len"], hidden=r["hidden"],
                dtype_bytes=dtype_bytes),
            **{k: int(v) for k, v in st.items() if k.startswith(("send_bytes_", "recv_bytes_"))},
            bubble_fraction=st["bubble_fraction"], micro_batches=r["micro_batches"],
            step_s=r["step_s"], final_loss=r["final_loss"])
        rows.append(row)
    return rows


def measured_rows(results: list[dict[str, Any]], dtype: str = "bf16") -> list[dict[str, Any]]:
    """One row per mode (per stage for a pipeline mode): bytes per step by kind, their total and
    its ratio to flat's, time; a pipeline's send/recv bytes beside the formula's."""
    flat = next((r for r in results if r["mode"] == "flat" and r["status"] == "ok"), None)
    rows = []
    for r in results:
        if r["status"] != "ok":
            rows.append({"mode": r["mode"], "status": r["status"],
                         "note": r.get("reason", "")[:160]})
        elif "stages" in r:
            rows.extend(_pipeline_rows(r, flat, DTYPE_BYTES[dtype]))
        else:
            row = _collective_row(r["mode"], r, flat)
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


def _pick_pipeline(candidates: list[MeshCandidate]) -> MeshCandidate | None:
    """The fastest fitting (else fastest) candidate with a pipeline, any tensor degree."""
    pool = [c for c in candidates if c.layout.pipeline > 1]
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
            picked.append((PIPELINE_LABEL, _pick_pipeline(plan.candidates)))
            picked.append(("planner's choice", plan.best))
            for label, c in picked:
                if c is None:
                    continue
                row = {
                    "model": model, "inter_gbps": float(inter), "candidate": label,
                    "layout": c.layout.name, "checkpointing": c.checkpointing, "fits": c.fits,
                    "mem_per_rank_gib": c.need_bytes / GiB, "intra_gb_per_step": c.intra_bytes / 1e9,
                    "inter_gb_per_step": c.inter_bytes / 1e9, "step_s": c.step_s,
                    "x_flat": base.step_s / c.step_s if base else None,
                    "inter_x_flat": c.inter_bytes / base.inter_bytes if base and base.inter_bytes
                    else None, "bound": c.bound}
                if label == PIPELINE_LABEL:  # the other rows keep their columns
                    row.update(schedule=c.schedule, micro_batches=c.grad_accum,
                               micro_batch=c.micro_batch,
                               bubble_fraction=c.bubble_fraction,
                               p2p_gb_per_step=c.traffic["pipeline-p2p"].total_bytes / 1e9)
                rows.append(row)
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
    "best pipeline (PP): the fastest fitting candidate with K > 1 stages (1F1B, any tensor "
    "degree; [Note: mesh time model]): the largest stage priced, step = (m + K - 1) x t_micro, "
    "bubble (K - 1) / (m + K - 1); p2p_gb_per_step: what a middle stage's rank sends, 2 m x b s "
    "h x 2 B (as many received); its inter_gb_per_step includes them",
]


def _check_pipeline_mode(mode: str, args: argparse.Namespace) -> None:
    k = pipeline_stages(mode)
    if k == 1:
        return
    if args.ranks % k:
        raise ValueError(f"--modes {mode}: {k} stages need --ranks a multiple of {k}, got "
                         f"{args.ranks}")
    sequences = k * args.batch_size  # per data-parallel rank of a stage
    if args.micro_batches < k or sequences % args.micro_batches:
        raise ValueError(f"--micro-batches: {mode} (1F1B) needs at least {k} micro-batches "
                         f"dividing the {sequences} sequences of a stage's rank ({k} x "
                         f"--batch-size {args.batch_size}), got {args.micro_batches}")


def _print_measured(measured: list[dict[str, Any]], ranks: int) -> None:
    """Part A's collective bytes of every mode, then the pipeline rows' send/recv bytes."""
    p2p = [k for k in dict.fromkeys(k for row in measured for k in row)
           if k.startswith(("send_bytes", "recv_bytes", "p2p_")) or k in PIPELINE_COLUMNS]
    rest = [k for k in dict.fromkeys(k for row in measured for k in row) if k not in p2p]
    kinds = sorted(k for k in rest if k.endswith("_bytes") and k != "total_bytes")
    lead = ["mode", "status", *kinds, "total_bytes", "bytes_x_flat", "micro_bytes_x_flat",
            "numel_x_flat"]
    columns = [k for k in lead if k in rest] + [k for k in rest if k not in lead]
    print(f"\ninfinity bench comm, part A: measured on {ranks} gloo processes")
    print(format_table(measured, columns))
    pipeline = [row for row in measured if "p2p_bytes" in row]
    if pipeline:
        print("\npart A, pipeline stages: send/recv bytes per rank per step, and the formula's")
        print(format_table(pipeline, ["mode", *p2p]))


def run(args: argparse.Namespace) -> int:
    if args.ranks < 2:
        raise ValueError(f"--ranks: expected >= 2 (collectives need peers), got {args.ranks}")
    modes = (_list(args.modes, MODES, "--modes") if args.modes is not None else
             [m for m in MODES if args.ranks % pipeline_stages(m) == 0])
    if "hsdp" in modes and args.ranks % 2:
        raise ValueError(f"--modes hsdp: needs an even --ranks (2 replicas), got {args.ranks}")
    for mode in modes:
        _check_pipeline_mode(mode, args)
    predicted = predicted_rows(args)
    measured: list[dict[str, Any]] = []
    if not args.no_measure:
        results = [measure_mode(mode, args) for mode in modes]
        measured = measured_rows(results, args.dtype)
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
        if any(pipeline_stages(m) > 1 for m in modes):
            notes.insert(1, PIPELINE_NOTE)
        if not args.json:
            _print_measured(measured, args.ranks)
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
        params={**{k: v for k, v in vars(args).items() if not k.startswith("_")},
                "modes": ",".join(modes)},  # the default resolved: those the ranks allow
        notes=notes, extra={"measured": measured, "zeropp_published": ZEROPP_PUBLISHED,
                                  "zeropp_setting": setting})
    report.emit(as_json=args.json, results_dir=args.results_dir, save=not args.no_save)
    return 0 if all(r["status"] != "error" for r in measured) else 1
