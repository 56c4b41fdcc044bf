"""The memory ledger: bytes per rank for ZeRO stages 0-3, split by term and by tier (pure arithmetic).

The ZeRO paper (Rajbhandari et al., arXiv 1910.02054, section 3 and Table 1) counts *model states*
per parameter: a low-precision parameter (2 B), its gradient (2 B) and K bytes of optimizer state
(K = 12 for mixed-precision Adam: fp32 master, momentum, variance). With data-parallel degree N the
bytes per rank are, per parameter::

    stage 0: 2 + 2 + K          stage 2: 2 + (2 + K)/N
    stage 1: 2 + 2 + K/N        stage 3: (2 + 2 + K)/N

The term sizes are not hard-coded: :class:`StateTerms` derives them from the configuration
(:meth:`StateTerms.from_config`), because fp32 training, bf16 moments or SGD change them.

[Note: ledger placement] Where each term lives, per rank, mirrors the engine:

* params: the low-precision copy used in compute. Stages 0-2: the full Psi on the device.
  Stage 3: a 1/N shard in ``offload_param``'s tier (device when 'none').
* grads: see [Note: gradient placement].
* optimizer: K bytes per parameter for the part this rank steps (all at stage 0, a shard from
  stage 1 on), in ``offload_optimizer``'s tier: fp32 master + moments, stepped by ``cpu_adam`` off the
  device.
* [Note: frozen parameters] Gradients and optimizer state exist only for trainable parameters
  (``trainable_numel``; LoRA: the adapters, ~0.1-1 % of the model): a frozen parameter has its
  low-precision copy in the params term and nothing else, as in the engine (frozen flat groups
  get no gradient accumulator, no master, no optimizer sub-group, and their NVMe shards are
  written once at set-up and only read afterwards).
* With the optimizer on NVMe the host holds staging buffers for a few sub-groups (read the next one,
  step the current one, write the previous one back): ``buffers['host']['optimizer_staging']``.
  That is the least; the engine reads further ahead (from backward on) into the room the host
  budget leaves, and keeps stepped sub-groups cached there for the next step ([Note: optimizer
  read-ahead] in infinity/optim/_offloaded.py), always within ``memory.host_budget_bytes``.
* Working buffers that depend on the model's shape (gathered units, a unit's full gradient, the
  device and host copies of offloaded parameter shards on their way up) appear under ``buffers``
  when ``unit_numel`` is given; activations come from :func:`activation_bytes`.

[Note: gradient placement] The engine reduces and accumulates gradients in fp32, whatever the
compute dtype: autograd's low-precision ``param.grad`` is folded into the unit's fp32 staging buffer
(one unit's full gradient, alive only until the unit is reduced), and the reduced gradient is summed
over micro-batches in an fp32 accumulator (DeepSpeed's bf16 optimizer and ZeRO-Offload do the same:
low-precision sums over many micro-batches lose the small contributions). So the ledger's gradient
term is 4 B per parameter for engine configs (:data:`ENGINE_GRAD_DTYPE`), not the paper's 2 B.
Where the accumulator lives:

* optimizer on the device: stages 0-1 keep the full all-reduced gradient on the device; stages 2-3
  reduce-scatter each unit into this rank's 1/N shard, also on the device.
* optimizer offloaded ('cpu' *and* 'nvme'): right after each unit's reduction the part of it this
  rank's optimizer steps (everything at stage 0, the shard from stage 1 on) is copied into an fp32
  buffer in host memory and the device copy is freed, so the device holds only one unit's transient
  full gradient (ZeRO-Offload keeps its fp32 gradient partitions in CPU memory the same way). The
  accumulators are HOST-homed shards of the store's host arena, allocated once and budgeted with it
  (``memory.host_budget_bytes`` covers them, DESIGN decision 7), and ``cpu_adam`` reads them in
  place. The fp32 masters such an optimizer takes over are built in host memory too, so neither
  gradients nor masters ever sit on the device as a whole.
* With the optimizer on NVMe the gradients accumulate in host memory while the host budget holds
  them beside the NVMe staging: writing 4 B per parameter during backward and reading it back
  at the step would add 8 B to the step's 24 B of NVMe traffic (+33 % on the slowest link) and
  contend with the parameter reads of the backward. Where the budget cannot hold them (a large
  model), they are NVMe-homed slices instead, and only a few slices sit in host memory
  (``grads_on_nvme``; [Note: gradients on NVMe] in infinity/zero/_grad_reducer.py).
* Those host accumulators hold the compute dtype instead of fp32 when nothing is summed into them
  in fp32 (:func:`host_grad_dtype`: one micro-batch per step, and one rank or a compute-dtype
  reduction): the value each element receives is already a bf16/fp16 number (autograd's
  ``param.grad``, or what came off the wire), so fp32 would hold the same value in twice the bytes.
  Half the host RAM of the gradients (14 GB for 7B parameters), and room for the NVMe optimizer's
  read-ahead. A parameter whose gradient arrives twice in one backward (reentrant checkpointing)
  is then summed in the compute dtype, as autograd sums ``param.grad`` in plain PyTorch.

[Note: the hpZ term] With ZeRO++ hpZ (``zero.hpz_partition_size`` H > 1, stage 3, parameters on
the device) each rank keeps a secondary shard of every unit, 1/H of its parameters in the compute
dtype, from the unit's forward gather to the end of the backward ([Note: hpZ secondary shards] in
infinity/zero/_hpz.py): ``buffers['device']['hpz_secondary']`` = numel x param bytes / H (2/H B
per parameter for bf16 weights). All units hold one at once between forward and backward, so it is
a term of the device peak, not of one unit.

[Note: fp32 master] With bf16/fp16 compute the fp32 master is a separate 4 B copy and part of K. With
fp32 compute the parameter *is* the master where the optimizer steps it in place on the device
(optimizer and parameters both on the device), so K is the moments alone (8 B for Adam). An
offloaded optimizer (or offloaded parameters) keeps its own fp32 master beside its moments, even
when both are homed on the same tier (the engine's sub-groups are [master | exp_avg | exp_avg_sq]),
so K = 4 + 8 there.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from infinity._tier import Tier
from infinity.config import AUTO_SUB_GROUP_NUMEL, DTYPE_BYTES, InfinityConfig

GB = 10**9
"""The unit of the ZeRO papers' model-state figures (1T params x 16 B = 16000 GB)."""

