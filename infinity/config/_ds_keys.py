"""Every key of a DeepSpeed 0.19.8 config and its fate here, with the reason.

Audited against DeepSpeed 0.19.8: ``deepspeed/runtime/config.py`` and ``constants.py`` (top
level), the pydantic models of ``zero_optimization`` (``runtime/zero/config.py``,
``offload_config.py``, ``leaf_module_config.py``, ``zenflow``), ``bf16``/``fp16``
(``runtime/precision_config.py``), the monitors (``monitor/config.py``), ``comms_logger``
(``comm/config.py``), ``flops_profiler`` (``profiling/config.py``), ``aio``
(``runtime/swap_tensor/``), ``activation_checkpointing``, the schedulers' parameters
(``runtime/lr_schedules.py``) and the keys 0.19 removed (``_REMOVED_*_CONFIG_KEYS``, still in old
configs). A few keys of earlier releases that public configs still carry (``aio.thread_count``,
``offload_optimizer.pipeline``) keep their old meaning, marked "(before 0.19)".

The fates:

* ``mapped``: carries meaning we implement; ``why`` names the native field it becomes.
* ``replaced``: tunes DeepSpeed's own machinery; accepted with one warning naming what does that
  job here.
* ``ignored``: a feature we do not implement whose absence does not change the training math
  (monitors, profilers, logging); accepted silently while off (``off``), and with one warning
  naming what is not done when on.
* ``rejected``: behaviour we do not implement that would change what trains; an error naming the
  key and what to do, unless the value is its "off" value (``off``), which is accepted.

A key missing from its table is unknown to DeepSpeed too: an error with a "did you mean".
Sections screened key by key carry their own table (``keys``); the others are judged whole.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Literal, Mapping, NamedTuple

FateKind = Literal["mapped", "replaced", "ignored", "rejected"]


class _Never:
    def __repr__(self) -> str:
        return "<never off>"


NEVER = _Never()
"""``off`` of a key that has no "off" value: any value warns (ignored) or fails (rejected)."""
ANY = object()
"""``off`` of a key whose every value is accepted silently (a part of an ignored section)."""


class Fate(NamedTuple):
    kind: FateKind
    why: str
    off: Any = NEVER
    """The value (or a predicate on the value) that means "feature off"."""
    keys: Mapping[str, "Fate"] | None = None
    """A section screened key by key: its keys' fates."""
    screened_by_mapping: bool = False
    """The section's keys are screened where it is mapped, against what its ``type`` takes
    (``scheduler.params``), not by the generic walk."""

    def is_off(self, value: Any) -> bool:
        if self.off is ANY:
            return True
        if self.off is NEVER:
            return False
        if callable(self.off):
            return bool(self.off(value))
        if isinstance(self.off, bool) or self.off is None:
            return value is self.off or (value == self.off and not isinstance(value, str))
        return value == self.off and not isinstance(value, bool)


def mapped(to: str, keys: Mapping[str, Fate] | None = None) -> Fate:
    return Fate("mapped", to, keys=keys)


def replaced(by: str) -> Fate:
    return Fate("replaced", by)


def ignored(what: str, off: Any = NEVER, keys: Mapping[str, Fate] | None = None) -> Fate:
    return Fate("ignored", what, off, keys)


def rejected(why: str, off: Any = NEVER) -> Fate:
    return Fate("rejected", why, off)


def disabled(section: Any) -> bool:
    """A section that is absent, empty, or ``"enabled": false``."""
    return not section or (isinstance(section, Mapping) and section.get("enabled", False) is False)


def at_defaults(defaults: Mapping[str, Any]) -> Callable[[Any], bool]:
    """A section whose every key is one of ``defaults`` and set to it (what "off" means there)."""
    def check(section: Any) -> bool:
        if not section:
            return True
        return isinstance(section, Mapping) and all(
            k in defaults and v == defaults[k] and type(v) is type(defaults[k])
            for k, v in section.items())
    return check


def _part_of(section: str) -> Fate:
    return Fate("ignored", f"a setting of {section}", ANY)


def _parts(section: str, *names: str) -> dict[str, Fate]:
    return {name: _part_of(section) for name in names}


