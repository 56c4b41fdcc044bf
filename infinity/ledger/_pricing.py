"""The pricing behind ``infinity plan``: every configuration the engine can run, priced; the best that fits.

Pure: a :class:`PlanRequest` (the model and the job) and a :class:`Hardware` (one node type) in, a
:class:`Plan` out; no I/O, no measurement. The ``infinity plan`` command (:mod:`infinity.cli._plan`)
measures the hardware, writes the configs and prints the table.

How it chooses: it enumerates every candidate (ZeRO stage, where parameters and optimizer state
live, micro-batch, activation checkpointing), prices each with the ledger of :mod:`._estimate`
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
memory-bound at (2K + g + p) bytes per parameter over the host's memory bandwidth.

Public API
----------
``Hardware``, ``PlanRequest``, ``Candidate``, ``Plan`` (frozen records);
``price(req, hw, *, stage, offload_param, offload_optimizer, micro_batch, checkpointing) -> Candidate``,
``candidates(req, hw) -> list[Candidate]``, ``make_plan(req, hw) -> Plan``; the model's constants
``EXPOSED_FRACTION``, ``EFFICIENCY_KNEE_TOKENS``, ``DEVICE_RESERVE_BYTES``, ``HOST_RESERVE_BYTES``,
``MICRO_BATCHES``, ``COLLECTIVE_LATENCY_S``, ``BUCKET_BYTES``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field

from infinity._common import GiB, MiB
from infinity._tier import Tier
from infinity.config import DTYPE_BYTES
from infinity.ledger._activations import ACTIVATION_STAGING_BYTES, Activations, activation_bytes
from infinity.ledger._estimate import (DEFAULT_SUB_GROUP_NUMEL, ENGINE_GRAD_DTYPE, Ledger,
                                       StateTerms, estimate_model_states, host_grad_dtype_of)
from infinity.ledger._model_shape import ModelShape

logger = logging.getLogger(__name__)

__all__ = ["BUCKET_BYTES", "COLLECTIVE_LATENCY_S", "DEVICE_RESERVE_BYTES", "EFFICIENCY_KNEE_TOKENS",
           "EXPOSED_FRACTION", "HOST_RESERVE_BYTES", "MICRO_BATCHES", "Candidate", "Hardware", "Plan",
           "PlanRequest", "candidates", "make_plan", "price"]


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
    offload_activations: str = "none"
    """Where the checkpointed layers' inputs live: 'none' (the device), 'host', 'nvme'
    (``activation_checkpointing.offload``)."""
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
        rank = {"none": 0, "cpu": 1, "host": 1, "nvme": 2}
        return (rank[self.offload_param] + rank[self.offload_optimizer]
                + rank[self.offload_activations])

    def describe(self) -> str:
        return (f"stage {self.stage}, offload_param {self.offload_param}, offload_optimizer "
                f"{self.offload_optimizer}, micro-batch {self.micro_batch} x GA {self.grad_accum}, "
                f"checkpointing {'on' if self.checkpointing else 'off'}"
                + (f" (inputs on {self.offload_activations})"
                   if self.offload_activations != "none" else ""))


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
    offload_activations: tuple[str, ...] = ("none", "host", "nvme")
    """Where checkpointed candidates may keep the layers' inputs ('nvme' needs an NVMe tier)."""
    nvme_path: str | None = None
    reduce_dtype: str = "fp32"
    """precision.reduce_dtype of the configs priced: 'fp32' or 'compute' (the compute dtype)."""


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
          offload_optimizer: str, micro_batch: int, checkpointing: bool,
          offload_activations: str = "none") -> Candidate:
    """Memory per tier and time per step of one configuration (see [Note: time model]);
    ``offload_activations``: where the checkpointed layers' inputs live ('none', 'host', 'nvme':
    [Note: activation placement] in infinity/ledger/_activations.py)."""
    n, psi, s = hw.gpus, req.numel, req.shape.seq_len
    ga = max(1, math.ceil(req.global_batch / (n * micro_batch)))
    terms = StateTerms.for_training(
        dtype=req.dtype, optimizer=req.optimizer,
        separate_master=req.dtype != "fp32" or offload_optimizer != "none" or (
            stage == 3 and offload_param != "none"),  # [Note: fp32 master] in infinity/ledger/_estimate.py
        grad_dtype=ENGINE_GRAD_DTYPE)  # the engine's fp32 gradients: [Note: gradient placement]
    if offload_optimizer != "none":  # the host accumulators, as the engine sizes them
        terms = dataclasses.replace(terms, offload_grad_bytes=float(DTYPE_BYTES[
            host_grad_dtype_of(req.dtype, ga, n, req.reduce_dtype)]))
    ledger = estimate_model_states(
        psi, stage, n, terms, offload_param=offload_param, offload_optimizer=offload_optimizer,
        gpus_per_node=hw.ranks_per_node, sub_group_numel=DEFAULT_SUB_GROUP_NUMEL,
        unit_numel=req.shape.largest_unit_numel())
    acts = activation_bytes(req.shape, micro_batch=micro_batch, checkpointing=checkpointing,
                            offload=offload_activations, dtype_bytes=int(terms.param_bytes))
    need, usable = _memory(ledger, acts, hw, req.headroom)
    times, step_s = _step_time(req, hw, ledger, stage=stage, micro_batch=micro_batch,
                               checkpointing=checkpointing, ga=ga, acts=acts)
    return Candidate(stage=stage, offload_param=offload_param, offload_optimizer=offload_optimizer,
                     offload_activations=offload_activations,
                     micro_batch=micro_batch, checkpointing=checkpointing, grad_accum=ga,
                     ledger=ledger, activations=acts, need_bytes=need, usable_bytes=usable,
                     times_s=times, step_s=step_s, tokens_per_step=ga * n * micro_batch * s)