OPTIMIZERS = ("adam", "sgd-momentum", "sgd")
_MOMENTS = {"adam": 2, "sgd-momentum": 1, "sgd": 0}
"""Moment tensors per parameter: Adam keeps momentum and variance, SGD with momentum one, SGD none."""

OPTIMIZER_STAGING_SUBGROUPS = 3
"""Sub-groups staged on the host with the optimizer on NVMe: read(i+1), step(i), write(i-1)."""

DEFAULT_SUB_GROUP_NUMEL = 100_000_000
"""The sub-group size ``infinity plan`` writes for an NVMe optimizer (and prices). A ledger
given no size, or a config at 'auto', assumes the engine's 'auto' (AUTO_SUB_GROUP_NUMEL): the
estimate of a default config must stage what the engine stages (it assumed this 1e8 until
2026-12-04: 3.6 GB of optimizer staging where the engine held 0.15 GB)."""

DEFAULT_PREFETCH_UNITS = 2
REDUCE_INFLIGHT_UNITS = 1
"""Gradient reductions left in flight (issued, not waited) while the next unit's backward
computes, with several data-parallel ranks ([Note: issue and wait] in
infinity/zero/_collectives.py): each holds its unit's staging and its shard of the result."""
"""Units gathered ahead of compute the ledger assumes when the lookahead is 'auto'."""

ENGINE_GRAD_DTYPE = "fp32"
"""The dtype the engine reduces and accumulates gradients in (see [Note: gradient placement])."""


def host_grad_dtype(config: InfinityConfig, world_size: int = 1) -> str:
    """The dtype of the host gradient accumulators of an offloaded optimizer for an engine
    config at ``world_size`` (:func:`host_grad_dtype_of`)."""
    return host_grad_dtype_of(config.precision.dtype, config.gradient_accumulation_steps,
                              world_size, config.precision.reduce_dtype)


def grad_staging_dtype(config: InfinityConfig, world_size: int = 1) -> str:
    """The dtype a unit's gradient is staged in for an engine config at ``world_size`` (the
    ranks gradients are summed over): the host accumulators' (:func:`host_grad_dtype`) where
    :func:`stages_in_accumulator_dtype` says so, else fp32."""
    if stages_in_accumulator_dtype(
            optimizer_offloaded=config.offload_optimizer.home_tier is not Tier.DEVICE,
            quantized_gradients=config.zero.quantized_gradients):
        return host_grad_dtype(config, world_size)
    return "fp32"


