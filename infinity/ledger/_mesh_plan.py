"""The planner past one node: mesh shape (pipeline x replicate x shard x tensor), hpZ and ZeRO++'s
quantized collectives chosen by a communication time model (pure arithmetic; ``infinity plan
--nodes``).

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
* Pipeline parallelism: K stages (the mesh's ``pipeline``; the issue's P, P being the
  parameter count here). Ranks are laid out pipeline-outermost, rank = ((k R + r) S + s) T + t
  (W = K R S T): a stage is W / K consecutive ranks, whole nodes or part of one
  (``stage_cluster`` in _comm_time), and runs everything above inside itself, as if it were
  the cluster: ZeRO-3 over its own R x S ranks, T inside a node. The largest stage is priced:
  ceil(L / K) layers, P_K = P x ceil(L / K) / L parameters (embeddings and head spread with the
  layers: a rounding of the model, as Megatron puts them on the first and last stages, a third
  of a Llama-70B layer each) and ceil(units / K) units. D = R S; the step's micro-batches
  m = global batch / (D b) (the GA of the candidates without a pipeline) must be >= K.
  One micro-batch on the stage costs t_micro = the micro-step above on P_K (its compute, its
  exposed ZeRO collectives, its TP all-reduces over ceil(L / K) layers) + its send/recv: the
  forward's activation, b s h x p bytes, to the next stage, and in backward its gradient,
  b s h x p bytes, to the previous one, each one ``pipeline_send`` on the link its stages'
  placement gives ([Note: collective cost over nodes] in infinity/ledger/_comm_time.py); every
  TP rank sends the whole activation, not 1/T of it (no sequence-sharded send).
  Both transfers are exposed: this model overlaps nothing across stages (1F1B in fact hides
  some of them behind the other micro-batches' compute). GPipe and 1F1B both take m + K - 1
  slots: step = (m + K - 1) x t_micro + replicate-reduce (of the stage's shard P_K / (T S)),
  bubble fraction (K - 1) / (m + K - 1). A middle stage's rank sends 2 m x b s h p bytes per
  step (its receives are as many, on the link's other direction, which bus bandwidths count
  apart). Memory: the ledger below on P_K, and activations of ceil(L / K) layers times the
  micro-batches in flight on stage 0: K with 1F1B (``PIPELINE_SCHEDULE``, the schedule priced
  and written), m with GPipe; plus the head's, as if on the same rank (an upper bound).
* Memory per rank: the ledger of ZeRO-3 over the shard group (``estimate_model_states(P/T, 3,
  S)``: sharded terms divided by S, the gathered-unit buffers), plus hpZ's secondary shard
  P/T x p / H, plus activations (Korthikanti et al. 2022: sbh(10 + 24/T + 5as/(hT)) per layer
  with T-way tensor parallelism, 2sbh per layer kept with checkpointing), plus the device
  reserve; it fits when that is within the device memory less the headroom.
* The choice: the fastest candidate that fits, unless a simpler one (fewer of: a layout other
  than flat, qwZ, qgZ, T > 1, K > 1) is within ``MIN_GAIN_FRACTION`` of it. Quantization changes
  the numbers, hierarchy costs memory and a pipeline needs the model split into stages: a few
  percent is not worth any of them.
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
                                        pipeline_send, plan_quantized_bytes, ring_all_gather,
                                        ring_all_reduce, ring_reduce_scatter, stage_cluster)
from infinity.ledger._estimate import (ENGINE_GRAD_DTYPE, Ledger, StateTerms, ceil_bytes,
                                       estimate_model_states)
from infinity.ledger._model_shape import ModelShape
from infinity.ledger._pricing import COLLECTIVE_LATENCY_S, DEVICE_RESERVE_BYTES, EXPOSED_FRACTION

__all__ = ["DEFAULT_MFU", "DEFAULT_QUANTIZATION_BLOCK_NUMEL", "MIN_GAIN_FRACTION", "MeshCandidate",
           "MeshLayout", "MeshPlan", "MeshRequest", "PIPELINE_SCHEDULE", "make_mesh_plan",
           "mesh_config_dict", "mesh_layouts", "price_mesh"]

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
PHASES = ("forward-gather", "backward-gather", "reduce-grad", "replicate-reduce", "tensor-parallel",
          "pipeline-p2p")
"""Traffic kinds; the first four are the engine's ``Phase`` values (``engine.stats()``)."""
PIPELINE_SCHEDULE = "1f1b"
"""The pipeline schedule priced and written (``pipeline.schedule``): GPipe's bubble, K
micro-batches' activations in flight instead of all m."""


