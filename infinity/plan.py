"""``infinity plan``: the fastest configuration that fits a model on the given hardware.

Example (the acceptance case: full fine-tuning of a 7B model on a 4 x 24 GB workstation)::

    infinity plan --params 7e9 --gpus 4 --gpu-memory-gb 24 --host-memory-gb 128 \\
        --nvme-path /mnt/nvme --out-native infinity.json --out-deepspeed ds_config.json

How it chooses: it enumerates every candidate (ZeRO stage, where parameters and optimizer state
live, micro-batch, activation checkpointing), prices each with the ledger of :mod:`infinity.estimate`
(bytes per tier, with headroom) and a simple time model, and picks the fastest that fits. Rules of
thumb ("a small model that fits should not use stage 3", "SGD gains little from stage 1") are not
coded: they fall out of the numbers.

[Note: time model] Per optimizer step, with GA micro-steps per step::

    step = (GA - 1) * micro + last_micro + boundary
    micro      = overlap(compute, link, pcie, nvme)       # per micro-step traffic
    last_micro = the same plus the gradient reduction stages 0-1 do once per step
    boundary   = overlap(optimizer, link, pcie, nvme)     # step, parameter all-gather, write-back
    overlap(xs) = max(xs) + EXPOSED_FRACTION * (sum(xs) - max(xs))

compute = 6 x params x tokens (8 x with checkpointing: forward again) / (FLOP rate x efficiency),
efficiency = tokens / (tokens + EFFICIENCY_KNEE_TOKENS) per micro-batch; ring collectives move
volume x (N-1)/N per rank over the link; NVMe bandwidth is shared by the ranks of a node; CPU Adam is
memory-bound at (2K + g + p) bytes per parameter over the host's memory bandwidth. Figures not given
are measured where cheap (RAM, disk capacity, a direct-I/O probe, GPU memory) and assumed otherwise;
the output says which.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from infinity._common import GiB, MiB, format_bytes
from infinity._ds_config import config_to_deepspeed
from infinity.config import (
    AUTO,
    InfinityConfig,
    MemoryConfig,
    OffloadConfig,
    PrecisionConfig,
    ZeroConfig,
    load_config,
)
from infinity.estimate import (
    DEFAULT_SUB_GROUP_NUMEL,
    GB,
    Activations,
    Ledger,
    ModelShape,
    StateTerms,
    Tier,
    activation_bytes,
    estimate_model_states,
)
from infinity.estimate_cli import add_model_arguments, gpus_per_node, resolve_model

logger = logging.getLogger(__name__)

EXPOSED_FRACTION = 0.25
"""Share of the non-bounding work that overlap fails to hide (see [Note: time model])."""
EFFICIENCY_KNEE_TOKENS = 512
"""Tokens per micro-batch at which the device reaches half its FLOP rate."""
DEVICE_RESERVE_BYTES = 1 * GiB
"""CUDA context, allocator slack and kernels' workspaces: device bytes no ledger term counts."""
HOST_RESERVE_BYTES = 8 * GiB
"""The OS, the Python processes and data loaders: host bytes no ledger term counts."""
MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)
COLLECTIVE_LATENCY_S = 100e-6
"""Fixed cost of one collective (launch, synchronisation, hook dispatch), paid per unit or bucket."""
BUCKET_BYTES = 25 * MiB
"""Gradient bucket of stages 0-1 (DDP's default), which sets how many all-reduces a step issues."""


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One node type; bandwidths in bytes per second, capacities in bytes."""

    gpus: int
    gpus_per_node: int
    device_memory_bytes: int
    """Per device; on a machine without a GPU the device tier is CPU memory (``shared_device_host``)."""
    host_memory_bytes: int
    """Per node."""
    nvme_capacity_bytes: int
    """Per node; 0: no NVMe tier."""
    nvme_read_bytes_per_s: float
    nvme_write_bytes_per_s: float
    device_flops: float
    device_memory_bytes_per_s: float
    link_bytes_per_s: float
    """Collective bandwidth per rank (ring bus bandwidth)."""
    pcie_bytes_per_s: float
    host_memory_bytes_per_s: float
    """Per node, for CPU Adam."""
    shared_device_host: bool = False
    notes: tuple[str, ...] = ()

    @property
    def ranks_per_node(self) -> int:
        return min(self.gpus_per_node, self.gpus)


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One priced configuration."""

    stage: int
    offload_param: str
    offload_optimizer: str
    micro_batch: int
    checkpointing: bool
    grad_accum: int
    ledger: Ledger
    activations: Activations
    need_bytes: dict[str, int]
    """tier -> bytes needed (device: per rank incl. activations and reserve; host, nvme: per node)."""
    usable_bytes: dict[str, int]
    """tier -> bytes available after headroom (same scope as ``need_bytes``)."""
    times_s: dict[str, float]
    """Per optimizer step: seconds each resource is busy (compute, link, pcie, nvme, optimizer)."""
    step_s: float
    tokens_per_step: int

    @property
    def fits(self) -> bool:
        return all(self.need_bytes[t] <= self.usable_bytes[t] for t in self.need_bytes)

    @property
    def bound(self) -> str:
        return max(self.times_s, key=self.times_s.get)

    @property
    def s_per_token(self) -> float:
        return self.step_s / self.tokens_per_step

    @property
    def offload_rank(self) -> int:
        """Tie-break: fewer and slower tiers in use is simpler."""
        rank = {"none": 0, "cpu": 1, "nvme": 2}
        return rank[self.offload_param] + rank[self.offload_optimizer]

    def describe(self) -> str:
        return (f"stage {self.stage}, offload_param {self.offload_param}, offload_optimizer "
                f"{self.offload_optimizer}, micro-batch {self.micro_batch} x GA {self.grad_accum}, "
                f"checkpointing {'on' if self.checkpointing else 'off'}")


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    numel: int
    shape: ModelShape
    shape_assumed: bool
    optimizer: str = "adam"
    dtype: str = "bf16"
    global_batch: int = 64
    headroom: float = 0.10
    micro_batches: tuple[int, ...] = MICRO_BATCHES
    checkpointing: tuple[bool, ...] = (False, True)
    nvme_path: str | None = None


