"""``infinity plan``: the fastest configuration that fits a model on the given hardware.

Example (the acceptance case: full fine-tuning of a 7B model on a 4 x 24 GB workstation)::

    infinity plan --params 7e9 --gpus 4 --gpu-memory-gb 24 --host-memory-gb 128 \\
        --nvme-path /mnt/nvme --out-native infinity.json --out-deepspeed ds_config.json

With ``--nodes N`` it plans past one node instead (mesh, hpZ, quantized collectives, tensor
parallelism: :mod:`._plan_mesh`). This module is the command's I/O: it gathers the hardware (:mod:`._hardware`), prices every
candidate with the pure pricing of :mod:`infinity.ledger` (how it chooses, and [Note: time model],
are there), prints the table and writes the chosen configuration. Figures not given are measured
where cheap (RAM, disk capacity, a direct-I/O probe, GPU memory) and assumed otherwise; the output
says which.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
from typing import Any

from infinity._common import MiB, format_bytes
from infinity.cli._estimate import add_model_arguments, gpus_per_node, resolve_model
from infinity.cli._hardware import detect_hardware
from infinity.cli._plan_mesh import add_mesh_arguments, run_mesh
from infinity.config import (AUTO, ActivationCheckpointingConfig, InfinityConfig, MemoryConfig,
                             OffloadConfig, PrecisionConfig, ZeroConfig, config_to_deepspeed,
                             load_config)
from infinity.ledger import (ACTIVATION_STAGING_BYTES, DEFAULT_SUB_GROUP_NUMEL,
                             DEVICE_RESERVE_BYTES, HOST_RESERVE_BYTES,
                             MICRO_BATCHES, Candidate, Hardware, ModelShape, Plan, PlanRequest,
                             Tier, make_plan)

logger = logging.getLogger(__name__)

__all__ = ["add_arguments", "format_plan", "plan_to_dict", "request_from_args", "run", "to_config",
           "write_configs"]


# ----------------------------------------------------------------------------------------------
# The chosen configuration as files


def to_config(plan: Plan) -> InfinityConfig:
    """The native config of the chosen candidate, with byte budgets from its ledger."""
    best, req, hw = plan.best, plan.request, plan.hardware
    if best is None:
        raise ValueError("no configuration fits; see the table for the tier that overflows")
    if req.optimizer != "adam":
        raise ValueError(f"the engine runs Adam/AdamW only; a plan for --optimizer {req.optimizer} is "
                         "an estimate and cannot be written as a config (drop --out-native/"
                         "--out-deepspeed or plan with --optimizer adam)")
    nvme_path = req.nvme_path or tempfile.gettempdir()

    def offload(name: str, device: str) -> OffloadConfig:
        return OffloadConfig(name=name, device=device, nvme_path=nvme_path if device == "nvme" else None)

    sub_group = DEFAULT_SUB_GROUP_NUMEL if best.offload_optimizer == "nvme" else AUTO
    device_budget = AUTO
    if not hw.shared_device_host:
        # Everything on the device but activations and the reserve is the managed shards' budget.
        device_budget = max(best.ledger.tier_bytes(Tier.DEVICE),
                            best.usable_bytes["device"] - best.activations.device_bytes
                            - DEVICE_RESERVE_BYTES)
    # The host arena also holds activations offloaded to it, or stages those bound for NVMe.
    host_need = (best.ledger.tier_bytes(Tier.HOST) + best.activations.host_bytes
                 + (ACTIVATION_STAGING_BYTES if best.activations.nvme_bytes else 0))
    host_budget = int(math.ceil(host_need * 1.05 / MiB)) * MiB if host_need else AUTO
    return InfinityConfig(
        zero=ZeroConfig(stage=best.stage, sub_group_numel=sub_group),
        offload_param=offload("offload_param", best.offload_param),
        offload_optimizer=offload("offload_optimizer", best.offload_optimizer),
        memory=MemoryConfig(device_budget_bytes=device_budget, host_budget_bytes=host_budget),
        precision=PrecisionConfig(dtype=req.dtype, reduce_dtype=req.reduce_dtype),
        gradient_accumulation_steps=best.grad_accum,
        train_micro_batch_size_per_gpu=best.micro_batch,
        activation_checkpointing=ActivationCheckpointingConfig(
            units="all" if best.checkpointing else "none", offload=best.offload_activations,
            nvme_path=(nvme_path if best.offload_activations == "nvme" and "nvme" not in (
                best.offload_param, best.offload_optimizer) else None)))


def write_configs(plan: Plan, *, native_path: str | None, deepspeed_path: str | None) -> list[str]:
    """Write the native and/or DeepSpeed form; both are read back through ``load_config``."""
    config = to_config(plan)
    written = []
    for path, payload in ((native_path, config.to_dict()), (deepspeed_path, config_to_deepspeed(config))):
        if not path:
            continue
        with open(path, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2)
            f.write("\n")
        load_config(path)  # what we write must load; a failure here is our bug, said loudly
        written.append(path)
    return written


# ----------------------------------------------------------------------------------------------
# Command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.set_defaults(gpus=None)
    hw = parser.add_argument_group("hardware (measured on this machine when not given)")
    hw.add_argument("--gpu-memory-gb", type=float, help="memory per GPU in GiB (as vendors label it)")
    hw.add_argument("--host-memory-gb", type=float, help="host RAM per node in GiB")
    hw.add_argument("--nvme-path", help="directory on the NVMe disk (default: the temp directory)")
    hw.add_argument("--nvme-gb", type=float, help="NVMe capacity per node in GiB (default: free space)")
    hw.add_argument("--nvme-read-gbs", type=float, help="NVMe read bandwidth per node, GB/s")
    hw.add_argument("--nvme-write-gbs", type=float, help="NVMe write bandwidth per node, GB/s")
    hw.add_argument("--no-nvme", action="store_true", help="no NVMe tier")
    hw.add_argument("--no-probe", action="store_true", help="assume NVMe bandwidth, do not measure")
    hw.add_argument("--device-tflops", type=float, help="achievable dense TFLOP/s per device")
    hw.add_argument("--device-mem-gbs", type=float, help="device memory bandwidth, GB/s")
    hw.add_argument("--link-gbs", type=float, help="collective bandwidth per rank, GB/s")
    hw.add_argument("--pcie-gbs", type=float, help="host-device bandwidth per device, GB/s")
    hw.add_argument("--host-mem-gbs", type=float, help="host memory bandwidth per node, GB/s")
    job = parser.add_argument_group("training job")
    job.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    job.add_argument("--global-batch", type=int, help="sequences per optimizer step (default max(64, N))")
    job.add_argument("--micro-batch", type=int, help="fix the micro-batch instead of searching")
    job.add_argument("--checkpointing", choices=("auto", "on", "off"), default="auto",
                     help="activation checkpointing (auto: search both)")
    job.add_argument("--headroom", type=float, default=0.10, help="fraction of each tier kept free")
    job.add_argument("--reduce-dtype", choices=("fp32", "compute"), default="fp32",
                     help="dtype gradients cross ranks in: fp32 (default, exact) or the compute "
                     "dtype (half the bytes with bf16/fp16)")
    parser.add_argument("--out-native", metavar="PATH", help="write the native config here")
    parser.add_argument("--out-deepspeed", metavar="PATH", help="write a DeepSpeed ds_config.json here")
    parser.add_argument("--all", action="store_true", help="list every fitting candidate, fastest first")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_mesh_arguments(parser)


def request_from_args(args: argparse.Namespace, hw: Hardware) -> PlanRequest:
    numel, shape = resolve_model(args)
    assumed = shape is None
    if shape is None:
        shape = ModelShape.assumed(numel, seq_len=args.seq_len or 2048)
    if not 0.0 <= args.headroom < 1.0:
        raise ValueError(f"--headroom: expected a fraction in [0, 1), got {args.headroom}")
    global_batch = args.global_batch or max(64, hw.gpus)
    if args.micro_batch:
        if args.micro_batch < 1:
            raise ValueError(f"--micro-batch: expected >= 1, got {args.micro_batch}")
        global_batch = max(global_batch, args.micro_batch * hw.gpus)
    if global_batch < 1:
        raise ValueError(f"--global-batch: expected >= 1, got {global_batch}")
    ckpt = {"auto": (False, True), "on": (True,), "off": (False,)}[args.checkpointing]
    mbs = (args.micro_batch,) if args.micro_batch else MICRO_BATCHES
    return PlanRequest(numel=numel, shape=shape, shape_assumed=assumed, optimizer=args.optimizer,
                       dtype=args.dtype, global_batch=global_batch, headroom=args.headroom,
                       micro_batches=mbs, checkpointing=ckpt, nvme_path=args.nvme_path,
                       reduce_dtype=args.reduce_dtype)


def plan_to_dict(plan: Plan, *, show_all: bool = False) -> dict[str, Any]:
    hw, req = plan.hardware, plan.request
    out: dict[str, Any] = {
        "model": {"numel": req.numel, "shape": req.shape.to_dict(), "shape_assumed": req.shape_assumed},
        "hardware": {k: v for k, v in hw.__dict__.items() if k != "notes"},
        "notes": list(hw.notes), "fits": plan.fits, "best": None}
    if plan.best is not None:
        out["best"] = _candidate_dict(plan.best)
        if req.optimizer == "adam":
            config = to_config(plan)
            out["config"] = config.to_dict()
            out["deepspeed_config"] = config_to_deepspeed(config)
    if show_all:
        ranked = sorted((c for c in plan.candidates if c.fits), key=lambda c: c.s_per_token)
        out["fitting"] = [_candidate_dict(c) for c in ranked]
    return out


def _candidate_dict(c: Candidate) -> dict[str, Any]:
    return {"stage": c.stage, "offload_param": c.offload_param,
            "offload_optimizer": c.offload_optimizer, "micro_batch": c.micro_batch,
            "gradient_accumulation_steps": c.grad_accum, "checkpointing": c.checkpointing,
            "offload_activations": c.offload_activations,
            "need_bytes": c.need_bytes, "usable_bytes": c.usable_bytes, "times_s": c.times_s,
            "step_s": c.step_s, "tokens_per_s": 1.0 / c.s_per_token, "bound": c.bound,
            "ledger": c.ledger.to_dict(), "activations": c.activations.to_dict()}


def format_plan(plan: Plan) -> str:
    """The one table that explains the choice: memory per tier with headroom, time per resource."""
    hw, req, best = plan.hardware, plan.request, plan.best
    lines = [f"model: {req.numel:,} params"
             + (" (shape assumed from the count)" if req.shape_assumed else "")
             + f", seq {req.shape.seq_len}, {req.dtype}, optimizer {req.optimizer}, "
             f"global batch {req.global_batch}; hardware: {hw.gpus} device(s), {hw.ranks_per_node}/node"]
    if best is None:
        closest = min(plan.candidates, key=lambda c: max(
            c.need_bytes[t] / max(1, c.usable_bytes[t]) for t in c.need_bytes))
        lines.append("NO CONFIGURATION FITS. Closest: " + closest.describe())
        lines += _memory_rows(closest, hw.ranks_per_node)
        return "\n".join(lines + [f"note: {n}" for n in hw.notes])
    lines.append(f"chosen: {best.describe()}")
    lines += _memory_rows(best, hw.ranks_per_node)
    lines.append(f"{'time per step':<22} {'seconds':>10}")
    for name, secs in sorted(best.times_s.items(), key=lambda kv: -kv[1]):
        mark = "  <- bounds the step" if name == best.bound else ""
        lines.append(f"  {name:<20} {secs:>10.3f}{mark}")
    lines.append(f"  {'step (overlapped)':<20} {best.step_s:>10.3f}   "
                 f"{1.0 / best.s_per_token:,.0f} tokens/s over {hw.gpus} device(s)")
    runners = sorted((c for c in plan.candidates if c.fits and c is not best),
                     key=lambda c: c.s_per_token)
    seen = {(best.stage, best.offload_param, best.offload_optimizer)}
    for c in runners:
        key = (c.stage, c.offload_param, c.offload_optimizer)
        if key in seen:
            continue
        seen.add(key)
        lines.append(f"  alternative: {c.describe()}: {c.s_per_token / best.s_per_token:.2f}x the time")
        if len(seen) > 3:
            break
    if best.checkpointing:
        lines.append("note: the native config turns activation checkpointing on (units 'all'"
                     + (f", inputs offloaded to {best.offload_activations}"
                        if best.offload_activations != "none" else "") + "); the "
                     "DeepSpeed form cannot carry it: with that file, checkpoint in the model "
                     "(torch.utils.checkpoint, use_reentrant=False)")
    return "\n".join(lines + [f"note: {n}" for n in hw.notes])


def _memory_rows(c: Candidate, ranks: int) -> list[str]:
    rows = [f"{'tier':<14} {'needed':>11} {'usable':>11} {'free':>5}  contents"]
    for name, need in c.need_bytes.items():
        usable = c.usable_bytes[name]
        left = f"{(usable - need) / usable:.0%}" if usable else "-"
        tiers = [Tier(name)] + ([Tier.DEVICE] if name == "host" and "device" not in c.need_bytes else [])
        parts = [f"{t}{'@' + tier.value if len(tiers) > 1 else ''} "
                 f"{format_bytes(c.ledger.states[t].get(tier, 0))}"
                 for tier in tiers for t in c.ledger.states if c.ledger.states[t].get(tier, 0)]
        parts += [f"{b} {format_bytes(v)}" for tier in tiers
                  for b, v in c.ledger.buffers.get(tier, {}).items()]
        if Tier.DEVICE in tiers:
            parts.append(f"activations {format_bytes(c.activations.total_bytes)}")
        if name == "device":
            parts.append(f"reserve {format_bytes(DEVICE_RESERVE_BYTES)}")
            contents, scope = ", ".join(parts), "/rank"
        else:
            contents = (f"{ranks} x ({', '.join(parts)})" if parts else "") + (
                f" + OS reserve {format_bytes(HOST_RESERVE_BYTES)}" if name == "host" else "")
            scope = "/node"
        rows.append(f"{name + ' ' + scope:<14} {format_bytes(need):>11} {format_bytes(usable):>11} "
                    f"{left:>5}  {contents}")
    return rows


def run(args: argparse.Namespace) -> int:
    if args.nodes is not None:  # past one node: the mesh planner (infinity/cli/_plan_mesh.py)
        return run_mesh(args)
    args.gpus_given = args.gpus is not None
    if args.gpus is None:
        args.gpus = 1  # replaced by the detected device count in detect_hardware
    hw = detect_hardware(args)
    args.gpus = hw.gpus
    gpus_per_node(args)  # validates --gpus / --gpus-per-node
    req = request_from_args(args, hw)
    plan = make_plan(req, hw)
    written = []
    if plan.fits and (args.out_native or args.out_deepspeed):
        written = write_configs(plan, native_path=args.out_native, deepspeed_path=args.out_deepspeed)
    if args.json:
        out = plan_to_dict(plan, show_all=args.all)
        out["written"] = written
        print(json.dumps(out, indent=2, default=float))
    else:
        print(format_plan(plan))
        for path in written:
            print(f"wrote {path}")
        if args.out_deepspeed and written:
            print("note: the DeepSpeed form has no place for memory budgets; the native form keeps them")
    return 0 if plan.fits else 1