@dataclass(frozen=True, kw_only=True)
class MeshLayout:
    """A candidate's mesh and ZeRO++ switches (the config names the parts of issues #17 and #36
    agreed on)."""

    pipeline: int = 1
    """Pipeline stages (K), the outermost dimension ([Note: mesh time model])."""
    replicate: int
    shard: int
    tensor: int = 1
    hpz_partition_size: int = 1
    quantized_weights: bool = False
    quantized_gradients: bool = False
    gradient_bits: int = 8

    def __post_init__(self) -> None:
        for name in ("pipeline", "replicate", "shard", "tensor", "hpz_partition_size"):
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
                + (self.tensor > 1) + (self.pipeline > 1))

    @property
    def name(self) -> str:
        parts = [f"pp {self.pipeline}"] if self.pipeline > 1 else []
        parts += [{"flat": f"flat {self.shard}", "hsdp": f"hsdp {self.replicate}x{self.shard}",
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
    pipeline_degrees: tuple[int, ...] | None = None
    """Pipeline stage counts (K) tried besides 1; None: every divisor of the world size up to the
    layers that leaves at least K micro-batches per step; (): no pipeline."""

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
        for k in self.pipeline_degrees or ():
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ValueError(f"pipeline_degrees: expected integers >= 1, got "
                                 f"{self.pipeline_degrees!r}")

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
    stage_layers: int
    """Layers of the largest pipeline stage (all of them without a pipeline)."""
    micro_batches_in_flight: int = 1
    """Micro-batches whose activations a rank holds at once (K on 1F1B's first stage)."""

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

    @property
    def schedule(self) -> str | None:
        """The pipeline schedule priced (None without a pipeline)."""
        return PIPELINE_SCHEDULE if self.layout.pipeline > 1 else None

    @property
    def bubble_fraction(self) -> float:
        """(K - 1) / (m + K - 1): the share of the step a stage idles ([Note: mesh time model])."""
        k = self.layout.pipeline
        return (k - 1) / (self.grad_accum + k - 1)

    def describe(self) -> str:
        pipe = (f", {self.schedule} over {self.layout.pipeline} stages of {self.stage_layers} "
                f"layers (bubble {self.bubble_fraction:.0%})" if self.schedule else "")
        return (f"{self.layout.name}, micro-batch {self.micro_batch} x GA {self.grad_accum}, "
                f"checkpointing {'on' if self.checkpointing else 'off'}{pipe}")

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
                "tokens_per_step": self.tokens_per_step, "pipeline": self.layout.pipeline,
                "schedule": self.schedule, "bubble_fraction": self.bubble_fraction,
                "stage_layers": self.stage_layers,
                "micro_batches_in_flight": self.micro_batches_in_flight,
                "pipeline_p2p_bytes": self.traffic["pipeline-p2p"].total_bytes,
                "pipeline_p2p_s": self.times_s["pipeline-p2p"]}


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


def pipeline_degrees(req: MeshRequest, cluster: Cluster) -> list[int]:
    """The stage counts K to price: 1, and those of ``req.pipeline_degrees`` (None: every divisor
    of the world size) that tile the nodes and are at most the layers; a degree asked for by
    name that cannot be priced is a ValueError saying why. (m >= K is checked per layout.)"""
    w, layers = cluster.world_size, req.shape.num_layers
    asked = req.pipeline_degrees
    out = [1]
    for k in (range(2, w + 1) if asked is None else sorted(set(asked) - {1})):
        why = None
        try:
            stage_cluster(cluster, k)
        except ValueError as e:
            why = str(e)
        else:
            if k > layers:
                why = f"{k} stages exceed the model's {layers} layers"
        if why is None:
            out.append(k)
        elif asked is not None:
            raise ValueError(f"pipeline_degrees: {why}")
    return out


def _micro_batches(req: MeshRequest, cluster: Cluster, data_parallel: int) -> int:
    """m (GA): micro-batches of ``req.micro_batch`` per step on each of D data-parallel ranks."""
    return max(1, math.ceil(req.sequences_per_step(cluster) / (data_parallel * req.micro_batch)))


def mesh_layouts(req: MeshRequest, cluster: Cluster) -> list[MeshLayout]:
    """For every pipeline degree K (:func:`pipeline_degrees`) and, inside a stage's nodes, every
    tensor-parallel degree T that divides a node's GPUs: flat, HSDP (shard = a node's
    data-parallel ranks, replicate = the stage's nodes) and hpZ (partition = a node's
    data-parallel ranks), each with and without qwZ / qgZ (without when there is no
    data-parallel group to quantize for)."""
    out = []
    for k in pipeline_degrees(req, cluster):
        stage = stage_cluster(cluster, k)
        g, n = stage.gpus_per_node, stage.nodes
        top = req.max_tensor or g
        for t in (t for t in range(1, g + 1) if g % t == 0 and t <= top):
            d, per_node = stage.world_size // t, g // t
            if _micro_batches(req, cluster, d) < k:
                continue  # the pipeline would never fill
            shapes = [dict(replicate=1, shard=d)]
            if n > 1:
                shapes.append(dict(replicate=n, shard=per_node))
                if per_node > 1:
                    shapes.append(dict(replicate=1, shard=d, hpz_partition_size=per_node))
            switches = (False, True) if d > 1 else (False,)
            for shape in shapes:
                for qw in switches:
                    for qg in switches:
                        out.append(MeshLayout(pipeline=k, tensor=t, quantized_weights=qw,
                                              quantized_gradients=qg,
                                              gradient_bits=req.gradient_bits, **shape))
    asked = set(req.pipeline_degrees or ()) - {1}
    short = asked - {x.pipeline for x in out}
    if short:
        k = min(short)
        got = _micro_batches(req, cluster, cluster.world_size // k)
        raise ValueError(f"pipeline_degrees: {k} stages need at least {k} micro-batches per step; "
                         f"the global batch of {req.sequences_per_step(cluster)} sequences gives "
                         f"{got} with micro-batch {req.micro_batch} (raise the global batch or "
                         f"use fewer stages)")
    return out


@dataclass(frozen=True, kw_only=True)
class _Stage:
    """The largest pipeline stage of a candidate ([Note: mesh time model]): the whole model and
    cluster without a pipeline."""

    cluster: Cluster
    numel: int
    layers: int
    units: int
    shape: ModelShape
    """The model cut to ``layers`` layers (its activations)."""

    @classmethod
    def of(cls, req: MeshRequest, cluster: Cluster, stages: int) -> "_Stage":
        shape, layers = req.shape, req.shape.num_layers
        if stages == 1:
            return cls(cluster=cluster, numel=req.numel, layers=layers, units=shape.num_units(),
                       shape=shape)
        if stages > layers:
            raise ValueError(f"MeshLayout.pipeline: {stages} stages exceed the model's {layers} "
                             f"layers; use at most {layers}")
        most = math.ceil(layers / stages)
        return cls(cluster=stage_cluster(cluster, stages), numel=req.numel * most // layers,
                   layers=most, units=math.ceil(shape.num_units() / stages),
                   shape=dataclasses.replace(shape, num_layers=most))


def _tp_activation_bytes(shape: ModelShape, *, micro_batch: int, checkpointing: bool,
                         tensor: int, dtype_bytes: int, in_flight: int = 1) -> int:
    """Activations per rank (Korthikanti et al. 2022, section 4.2: tensor parallelism without
    sequence parallelism keeps sbh(10 + 24/t + 5as/(ht)) per layer, the last term with eager
    attention only: [Note: fused attention keeps no scores] in infinity/ledger/_activations.py);
    what the forward keeps for backward is held for ``in_flight`` micro-batches (a pipeline
    stage's, [Note: mesh time model])."""
    base = activation_bytes(shape, micro_batch=micro_batch, checkpointing=checkpointing,
                            dtype_bytes=dtype_bytes)
    if tensor == 1:
        return base.stored_bytes * in_flight + base.recompute_bytes + base.head_bytes
    s, b, h = shape.seq_len, micro_batch, shape.hidden_size
    scale = dtype_bytes / 2
    per_layer = ceil_bytes(s * b * h * (10 + 24 / tensor + attention_scores_term(shape, s, tensor))
                           * scale)
    head = ceil_bytes(4 * s * b * h * scale + 4 * s * b * shape.vocab_size / tensor)
    stored = base.stored_bytes if checkpointing else shape.num_layers * per_layer
    return stored * in_flight + (per_layer if checkpointing else 0) + head


def _groups(layout: MeshLayout, cluster: Cluster) -> dict[str, tuple[int, int]]:
    """Group -> (size, ranks per node) under the tensor-innermost layout of [Note: mesh time model],
    on one pipeline stage's ``cluster``."""
    per_node = cluster.gpus_per_node // layout.tensor  # data-parallel indices per node
    s, r = layout.shard, layout.replicate
    shard_c = min(s, per_node)
    replicate_c = max(1, per_node // s) if r > 1 else 1
    hpz = layout.hpz_partition_size
    return {"shard": (s, shard_c), "replicate": (r, min(r, replicate_c)),
            "hpz": (hpz, hpz), "tensor": (layout.tensor, layout.tensor)}


def _traffic(req: MeshRequest, cluster: Cluster, layout: MeshLayout, stage: _Stage, *,
             checkpointing: bool) -> dict[str, Traffic]:
    """Phase -> one rank's traffic: per micro-step, except replicate-reduce (once per step).
    ``cluster``: the whole; the ZeRO and TP groups live in ``stage.cluster``."""
    p, gw = DTYPE_BYTES[req.dtype], _wire_grad_bytes(req)
    pt, shape, t = stage.numel / layout.tensor, req.shape, layout.tensor
    groups = _groups(layout, stage.cluster)
    whole = cluster
    cluster = stage.cluster  # every collective below but the send/recv stays inside a stage
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
    # One collective per unit (the bytes are the whole stage's either way).
    units = stage.units
    fwd, bwd, red = (dataclasses.replace(x, count=x.count * units) for x in (fwd, bwd, red))
    size, c = groups["replicate"]
    rep = ring_all_reduce(cluster, group_size=size, ranks_per_node=c,
                          payload_bytes=pt / layout.shard * gw)
    per_layer = TP_ALL_REDUCES_PER_LAYER + (TP_RECOMPUTE_ALL_REDUCES_PER_LAYER
                                            if checkpointing else 0)
    activation = req.micro_batch * shape.seq_len * shape.hidden_size * p
    tp = ring_all_reduce(cluster, group_size=t, ranks_per_node=t, payload_bytes=activation)
    # The forward's activation to the next stage, its gradient back in backward.
    p2p = pipeline_send(whole, stages=layout.pipeline, payload_bytes=activation).times(2)
    return {"forward-gather": fwd, "backward-gather": bwd, "reduce-grad": red,
            "replicate-reduce": rep, "tensor-parallel": tp.times(per_layer * stage.layers),
            "pipeline-p2p": p2p}


def _wire_grad_bytes(req: MeshRequest) -> int:
    """Bytes per gradient element a full-precision reduction sends (precision.reduce_dtype)."""
    return DTYPE_BYTES[req.dtype] if req.reduce_dtype == "compute" else DTYPE_BYTES["fp32"]


def _busy_s(x: Traffic) -> float:
    return x.time_s + x.count * COLLECTIVE_LATENCY_S


def price_mesh(req: MeshRequest, cluster: Cluster, layout: MeshLayout, *,
               checkpointing: bool) -> MeshCandidate:
    """Memory per rank and time per step of one candidate ([Note: mesh time model])."""
    k, t, g_node = layout.pipeline, layout.tensor, cluster.gpus_per_node
    if (cluster.world_size % k or g_node % t
            or k * layout.replicate * layout.shard * t != cluster.world_size):
        raise ValueError(f"mesh {k} x {layout.replicate} x {layout.shard} x {t} (pipeline x "
                         f"replicate x shard x tensor) does not tile {cluster.nodes} x {g_node} "
                         f"GPUs")
    stage = _Stage.of(req, cluster, k)
    if stage.cluster.gpus_per_node % t:
        raise ValueError(f"tensor {t} does not tile a pipeline stage's "
                         f"{stage.cluster.gpus_per_node} GPUs of a node; use a divisor of it")
    p, gw = DTYPE_BYTES[req.dtype], _wire_grad_bytes(req)
    pt, b, shape = stage.numel / t, req.micro_batch, req.shape
    d = layout.replicate * layout.shard
    ga = _micro_batches(req, cluster, d)
    if ga < k:
        raise ValueError(f"MeshLayout.pipeline: {k} stages need at least {k} micro-batches per "
                         f"step, the global batch gives {ga}; raise global_batch or use fewer "
                         f"stages")
    micro = _traffic(req, cluster, layout, stage, checkpointing=checkpointing)

    compute = (8 if checkpointing else 6) * pt * b * shape.seq_len / (req.device_flops * req.mfu)
    quant_s = ((2 * pt * (1 + p) if layout.quantized_weights else 0.0)
               + (2 * pt * (1 + gw) if layout.quantized_gradients else 0.0)
               ) / req.device_memory_bytes_per_s
    zero_s = sum(_busy_s(micro[k]) for k in ("forward-gather", "backward-gather", "reduce-grad"))
    tp_s, rep_s = _busy_s(micro["tensor-parallel"]), _busy_s(micro["replicate-reduce"])
    p2p_s = _busy_s(micro["pipeline-p2p"])
    parts = [compute + quant_s, zero_s]
    micro_s = max(parts) + req.exposed_fraction * (sum(parts) - max(parts)) + tp_s + p2p_s
    # GPipe / 1F1B: m micro-batches through K stages take m + K - 1 slots (K = 1: GA x micro).
    step_s = (ga + k - 1) * micro_s + rep_s

    terms = StateTerms.for_training(dtype=req.dtype, grad_dtype=ENGINE_GRAD_DTYPE)
    ledger = estimate_model_states(ceil_bytes(pt), 3, layout.shard, terms, gpus_per_node=g_node,
                                   unit_numel=ceil_bytes(shape.largest_unit_numel() / t))
    hpz_bytes = ceil_bytes(pt * p / layout.hpz_partition_size) if layout.hpz_partition_size > 1 else 0
    in_flight = min(k, ga)  # 1F1B's first stage; GPipe would hold all ga
    acts = _tp_activation_bytes(stage.shape, micro_batch=b, checkpointing=checkpointing, tensor=t,
                                dtype_bytes=p, in_flight=in_flight)
    need = ledger.tier_bytes(Tier.DEVICE) + hpz_bytes + acts + DEVICE_RESERVE_BYTES
    traffic = {name: (v if name == "replicate-reduce" else v.times(ga))
               for name, v in micro.items()}
    times = {"compute": ga * compute, "quantize": ga * quant_s, "zero-comm": ga * zero_s,
             "tensor-parallel": ga * tp_s, "replicate-reduce": rep_s,
             "pipeline-p2p": ga * p2p_s, "bubble": (k - 1) * micro_s}
    return MeshCandidate(layout=layout, checkpointing=checkpointing, grad_accum=ga, micro_batch=b,
                         ledger=ledger, hpz_secondary_bytes=hpz_bytes, activation_bytes=acts,
                         need_bytes=need,
                         usable_bytes=int(req.device_memory_bytes * (1 - req.headroom)),
                         traffic=traffic, times_s=times, step_s=step_s,
                         tokens_per_step=ga * d * b * shape.seq_len, stage_layers=stage.layers,
                         micro_batches_in_flight=in_flight)


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
    """The chosen candidate as a native config dict with the names issues #17's and #36's parts
    agreed on (``mesh`` with ``mesh.pipeline`` outermost when K > 1, ``pipeline.schedule`` /
    ``pipeline.micro_batches``, ``zero.hpz_partition_size``,
    ``zero.quantized_weights``/``quantized_gradients``, ``zero.quantization_block_numel``,
    ``zero.quantized_gradient_bits``). Without a pipeline neither ``mesh.pipeline`` nor the
    ``pipeline`` section is written: the config reads as it did before them."""
    lay = candidate.layout
    mesh = {"replicate": lay.replicate, "shard": lay.shard, "tensor": lay.tensor}
    zero: dict[str, Any] = {"stage": 3, "hpz_partition_size": lay.hpz_partition_size,
                            "quantized_weights": lay.quantized_weights,
                            "quantized_gradients": lay.quantized_gradients}
    if lay.quantized_weights or lay.quantized_gradients:
        zero["quantization_block_numel"] = req.quantization_block_numel
    if lay.quantized_gradients:
        zero["quantized_gradient_bits"] = lay.gradient_bits
    out: dict[str, Any] = {
        "mesh": ({"pipeline": lay.pipeline, **mesh} if lay.pipeline > 1 else mesh), "zero": zero,
        "precision": {"dtype": req.dtype, "reduce_dtype": req.reduce_dtype},
        "train_micro_batch_size_per_gpu": candidate.micro_batch,
        "gradient_accumulation_steps": candidate.grad_accum,
        "activation_checkpointing": {"units": "all" if candidate.checkpointing else "none"}}
    if lay.pipeline > 1:
        # The schedule's micro-batches are the step's accumulation steps (one count, both keys).
        out["pipeline"] = {"schedule": PIPELINE_SCHEDULE, "micro_batches": candidate.grad_accum}
    return out
