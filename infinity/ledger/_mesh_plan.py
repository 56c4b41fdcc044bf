"""The planner past one node: mesh shape (replicate x shard x tensor), hpZ and ZeRO++'s quantized
collectives chosen by a communication time model (pure arithmetic; ``infinity plan --nodes``).

[Note: mesh time model] Per optimizer step, for P parameters on N nodes x G GPUs (W = N G ranks),
one candidate = (replicate R, shard S, tensor T, hpZ partition H, qwZ, qgZ, checkpointing); the
global batch (sequences) is fixed, so step times compare directly. Notation: p bytes per
parameter in the compute dtype, g bytes per gradient element on the wire (fp32: 4, or the
compute dtype with ``reduce_dtype`` 'compute'), b micro-batch, s sequence, h hidden, L layers,
D = W / T the data-parallel degree, R x S = D, GA = global batch / (D b) micro-steps per step.
Collective costs are [Note: collective cost over nodes] in infinity/ledger/_comm_time.py.

* Ranks are laid out tensor-innermost (rank = d T + t): a node holds G / T consecutive
  data-parallel indices; shard groups are S consecutive indices (inside a node when S <= G / T:
  HSDP with S = G / T, R = N), replicate groups take every S-th.
* Tensor parallelism divides every weight by T (norms are in fact replicated: a rounding error
  of the model) and keeps T inside the node. Each TP rank runs ZeRO-3 on its P / T.
* Per micro-step, ZeRO-3 moves, per rank (Q(x): x elements quantized, bits / 8 B + 4 B per block):
  forward-gather: all-gather of P/T x p (qwZ: Q(P/T)) over the shard group; with hpZ over all D
  ranks (R = 1, S = D) and each rank keeps a secondary shard of P/T x p / H bytes inside its
  node-local group of H;
  backward-gather: the same over the shard group, with hpZ over the H-group only (intra-node);
  qwZ quantizes both gathers;
  reduce-grad: reduce-scatter of P/T x g over the shard group (qgZ: the hierarchical
  all-to-all of Q(P/T) with ``gradient_bits``);
  tensor-parallel: Megatron's 2 all-reduces per layer in forward (after the row-parallel o and
  MLP down projections) and 2 in backward (the column-parallel layers' input gradients), each
  of b s h x p bytes over the T ranks (with checkpointing 2 more: the forward runs again),
  i.e. 2 (T-1)/T x b s h p x (4 or 6) x L bytes per rank.
  Once per step (at the accumulation boundary, as MiCS does): replicate-reduce: all-reduce of
  the gradient shard P/(T S) x g over the R replicas (HSDP only).
* Every collective also pays ``COLLECTIVE_LATENCY_S`` (one per unit per gather or reduction,
  two for a qgZ that spans nodes; one per TP all-reduce).
* compute per micro-step = (6, or 8 with checkpointing) x P/T x b s / (peak FLOP/s x MFU), i.e.
  6 P x tokens / (W x peak x MFU) per step. qwZ / qgZ add quantize + dequantize passes over the
  device memory: 2 x P/T x (1 + p) bytes (qwZ, two gathers) and 2 x P/T x (1 + g) bytes (qgZ),
  at the device memory bandwidth, on the compute stream.
* micro = overlap(compute + quantize, ZeRO collectives) + tensor-parallel, where
  overlap(xs) = max(xs) + EXPOSED_FRACTION x (sum(xs) - max(xs)) ([Note: time model] in
  infinity/ledger/_pricing.py; ``MeshRequest.exposed_fraction``, 1.0 for the serial bound):
  ZeRO's gathers and reductions are prefetched and overlap compute,
  TP's all-reduces sit on the critical path (the next matmul needs their result).
  step = GA x micro + replicate-reduce (exposed: it runs after the last backward).
* Memory per rank: the ledger of ZeRO-3 over the shard group (``estimate_model_states(P/T, 3,
  S)``: sharded terms divided by S, the gathered-unit buffers), plus hpZ's secondary shard
  P/T x p / H, plus activations (Korthikanti et al. 2022: sbh(10 + 24/T + 5as/(hT)) per layer
  with T-way tensor parallelism, 2sbh per layer kept with checkpointing), plus the device
  reserve; it fits when that is within the device memory less the headroom.
* The choice: the fastest candidate that fits, unless a simpler one (fewer of: a layout other
  than flat, qwZ, qgZ, T > 1) is within ``MIN_GAIN_FRACTION`` of it. Quantization changes the
  numbers and hierarchy costs memory: a few percent is not worth either.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from infinity._tier import Tier
from infinity.config import DTYPE_BYTES
from infinity.ledger._activations import activation_bytes, attention_scores_term
from infinity.ledger._comm_time import (Cluster, Traffic, hierarchical_all_to_all,
                                        plan_quantized_bytes, ring_all_gather, ring_all_reduce,
                                        ring_reduce_scatter)
from infinity.ledger._estimate import (ENGINE_GRAD_DTYPE, Ledger, StateTerms, ceil_bytes,
                                       estimate_model_states)
from infinity.ledger._model_shape import ModelShape
from infinity.ledger._pricing import COLLECTIVE_LATENCY_S, DEVICE_RESERVE_BYTES, EXPOSED_FRACTION

__all__ = ["DEFAULT_MFU", "DEFAULT_QUANTIZATION_BLOCK_NUMEL", "MIN_GAIN_FRACTION", "MeshCandidate",
           "MeshLayout", "MeshPlan", "MeshRequest", "make_mesh_plan", "mesh_config_dict",
           "mesh_layouts", "price_mesh"]

MIN_GAIN_FRACTION = 0.05
"""A simpler candidate within this fraction of the fastest one's step time is chosen instead."""
DEFAULT_MFU = 0.4
"""Model FLOP utilisation assumed when none is given (dense bf16 training reaches 0.35-0.55)."""
DEFAULT_QUANTIZATION_BLOCK_NUMEL = 2048
"""Elements per quantization block (one fp32 scale each) the planner prices when none is given."""
TP_ALL_REDUCES_PER_LAYER = 4
"""Megatron tensor parallelism: 2 all-reduces per layer forward, 2 backward."""
TP_RECOMPUTE_ALL_REDUCES_PER_LAYER = 2
"""With activation checkpointing the forward, and its 2 all-reduces, run again in backward."""
PHASES = ("forward-gather", "backward-gather", "reduce-grad", "replicate-reduce", "tensor-parallel")
"""Traffic kinds; the first four are the engine's ``Phase`` values (``engine.stats()``)."""