@dataclass(frozen=True, kw_only=True)
class Plan:
    request: PlanRequest
    hardware: Hardware
    best: Candidate | None
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.best is not None


# ----------------------------------------------------------------------------------------------
# Pricing


def _overlap(times: list[float]) -> float:
    top = max(times)
    return top + EXPOSED_FRACTION * (sum(times) - top)


def price(req: PlanRequest, hw: Hardware, *, stage: int, offload_param: str,
          offload_optimizer: str, micro_batch: int, checkpointing: bool) -> Candidate:
    """Memory per tier and time per step of one configuration (see [Note: time model])."""
    n, psi, s = hw.gpus, req.numel, req.shape.seq_len
    terms = StateTerms.for_training(
        dtype=req.dtype, optimizer=req.optimizer,
        separate_master=req.dtype != "fp32" or offload_optimizer != (
            offload_param if stage == 3 else "none"))
    ledger = estimate_model_states(
        psi, stage, n, terms, offload_param=offload_param, offload_optimizer=offload_optimizer,
        gpus_per_node=hw.ranks_per_node, sub_group_numel=DEFAULT_SUB_GROUP_NUMEL,
        unit_numel=req.shape.largest_unit_numel())
    acts = activation_bytes(req.shape, micro_batch=micro_batch, checkpointing=checkpointing,
                            dtype_bytes=int(terms.param_bytes))
    need, usable = _memory(ledger, acts, hw, req.headroom)
    ga = max(1, math.ceil(req.global_batch / (n * micro_batch)))
    times, step_s = _step_time(req, hw, ledger, stage=stage, micro_batch=micro_batch,
                               checkpointing=checkpointing, ga=ga)
    return Candidate(stage=stage, offload_param=offload_param, offload_optimizer=offload_optimizer,
                     micro_batch=micro_batch, checkpointing=checkpointing, grad_accum=ga,
                     ledger=ledger, activations=acts, need_bytes=need, usable_bytes=usable,
                     times_s=times, step_s=step_s, tokens_per_step=ga * n * micro_batch * s)


def _memory(ledger: Ledger, acts: Activations, hw: Hardware,
            headroom: float) -> tuple[dict[str, int], dict[str, int]]:
    device = ledger.tier_bytes(Tier.DEVICE) + acts.total_bytes
    host = ledger.node_bytes(Tier.HOST) + HOST_RESERVE_BYTES
    nvme = ledger.node_bytes(Tier.NVME)
    keep = 1.0 - headroom
    if hw.shared_device_host:
        # No GPU: the "device" tier is the same RAM as the host tier; both draw on one pool.
        need = {"host": host + device * hw.ranks_per_node, "nvme": nvme}
        usable = {"host": int(hw.host_memory_bytes * keep)}
    else:
        need = {"device": device + DEVICE_RESERVE_BYTES, "host": host, "nvme": nvme}
        usable = {"device": int(hw.device_memory_bytes * keep), "host": int(hw.host_memory_bytes * keep)}
    usable["nvme"] = int(hw.nvme_capacity_bytes * keep)
    return need, usable