_GATHER_ON_DEMAND = "engine.full_state_dict() / `infinity consolidate` gather weights on demand"
_ONE_ARENA = "host memory is one arena (memory.host_budget_bytes), pinned when the engine's device is a GPU"
_PER_UNIT = "one collective per unit (units set by zero.unit_class_names / zero.unit_min_numel)"
_REMOVED = "removed from DeepSpeed itself in 0.19"

OFFLOAD_PARAM_KEYS: dict[str, Fate] = {
    "device": mapped("offload_param.device"),
    "nvme_path": mapped("offload_param.nvme_path"),
    "max_in_cpu": mapped("memory.host_param_cache_bytes (elements x the parameter dtype's bytes; "
                         "with device 'nvme', as in DeepSpeed)"),
    "pin_memory": replaced(_ONE_ARENA),
    "buffer_count": replaced("memory.host_param_cache_bytes / memory.host_budget_bytes (one "
                             "arena, carved per shard)"),
    "buffer_size": replaced("memory.host_param_cache_bytes / memory.host_budget_bytes (one "
                            "arena, carved per shard)"),
}

OFFLOAD_OPTIMIZER_KEYS: dict[str, Fate] = {
    "device": mapped("offload_optimizer.device"),
    "nvme_path": mapped("offload_optimizer.nvme_path"),
    "ratio": rejected("partial optimizer offload (ratio < 1) is not implemented", 1.0),
    "super_offload": rejected("SuperOffload is not implemented", False),
    "pin_memory": replaced(_ONE_ARENA),
    "buffer_count": replaced("memory.host_budget_bytes and zero.sub_group_numel"),
    "fast_init": replaced("optimizer state is always created directly in its home tier"),
    "pipeline_read": replaced("the optimizer's NVMe pipeline is always on"),
    "pipeline_write": replaced("the optimizer's NVMe pipeline is always on"),
    "pipeline": replaced("the optimizer's NVMe pipeline is always on (before 0.19)"),
    "cpuadam_cores_perc": replaced("the CPU Adam kernel uses torch's intra-op threads "
                                   "(torch.set_num_threads)"),
}

