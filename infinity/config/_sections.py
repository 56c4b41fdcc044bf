"""The native configuration: one frozen, keyword-only dataclass per component, every field
documented, units in its name, validated at construction. A component receives its own slice
(``config.swapper``, ``config.zero``...), never the whole.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from infinity._common import MiB, warn_once
from infinity._tier import Tier
from infinity.config._checks import (AUTO, check_choice, check_float, check_int, fail,
                                     is_power_of_two)
from infinity.config._mesh import MeshConfig
from infinity.config._pipeline import PipelineConfig
from infinity.config._scheduler import SchedulerConfig

OffloadDevice = Literal["none", "cpu", "nvme"]
DTypeName = Literal["fp32", "bf16", "fp16"]

_OFFLOAD_DEVICES = ("none", "cpu", "nvme")
_DTYPES = ("fp32", "bf16", "fp16")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

AUTO_SUB_GROUP_NUMEL = 2 ** 22
"""'auto' zero.sub_group_numel: 4 Mi elements, a 48 MiB [master | exp_avg | exp_avg_sq] shard:
large enough for full-speed NVMe requests, small enough that three (the read ahead, the one
being stepped, the one being written) fit a modest host budget. Here rather than in the offload
budgets that halve it, so that the ledger (which sees only the config) assumes the same size."""


@dataclass(frozen=True, kw_only=True)
class SwapperConfig:
    """The NVMe I/O engine (:mod:`infinity.io`)."""

    block_size_bytes: int = 16 * MiB
    """Largest single read/write issued to the kernel; large blocks reach the disk's limit."""
    queue_depth: int = 32
    """Block requests one Swapper keeps in flight at most (across all its threads)."""
    num_io_threads: int = 8
    """Threads issuing blocking ``pread``/``pwrite`` calls (they release the GIL)."""
    direct_io: Literal["auto", "on", "off"] = "auto"
    """``O_DIRECT``: 'auto' uses it where the file system accepts it and falls back with one warning."""
    alignment_bytes: int = 0
    """Offset/length/address alignment for direct I/O; 0 reads it from the file system (4096 fallback)."""

    def __post_init__(self) -> None:
        check_int("swapper.block_size_bytes", self.block_size_bytes, minimum=4096)
        if not is_power_of_two(self.block_size_bytes):
            fail("swapper.block_size_bytes", "a power of two", self.block_size_bytes)
        check_int("swapper.queue_depth", self.queue_depth, minimum=1)
        check_int("swapper.num_io_threads", self.num_io_threads, minimum=1)
        check_choice("swapper.direct_io", self.direct_io, ("auto", "on", "off"))
        check_int("swapper.alignment_bytes", self.alignment_bytes, minimum=0)
        if self.alignment_bytes and not is_power_of_two(self.alignment_bytes):
            fail("swapper.alignment_bytes", "0 or a power of two", self.alignment_bytes)


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """Where one kind of model state lives when it is not in use (``offload_param``/``offload_optimizer``)."""

    device: OffloadDevice = "none"
    """'none': stays on the compute device; 'cpu': host memory; 'nvme': files under ``nvme_path``."""
    nvme_path: str | None = None
    """Directory for swap files (one subdirectory per process/rank is created under it)."""
    name: str = "offload"
    """Config path used in error messages (set by the parent)."""

    @property
    def home_tier(self) -> Tier:
        """Where the offloaded state lives: DEVICE ('none'), HOST ('cpu') or NVME ('nvme')."""
        return Tier.of_offload(self.device)

    def __post_init__(self) -> None:
        check_choice(f"{self.name}.device", self.device, _OFFLOAD_DEVICES)
        if self.device == "nvme" and not self.nvme_path:
            fail(f"{self.name}.nvme_path", "a directory path when device is 'nvme'", self.nvme_path,
                  "set it to a directory on a local disk")
        if self.nvme_path is not None and not isinstance(self.nvme_path, str):
            fail(f"{self.name}.nvme_path", "a string path", self.nvme_path)


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """Byte budgets of the fast tiers (enforced on every allocation by :mod:`infinity.tiers`)."""

    device_budget_bytes: int | Literal["auto"] = AUTO
    """Bytes of offloaded parameter shards' copies on the compute device (the store's DEVICE tier;
    gathered units, gradients, device-held optimizer state and activations are outside it).
    'auto' on a GPU: 80 % of the free memory at initialize, less what the engine allocates there
    itself (the units gathered at once, the units that stay gathered, the gradient buffers, the
    optimizer state kept on the device); the other 20 % is for activations, fragmentation and
    CUDA/NCCL workspaces ([Note: the 'auto' device budget] in infinity/tiers/_offload_budgets.py).
    'auto' without a GPU: the shards in flight plus 64 MiB."""
    host_budget_bytes: int | Literal["auto"] = AUTO
    """Bytes of the host arena (pinned when the engine's device is a GPU); 'auto': sized from the
    model and offload."""
    host_param_cache_bytes: int | Literal["auto"] = AUTO
    """With ``offload_param.device`` 'nvme' and an 'auto' host budget: the host room for
    parameter shards read from NVMe (their staging on the way to the device, and the copies kept
    as a cache that saves reads), on top of what the rest of the offload keeps in host memory
    (a CPU-homed optimizer, gradient accumulators, the NVMe optimizer's staging). Raised to at
    least two shards in flight and a spare extent; capped at every shard. 'auto': that least
    staging. DeepSpeed's ``offload_param.max_in_cpu`` (elements) maps here (x the parameter
    dtype's bytes). With the optimizer homed on the host (or the device) this bounds the host
    bytes of parameter copies; an NVMe optimizer's idle staging room may also hold them."""

    def __post_init__(self) -> None:
        check_int("memory.device_budget_bytes", self.device_budget_bytes, minimum=1, allow_auto=True)
        check_int("memory.host_budget_bytes", self.host_budget_bytes, minimum=1, allow_auto=True)
        check_int("memory.host_param_cache_bytes", self.host_param_cache_bytes, minimum=1,
                  allow_auto=True)
        if self.host_param_cache_bytes != AUTO and self.host_budget_bytes != AUTO:
            fail("memory.host_param_cache_bytes", "'auto' when memory.host_budget_bytes is set",
                 self.host_param_cache_bytes, "host_budget_bytes bounds all host memory; "
                 "host_param_cache_bytes sizes the parameter share of an 'auto' one: set one")


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """Sharding and the parameter manager (:mod:`infinity.zero._param_manager`)."""

    stage: int = 3
    """0: replicate all; 1: shard optimizer state; 2: also gradients; 3: also parameters."""
    unit_class_names: tuple[str, ...] = ()
    """Module class names that form one unit each (e.g. ``("LlamaDecoderLayer",)``); empty: see
    ``unit_min_numel``."""
    unit_min_numel: int | Literal["auto"] = AUTO
    """Without class names: choose units by size, a module becoming a unit once its subtree holds
    this many elements; 'auto': the model's repeated blocks (transformer layers), by size at 1e6
    elements when it has none (``infinity.zero._unit_choice.block_class_names``)."""
    persistence_threshold_numel: int | Literal["auto"] = AUTO
    """Parameters with fewer elements than this stay gathered on the device (norms, biases)."""
    prefetch_lookahead_bytes: int | Literal["auto"] = AUTO
    """Upper bound on bytes of prefetches in flight ahead of compute; 'auto': from bandwidth and trace."""
    max_live_bytes: int | Literal["auto"] = AUTO
    """Upper bound on gathered (full) unit bytes resident at once on the device."""
    max_reuse_distance_numel: int | Literal["auto"] = AUTO
    """Keep a unit gathered when the trace says it is used again within this many elements of fetches."""
    sub_group_numel: int | Literal["auto"] = AUTO
    """Optimizer-state elements stepped and swapped as one piece (the NVMe pipeline's grain);
    'auto': AUTO_SUB_GROUP_NUMEL, halved while the host budget cannot hold its staging."""
    # ZeRO++ quantized collectives (infinity/zero/_quantized_collectives.py; issue #17, part 3)
    quantized_weights: bool = False
    """qwZ: stage 3's parameter all-gathers (forward and backward) send int8 with fp32 block
    scales, dequantized into the gathered unit; shards and masters stay exact (DeepSpeed
    ``zero_quantized_weights``). No effect below stage 3 (nothing is gathered): a warning."""
    quantized_frozen_weights: bool = False
    """qwZ for the frozen parameters' flat groups only (DeepSpeed
    ``zero_quantized_nontrainable_weights``); implied by ``quantized_weights``."""
    quantized_gradients: bool = False
    """qgZ: stage 2-3 gradient reduce-scatters send ``quantized_gradient_bits`` integers with
    fp32 block scales over one all-to-all and sum in fp32 (DeepSpeed
    ``zero_quantized_gradients``). Rejected below stage 2 (whole-gradient all-reduce)."""
    quantization_block_numel: int = 2048
    """Elements sharing one fp32 scale in quantized collectives (4 B of scale per block: 0.2% of
    the int8 payload at 2048, the block size ZeRO++ quantizes in; smaller blocks track outliers
    more closely for more scale bytes)."""
    quantized_gradient_bits: int = 8
    """Width of a quantized gradient element: 8 (int8, ~1/4 of the fp32 bytes) or 4 (int4 packed
    two per byte, ~1/8; what DeepSpeed's qgZ sends)."""

    hpz_partition_size: int = 1
    """ZeRO++ hpZ (DeepSpeed's ``zero_hpz_partition_size``): ranks per secondary group, made of
    consecutive ranks (a node). The forward gathers each unit over all ranks and keeps a secondary
    shard (1/H of the unit) on the device; the backward gathers inside the group only. Costs
    model bytes / H of device memory per rank between forward and backward. 1: off. Stage 3,
    parameters on the device, and a divisor of the world size ([Note: hpZ secondary shards] in
    infinity/zero/_hpz.py)."""

    overlap_param_gather: bool = False
    """Stages 1-2 over several data-parallel ranks: ``engine.step()`` issues the all-gather of the
    updated parameters and returns; each unit's gather is waited where the next forward first
    reads it (its module's forward pre-hook; units read outside their modules at the model's
    own), so it overlaps the forward (Megatron's ``overlap_param_gather``). Between ``step()``
    and the next forward the parameters are in flight: read them through the engine
    (``full_state_dict``, ``module.state_dict()``, checkpoints and ``engine.finish_step()`` wait
    for them), not directly (an EMA reading ``p.data`` after ``step()``). false: ``step()``
    returns with the parameters gathered ([Note: the after-step gather overlaps the next
    forward] in infinity/zero/_step_gathers.py)."""

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            fail("zero_optimization.stage", "one of 0, 1, 2, 3", self.stage)
        if not isinstance(self.unit_class_names, tuple) or not all(
                isinstance(n, str) and n for n in self.unit_class_names):
            fail("zero.unit_class_names", "a list of class-name strings", self.unit_class_names)
        check_int("zero.unit_min_numel", self.unit_min_numel, minimum=1, allow_auto=True)
        check_int("zero.persistence_threshold_numel", self.persistence_threshold_numel, allow_auto=True)
        check_int("zero.prefetch_lookahead_bytes", self.prefetch_lookahead_bytes, allow_auto=True)
        check_int("zero.max_live_bytes", self.max_live_bytes, minimum=1, allow_auto=True)
        check_int("zero.max_reuse_distance_numel", self.max_reuse_distance_numel, allow_auto=True)
        check_int("zero.sub_group_numel", self.sub_group_numel, minimum=1, allow_auto=True)
        self._check_quantization()
        self._check_hpz()
        if not isinstance(self.overlap_param_gather, bool):
            fail("zero.overlap_param_gather", "true or false", self.overlap_param_gather)

    def _check_quantization(self) -> None:
        for name in ("quantized_weights", "quantized_frozen_weights", "quantized_gradients"):
            if not isinstance(getattr(self, name), bool):
                fail(f"zero.{name}", "true or false", getattr(self, name))
        check_int("zero.quantization_block_numel", self.quantization_block_numel, minimum=1)
        if isinstance(self.quantized_gradient_bits, bool) or self.quantized_gradient_bits not in (8, 4):
            fail("zero.quantized_gradient_bits", "8 or 4", self.quantized_gradient_bits)
        if self.quantized_gradients and self.stage < 2:
            fail("zero.quantized_gradients", "false at stage 0-1", True,
                 "stages 0 and 1 all-reduce whole gradients, and only the reduce-scatter of "
                 "stages 2-3 is quantized (qgZ): set zero_optimization.stage to 2 or 3, or "
                 "turn quantized gradients off")
        if (self.quantized_weights or self.quantized_frozen_weights) and self.stage < 3:
            warn_once("zero.quantized_weights",
                      f"zero.quantized_weights / quantized_frozen_weights have no effect at stage "
                      f"{self.stage}: parameters are all-gathered (and quantized) only at stage 3")

    def _check_hpz(self) -> None:
        check_int("zero.hpz_partition_size", self.hpz_partition_size, minimum=1)
        if self.hpz_partition_size > 1 and self.stage != 3:
            fail("zero.hpz_partition_size", "1 below stage 3", self.hpz_partition_size,
                 "hpZ keeps secondary shards of stage 3's gathered units; set "
                 "zero_optimization.stage 3 or hpz_partition_size 1")


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """Mixed precision and loss scaling."""

    dtype: DTypeName = "fp32"
    """Dtype of the parameters and gradients used in compute; fp32 master weights always exist."""
    loss_scale: float = 0.0
    """fp16 only. 0: dynamic loss scaling; > 0: this static scale."""
    initial_scale_power: int = 16
    """fp16 dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """Steps without overflow before the dynamic scale doubles."""
    hysteresis: int = 2
    """Overflows tolerated before the scale is halved."""
    min_loss_scale: float = 1.0
    """The dynamic scale never drops below this."""
    reduce_dtype: Literal["fp32", "compute"] = "fp32"
    """Dtype gradients cross ranks in (reduce-scatter / all-reduce). 'fp32': the engine's fp32
    gradient staging as it is, no rounding between ranks. 'compute': cast to ``dtype`` first, half
    the bytes with bf16/fp16 (DeepSpeed's and FSDP's default), rounded once per reduction."""

    def __post_init__(self) -> None:
        check_choice("precision.dtype", self.dtype, _DTYPES)
        check_choice("precision.reduce_dtype", self.reduce_dtype, ("fp32", "compute"))
        check_float("fp16.loss_scale", self.loss_scale)
        check_int("fp16.initial_scale_power", self.initial_scale_power, minimum=0)
        if self.initial_scale_power > 63:
            fail("fp16.initial_scale_power", "an integer in [0, 63]", self.initial_scale_power)
        check_int("fp16.loss_scale_window", self.loss_scale_window, minimum=1)
        check_int("fp16.hysteresis", self.hysteresis, minimum=1)
        check_float("fp16.min_loss_scale", self.min_loss_scale, strictly_positive=True)

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Adam/AdamW run by :mod:`infinity.optim.cpu_adam` (or torch's fused Adam for state on the device)."""

    type: Literal["adamw", "adam"] = "adamw"
    """'adamw': decoupled weight decay; 'adam': L2 penalty added to the gradient."""
    lr: float | Literal["auto"] = 1e-3
    betas: tuple[float, float] | Literal["auto"] = (0.9, 0.999)
    eps: float | Literal["auto"] = 1e-8
    weight_decay: float | Literal["auto"] = 0.0
    bias_correction: bool = True
    state_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype of the Adam moments; 'bf16' halves their bytes (see :mod:`infinity.optim.cpu_adam`)."""

    def __post_init__(self) -> None:
        check_choice("optimizer.type", self.type, ("adamw", "adam"))
        check_float("optimizer.params.lr", self.lr, allow_auto=True)
        if self.betas != AUTO:
            if (not isinstance(self.betas, tuple) or len(self.betas) != 2
                    or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in self.betas)):
                fail("optimizer.params.betas", "two numbers in [0, 1)", self.betas)
        check_float("optimizer.params.eps", self.eps, allow_auto=True)
        check_float("optimizer.params.weight_decay", self.weight_decay, allow_auto=True)
        if not isinstance(self.bias_correction, bool):
            fail("optimizer.params.bias_correction", "true or false", self.bias_correction)
        check_choice("optimizer.state_dtype", self.state_dtype, ("fp32", "bf16"))

    @property
    def adamw_mode(self) -> bool:
        return self.type == "adamw"


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointingConfig:
    """Activation checkpointing applied by the engine (:mod:`infinity.zero._activations`).

    A checkpointed module keeps only its inputs for backward and runs its forward again during
    backward (``torch.utils.checkpoint``, non-reentrant), trading about one extra forward for the
    activations inside it (Korthikanti et al. 2022: 2sbh instead of sbh(34 + 5as/h) per layer).
    """

    units: Literal["none", "all"] | tuple[str, ...] = "none"
    """'none': off; 'all': every unit module (the modules the parameter manager makes units of,
    not the root); or module class names (e.g. ``("Block",)``), the outermost match wins."""
    offload_to_host: bool = False
    """The same as ``offload: 'host'`` (its older spelling, DeepSpeed's ``cpu_checkpointing``)."""
    offload: Literal["none", "host", "nvme", "auto"] = "none"
    """Where the checkpointed modules' saved inputs live between forward and recompute
    ([Note: saved activations are shards of the store] in infinity/zero/_stored_activations.py):
    'none': where torch keeps them (the device); 'host': in the store's host arena, inside
    ``memory.host_budget_bytes``; 'nvme': swap files, written behind as they are saved and read
    back ahead of the backward, the host arena caching what it has room for; 'auto': a GPU while
    it has room, then host while the arena has room beside the model's states, then NVMe. Needs
    ``units`` other than 'none'."""
    nvme_path: str | None = None
    """Swap directory of activations on NVMe; None: the offload sections' ``nvme_path`` (one swap
    directory per process: when both are set they must be the same)."""

    def __post_init__(self) -> None:
        if isinstance(self.units, str):
            check_choice("activation_checkpointing.units", self.units, ("none", "all"))
        elif not isinstance(self.units, tuple) or not self.units or not all(
                isinstance(n, str) and n for n in self.units):
            fail("activation_checkpointing.units", "'none', 'all' or a non-empty list of module "
                  "class names", self.units, "e.g. \"all\" or [\"LlamaDecoderLayer\"]")
        if not isinstance(self.offload_to_host, bool):
            fail("activation_checkpointing.offload_to_host", "true or false", self.offload_to_host)
        if self.offload_to_host and self.units == "none":
            fail("activation_checkpointing.offload_to_host", "false while units is 'none'", True,
                  "offload moves checkpointed inputs; set units to 'all' or class names")
        check_choice("activation_checkpointing.offload", self.offload,
                     ("none", "host", "nvme", "auto"))
        if self.offload_to_host and self.offload not in ("none", "host"):
            fail("activation_checkpointing.offload_to_host", "false with offload "
                 f"{self.offload!r}", True, "offload_to_host is offload 'host': set one of them")
        if self.offload != "none" and self.units == "none":
            fail("activation_checkpointing.offload", "'none' while units is 'none'", self.offload,
                 "offload moves checkpointed inputs; set units to 'all' or class names")
        if self.nvme_path is not None and (not isinstance(self.nvme_path, str) or not self.nvme_path):
            fail("activation_checkpointing.nvme_path", "a directory path", self.nvme_path)

    @property
    def offload_tier(self) -> str:
        """'none', 'host', 'nvme' or 'auto', with ``offload_to_host`` read as 'host'."""
        return "host" if self.offload_to_host else self.offload

    @property
    def enabled(self) -> bool:
        return self.units != "none"


@dataclass(frozen=True, kw_only=True)
class InfinityConfig:
    """The whole engine's configuration; each component is handed only its own slice."""

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    offload_param: OffloadConfig = field(
        default_factory=lambda: OffloadConfig(name="offload_param"))
    offload_optimizer: OffloadConfig = field(
        default_factory=lambda: OffloadConfig(name="offload_optimizer"))
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    swapper: SwapperConfig = field(default_factory=SwapperConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    """How the ranks split into pipeline stages, replicas, shard groups and tensor slices."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """The schedule of a pipeline-parallel engine (``mesh.pipeline`` > 1)."""
    gradient_clipping: float | Literal["auto"] = 0.0
    """Global L2 norm the gradients are clipped to (across shards and ranks); 0 disables clipping.
    'auto' (a Hugging Face-style config) resolves to 1.0, TrainingArguments' max_grad_norm."""
    gradient_accumulation_steps: int | Literal["auto"] = 1
    """Micro-batches per optimizer step; ``engine.backward`` scales the loss by its inverse."""
    train_micro_batch_size_per_gpu: int | Literal["auto"] | None = None
    """Samples per micro-batch per rank (informational for the engine; used by the planner)."""
    device: str = AUTO
    """Compute device: 'auto' is this rank's GPU (``LOCAL_RANK % device_count``) when CUDA is
    present, else the CPU; 'cuda' is this rank's GPU too; 'cuda:N' is GPU N, refused when several
    local ranks would share it; 'cpu' ([Note: one rank per device] in infinity/zero/_device.py)."""

    def __post_init__(self) -> None:
        check_float("gradient_clipping", self.gradient_clipping, allow_auto=True)
        check_int("gradient_accumulation_steps", self.gradient_accumulation_steps, minimum=1,
                   allow_auto=True)
        check_int("train_micro_batch_size_per_gpu", self.train_micro_batch_size_per_gpu, minimum=1,
                   allow_auto=True, allow_none=True)
        if not isinstance(self.device, str) or not (
                self.device in (AUTO, "cpu") or re.fullmatch(r"cuda(:\d+)?", self.device)):
            fail("device", "'auto', 'cpu' or 'cuda[:N]'", self.device)
        if self.zero.stage < 3 and self.offload_param.device != "none":
            fail("offload_param.device", "'none' below stage 3", self.offload_param.device,
                  "parameter offload needs zero_optimization.stage 3")
        if self.zero.hpz_partition_size > 1 and self.offload_param.device != "none":
            fail("zero.hpz_partition_size", "1 with offload_param", self.zero.hpz_partition_size,
                 "hpZ's secondary shards are device copies outside the offload budgets, which is "
                 "not supported yet; set offload_param.device 'none' or hpz_partition_size 1")
        if self.memory.host_param_cache_bytes != AUTO and self.offload_param.device != "nvme":
            fail("memory.host_param_cache_bytes", "'auto' unless offload_param.device is 'nvme'",
                 self.memory.host_param_cache_bytes, "it sizes the host cache of parameters "
                 "read from NVMe")
        if self.precision.loss_scale and self.precision.dtype != "fp16":
            fail("fp16.loss_scale", "0 unless fp16 is enabled", self.precision.loss_scale)
        if self.offload_optimizer.device != "none" and self.optimizer.state_dtype != "fp32":
            fail("optimizer.state_dtype", "'fp32' with offload_optimizer", self.optimizer.state_dtype,
                 "bf16 moments are implemented for the optimizer on the device only; use "
                 "state_dtype 'fp32' or offload_optimizer.device 'none'")
        paths = {s.nvme_path for s in (self.offload_param, self.offload_optimizer)
                 if s.device == "nvme"}
        if len(paths) > 1:
            raise ValueError(f"offload_param.nvme_path and offload_optimizer.nvme_path differ "
                             f"({sorted(paths)}); one swap directory per process is supported: "
                             f"use the same path for both")
        acts = self.activation_checkpointing
        if acts.offload_tier == "nvme" and not (paths or acts.nvme_path):
            fail("activation_checkpointing.nvme_path", "a directory path with offload 'nvme'",
                 acts.nvme_path, "set it (or an offload section's nvme_path) to a directory on "
                 "a local disk")
        if acts.nvme_path is not None and paths and acts.nvme_path not in paths:
            fail("activation_checkpointing.nvme_path", f"the offload sections' {sorted(paths)[0]!r}"
                 " or unset", acts.nvme_path, "one swap directory per process is supported")

    def check_resolved(self, where: str) -> None:
        """Raise ``ValueError`` naming every value still 'auto' that ``where`` needs as a number
        (the optimizer's hyperparameters, the accumulation steps, clipping, the schedule). 'auto'
        is valid in a config (DeepSpeed configs copied from Hugging Face scripts carry it), not
        in a running engine: :func:`infinity.config.load_config` (which ``initialize`` calls)
        resolves it (:func:`infinity.config.resolve_auto`)."""
        opt = self.optimizer
        unresolved = [f"optimizer.params.{name}" for name in ("lr", "betas", "eps", "weight_decay")
                      if getattr(opt, name) == AUTO]
        unresolved += [name for name in ("gradient_accumulation_steps", "gradient_clipping")
                       if getattr(self, name) == AUTO]
        unresolved += [f"scheduler.{name}" for name in self.scheduler.unresolved()]
        if unresolved:
            raise ValueError(f"{', '.join(unresolved)}: 'auto' must be resolved before {where} "
                             f"(set the values, or pass the config through "
                             f"infinity.config.resolve_auto / load_config)")

    def replace(self, **changes: Any) -> "InfinityConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Native dict form (what :func:`load_config` reads back)."""
        out = dataclasses.asdict(self)
        for key in ("offload_param", "offload_optimizer"):
            out[key].pop("name")
        out["zero"]["unit_class_names"] = list(self.zero.unit_class_names)
        if isinstance(self.optimizer.betas, tuple):
            out["optimizer"]["betas"] = list(self.optimizer.betas)
        if isinstance(self.activation_checkpointing.units, tuple):
            out["activation_checkpointing"]["units"] = list(self.activation_checkpointing.units)
        out["scheduler"] = self.scheduler.to_dict()
        return out