def _step_time(req: PlanRequest, hw: Hardware, ledger: Ledger, *, stage: int, micro_batch: int,
               checkpointing: bool, ga: int) -> tuple[dict[str, float], float]:
    n, psi, t = hw.gpus, req.numel, ledger.terms
    p, g, k, og = t.param_bytes, t.grad_bytes, t.optimizer_bytes, t.optimizer_grad_bytes
    shard = psi / n
    ring = (n - 1) / n
    link = hw.link_bytes_per_s
    nvme_r = hw.nvme_read_bytes_per_s / hw.ranks_per_node
    nvme_w = hw.nvme_write_bytes_per_s / hw.ranks_per_node
    op, oo = ledger.offload_param, ledger.offload_optimizer

    tokens = micro_batch * req.shape.seq_len
    efficiency = tokens / (tokens + EFFICIENCY_KNEE_TOKENS)
    compute = (8 if checkpointing else 6) * psi * tokens / (hw.device_flops * efficiency)

    # Per micro-step traffic. Stage 3 gathers every unit twice and reduce-scatters it once; stage 2
    # reduce-scatters each unit; each collective also pays a fixed latency.
    units = req.shape.num_units() if n > 1 else 0
    latency = COLLECTIVE_LATENCY_S if n > 1 else 0.0
    link_micro = {0: 0.0, 1: 0.0, 2: psi * g * ring, 3: psi * (2 * p + g) * ring}[stage] / link
    link_micro += {2: units, 3: 3 * units}.get(stage, 0) * latency
    # The first unit of forward and of backward is gathered before any compute can hide it.
    fill = 2 * req.shape.largest_unit_numel() * p * ring / link if stage == 3 else 0.0
    pcie_micro = (2 * shard * p if op != "none" else 0.0)
    if oo != "none" and stage >= 2:
        pcie_micro += shard * g  # each micro-step's gradient shard leaves the device
    nvme_micro = (2 * shard * p / nvme_r if op == "nvme" else 0.0)
    if oo == "nvme" and stage >= 2:
        nvme_micro += shard * og / nvme_w
    micro = fill + _overlap([compute, link_micro, pcie_micro / hw.pcie_bytes_per_s, nvme_micro])
    # Stages 0-1 reduce gradients once per step in buckets, overlapping the last backward.
    reduce_once = {0: 2 * psi * g * ring, 1: psi * g * ring}.get(stage, 0.0) / link
    if stage < 2 and n > 1:
        reduce_once += math.ceil(psi * g / BUCKET_BYTES) * latency
    pcie_last = pcie_micro + (shard * g if oo != "none" and stage == 1 else 0.0)
    last = fill + _overlap([compute, link_micro + reduce_once, pcie_last / hw.pcie_bytes_per_s,
                            nvme_micro])

    # Boundary: the optimizer pass, its I/O, and the parameter all-gather of stages 1-2.
    stepped = psi if stage == 0 else shard
    if oo == "none":
        opt = stepped * (2 * k + g + p) / hw.device_memory_bytes_per_s
    else:
        opt = stepped * (2 * k + og + p) / (hw.host_memory_bytes_per_s / hw.ranks_per_node)
    link_b = psi * p * ring / link if stage in (1, 2) else 0.0
    param_home = op if stage == 3 else "none"
    pcie_b = shard * p if oo != "none" and param_home == "none" else 0.0
    nvme_b = 0.0
    if oo == "nvme":
        nvme_b += stepped * (k + (og if stage >= 2 else 0)) / nvme_r + stepped * k / nvme_w
    if param_home == "nvme":
        nvme_b += shard * p / nvme_w
    boundary = _overlap([opt, link_b, pcie_b / hw.pcie_bytes_per_s, nvme_b])

    times = {
        "compute": ga * compute,
        "link": ga * (link_micro + fill) + reduce_once + link_b,
        "pcie": ((ga - 1) * pcie_micro + pcie_last + pcie_b) / hw.pcie_bytes_per_s,
        "nvme": ga * nvme_micro + nvme_b,
        "optimizer": opt,
    }
    return times, (ga - 1) * micro + last + boundary