def host_grad_dtype_of(dtype: str, grad_accum: Any, world_size: int, reduce_dtype: str) -> str:
    """[Note: gradient placement], last point: the compute dtype when each element is written
    once per step with a value that already is in that dtype, so holding it in fp32 would keep
    nothing more -- one micro-batch per step (``grad_accum`` 1) and either one rank or
    gradients crossing ranks in the compute dtype (``reduce_dtype`` 'compute'). fp32 otherwise:
    sums over micro-batches or over ranks in fp32 must not be rounded."""
    if dtype == "fp32" or grad_accum != 1:
        return "fp32"
    if world_size > 1 and reduce_dtype != "compute":
        return "fp32"
    return dtype


def stages_in_accumulator_dtype(*, optimizer_offloaded: bool, quantized_gradients: bool) -> bool:
    """[Note: staging in the accumulator's dtype]
    Whether a unit's gradient is staged in its host accumulator's dtype
    (:func:`host_grad_dtype_of`) rather than in fp32.

    A unit's gradient is staged in fp32 where fp32 sums are kept: device accumulators, host
    ones in fp32 (several micro-batches, or ranks summing in fp32). Where the host
    accumulator holds the compute dtype (``ledger.host_grad_dtype_of``: one micro-batch, and
    one rank or a wire in the compute dtype), every element the staging holds is a gradient
    autograd made in that dtype, copied in exactly, so an fp32 buffer keeps nothing more and
    the value that reaches the accumulator is the same: the division by the ranks rounds
    once either way, and so does a parameter used twice in one backward (a tied weight; a
    third use would round once more here than in fp32). Half the bytes, and they count: at
    one rank, stored gradient slices are staged this way, and the root unit's staging
    (whose embedding gradient comes last) lives through the whole backward beside the
    current unit's: the 3.3B GPT at a 4 GiB host budget peaked at 5.80 GB RSS with fp32
    staging, 5.48 GB with this (the 1B run, whose accumulators are staged in place: 4.95).
    Not with qgZ, whose quantizer reads fp32. The reducer (``ReducerConfig.staging_dtype``),
    the 'auto' device budget's working set (``device_working_set``) and the ledger's unit
    buffers (``estimate_model_states``) all ask this."""
    return optimizer_offloaded and not quantized_gradients


TERMS = ("params", "grads", "optimizer")


def _check_offload(name: str, value: str) -> Tier:
    try:
        return Tier.of_offload(value)
    except ValueError:
        raise ValueError(f"{name}: expected one of 'none', 'cpu', 'nvme', got {value!r}") from None