@dataclass(frozen=True, kw_only=True)
class MeshLayout:
    """A candidate's mesh and ZeRO++ switches (the config names the parts of issue #17 agreed on)."""

    replicate: int
    shard: int
    tensor: int = 1
    hpz_partition_size: int = 1
    quantized_weights: bool = False
    quantized_gradients: bool = False
    gradient_bits: int = 8

    def __post_init__(self) -> None:
        for name in ("replicate", "shard", "tensor", "hpz_partition_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MeshLayout.{name}: expected an integer >= 1, got {value!r}")
        if self.hpz_partition_size > 1 and self.replicate > 1:
            raise ValueError("MeshLayout: hpZ (hpz_partition_size > 1) partitions the full data-"
                             "parallel group; use replicate 1 with it")
        if self.gradient_bits not in (4, 8):
            raise ValueError(f"MeshLayout.gradient_bits: expected 8 or 4, got {self.gradient_bits!r}")

    @property
    def kind(self) -> str:
        if self.hpz_partition_size > 1:
            return "hpz"
        return "hsdp" if self.replicate > 1 else "flat"

    @property
    def complexity(self) -> int:
        """How many departures from flat ZeRO-3 (the tie-break of [Note: mesh time model])."""
        return ((self.kind != "flat") + self.quantized_weights + self.quantized_gradients
                + (self.tensor > 1))

    @property
    def name(self) -> str:
        parts = [{"flat": f"flat {self.shard}", "hsdp": f"hsdp {self.replicate}x{self.shard}",
                  "hpz": f"hpz {self.hpz_partition_size}"}[self.kind]]
        if self.quantized_weights:
            parts.append("qwZ")
        if self.quantized_gradients:
            parts.append("qgZ" + ("" if self.gradient_bits == 8 else f"{self.gradient_bits}"))
        if self.tensor > 1:
            parts.append(f"tp {self.tensor}")
        return " + ".join(parts)


