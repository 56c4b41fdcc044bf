"""``infinity plan --nodes N``: the mesh (pipeline x replicate x shard x tensor), hpZ and ZeRO++'s
quantized collectives for a model on N nodes x G GPUs with two link kinds.

Example (the issue #17 case: 4 nodes of 8 H100s, NVLink 900 GB/s, InfiniBand 50 GB/s per node)::

    infinity plan --params 7e9 --nodes 4 --gpus-per-node 8 --intra-node-gbps 900 \\
        --inter-node-gbps 50 --out-native infinity.json

The pricing is :func:`infinity.ledger.make_mesh_plan` ([Note: mesh time model] in
infinity/ledger/_mesh_plan.py); this module turns the arguments into its request, prints the
table (candidate, memory per rank, bytes per step inside / across nodes, the pipeline's bubble,
predicted step time)
and writes the chosen configuration. Figures not given are assumed (an H100 node) and the
output says which.
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from infinity._common import GiB, format_bytes
from infinity.cli._estimate import resolve_model
from infinity.ledger import (DEFAULT_MFU, DEFAULT_QUANTIZATION_BLOCK_NUMEL, GB, Cluster,
                             MeshPlan, MeshRequest, ModelShape, make_mesh_plan, mesh_config_dict)

logger = logging.getLogger(__name__)

__all__ = ["add_mesh_arguments", "format_mesh_plan", "mesh_plan_to_dict", "mesh_request_from_args",
           "run_mesh", "write_mesh_config"]

ASSUMED = {  # an H100 SXM node, where a figure is not given
    "gpus_per_node": 8, "gpu_memory_gb": 80.0, "device_tflops": 989.0, "device_mem_gbs": 3350.0,
    "intra_node_gbps": 900.0, "inter_node_gbps": 50.0,
}
TABLE_ROWS = 12
"""Candidates printed without --all (fastest first, the fitting ones before the others)."""


def add_mesh_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of the planner past one node (``--nodes`` switches it on)."""
    g = parser.add_argument_group("past one node (--nodes switches to the mesh planner)")
    g.add_argument("--nodes", type=int, help="nodes; with --gpus-per-node (default 8) the world")
    g.add_argument("--intra-node-gbps", type=float,
                   help=f"per GPU, GB/s inside a node (NVLink bus bandwidth; default "
                   f"{ASSUMED['intra_node_gbps']:g})")
    g.add_argument("--inter-node-gbps", type=float,
                   help=f"per node, GB/s across nodes (all its NICs; default "
                   f"{ASSUMED['inter_node_gbps']:g})")
    g.add_argument("--mfu", type=float, default=DEFAULT_MFU,
                   help=f"model FLOP utilisation of the compute (default {DEFAULT_MFU})")
    g.add_argument("--quantization-block-numel", type=int, default=DEFAULT_QUANTIZATION_BLOCK_NUMEL,
                   help="elements per qwZ / qgZ block (one fp32 scale each)")
    g.add_argument("--gradient-bits", type=int, choices=(8, 4), default=8, help="qgZ bits")
    g.add_argument("--max-tensor", type=int, help="largest tensor-parallel degree to try")
    g.add_argument("--pipeline", default="auto", metavar="{auto,off,N}",
                   help="pipeline stages: auto (default) prices every degree that divides the "
                   "GPUs, off none, N that one beside no pipeline (1F1B schedule)")


def mesh_request_from_args(args: argparse.Namespace) -> tuple[MeshRequest, Cluster, list[str]]:
    """(request, cluster, notes on the assumed figures); ``ValueError`` names the flag."""
    notes: list[str] = []

    def figure(value: float | None, key: str, what: str) -> float:
        if value is not None:
            return value
        notes.append(f"{what} assumed {ASSUMED[key]:g} (pass --{key.replace('_', '-')})")
        return ASSUMED[key]

    if args.nodes < 1:
        raise ValueError(f"--nodes: expected >= 1, got {args.nodes}")
    pipeline = _pipeline_degrees(args.pipeline)
    per_node = args.gpus_per_node or ASSUMED["gpus_per_node"]
    if per_node < 1:
        raise ValueError(f"--gpus-per-node: expected >= 1, got {per_node}")
    if args.gpus is not None and args.gpus != args.nodes * per_node:
        raise ValueError(f"--gpus {args.gpus} contradicts --nodes {args.nodes} x --gpus-per-node "
                         f"{per_node}; drop --gpus (the mesh planner takes nodes x GPUs per node)")
    numel, shape = resolve_model(args)
    if shape is None:
        shape = ModelShape.assumed(numel, seq_len=args.seq_len or 2048)
        notes.append("model shape assumed from the parameter count (pass --model CONFIG)")
    cluster = Cluster(nodes=args.nodes, gpus_per_node=per_node,
                      intra_node_bytes_per_s=figure(args.intra_node_gbps, "intra_node_gbps",
                                                    "intra-node bandwidth (GB/s per GPU)") * GB,
                      inter_node_bytes_per_s=figure(args.inter_node_gbps, "inter_node_gbps",
                                                    "inter-node bandwidth (GB/s per node)") * GB)
    ckpt = {"auto": (False, True), "on": (True,), "off": (False,)}[args.checkpointing]
    memory_gb = figure(args.gpu_memory_gb, "gpu_memory_gb", "GPU memory (GiB)")
    tflops = figure(args.device_tflops, "device_tflops", "peak TFLOP/s per GPU")
    mem_gbs = figure(args.device_mem_gbs, "device_mem_gbs", "device memory bandwidth (GB/s)")
    req = MeshRequest(numel=numel, shape=shape, dtype=args.dtype, reduce_dtype=args.reduce_dtype,
                      micro_batch=args.micro_batch or 1, global_batch=args.global_batch,
                      checkpointing=ckpt, device_memory_bytes=int(memory_gb * GiB),
                      device_flops=tflops * 1e12, mfu=args.mfu,
                      device_memory_bytes_per_s=mem_gbs * GB,
                      quantization_block_numel=args.quantization_block_numel,
                      gradient_bits=args.gradient_bits, headroom=args.headroom,
                      max_tensor=args.max_tensor, pipeline_degrees=pipeline)
    return req, cluster, notes