ZERO_KEYS: dict[str, Fate] = {
    "stage": mapped("zero.stage"),
    "offload_param": mapped("offload_param (where parameter shards live)", OFFLOAD_PARAM_KEYS),
    "offload_optimizer": mapped("offload_optimizer (where masters and moments live)",
                                OFFLOAD_OPTIMIZER_KEYS),
    "cpu_offload": mapped("offload_optimizer.device 'cpu' (deprecated boolean spelling)"),
    "cpu_offload_param": mapped("offload_param.device 'cpu' (deprecated boolean spelling)"),
    "cpu_offload_use_pin_memory": replaced(_ONE_ARENA),
    "sub_group_size": mapped("zero.sub_group_numel"),
    "stage3_prefetch_bucket_size": mapped("zero.prefetch_lookahead_bytes (x parameter bytes)"),
    "prefetch_bucket_size": mapped("zero.prefetch_lookahead_bytes (x parameter bytes)"),
    "stage3_param_persistence_threshold": mapped("zero.persistence_threshold_numel"),
    "param_persistence_threshold": mapped("zero.persistence_threshold_numel"),
    "stage3_max_live_parameters": mapped("zero.max_live_bytes (x parameter bytes)"),
    "max_live_parameters": mapped("zero.max_live_bytes (x parameter bytes)"),
    "stage3_max_reuse_distance": mapped("zero.max_reuse_distance_numel"),
    "max_reuse_distance": mapped("zero.max_reuse_distance_numel"),
    "stage3_module_granularity_threshold": mapped("zero.unit_min_numel (0: our size default)"),
    "module_granularity_threshold": mapped("zero.unit_min_numel (0: our size default)"),
    "stage3_model_persistence_threshold": ignored(
        "a cap on the total of persistent parameters is not implemented: every parameter below "
        "zero.persistence_threshold_numel stays gathered", sys.maxsize),
    "model_persistence_threshold": ignored(
        "a cap on the total of persistent parameters is not implemented: every parameter below "
        "zero.persistence_threshold_numel stays gathered", sys.maxsize),
    "contiguous_gradients": replaced("gradients always land in one contiguous shard per unit"),
    "overlap_comm": replaced("collectives and I/O always overlap compute"),
    "reduce_scatter": replaced("stages 2 and 3 always reduce-scatter per unit"),
    "reduce_bucket_size": replaced(_PER_UNIT),
    "allgather_bucket_size": replaced(_PER_UNIT),
    "allgather_partitions": replaced("parameters are always all-gathered per unit"),
    "use_multi_rank_bucket_allreduce": replaced(_PER_UNIT),
    "stage3_use_all_reduce_for_fetch_params": replaced(
        "parameters are always all-gathered per unit"),
    "use_all_reduce_for_fetch_params": replaced("parameters are always all-gathered per unit"),
    "stage3_allgather_sequential": replaced("parameters are always all-gathered per unit"),
    "allgather_sequential": replaced("parameters are always all-gathered per unit"),
    "round_robin_gradients": replaced("gradient shards are contiguous per unit"),
    "compute_grad_norm": replaced("the exact global gradient norm is always computed"),
    "elastic_checkpoint": replaced("checkpoints load at any world size"),
    "load_from_fp32_weights": replaced("checkpoints always restore the fp32 master"),
    "memory_efficient_linear": replaced("gathered parameters are views; no special linear needed"),
    "ignore_unused_parameters": replaced("unused parameters are always tolerated"),
    "legacy_stage1": replaced("one mechanism serves stages 0-3"),
    "parameter_alignment": replaced("flat groups are laid out and padded by the engine"),
    "pipeline_loading_checkpoint": replaced("infinity.init materialises weights unit by unit"),
    "override_module_apply": replaced("infinity.init records the model and materialises it unit "
                                      "by unit"),
    "log_trace_cache_warnings": replaced("the prefetch trace is re-recorded when it diverges"),
    "enable_sanity_checks": replaced("the tiered store checks every state transition"),
    "leaf_module": replaced("a unit is a whole module subtree (zero.unit_class_names), fetched "
                            "together"),
    "stage3_gather_16bit_weights_on_model_save": replaced(_GATHER_ON_DEMAND),
    "gather_16bit_weights_on_model_save": replaced(_GATHER_ON_DEMAND),
    "stage3_gather_fp16_weights_on_model_save": replaced(_GATHER_ON_DEMAND),
    "save_muon_momentum_buffer_in_memory": ignored("the Muon optimizer is not implemented", False),
    "zero_quantized_weights": mapped("zero.quantized_weights (qwZ: int8 parameter all-gather)"),
    "zero_quantized_nontrainable_weights": mapped(
        "zero.quantized_frozen_weights (qwZ for frozen parameters only)"),
    "zero_quantized_gradients": mapped(
        "zero.quantized_gradients with zero.quantized_gradient_bits = 4 (qgZ: DeepSpeed "
        "reduces gradients in int4)"),
    "zero_hpz_partition_size": mapped("zero.hpz_partition_size"),
    "zenflow": rejected("ZenFlow (asynchronous offloaded updates) is not implemented", None),
    "mics_shard_size": mapped("mesh.shard (-1: off, the flat mesh; replicas: world / shard)"),
    "mics_hierarchical_params_gather": rejected(f"MiCS ({_REMOVED})", False),
    "zeropp_loco_param": rejected(f"LoCo-ZeRO++ ({_REMOVED})", None),
}

AIO_KEYS: dict[str, Fate] = {
    "block_size": mapped("swapper.block_size_bytes"),
    "queue_depth": mapped("swapper.queue_depth"),
    "intra_op_parallelism": mapped("swapper.num_io_threads"),
    "thread_count": mapped("swapper.num_io_threads (before 0.19)"),
    "single_submit": replaced("swapper.queue_depth requests are always kept in flight"),
    "overlap_events": replaced("I/O always overlaps compute"),
    "use_gds": rejected("GPUDirect Storage is not implemented", False),
}

FP16_KEYS: dict[str, Fate] = {
    "enabled": mapped("precision.dtype 'fp16' ('auto': off unless a trainer fills it)"),
    "loss_scale": mapped("precision.loss_scale"),
    "initial_scale_power": mapped("precision.initial_scale_power"),
    "loss_scale_window": mapped("precision.loss_scale_window"),
    "hysteresis": mapped("precision.hysteresis"),
    "min_loss_scale": mapped("precision.min_loss_scale"),
    "consecutive_hysteresis": rejected("consecutive hysteresis is not implemented", False),
    "auto_cast": rejected("fp16 auto_cast of inputs is not implemented; cast inputs yourself",
                          False),
    "fp16_master_weights_and_grads": rejected("fp16 master weights are not implemented", False),
}