def _memory(ledger: Ledger, acts: Activations, hw: Hardware,
            headroom: float) -> tuple[dict[str, int], dict[str, int]]:
    device = ledger.tier_bytes(Tier.DEVICE) + acts.device_bytes
    # Activations offloaded: homed in the host arena, or staged through it on their way to NVMe.
    staged = ACTIVATION_STAGING_BYTES if acts.nvme_bytes else 0
    host = (ledger.node_bytes(Tier.HOST) + HOST_RESERVE_BYTES
            + (acts.host_bytes + staged) * hw.ranks_per_node)
    nvme = ledger.node_bytes(Tier.NVME) + acts.nvme_bytes * hw.ranks_per_node
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
               checkpointing: bool, ga: int, acts: Activations) -> tuple[dict[str, float], float]:
    """Seconds per lane of one optimizer step (``ga`` micro-steps and the boundary), and the
    step's time: each phase takes its slowest lane and part of the others (:func:`_overlap`)."""
    m = _micro_step(req, hw, ledger, stage=stage, micro_batch=micro_batch,
                    checkpointing=checkpointing, acts=acts)
    micro = m.fill + _overlap([m.compute, m.link, m.pcie_bytes / hw.pcie_bytes_per_s, m.nvme])
    reduce_once = _reduce_once(req, hw, ledger, stage=stage, per_micro=m.reduce_per_micro)
    pcie_last = m.pcie_bytes
    last = m.fill + _overlap([m.compute, m.link + reduce_once, pcie_last / hw.pcie_bytes_per_s,
                              m.nvme])
    opt, link_b, pcie_b, nvme_b = _boundary(req, hw, ledger, stage=stage)
    boundary = _overlap([opt, link_b, pcie_b / hw.pcie_bytes_per_s, nvme_b])

    times = {
        "compute": ga * m.compute,
        "link": ga * (m.link + m.fill) + reduce_once + link_b,
        "pcie": ((ga - 1) * m.pcie_bytes + pcie_last + pcie_b) / hw.pcie_bytes_per_s,
        "nvme": ga * m.nvme + nvme_b,
        "optimizer": opt,
    }
    return times, (ga - 1) * micro + last + boundary


def _wire_bytes(req: PlanRequest, ledger: Ledger) -> float:
    """Bytes per element a gradient collective moves: the engine reduces its fp32 staging as
    is, or cast to the compute dtype (precision.reduce_dtype). The fp32 accumulator (``g``) is
    what sits in memory and crosses PCIe; parameter gathers move ``p``."""
    return ledger.terms.param_bytes if req.reduce_dtype == "compute" else DTYPE_BYTES["fp32"]


@dataclass(frozen=True)
class _MicroStep:
    """One micro-step's cost per lane: seconds, but bytes for PCIe (priced by the caller)."""

    compute: float
    link: float
    pcie_bytes: float
    nvme: float
    fill: float
    """The first unit of forward and of backward, gathered before any compute can hide it."""
    reduce_per_micro: bool
    """Stages 0-1 with an offloaded optimizer all-reduce every unit every micro-step."""