@dataclass(frozen=True, kw_only=True)
class MeshRequest:
    """The model and the job; the hardware beyond the links (FLOP rate, memory per GPU)."""

    numel: int
    shape: ModelShape
    dtype: str = "bf16"
    reduce_dtype: str = "fp32"
    micro_batch: int = 1
    global_batch: int | None = None
    """Sequences per optimizer step; None: one micro-batch per rank without tensor parallelism."""
    checkpointing: tuple[bool, ...] = (False, True)
    device_memory_bytes: int
    device_flops: float
    """Peak dense FLOP/s per GPU in the compute dtype."""
    mfu: float = DEFAULT_MFU
    device_memory_bytes_per_s: float
    quantization_block_numel: int = DEFAULT_QUANTIZATION_BLOCK_NUMEL
    gradient_bits: int = 8
    headroom: float = 0.10
    max_tensor: int | None = None
    """Largest tensor-parallel degree tried (None: the GPUs of a node)."""
    exposed_fraction: float = EXPOSED_FRACTION
    """Share of the smaller of compute and ZeRO communication that overlap fails to hide (the
    single-node planner's rule; 1.0: no overlap, the serial bound)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype: expected one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.reduce_dtype not in ("fp32", "compute"):
            raise ValueError(f"reduce_dtype: expected 'fp32' or 'compute', got {self.reduce_dtype!r}")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu: expected a fraction in (0, 1], got {self.mfu!r}")
        if isinstance(self.micro_batch, bool) or not isinstance(self.micro_batch, int) \
                or self.micro_batch < 1:
            raise ValueError(f"micro_batch: expected an integer >= 1, got {self.micro_batch!r}")
        if self.gradient_bits not in (4, 8):
            raise ValueError(f"gradient_bits: expected 8 or 4, got {self.gradient_bits!r}")
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError(f"headroom: expected a fraction in [0, 1), got {self.headroom!r}")
        if not 0.0 <= self.exposed_fraction <= 1.0:
            raise ValueError(f"exposed_fraction: expected a fraction in [0, 1], got "
                             f"{self.exposed_fraction!r}")

    def sequences_per_step(self, cluster: Cluster) -> int:
        return self.global_batch or cluster.world_size * self.micro_batch


@dataclass(frozen=True, kw_only=True)
class MeshCandidate:
    """One priced candidate: memory per rank and time per step (see [Note: mesh time model])."""

    layout: MeshLayout
    checkpointing: bool
    grad_accum: int
    micro_batch: int
    ledger: Ledger
    hpz_secondary_bytes: int
    activation_bytes: int
    need_bytes: int
    """Per rank on the device: ledger + hpZ secondary + activations + reserve."""
    usable_bytes: int
    traffic: dict[str, Traffic]
    """Phase -> per-step traffic of one rank (PHASES)."""
    times_s: dict[str, float]
    """Per step: compute, quantize, zero-comm, tensor-parallel, replicate-reduce (seconds busy)."""
    step_s: float
    tokens_per_step: int

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.usable_bytes

    @property
    def intra_bytes(self) -> float:
        return sum(t.intra_bytes for t in self.traffic.values())

    @property
    def inter_bytes(self) -> float:
        return sum(t.inter_bytes for t in self.traffic.values())

    @property
    def bound(self) -> str:
        return max(self.times_s, key=self.times_s.get)

    def describe(self) -> str:
        return (f"{self.layout.name}, micro-batch {self.micro_batch} x GA {self.grad_accum}, "
                f"checkpointing {'on' if self.checkpointing else 'off'}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.layout.name, "layout": dataclasses.asdict(self.layout),
                "checkpointing": self.checkpointing, "gradient_accumulation_steps": self.grad_accum,
                "micro_batch": self.micro_batch, "fits": self.fits,
                "need_bytes": self.need_bytes, "usable_bytes": self.usable_bytes,
                "ledger_device_bytes": self.ledger.tier_bytes(Tier.DEVICE),
                "hpz_secondary_bytes": self.hpz_secondary_bytes,
                "activation_bytes": self.activation_bytes,
                "traffic": {k: dataclasses.asdict(t) for k, t in self.traffic.items()},
                "intra_bytes": self.intra_bytes, "inter_bytes": self.inter_bytes,
                "times_s": self.times_s, "step_s": self.step_s, "bound": self.bound,
                "tokens_per_step": self.tokens_per_step}


@dataclass(frozen=True, kw_only=True)
class MeshPlan:
    request: MeshRequest
    cluster: Cluster
    best: MeshCandidate | None
    candidates: list[MeshCandidate] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.best is not None

    def baseline(self) -> MeshCandidate | None:
        """Flat ZeRO-3 without quantization or TP (fastest checkpointing that fits, else any)."""
        flat = [c for c in self.candidates if c.layout.complexity == 0]
        pool = [c for c in flat if c.fits] or flat
        return min(pool, key=lambda c: c.step_s) if pool else None


# ----------------------------------------------------------------------------------------------
# Candidates


def mesh_layouts(req: MeshRequest, cluster: Cluster) -> list[MeshLayout]:
    """flat, HSDP (shard = a node's data-parallel ranks, replicate = nodes) and hpZ (partition =
    a node's data-parallel ranks), each with and without qwZ / qgZ, for every tensor-parallel
    degree T that divides a node's GPUs."""
    g, n = cluster.gpus_per_node, cluster.nodes
    top = req.max_tensor or g
    out = []
    for t in (t for t in range(1, g + 1) if g % t == 0 and t <= top):
        d, per_node = cluster.world_size // t, g // t
        shapes = [dict(replicate=1, shard=d)]
        if n > 1:
            shapes.append(dict(replicate=n, shard=per_node))
            if per_node > 1:
                shapes.append(dict(replicate=1, shard=d, hpz_partition_size=per_node))
        for shape in shapes:
            for qw in (False, True):
                for qg in (False, True):
                    out.append(MeshLayout(tensor=t, quantized_weights=qw, quantized_gradients=qg,
                                          gradient_bits=req.gradient_bits, **shape))
    return out


def _tp_activation_bytes(shape: ModelShape, *, micro_batch: int, checkpointing: bool,
                         tensor: int, dtype_bytes: int) -> int:
    """Activations per rank (Korthikanti et al. 2022, section 4.2: tensor parallelism without
    sequence parallelism keeps sbh(10 + 24/t + 5as/(ht)) per layer, the last term with eager
    attention only: [Note: fused attention keeps no scores] in infinity/ledger/_activations.py)."""
    base = activation_bytes(shape, micro_batch=micro_batch, checkpointing=checkpointing,
                            dtype_bytes=dtype_bytes)
    if tensor == 1:
        return base.total_bytes
    s, b, h = shape.seq_len, micro_batch, shape.hidden_size
    scale = dtype_bytes / 2
    per_layer = ceil_bytes(s * b * h * (10 + 24 / tensor + attention_scores_term(shape, s, tensor))
                           * scale)
    head = ceil_bytes(4 * s * b * h * scale + 4 * s * b * shape.vocab_size / tensor)
    stored = base.stored_bytes if checkpointing else shape.num_layers * per_layer
    return stored + (per_layer if checkpointing else 0) + head


def _groups(layout: MeshLayout, cluster: Cluster) -> dict[str, tuple[int, int]]:
    """Group -> (size, ranks per node) under the tensor-innermost layout of [Note: mesh time model]."""
    per_node = cluster.gpus_per_node // layout.tensor  # data-parallel indices per node
    s, r = layout.shard, layout.replicate
    shard_c = min(s, per_node)
    replicate_c = max(1, per_node // s) if r > 1 else 1
    hpz = layout.hpz_partition_size
    return {"shard": (s, shard_c), "replicate": (r, min(r, replicate_c)),
            "hpz": (hpz, hpz), "tensor": (layout.tensor, layout.tensor)}


def _traffic(req: MeshRequest, cluster: Cluster, layout: MeshLayout, *,
             checkpointing: bool) -> dict[str, Traffic]:
    """Phase -> one rank's traffic: per micro-step, except replicate-reduce (once per step)."""
    p, gw = DTYPE_BYTES[req.dtype], _wire_grad_bytes(req)
    pt, shape, t = req.numel / layout.tensor, req.shape, layout.tensor
    groups = _groups(layout, cluster)
    block = req.quantization_block_numel
    weight_bytes = (plan_quantized_bytes(pt, block_numel=block, bits=8) if layout.quantized_weights
                    else pt * p)
    size, c = groups["shard"]
    fwd = ring_all_gather(cluster, group_size=size, ranks_per_node=c, payload_bytes=weight_bytes)
    if layout.hpz_partition_size > 1:
        size, c = groups["hpz"]
    bwd = ring_all_gather(cluster, group_size=size, ranks_per_node=c, payload_bytes=weight_bytes)
    size, c = groups["shard"]
    if layout.quantized_gradients:
        red = hierarchical_all_to_all(cluster, group_size=size, ranks_per_node=c, numel=pt,
                                      block_numel=block, bits=layout.gradient_bits)
    else:
        red = ring_reduce_scatter(cluster, group_size=size, ranks_per_node=c, payload_bytes=pt * gw)
    # One collective per unit (the bytes are the whole model's either way).
    units = shape.num_units()
    fwd, bwd, red = (dataclasses.replace(x, count=x.count * units) for x in (fwd, bwd, red))
    size, c = groups["replicate"]
    rep = ring_all_reduce(cluster, group_size=size, ranks_per_node=c,
                          payload_bytes=pt / layout.shard * gw)
    per_layer = TP_ALL_REDUCES_PER_LAYER + (TP_RECOMPUTE_ALL_REDUCES_PER_LAYER
                                            if checkpointing else 0)
    tp = ring_all_reduce(cluster, group_size=t, ranks_per_node=t,
                         payload_bytes=req.micro_batch * shape.seq_len * shape.hidden_size * p)
    return {"forward-gather": fwd, "backward-gather": bwd, "reduce-grad": red,
            "replicate-reduce": rep, "tensor-parallel": tp.times(per_layer * shape.num_layers)}


def _wire_grad_bytes(req: MeshRequest) -> int:
    """Bytes per gradient element a full-precision reduction sends (precision.reduce_dtype)."""
    return DTYPE_BYTES[req.dtype] if req.reduce_dtype == "compute" else DTYPE_BYTES["fp32"]


def _busy_s(x: Traffic) -> float:
    return x.time_s + x.count * COLLECTIVE_LATENCY_S


def price_mesh(req: MeshRequest, cluster: Cluster, layout: MeshLayout, *,
               checkpointing: bool) -> MeshCandidate:
    """Memory per rank and time per step of one candidate ([Note: mesh time model])."""
    t, g_node = layout.tensor, cluster.gpus_per_node
    if g_node % t or layout.replicate * layout.shard * t != cluster.world_size:
        raise ValueError(f"mesh {layout.replicate} x {layout.shard} x {t} does not tile "
                         f"{cluster.nodes} x {g_node} GPUs")
    p, gw = DTYPE_BYTES[req.dtype], _wire_grad_bytes(req)
    pt, b, shape = req.numel / t, req.micro_batch, req.shape
    d = layout.replicate * layout.shard
    ga = max(1, math.ceil(req.sequences_per_step(cluster) / (d * b)))
    micro = _traffic(req, cluster, layout, checkpointing=checkpointing)

    compute = (8 if checkpointing else 6) * pt * b * shape.seq_len / (req.device_flops * req.mfu)
    quant_s = ((2 * pt * (1 + p) if layout.quantized_weights else 0.0)
               + (2 * pt * (1 + gw) if layout.quantized_gradients else 0.0)
               ) / req.device_memory_bytes_per_s
    zero_s = sum(_busy_s(micro[k]) for k in ("forward-gather", "backward-gather", "reduce-grad"))
    tp_s, rep_s = _busy_s(micro["tensor-parallel"]), _busy_s(micro["replicate-reduce"])
    parts = [compute + quant_s, zero_s]
    step_s = ga * (max(parts) + req.exposed_fraction * (sum(parts) - max(parts)) + tp_s) + rep_s

    terms = StateTerms.for_training(dtype=req.dtype, grad_dtype=ENGINE_GRAD_DTYPE)
    ledger = estimate_model_states(ceil_bytes(pt), 3, layout.shard, terms, gpus_per_node=g_node,
                                   unit_numel=ceil_bytes(shape.largest_unit_numel() / t))
    hpz_bytes = ceil_bytes(pt * p / layout.hpz_partition_size) if layout.hpz_partition_size > 1 else 0
    acts = _tp_activation_bytes(shape, micro_batch=b, checkpointing=checkpointing, tensor=t,
                                dtype_bytes=p)
    need = ledger.tier_bytes(Tier.DEVICE) + hpz_bytes + acts + DEVICE_RESERVE_BYTES
    traffic = {k: (v if k == "replicate-reduce" else v.times(ga)) for k, v in micro.items()}
    times = {"compute": ga * compute, "quantize": ga * quant_s, "zero-comm": ga * zero_s,
             "tensor-parallel": ga * tp_s, "replicate-reduce": rep_s}
    return MeshCandidate(layout=layout, checkpointing=checkpointing, grad_accum=ga, micro_batch=b,
                         ledger=ledger, hpz_secondary_bytes=hpz_bytes, activation_bytes=acts,
                         need_bytes=need,
                         usable_bytes=int(req.device_memory_bytes * (1 - req.headroom)),
                         traffic=traffic, times_s=times, step_s=step_s,
                         tokens_per_step=ga * d * b * shape.seq_len)


def make_mesh_plan(req: MeshRequest, cluster: Cluster) -> MeshPlan:
    """Price every candidate; choose per [Note: mesh time model] (fastest that fits, unless a
    simpler one is within ``MIN_GAIN_FRACTION``)."""
    priced = [price_mesh(req, cluster, layout, checkpointing=ckpt)
              for layout in mesh_layouts(req, cluster) for ckpt in req.checkpointing]
    fitting = [c for c in priced if c.fits]
    if not fitting:
        return MeshPlan(request=req, cluster=cluster, best=None, candidates=priced)
    fastest = min(c.step_s for c in fitting)
    close = [c for c in fitting if c.step_s <= fastest * (1 + MIN_GAIN_FRACTION)]
    best = min(close, key=lambda c: (c.layout.complexity, c.step_s, c.checkpointing))
    return MeshPlan(request=req, cluster=cluster, best=best, candidates=priced)


def mesh_config_dict(candidate: MeshCandidate, req: MeshRequest) -> dict[str, Any]:
    """The chosen candidate as a native config dict with the names issue #17's parts agreed on
    (``mesh``, ``zero.hpz_partition_size``, ``zero.quantized_weights``/``quantized_gradients``,
    ``zero.quantization_block_numel``, ``zero.quantized_gradient_bits``)."""
    lay = candidate.layout
    zero: dict[str, Any] = {"stage": 3, "hpz_partition_size": lay.hpz_partition_size,
                            "quantized_weights": lay.quantized_weights,
                            "quantized_gradients": lay.quantized_gradients}
    if lay.quantized_weights or lay.quantized_gradients:
        zero["quantization_block_numel"] = req.quantization_block_numel
    if lay.quantized_gradients:
        zero["quantized_gradient_bits"] = lay.gradient_bits
    return {"mesh": {"replicate": lay.replicate, "shard": lay.shard, "tensor": lay.tensor},
            "zero": zero,
            "precision": {"dtype": req.dtype, "reduce_dtype": req.reduce_dtype},
            "train_micro_batch_size_per_gpu": candidate.micro_batch,
            "gradient_accumulation_steps": candidate.grad_accum,
            "activation_checkpointing": {"units": "all" if candidate.checkpointing else "none"}}