BF16_KEYS: dict[str, Fate] = {
    "enabled": mapped("precision.dtype 'bf16' ('auto': off unless a trainer fills it)"),
    "immediate_grad_update": replaced("gradients are reduced per unit as soon as they are ready"),
    "check_grad_overflow": ignored("bf16 steps are not skipped for non-finite gradients (only "
                                   "fp16 steps are); DeepSpeed 0.19.8's default is true", False),
    "bf16_master_weights_and_grads": rejected("bf16 master weights are not implemented (the "
                                              "master is always fp32)", False),
    "bf16_optimizer_states": rejected("bf16 optimizer state with bf16 masters is not "
                                      "implemented (the native optimizer.state_dtype 'bf16' "
                                      "keeps fp32 masters)", False),
}

OPTIMIZER_PARAMS: dict[str, Fate] = {
    "lr": mapped("optimizer.lr"),
    "betas": mapped("optimizer.betas"),
    "eps": mapped("optimizer.eps"),
    "weight_decay": mapped("optimizer.weight_decay"),
    "bias_correction": mapped("optimizer.bias_correction"),
    "adam_w_mode": mapped("optimizer.type ('adamw' / 'adam')"),
    "torch_adam": replaced("infinity.optim.cpu_adam runs off-device state; torch Adam runs "
                           "on-device"),
    "fused": replaced("the Adam step is always fused"),
    "amsgrad": rejected("AMSGrad is not implemented", False),
    "maximize": rejected("maximize is not implemented", False),
    "max_grad_norm": rejected("an optimizer-level max_grad_norm is not supported (DeepSpeed "
                              "refuses it too); use the top-level 'gradient_clipping'"),
}

OPTIMIZER_KEYS: dict[str, Fate] = {
    "type": mapped("optimizer.type (Adam / AdamW and their fused / CPU spellings)"),
    "params": mapped("optimizer (its hyperparameters)", OPTIMIZER_PARAMS),
    "legacy_fusion": replaced("the Adam step is always fused"),
}

SCHEDULER_PARAM_FIELDS: dict[str, str] = {
    "warmup_min_lr": "warmup_min_lr", "warmup_max_lr": "warmup_max_lr",
    "warmup_num_steps": "warmup_num_steps", "warmup_type": "warmup_type",
    "total_num_steps": "total_num_steps", "warmup_min_ratio": "warmup_min_ratio",
    "cos_min_ratio": "cos_min_ratio", "cycle_min_lr": "cycle_min_lr",
    "cycle_max_lr": "cycle_max_lr", "decay_lr_rate": "decay_lr_rate",
    "cycle_first_step_size": "cycle_first_num_steps",
    "cycle_second_step_size": "cycle_second_num_steps",
    "cycle_first_stair_count": "cycle_first_num_stairs",
    "cycle_second_stair_count": "cycle_second_num_stairs",
    "decay_step_size": "decay_interval_num_steps", "cycle_momentum": "cycle_momentum",
    "cycle_min_mom": "cycle_min_mom", "cycle_max_mom": "cycle_max_mom",
    "decay_mom_rate": "decay_mom_rate", "lr_range_test_min_lr": "lr_range_test_min_lr",
    "lr_range_test_step_size": "lr_range_test_interval_num_steps",
    "lr_range_test_step_rate": "lr_range_test_step_rate",
    "lr_range_test_staircase": "lr_range_test_staircase",
}
"""DeepSpeed's scheduler parameters (the keyword arguments of its schedule classes) and the
native :class:`~infinity.config.SchedulerConfig` field each becomes."""

SCHEDULER_PARAMS: dict[str, Fate] = {
    **{ds: mapped(f"scheduler.{native}") for ds, native in SCHEDULER_PARAM_FIELDS.items()},
    "last_batch_iteration": rejected("starting a schedule part-way is not supported from the "
                                     "config; engine checkpoints restore the schedule", -1),
}