def _micro_step(req: PlanRequest, hw: Hardware, ledger: Ledger, *, stage: int, micro_batch: int,
                checkpointing: bool, acts: Activations) -> _MicroStep:
    """Compute, collectives, PCIe and NVMe traffic of one micro-step (forward and backward)."""
    n, psi, p, g = hw.gpus, req.numel, ledger.terms.param_bytes, ledger.terms.grad_bytes
    gw = _wire_bytes(req, ledger)
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
    link_micro = {0: 0.0, 1: 0.0, 2: psi * gw * ring, 3: psi * (2 * p + gw) * ring}[stage] / link
    link_micro += {2: units, 3: 3 * units}.get(stage, 0) * latency
    # An offloaded optimizer takes each unit's gradient off the device as soon as it is reduced
    # ([Note: gradient placement]), so stages 0-1 then reduce every unit every micro-step: an
    # all-reduce at stage 0, a reduce-scatter at stage 1 ([Note: stage 1 reduce-scatters] in
    # infinity/zero/_grad_reducer.py).
    reduce_per_micro = oo != "none" and stage < 2
    if reduce_per_micro:
        link_micro += ({0: 2, 1: 1}[stage] * psi * gw * ring / link + units * latency)
    fill = 2 * req.shape.largest_unit_numel() * p * ring / link if stage == 3 else 0.0
    stepped = psi if stage == 0 else shard
    pcie_micro = (2 * shard * p if op != "none" else 0.0)
    if oo != "none":
        pcie_micro += stepped * g  # each micro-step's gradient partition leaves the device
    # Gradients accumulate in host memory even with the optimizer on NVMe: no NVMe gradient I/O.
    nvme_micro = (2 * shard * p / nvme_r if op == "nvme" else 0.0)
    # Offloaded activations: the layers' inputs leave the device and come back once each micro-
    # step; on NVMe they are also written once and read once.
    pcie_micro += 2 * acts.moved_bytes
    if acts.nvme_bytes:
        nvme_micro += acts.nvme_bytes / nvme_w + acts.nvme_bytes / nvme_r
    return _MicroStep(compute=compute, link=link_micro, pcie_bytes=pcie_micro, nvme=nvme_micro,
                      fill=fill, reduce_per_micro=reduce_per_micro)


def _reduce_once(req: PlanRequest, hw: Hardware, ledger: Ledger, *, stage: int,
                 per_micro: bool) -> float:
    """Stages 0-1 reduce gradients once per step in buckets, overlapping the last backward
    (nothing left to reduce there when ``per_micro``: every micro-step reduced its own)."""
    n, psi = hw.gpus, req.numel
    gw = _wire_bytes(req, ledger)
    ring = (n - 1) / n
    latency = COLLECTIVE_LATENCY_S if n > 1 else 0.0
    reduce_once = {0: 2 * psi * gw * ring, 1: psi * gw * ring}.get(stage, 0.0) / hw.link_bytes_per_s
    if stage < 2 and n > 1:
        reduce_once += math.ceil(psi * gw / BUCKET_BYTES) * latency
    if per_micro:
        reduce_once = 0.0
    return reduce_once


def _boundary(req: PlanRequest, hw: Hardware, ledger: Ledger, *,
              stage: int) -> tuple[float, float, float, float]:
    """The step's boundary: the optimizer pass (seconds), and its traffic: link seconds (the
    parameter all-gather of stages 1-2), PCIe bytes, NVMe seconds."""
    n, psi, t = hw.gpus, req.numel, ledger.terms
    p, g, k, og = t.param_bytes, t.grad_bytes, t.optimizer_bytes, t.optimizer_grad_bytes
    shard = psi / n
    ring = (n - 1) / n
    nvme_r = hw.nvme_read_bytes_per_s / hw.ranks_per_node
    nvme_w = hw.nvme_write_bytes_per_s / hw.ranks_per_node
    op, oo = ledger.offload_param, ledger.offload_optimizer
    stepped = psi if stage == 0 else shard
    if oo == "none":
        opt = stepped * (2 * k + g + p) / hw.device_memory_bytes_per_s
    else:
        opt = stepped * (2 * k + og + p) / (hw.host_memory_bytes_per_s / hw.ranks_per_node)
    link_b = psi * p * ring / hw.link_bytes_per_s if stage in (1, 2) else 0.0
    param_home = op if stage == 3 else "none"
    pcie_b = shard * p if oo != "none" and param_home == "none" else 0.0
    nvme_b = 0.0
    if oo == "nvme":
        nvme_b += stepped * k / nvme_r + stepped * k / nvme_w
    if param_home == "nvme":
        nvme_b += shard * p / nvme_w
    return opt, link_b, pcie_b, nvme_b


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
                    for acts in (_activation_tiers(req, hw) if ckpt else ["none"]):
                        for mb in micro_batches:
                            out.append(price(req, hw, stage=stage, offload_param=op,
                                             offload_optimizer=oo, micro_batch=mb,
                                             checkpointing=ckpt, offload_activations=acts))
    return out


def _activation_tiers(req: PlanRequest, hw: Hardware) -> list[str]:
    """Where a checkpointed candidate may keep the layers' inputs on this hardware."""
    return [t for t in req.offload_activations
            if t != "nvme" or hw.nvme_capacity_bytes > 0]


def make_plan(req: PlanRequest, hw: Hardware) -> Plan:
    """Price all candidates; the best is the fastest per token that fits (ties: simpler first)."""
    priced = candidates(req, hw)
    fitting = [c for c in priced if c.fits]
    fitting.sort(key=lambda c: (c.s_per_token, c.stage, c.offload_rank, c.checkpointing))
    return Plan(request=req, hardware=hw, best=fitting[0] if fitting else None, candidates=priced)