def _pipeline_degrees(value: str) -> tuple[int, ...] | None:
    """--pipeline: 'auto' -> None (every degree), 'off' -> (), N -> (N,)."""
    if value in ("auto", "off"):
        return None if value == "auto" else ()
    try:
        stages = int(value)
    except ValueError:
        stages = 0
    if stages < 1:
        raise ValueError(f"--pipeline: expected auto, off or a stage count >= 1, got {value!r}")
    return (stages,)


def mesh_plan_to_dict(plan: MeshPlan, *, show_all: bool = False) -> dict[str, Any]:
    req, cl = plan.request, plan.cluster
    ranked = sorted(plan.candidates, key=lambda c: (not c.fits, c.step_s))
    base = plan.baseline()
    out: dict[str, Any] = {
        "model": {"numel": req.numel, "shape": req.shape.to_dict()},
        "cluster": {"nodes": cl.nodes, "gpus_per_node": cl.gpus_per_node,
                    "intra_node_bytes_per_s": cl.intra_node_bytes_per_s,
                    "inter_node_bytes_per_s": cl.inter_node_bytes_per_s},
        "fits": plan.fits, "best": plan.best.to_dict() if plan.best else None,
        "baseline": base.to_dict() if base else None,
        "candidates": [c.to_dict() for c in (ranked if show_all else ranked[:TABLE_ROWS])]}
    if plan.best is not None:
        out["config"] = mesh_config_dict(plan.best, req)
    return out


def format_mesh_plan(plan: MeshPlan, *, show_all: bool = False) -> str:
    req, cl, best = plan.request, plan.cluster, plan.best
    lines = [f"model: {req.numel:,} params, seq {req.shape.seq_len}, {req.dtype}; cluster: "
             f"{cl.nodes} node(s) x {cl.gpus_per_node} GPU(s), "
             f"{cl.intra_node_bytes_per_s / GB:g} GB/s per GPU inside a node, "
             f"{cl.inter_node_bytes_per_s / GB:g} GB/s per node across nodes",
             f"{'candidate':<36} {'ckpt':>4} {'GA':>3} {'mem/rank':>10} {'fits':>4} "
             f"{'intra GB':>9} {'inter GB':>9} {'bubble':>6} {'step s':>8} {'x flat':>7}  bound"]
    base = plan.baseline()
    ranked = sorted(plan.candidates, key=lambda c: (not c.fits, c.step_s))
    for c in ranked if show_all else ranked[:TABLE_ROWS]:
        mark = "  <- chosen" if c is best else ""
        x = f"{base.step_s / c.step_s:7.2f}" if base else "      -"
        bubble = f"{c.bubble_fraction:6.0%}" if c.layout.pipeline > 1 else "     -"
        lines.append(f"{c.layout.name:<36} {'on' if c.checkpointing else 'off':>4} "
                     f"{c.grad_accum:>3} {format_bytes(c.need_bytes):>10} "
                     f"{'yes' if c.fits else 'no':>4} {c.intra_bytes / 1e9:>9.2f} "
                     f"{c.inter_bytes / 1e9:>9.2f} {bubble} {c.step_s:>8.3f} {x}  {c.bound}{mark}")
    lines.append("(bytes: sent per rank per optimizer step, a pipeline's send/recv included; "
                 "pp K: K pipeline stages, GA their micro-batches, bubble (K-1)/(GA+K-1); "
                 "x flat: flat ZeRO-3's step time / this one's)")
    if best is None:
        lines.append("NO CANDIDATE FITS the GPU memory: add GPUs or nodes, or offload "
                     "(single-node planner: drop --nodes)")
    else:
        lines.append(f"chosen: {best.describe()}: {best.step_s:.3f} s per step, "
                     f"{best.tokens_per_step / best.step_s:,.0f} tokens/s over {cl.world_size} GPUs")
        lines.append("config: " + json.dumps(mesh_config_dict(best, req)))
    return "\n".join(lines)


def write_mesh_config(plan: MeshPlan, path: str) -> None:
    """The chosen candidate as a native config file (``mesh`` + ``zero`` ZeRO++ keys)."""
    if plan.best is None:
        raise ValueError("no candidate fits; nothing to write")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(mesh_config_dict(plan.best, plan.request), f, indent=2)
        f.write("\n")


def run_mesh(args: argparse.Namespace) -> int:
    if args.out_deepspeed:
        raise ValueError("--out-deepspeed with --nodes: the DeepSpeed form of a mesh (MiCS, "
                         "tensor parallelism) is not written yet; use --out-native")
    req, cluster, notes = mesh_request_from_args(args)
    try:
        plan = make_mesh_plan(req, cluster)
    except ValueError as e:
        if not req.pipeline_degrees:
            raise
        raise ValueError(f"--pipeline {args.pipeline}: {e}") from e
    written = []
    if plan.fits and args.out_native:
        write_mesh_config(plan, args.out_native)
        written.append(args.out_native)
    if args.json:
        out = mesh_plan_to_dict(plan, show_all=args.all)
        out["notes"], out["written"] = notes, written
        print(json.dumps(out, indent=2, default=float))
    else:
        print(format_mesh_plan(plan, show_all=args.all))
        for path in written:
            print(f"wrote {path}")
        for note in notes:
            print(f"note: {note}")
    return 0 if plan.fits else 1