SCHEDULER_KEYS: dict[str, Fate] = {
    "type": mapped("scheduler.type (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, "
                   "LRRangeTest)"),
    "params": Fate("mapped", "scheduler (the parameters the schedule named by type takes)",
                   keys=SCHEDULER_PARAMS, screened_by_mapping=True),
}

_LOG_STATS = "log engine.stats() yourself"
MONITOR_KEYS: dict[str, dict[str, Fate]] = {
    "tensorboard": _parts("tensorboard", "output_path", "job_name"),
    "wandb": _parts("wandb", "group", "team", "project"),
    "csv_monitor": _parts("csv_monitor", "output_path", "job_name"),
    "comet": _parts("comet", "samples_log_interval", "project", "workspace", "api_key",
                    "experiment_name", "experiment_key", "online", "mode"),
    "comms_logger": _parts("comms_logger", "prof_all", "prof_ops", "verbose", "debug"),
    "flops_profiler": _parts("flops_profiler", "recompute_fwd_factor", "profile_step",
                             "module_depth", "top_modules", "detailed", "output_file"),
}
_MONITOR_WHY = {
    "tensorboard": f"the TensorBoard monitor is not implemented: nothing is written; {_LOG_STATS}",
    "wandb": f"the Weights & Biases monitor is not implemented: nothing is logged; {_LOG_STATS}",
    "csv_monitor": f"the CSV monitor is not implemented: no CSV files are written; {_LOG_STATS}",
    "comet": f"the Comet monitor is not implemented: nothing is logged; {_LOG_STATS}",
    "comms_logger": "the communication logger is not implemented; engine.stats()['bytes_moved'] "
                    "counts the bytes collectives send",
    "flops_profiler": "the FLOPs profiler is not implemented; torch.profiler(with_flops=True) "
                      "counts them",
}
for _name, _keys in MONITOR_KEYS.items():
    _keys["enabled"] = Fate("ignored", _MONITOR_WHY[_name], ANY)

ACTIVATION_CHECKPOINTING_DEFAULTS = {
    "partition_activations": False, "contiguous_memory_optimization": False,
    "cpu_checkpointing": False, "synchronize_checkpoint_boundary": False, "profile": False}
_ACTIVATION_WHY = (
    "the section configures DeepSpeed's own checkpoint API (deepspeed.checkpointing), which a "
    "model calls itself (Megatron-style) and which is not implemented here, so it checkpoints "
    "and offloads nothing (as under DeepSpeed for a model that does not call that API: a "
    "Hugging Face model's gradient_checkpointing_enable() uses torch.utils.checkpoint either "
    "way); for the engine's own checkpointing use the native 'activation_checkpointing' section "
    "({\"units\": \"all\" or [\"Block\"], \"offload\": \"host\" (cpu_checkpointing), "
    "\"nvme\" or \"auto\"}; partition_activations and contiguous_memory_optimization have no "
    "counterpart: the saved inputs are whole per rank and live in the store's arena or swap "
    "files), or config.replace(activation_checkpointing=ActivationCheckpointingConfig(...))")


def _activation_off(section: Any) -> bool:
    if not section:
        return True
    return isinstance(section, Mapping) and all(
        (k == "number_checkpoints" and v is None) or (
            k in ACTIVATION_CHECKPOINTING_DEFAULTS and v is False) for k, v in section.items())


PIPELINE_KEYS: dict[str, Fate] = {
    "stages": mapped("mesh.pipeline ('auto': 1; a pipeline is built by infinity.pipeline."
                     "initialize)"),
    "partition": replaced("the balanced split of infinity.pipeline (parameters and FLOPs per "
                          "stage; split_points to choose the cuts)"),
    "seed_layers": ignored("per-layer seeds (the model's parameters are built before the split)",
                           False),
    "activation_checkpoint_interval": rejected(
        "checkpointing every k-th layer of a PipelineModule is not implemented; use the native "
        "activation_checkpointing.units ('all' or class names)", 0),
    "pipe_partitioned": ignored("activations between stages are sent whole (no tensor-parallel "
                                "partitioning of them)", ANY),
    "grad_partitioned": ignored("activation gradients between stages are sent whole", ANY),
}
"""DeepSpeed's ``pipeline`` section (``runtime/config.py``'s ``get_pipeline_config``: stages
'auto', partition 'best', seed_layers False, activation_checkpoint_interval 0, pipe_partitioned
and grad_partitioned True)."""