@dataclass(frozen=True, kw_only=True)
class StateTerms:
    """Bytes per parameter of each model-state term (the ZeRO paper's 2 + 2 + K by default)."""

    param_bytes: float = 2.0
    """The parameter copy used in forward and backward (bf16/fp16: 2, fp32: 4)."""
    grad_bytes: float = 2.0
    """The gradient as backward produces it and the collectives reduce it."""
    optimizer_bytes: float = 12.0
    """K: everything the optimizer keeps per parameter (fp32 master + moments for Adam)."""
    offload_grad_bytes: float | None = None
    """The gradient copy the optimizer reads in its own tier when offloaded; None: ``grad_bytes``
    (``cpu_adam`` upcasts low-precision gradients inside its pass, so no fp32 copy is kept)."""

    def __post_init__(self) -> None:
        for name in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"StateTerms.{name}: expected a number of bytes >= 0, got {value!r}")
        if self.offload_grad_bytes is not None and self.offload_grad_bytes < 0:
            raise ValueError(f"StateTerms.offload_grad_bytes: expected >= 0 or None, got "
                             f"{self.offload_grad_bytes!r}")

    @property
    def optimizer_grad_bytes(self) -> float:
        return self.grad_bytes if self.offload_grad_bytes is None else self.offload_grad_bytes

    @property
    def per_param_bytes(self) -> float:
        """2 + 2 + K: the replicated (stage 0) bytes per parameter."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @classmethod
    def for_training(cls, *, dtype: str = "bf16", optimizer: str = "adam", state_dtype: str = "fp32",
                     separate_master: bool | None = None,
                     grad_dtype: str | None = None) -> "StateTerms":
        """Terms for ``dtype`` compute with ``optimizer`` (see [Note: fp32 master]).

        ``separate_master``: whether the optimizer keeps its own fp32 master; None decides from the
        dtype (always with bf16/fp16, never with fp32). ``grad_dtype``: the dtype gradients are
        reduced and accumulated in; None: ``dtype`` (the paper's count). The engine accumulates in
        :data:`ENGINE_GRAD_DTYPE` (see [Note: gradient placement]).
        """
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype: expected one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
        if optimizer not in _MOMENTS:
            raise ValueError(f"optimizer: expected one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
        if state_dtype not in ("fp32", "bf16"):
            raise ValueError(f"state_dtype: expected 'fp32' or 'bf16', got {state_dtype!r}")
        if grad_dtype is not None and grad_dtype not in DTYPE_BYTES:
            raise ValueError(f"grad_dtype: expected one of {sorted(DTYPE_BYTES)}, got {grad_dtype!r}")
        low = DTYPE_BYTES[dtype]
        grad = DTYPE_BYTES[grad_dtype] if grad_dtype is not None else low
        if separate_master is None:
            separate_master = dtype != "fp32"
        master = 4 if (separate_master or dtype != "fp32") else 0
        moments = _MOMENTS[optimizer] * DTYPE_BYTES[state_dtype]
        return cls(param_bytes=low, grad_bytes=grad, optimizer_bytes=master + moments)

    @classmethod
    def from_config(cls, config: InfinityConfig, *, optimizer: str = "adam",
                    world_size: int = 1) -> "StateTerms":
        """Terms of an engine config: precision.dtype, optimizer.state_dtype and the offload tiers;
        gradients in the engine's fp32, and an offloaded optimizer's host accumulators in
        :func:`host_grad_dtype` (see [Note: gradient placement])."""
        stage = config.zero.stage
        param_home = config.offload_param.device if stage == 3 else "none"
        separate = config.precision.dtype != "fp32" or "none" != config.offload_optimizer.device or (
            param_home != "none")  # [Note: fp32 master]
        terms = cls.for_training(dtype=config.precision.dtype, optimizer=optimizer,
                                 state_dtype=config.optimizer.state_dtype,
                                 separate_master=separate, grad_dtype=ENGINE_GRAD_DTYPE)
        if config.offload_optimizer.device == "none":
            return terms
        return dataclasses.replace(
            terms, offload_grad_bytes=float(DTYPE_BYTES[host_grad_dtype(config, world_size)]))

    def to_dict(self) -> dict[str, float]:
        return {"param_bytes": self.param_bytes, "grad_bytes": self.grad_bytes,
                "optimizer_bytes": self.optimizer_bytes,
                "offload_grad_bytes": self.optimizer_grad_bytes}


@dataclass(frozen=True, kw_only=True)
class Ledger:
    """Bytes per rank of the model states (by term and tier) and of the buffers around them."""

    numel: int
    stage: int
    world_size: int
    gpus_per_node: int
    terms: StateTerms
    trainable_numel: int
    """Parameters with gradients and optimizer state ([Note: frozen parameters]); ``numel``
    when everything trains."""
    offload_param: str
    offload_optimizer: str
    shard_size: int | None = None
    """The shard degree S that sharded terms divided by (None: ``world_size``, the flat mesh)."""
    states: Mapping[str, Mapping[Tier, int]]
    """term -> tier -> bytes on one rank (see [Note: ledger placement])."""
    buffers: Mapping[Tier, Mapping[str, int]] = field(default_factory=dict)
    """tier -> named working/staging buffer -> bytes on one rank."""

    def term_bytes(self, term: str) -> int:
        return sum(self.states[term].values())

    @property
    def params_bytes(self) -> int:
        return self.term_bytes("params")

    @property
    def grads_bytes(self) -> int:
        return self.term_bytes("grads")

    @property
    def optimizer_bytes(self) -> int:
        return self.term_bytes("optimizer")

    @property
    def total_bytes(self) -> int:
        """Model states on one rank, all tiers (the ZeRO paper's per-device figure)."""
        return sum(self.term_bytes(t) for t in TERMS)

    def state_bytes(self, tier: Tier | str) -> int:
        tier = Tier(tier)
        return sum(self.states[t].get(tier, 0) for t in TERMS)

    def buffer_bytes(self, tier: Tier | str) -> int:
        return sum(self.buffers.get(Tier(tier), {}).values())

    def tier_bytes(self, tier: Tier | str) -> int:
        """Model states plus buffers in ``tier`` on one rank."""
        return self.state_bytes(tier) + self.buffer_bytes(tier)

    @property
    def ranks_per_node(self) -> int:
        return min(self.gpus_per_node, self.world_size)

    def node_bytes(self, tier: Tier | str) -> int:
        """``tier``'s bytes summed over the ranks of one node (host RAM and NVMe are per node)."""
        return self.tier_bytes(tier) * self.ranks_per_node

    def to_dict(self) -> dict[str, Any]:
        tiers = {}
        for tier in Tier:
            tiers[tier.value] = {
                **{f"{t}_bytes": self.states[t].get(tier, 0) for t in TERMS},
                "buffers": dict(self.buffers.get(tier, {})),
                "total_bytes": self.tier_bytes(tier),
                "node_total_bytes": self.node_bytes(tier),
            }
        return {
            "numel": self.numel, "trainable_numel": self.trainable_numel,
            "stage": self.stage, "world_size": self.world_size,
            "shard_size": self.world_size if self.shard_size is None else self.shard_size,
            "gpus_per_node": self.gpus_per_node, "terms": self.terms.to_dict(),
            "offload_param": self.offload_param, "offload_optimizer": self.offload_optimizer,
            "params_bytes": self.params_bytes, "grads_bytes": self.grads_bytes,
            "optimizer_bytes": self.optimizer_bytes, "total_bytes": self.total_bytes,
            "tiers": tiers,
        }


def ceil_bytes(x: float) -> int:
    """Bytes rounded up (a hair below an integer counts as it: float sums of exact terms)."""
    return int(math.ceil(x - 1e-9))


def estimate_model_states(numel: int, stage: int, world_size: int, terms: StateTerms | None = None,
                          *, offload_param: str = "none", offload_optimizer: str = "none",
                          gpus_per_node: int | None = None, sub_group_numel: int | None = None,
                          unit_numel: int | None = None,
                          prefetch_units: int = DEFAULT_PREFETCH_UNITS,
                          optimizer_host_resident_bytes: int = 0,
                          grads_on_nvme: bool = False, trainable_numel: int | None = None,
                          unit_trainable_numel: int | None = None,
                          shard_size: int | None = None, device_holds_params: bool = False,
                          hpz_partition_size: int = 1,
                          quantized_gradients: bool = False) -> Ledger:
    """The per-rank ledger of ``numel`` parameters at ZeRO ``stage`` over ``world_size`` ranks.

    ``shard_size``: the shard degree S the sharded terms divide by, over a mesh of replicas
    (HSDP / MiCS: [Note: mesh dimensions] in infinity/config/_mesh.py); None: ``world_size``
    (the flat mesh). Replicas add no bytes per rank: each holds what a rank of S ranks holds.
    ``trainable_numel``: how many of them train (None: all); the others are frozen, with a
    params term and no gradient or optimizer state ([Note: frozen parameters]).

    Where the model states sit (``grads_on_nvme``, ``optimizer_host_resident_bytes``):
    :func:`_place_states`. The optimizer's NVMe staging (``sub_group_numel``):
    :func:`_optimizer_staging`. The working buffers of the largest unit (``unit_numel``,
    ``unit_trainable_numel``, ``prefetch_units``, ``device_holds_params``,
    ``quantized_gradients``): :func:`_unit_working_buffers`. ``hpz_partition_size``: ZeRO++
    hpZ's secondary group size H; above 1 (stage 3, parameters on the device, H dividing the
    shard degree) the device holds 1/H of the parameters as secondary shards
    ([Note: the hpZ term]).
    """
    n, trainable = _check_sizes(numel, stage, world_size, shard_size, trainable_numel)
    terms = terms or StateTerms()
    param_home = _check_offload("offload_param", offload_param)
    opt_tier = _check_offload("offload_optimizer", offload_optimizer)
    if stage < 3 and param_home is not Tier.DEVICE:
        raise ValueError(f"offload_param = {offload_param!r} needs stage 3 (got stage {stage}); "
                         "parameters are replicated below stage 3, set --offload-param none")
    _check_hpz(hpz_partition_size, stage, n, param_home)
    if grads_on_nvme and opt_tier is not Tier.NVME:
        raise ValueError(f"grads_on_nvme needs offload_optimizer 'nvme', got {offload_optimizer!r}")
    states, stepped = _place_states(
        numel, trainable, stage=stage, shard_size=n, terms=terms, param_home=param_home,
        opt_tier=opt_tier, grads_on_nvme=grads_on_nvme,
        optimizer_host_resident_bytes=optimizer_host_resident_bytes)
    buffers = _optimizer_staging(opt_tier, stepped, sub_group_numel, terms, grads_on_nvme)
    if unit_numel:
        _unit_working_buffers(
            buffers, numel, trainable, stage=stage, shard_size=n, terms=terms,
            unit_numel=unit_numel, unit_trainable_numel=unit_trainable_numel,
            prefetch_units=prefetch_units, device_holds_params=device_holds_params,
            param_home=param_home, opt_tier=opt_tier, quantized_gradients=quantized_gradients)
    if hpz_partition_size > 1:  # [Note: the hpZ term]
        buffers.setdefault(Tier.DEVICE, {})["hpz_secondary"] = ceil_bytes(
            numel * terms.param_bytes / hpz_partition_size)
    return Ledger(numel=numel, stage=stage, world_size=world_size, shard_size=n,
                  gpus_per_node=gpus_per_node or world_size, terms=terms, trainable_numel=trainable,
                  offload_param=offload_param, offload_optimizer=offload_optimizer,
                  states=states, buffers=buffers)


def _check_sizes(numel: int, stage: int, world_size: int, shard_size: int | None,
                 trainable_numel: int | None) -> tuple[int, int]:
    """The shard degree and the trainable count of :func:`estimate_model_states`, each checked."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel: expected an integer >= 0, got {numel!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage: expected one of 0, 1, 2, 3, got {stage!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected an integer >= 1, got {world_size!r}")
    n = world_size if shard_size is None else shard_size
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or world_size % n:
        raise ValueError(f"shard_size: expected an integer >= 1 dividing world_size "
                         f"{world_size}, got {shard_size!r}")
    trainable = numel if trainable_numel is None else trainable_numel
    if isinstance(trainable, bool) or not isinstance(trainable, int) or not 0 <= trainable <= numel:
        raise ValueError(f"trainable_numel: expected an integer in [0, numel={numel}], got "
                         f"{trainable_numel!r}")
    return n, trainable


def _place_states(numel: int, trainable: int, *, stage: int, shard_size: int, terms: StateTerms,
                  param_home: Tier, opt_tier: Tier, grads_on_nvme: bool,
                  optimizer_host_resident_bytes: int) -> tuple[dict[str, dict[Tier, int]], int]:
    """The model states per term and tier, and the elements this rank's optimizer steps.

    ``grads_on_nvme`` (optimizer on NVMe): the gradient accumulators are NVMe-homed slices, as
    the engine's offload budgets choose when the host cannot hold them (``OffloadBudgets``): the
    gradient term moves from the HOST to the NVMe row, and the host holds slices of it as
    staging.

    ``optimizer_host_resident_bytes``: optimizer state the engine homes on HOST out of an NVMe
    home when the host budget has room beyond its pipeline (``OffloadBudgets`` of
    :mod:`infinity.tiers`, [Note: host-resident sub-groups]): moved from the NVMe to the HOST row.
    """
    n = shard_size
    shard = ceil_bytes(numel / n)
    states: dict[str, dict[Tier, int]] = {t: {} for t in TERMS}

    def put(term: str, tier: Tier, nbytes: float) -> None:
        states[term][tier] = states[term].get(tier, 0) + ceil_bytes(nbytes)

    put("params", param_home, (shard if stage == 3 else numel) * terms.param_bytes)
    trainable_shard = ceil_bytes(trainable / n)
    stepped = trainable if stage == 0 else trainable_shard
    # [Note: gradient placement]: the accumulator sits beside the optimizer, in host memory when
    # the optimizer is offloaded (to 'cpu' or 'nvme'), holding just the part the optimizer steps.
    if opt_tier is Tier.DEVICE:
        put("grads", Tier.DEVICE, (trainable_shard if stage >= 2 else trainable) * terms.grad_bytes)
    else:
        put("grads", Tier.NVME if grads_on_nvme else Tier.HOST, stepped * terms.optimizer_grad_bytes)
    resident = min(max(0, int(optimizer_host_resident_bytes)), stepped * terms.optimizer_bytes) \
        if opt_tier is Tier.NVME else 0
    put("optimizer", opt_tier, stepped * terms.optimizer_bytes - resident)
    if resident:
        put("optimizer", Tier.HOST, resident)
    return states, stepped


def _optimizer_staging(opt_tier: Tier, stepped: int, sub_group_numel: int | None,
                       terms: StateTerms, grads_on_nvme: bool) -> dict[Tier, dict[str, int]]:
    """The host staging of an optimizer on NVMe: sub-groups of optimizer state (K) read,
    stepped and written; the gradient is read in place from its host accumulator, the new
    parameters go straight to their home. Gradients on NVMe add a slice beside each sub-group,
    and the one being accumulated."""
    buffers: dict[Tier, dict[str, int]] = {}
    if opt_tier is Tier.NVME and stepped:
        group = min(sub_group_numel or AUTO_SUB_GROUP_NUMEL, stepped)
        buffers.setdefault(Tier.HOST, {})["optimizer_staging"] = ceil_bytes(
            OPTIMIZER_STAGING_SUBGROUPS * group * terms.optimizer_bytes)
        if grads_on_nvme:
            buffers[Tier.HOST]["gradient_staging"] = ceil_bytes(
                (OPTIMIZER_STAGING_SUBGROUPS + 1) * group * terms.optimizer_grad_bytes)
    return buffers


def _unit_working_buffers(buffers: dict[Tier, dict[str, int]], numel: int, trainable: int, *,
                          stage: int, shard_size: int, terms: StateTerms, unit_numel: int,
                          unit_trainable_numel: int | None, prefetch_units: int,
                          device_holds_params: bool, param_home: Tier, opt_tier: Tier,
                          quantized_gradients: bool) -> None:
    """Add the working buffers of the gathered units and of a unit's gradient (see
    [Note: ledger placement]); ``unit_numel``: the largest unit's element count.

    ``unit_trainable_numel``: the trainable elements of the largest unit, which size its
    gradient buffer (None: all of ``unit_numel`` when everything trains, else its share
    ``unit_numel * trainable_numel / numel``, adapters spread evenly over the units).
    ``quantized_gradients``: qgZ, whose unit staging is fp32 ([Note: staging in the
    accumulator's dtype]).

    ``device_holds_params`` (parameters offloaded): the engine's device budget holds every
    parameter shard (``OffloadBudgets.device_holds_params``), so after its first read a shard
    stays on the device and the optimizer writes it there: nothing is staged through the host
    (no ``param_staging`` row), as the engine's budgets plan it ([Note: optimizer read-ahead] in
    infinity/tiers/_offload_budgets.py).
    """
    if unit_trainable_numel is None:
        unit_trainable_numel = unit_numel if trainable == numel else \
            ceil_bytes(unit_numel * trainable / max(1, numel))
    _add_unit_buffers(buffers, stage=stage, world_size=shard_size, terms=terms,
                      unit_numel=unit_numel, unit_trainable_numel=unit_trainable_numel,
                      prefetch_units=prefetch_units, host_staging=not device_holds_params,
                      param_home=param_home, grads_leave=stage >= 2 or opt_tier is not Tier.DEVICE,
                      grad_staging_bytes=terms.optimizer_grad_bytes
                      if stages_in_accumulator_dtype(
                          optimizer_offloaded=opt_tier is not Tier.DEVICE,
                          quantized_gradients=quantized_gradients) else terms.grad_bytes)


def _check_hpz(partition_size: Any, stage: int, world_size: int, param_home: Tier) -> None:
    if isinstance(partition_size, bool) or not isinstance(partition_size, int) or partition_size < 1:
        raise ValueError(f"hpz_partition_size: expected an integer >= 1, got {partition_size!r}")
    if partition_size == 1:
        return
    if stage != 3 or param_home is not Tier.DEVICE:
        raise ValueError(f"hpz_partition_size = {partition_size} needs stage 3 with parameters on "
                         f"the device (got stage {stage}, parameters homed on {param_home.value!r})")
    if world_size % partition_size:
        raise ValueError(f"hpz_partition_size = {partition_size} must divide world_size = "
                         f"{world_size}")


def _add_unit_buffers(buffers: dict[Tier, dict[str, int]], *, stage: int, world_size: int,
                      terms: StateTerms, unit_numel: int, unit_trainable_numel: int,
                      prefetch_units: int, param_home: Tier, grads_leave: bool,
                      grad_staging_bytes: float, host_staging: bool = True) -> None:
    """Working buffers that scale with the largest unit (one current + the prefetched ones).

    ``grads_leave``: each unit's full gradient is reduced into a smaller or off-device accumulator
    (stages 2-3, or an offloaded optimizer), so it exists beside the accumulator until then, in
    ``grad_staging_bytes`` per element. ``host_staging``: offloaded shards pass through the host
    on their way up (False: the device keeps every one once read)."""
    device = buffers.setdefault(Tier.DEVICE, {})
    if stage == 3:
        device["gathered_units"] = ceil_bytes((1 + prefetch_units) * unit_numel * terms.param_bytes)
    if grads_leave and unit_trainable_numel:
        # [Note: gradient placement]: a unit's full gradient lives until it is reduced and moved.
        device["unit_gradient"] = ceil_bytes(unit_trainable_numel * grad_staging_bytes)
        if world_size > 1:  # the reductions in flight beside it: staging and result shard
            device["gradients_in_flight"] = ceil_bytes(
                REDUCE_INFLIGHT_UNITS * unit_trainable_numel * grad_staging_bytes
                * (1 + 1 / world_size))
    if stage == 3 and param_home is not Tier.DEVICE:
        unit_shard = ceil_bytes(unit_numel / world_size)
        # Shards on their way up: the device copies the gathers read from (the store's DEVICE
        # copies, bounded by its device budget) and the host copies of shards read from NVMe.
        device["param_shards"] = ceil_bytes((1 + prefetch_units) * unit_shard * terms.param_bytes)
        if host_staging:
            buffers.setdefault(Tier.HOST, {})["param_staging"] = ceil_bytes(
                (1 + prefetch_units) * unit_shard * terms.param_bytes)
    if not device:
        buffers.pop(Tier.DEVICE)


def estimate_from_config(config: InfinityConfig, numel: int, world_size: int, *,
                         gpus_per_node: int | None = None, optimizer: str = "adam",
                         unit_numel: int | None = None,
                         optimizer_host_resident_bytes: int = 0,
                         grads_on_nvme: bool = False, trainable_numel: int | None = None,
                         unit_trainable_numel: int | None = None,
                         sub_group_numel: int | None = None,
                         device_holds_params: bool = False) -> Ledger:
    """The ledger of an engine config (stage, offload tiers, dtypes, sub-group size);
    ``optimizer_host_resident_bytes``, ``grads_on_nvme`` and ``device_holds_params`` as in
    :func:`estimate_model_states`
    (the engine's plan), ``trainable_numel`` and ``unit_trainable_numel`` too (frozen
    parameters: [Note: frozen parameters]). ``sub_group_numel``: the size the engine resolved
    (``engine.stats()["sub_group_numel"]``, the plan again: an 'auto' size is halved where the
    host budget is small); None: the config's, AUTO_SUB_GROUP_NUMEL for 'auto'. ``world_size``:
    every rank (the config's ``mesh`` says how many shard a unit: the sharded terms divide by
    that shard degree)."""
    _, shard_size, _ = config.mesh.resolve(world_size)
    z = config.zero
    sub_group = sub_group_numel or (z.sub_group_numel if isinstance(z.sub_group_numel, int)
                                    else None)
    prefetch_units = DEFAULT_PREFETCH_UNITS
    if unit_numel and isinstance(z.prefetch_lookahead_bytes, int):
        prefetch_units = z.prefetch_lookahead_bytes // max(1, unit_numel * config.precision.param_bytes)
    return estimate_model_states(
        numel, z.stage, world_size,
        StateTerms.from_config(config, optimizer=optimizer, world_size=world_size),
        offload_param=config.offload_param.device if z.stage == 3 else "none",
        offload_optimizer=config.offload_optimizer.device, gpus_per_node=gpus_per_node,
        sub_group_numel=sub_group, unit_numel=unit_numel, prefetch_units=prefetch_units,
        optimizer_host_resident_bytes=optimizer_host_resident_bytes, grads_on_nvme=grads_on_nvme,
        device_holds_params=device_holds_params,
        trainable_numel=trainable_numel, unit_trainable_numel=unit_trainable_numel,
        shard_size=shard_size, hpz_partition_size=z.hpz_partition_size,
        quantized_gradients=z.quantized_gradients)


def paper_bytes_per_device(numel: float, stage: int, world_size: int, k: float = 12.0,
                           param_bytes: float = 2.0, grad_bytes: float = 2.0) -> float:
    """The ZeRO paper's closed form (floats, no shard rounding): the reference the ledger must meet."""
    p, g, n = param_bytes, grad_bytes, world_size
    return numel * {0: p + g + k, 1: p + g + k / n, 2: p + (g + k) / n, 3: (p + g + k) / n}[stage]