def candidates(req: PlanRequest, hw: Hardware) -> list[Candidate]:
    """Every configuration the engine can run, priced."""
    tiers = ["none", "cpu"] + (["nvme"] if hw.nvme_capacity_bytes > 0 else [])
    out = []
    per_rank_batch = max(1, req.global_batch // hw.gpus)
    micro_batches = [m for m in req.micro_batches if m <= per_rank_batch] or [1]
    for stage in (0, 1, 2, 3):
        for oo in tiers:
            for op in (tiers if stage == 3 else ["none"]):
                for ckpt in req.checkpointing:
                    for mb in micro_batches:
                        out.append(price(req, hw, stage=stage, offload_param=op,
                                         offload_optimizer=oo, micro_batch=mb, checkpointing=ckpt))
    return out


def make_plan(req: PlanRequest, hw: Hardware) -> Plan:
    """Price all candidates; the best is the fastest per token that fits (ties: simpler first)."""
    priced = candidates(req, hw)
    fitting = [c for c in priced if c.fits]
    fitting.sort(key=lambda c: (c.s_per_token, c.stage, c.offload_rank, c.checkpointing))
    return Plan(request=req, hardware=hw, best=fitting[0] if fitting else None, candidates=priced)


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
                            best.usable_bytes["device"] - best.activations.total_bytes
                            - DEVICE_RESERVE_BYTES)
    host_need = best.ledger.tier_bytes(Tier.HOST)
    host_budget = int(math.ceil(host_need * 1.05 / MiB)) * MiB if host_need else AUTO
    return InfinityConfig(
        zero=ZeroConfig(stage=best.stage, sub_group_numel=sub_group),
        offload_param=offload("offload_param", best.offload_param),
        offload_optimizer=offload("offload_optimizer", best.offload_optimizer),
        memory=MemoryConfig(device_budget_bytes=device_budget, host_budget_bytes=host_budget),
        precision=PrecisionConfig(dtype=req.dtype),
        gradient_accumulation_steps=best.grad_accum,
        train_micro_batch_size_per_gpu=best.micro_batch)


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
# Hardware: given, measured, or assumed (each figure's origin goes into the notes)


def probe_disk_bandwidth(directory: str, nbytes: int = 256 * MiB) -> tuple[float, float, str]:
    """(read, write) bytes/s of ``directory``'s disk from one direct-I/O write and read back.

    Uses :class:`infinity.swapper.Swapper` (the engine's own I/O path) where it exists, otherwise a
    direct ``O_DIRECT`` probe of our own. One large transfer: a rough figure, not a benchmark.
    """
    try:
        from infinity.swapper import Swapper, aligned_empty
    except ImportError:
        return (*_probe_direct(directory, nbytes), "direct-I/O probe")
    buf = aligned_empty(nbytes, _uint8())
    buf.fill_(7)
    with Swapper(directory) as swapper:
        start = time.perf_counter()
        swapper.swap_out("plan-probe", buf).wait()
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        swapper.swap_in("plan-probe", buf).wait()
        read_s = time.perf_counter() - start
        how = "infinity.swapper" + (" (O_DIRECT)" if swapper.direct_io else " (buffered)")
    return nbytes / read_s, nbytes / write_s, how


def _uint8():
    import torch

    return torch.uint8