def _no_parallelism(section: Any) -> bool:
    return not section or (isinstance(section, Mapping) and all(
        v in (0, 1, None, False, {}) for v in section.values()))


TOP_KEYS: dict[str, Fate] = {
    "zero_optimization": mapped("zero, offload_param, offload_optimizer, memory", ZERO_KEYS),
    "aio": mapped("swapper (the NVMe I/O engine)", AIO_KEYS),
    "bf16": mapped("precision (dtype 'bf16')", BF16_KEYS),
    "bfloat16": mapped("precision (old spelling of bf16)", BF16_KEYS),
    "fp16": mapped("precision (dtype 'fp16', loss scaling)", FP16_KEYS),
    "optimizer": mapped("optimizer (Adam / AdamW)", OPTIMIZER_KEYS),
    "scheduler": mapped("scheduler (engine.lr_scheduler)", SCHEDULER_KEYS),
    "gradient_clipping": mapped("gradient_clipping (DeepSpeed 0.19.8's default when absent: "
                                "1.0)"),
    "gradient_accumulation_steps": mapped("gradient_accumulation_steps"),
    "train_micro_batch_size_per_gpu": mapped("train_micro_batch_size_per_gpu"),
    "train_batch_size": mapped("checked: micro-batch x accumulation steps x world size"),
    "communication_data_type": mapped("precision.reduce_dtype ('fp32' or the compute dtype)"),
    "steps_per_print": replaced("engine.stats() and the CLI's progress bar"),
    "wall_clock_breakdown": replaced("engine.stats() reports stall and transfer time"),
    "memory_breakdown": replaced("engine.stats() reports bytes per tier"),
    "dump_state": replaced("engine.stats() reports the engine's state"),
    "timers": replaced("engine.stats() reports step and stall time"),
    "log_level": replaced("infinity logs to the 'infinity' logger; set its level with logging"),
    "zero_allow_untested_optimizer": replaced("the engine runs its own Adam/AdamW only"),
    "zero_force_ds_cpu_optimizer": replaced("infinity.optim.cpu_adam is always used off-device"),
    "disable_allgather": replaced("parameters are always all-gathered per unit"),
    "checkpoint": replaced("engine.save_checkpoint / load_checkpoint: one format, loadable at any "
                           "world size, written by every rank for its own shards"),
    "data_parallel_size": replaced("every rank of the default process group is a data-parallel "
                                   "rank"),
    "disable_python_gc": ignored("Python's garbage collector is left as it is", False),
    "dataloader_drop_last": ignored("DeepSpeed's own data loader (training_data=) is not "
                                    "implemented; build a torch DataLoader", False),
    "vocabulary_size": ignored("DeepSpeed uses it only to warn about sizes not divisible by 8",
                               ANY),
    "seq_parallel_communication_data_type": ignored("sequence parallelism is not implemented",
                                                    "fp32"),
    "tensorboard": ignored(_MONITOR_WHY["tensorboard"], disabled, MONITOR_KEYS["tensorboard"]),
    "wandb": ignored(_MONITOR_WHY["wandb"], disabled, MONITOR_KEYS["wandb"]),
    "csv_monitor": ignored(_MONITOR_WHY["csv_monitor"], disabled, MONITOR_KEYS["csv_monitor"]),
    "comet": ignored(_MONITOR_WHY["comet"], disabled, MONITOR_KEYS["comet"]),
    "comms_logger": ignored(_MONITOR_WHY["comms_logger"], disabled, MONITOR_KEYS["comms_logger"]),
    "flops_profiler": ignored(_MONITOR_WHY["flops_profiler"], disabled,
                              MONITOR_KEYS["flops_profiler"]),
    "prescale_gradients": rejected("gradient prescaling is not implemented", False),
    "gradient_predivide_factor": rejected("gradient predivide is not implemented", 1.0),
    "gradient_allreduce_op": rejected("gradients are always averaged over ranks ('mean')",
                                      "mean"),
    "managed_gradient_accumulation": rejected(
        "the engine always owns the accumulation boundary (every gradient_accumulation_steps-th "
        "engine.step())", True),
    # Ignored, not rejected: DeepSpeed runs such a config with a model that does not call its
    # checkpoint API (every Hugging Face model), and so must we.
    "activation_checkpointing": ignored(_ACTIVATION_WHY, _activation_off),
    "torch_autocast": rejected("torch autocast under the engine is not implemented; use bf16 or "
                               "fp16 (parameters in the compute dtype)", disabled),
    "data_types": rejected("separate gradient / parameter / buffer dtypes are not implemented "
                           "(gradients accumulate in fp32, buffers follow the compute dtype)",
                           at_defaults({"grad_accum_dtype": None, "param_dtype": None,
                                        "buffer_dtype": None, "keep_in_fp32_modules": "auto"})),
    "compile": rejected("DeepCompile is not implemented; torch.compile the model yourself",
                        lambda v: not v or (isinstance(v, Mapping) and not any(
                            v.get(k) for k in ("deepcompile", "offload_activation",
                                               "offload_opt_states", "offload_parameters",
                                               "free_activation")))),
    "autotuning": rejected("autotuning is not implemented; see `infinity plan`", disabled),
    "hybrid_engine": rejected("the hybrid (RLHF) engine is not implemented", disabled),
    "data_efficiency": rejected("data efficiency (sampling / routing) is not implemented",
                                disabled),
    "pipeline": mapped("mesh.pipeline and infinity.pipeline (the stages run by "
                       "torch.distributed.pipelining, ZeRO inside each)", PIPELINE_KEYS),
    "tensor_parallel": rejected("tensor parallelism (AutoTP) is not implemented",
                                _no_parallelism),
    "expert_parallel": rejected("expert parallelism (AutoEP) is not implemented", disabled),
    "sequence_parallel_size": rejected("sequence parallelism is not implemented", 1),
    "use_data_before_expert_parallelism": rejected("expert parallelism is not implemented",
                                                   False),
    "datastates_ckpt": rejected("DataStates checkpointing is not implemented; engine "
                                "checkpoints are written by every rank in parallel",
                                lambda v: v is None or v is False),
    "weight_quantization": rejected("weight quantization is not implemented"),
    # Removed from DeepSpeed 0.19 (it raises for them), still in configs copied from older scripts.
    "nebula": rejected(f"Nebula checkpointing ({_REMOVED})", disabled),
    "compression_training": rejected(f"the compression library ({_REMOVED})", lambda v: not v),
    "amp": rejected(f"apex AMP ({_REMOVED}); use bf16 or fp16", disabled),
    "quantize_training": rejected(f"MoQ quantized training ({_REMOVED})", disabled),
    "sparse_gradients": rejected(f"sparse embedding gradient compression ({_REMOVED})", False),
    "eigenvalue": rejected(f"eigenvalue MoQ ({_REMOVED})", disabled),
    "sparse_attention": rejected(f"sparse attention ({_REMOVED})", lambda v: not v),
    "elasticity": rejected(f"elastic training ({_REMOVED}); set the batch sizes directly",
                           disabled),
    "graph_harvesting": rejected(f"graph harvesting ({_REMOVED})", False),
    "curriculum_learning": rejected(f"legacy curriculum learning ({_REMOVED})", disabled),
    "progressive_layer_drop": rejected(f"progressive layer drop ({_REMOVED})", disabled),
}
"""The top-level keys of a DeepSpeed config (see the module docstring)."""


def fate_of(dotted: str) -> Fate | None:
    """The fate of a DeepSpeed key by its dotted name (``"zero_optimization.offload_param.
    max_in_cpu"``); None when DeepSpeed has no such key. A key inside a section judged whole
    (``pipeline.stages``) has its section's fate."""
    table: Mapping[str, Fate] | None = TOP_KEYS
    fate = None
    for part in dotted.split("."):
        if table is None:
            return fate  # inside a section judged whole
        fate = table.get(part)
        if fate is None:
            return None
        table = fate.keys
    return fate


def iter_keys(table: Mapping[str, Fate] = TOP_KEYS, prefix: str = ""):
    """Every (dotted key, fate) of ``table`` and its sections, depth first."""
    for key, fate in table.items():
        yield prefix + key, fate
        if fate.keys is not None:
            yield from iter_keys(fate.keys, prefix + key + ".")