def _probe_direct(directory: str, nbytes: int) -> tuple[float, float]:
    import mmap

    block = 16 * MiB
    nbytes = max(block, nbytes // block * block)
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT requires
    buf.write(b"\x07" * block)
    path = os.path.join(directory, f".infinity-plan-probe-{os.getpid()}")
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # file system refuses O_DIRECT
    try:
        start = time.perf_counter()
        for off in range(0, nbytes, block):
            os.pwritev(fd, [buf], off)
        os.fsync(fd)
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        for off in range(0, nbytes, block):
            os.preadv(fd, [buf], off)
        read_s = time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(path)
    return nbytes / read_s, nbytes / write_s


def detect_hardware(args: argparse.Namespace) -> Hardware:
    """Hardware from the arguments, measuring what is cheap to measure and assuming the rest."""
    import psutil

    notes: list[str] = []
    cuda_count, cuda_memory = _cuda_devices() if args.gpu_memory_gb is None else (0, 0)
    gpus = args.gpus if args.gpus_given else (cuda_count or 1)
    shared = False
    if args.gpu_memory_gb is not None:
        device_memory = int(args.gpu_memory_gb * GiB)
    elif cuda_memory:
        device_memory = cuda_memory
        notes.append(f"GPU memory measured: {format_bytes(cuda_memory)} per device")
    else:
        device_memory, shared = psutil.virtual_memory().total, True
        notes.append("no GPU: the device tier is CPU memory, shared with the host tier")
    if args.host_memory_gb is not None:
        host_memory = int(args.host_memory_gb * GiB)
    else:
        host_memory = psutil.virtual_memory().total
        notes.append(f"host RAM measured: {format_bytes(host_memory)}")
    nvme_cap, nvme_r, nvme_w = _nvme(args, notes)
    per_node = min(args.gpus_per_node or min(gpus, 8), gpus)

    def figure(value: float | None, assumed: float, what: str) -> float:
        if value is not None:
            return value * GB
        notes.append(f"{what} assumed {assumed:g} GB/s (pass it to sharpen the time model)")
        return assumed * GB

    gpu = not shared
    link_default = (20.0 if per_node == gpus else 12.5) if gpu else 5.0
    flops = args.device_tflops * 1e12 if args.device_tflops else (100e12 if gpu else 0.1e12)
    if not args.device_tflops:
        notes.append(f"device FLOP rate assumed {flops / 1e12:g} TFLOP/s (--device-tflops)")
    return Hardware(
        gpus=gpus, gpus_per_node=per_node, device_memory_bytes=device_memory,
        host_memory_bytes=host_memory, nvme_capacity_bytes=nvme_cap, nvme_read_bytes_per_s=nvme_r,
        nvme_write_bytes_per_s=nvme_w, device_flops=flops,
        device_memory_bytes_per_s=figure(args.device_mem_gbs, 1000.0 if gpu else 10.0,
                                         "device memory bandwidth"),
        link_bytes_per_s=figure(args.link_gbs, link_default, "collective link bandwidth"),
        pcie_bytes_per_s=figure(args.pcie_gbs, 20.0 if gpu else 10.0, "host-device (PCIe) bandwidth"),
        host_memory_bytes_per_s=figure(args.host_mem_gbs, 50.0 if gpu else 10.0,
                                       "host memory bandwidth (CPU Adam)"),
        shared_device_host=shared, notes=tuple(notes))


def _cuda_devices() -> tuple[int, int]:
    try:
        import torch
    except ImportError:
        return 0, 0
    if not torch.cuda.is_available():
        return 0, 0
    return torch.cuda.device_count(), torch.cuda.get_device_properties(0).total_memory


def _nvme(args: argparse.Namespace, notes: list[str]) -> tuple[int, float, float]:
    if args.no_nvme:
        return 0, 0.0, 0.0
    path = args.nvme_path or tempfile.gettempdir()
    if args.nvme_gb is not None:
        capacity = int(args.nvme_gb * GiB)
    else:
        capacity = shutil.disk_usage(path).free
        notes.append(f"NVMe capacity measured: {format_bytes(capacity)} free under {path}")
    if args.nvme_read_gbs is not None and args.nvme_write_gbs is not None:
        return capacity, args.nvme_read_gbs * GB, args.nvme_write_gbs * GB
    if args.no_probe:
        read, write = 2.0 * GB, 1.0 * GB
        notes.append("NVMe bandwidth assumed 2 GB/s read, 1 GB/s write (--no-probe)")
    else:
        try:
            read, write, how = probe_disk_bandwidth(path)
            notes.append(f"NVMe bandwidth measured under {path} with {how}: "
                         f"{read / GB:.2f} GB/s read, {write / GB:.2f} GB/s write")
        except (OSError, RuntimeError) as e:  # unwritable or full disk: plan on, say so
            read, write = 2.0 * GB, 1.0 * GB
            notes.append(f"NVMe bandwidth probe under {path} failed ({e}); assumed 2 GB/s read, "
                         "1 GB/s write")
    if args.nvme_read_gbs is not None:
        read = args.nvme_read_gbs * GB
    if args.nvme_write_gbs is not None:
        write = args.nvme_write_gbs * GB
    return capacity, read, write


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
    parser.add_argument("--out-native", metavar="PATH", help="write the native config here")
    parser.add_argument("--out-deepspeed", metavar="PATH", help="write a DeepSpeed ds_config.json here")
    parser.add_argument("--all", action="store_true", help="list every fitting candidate, fastest first")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


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
                       micro_batches=mbs, checkpointing=ckpt, nvme_path=args.nvme_path)


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
        lines.append("note: enable activation checkpointing in the model "
                     "(torch.utils.checkpoint, use_reentrant=False); configs do not carry it")
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
