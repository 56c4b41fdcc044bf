"""Map a DeepSpeed ``ds_config.json`` onto :class:`~infinity.config.InfinityConfig`, and back.

Every DeepSpeed key falls in exactly one of four groups, listed in the tables below:

* **mapped**: carries meaning we implement (``zero_optimization.stage`` -> ``zero.stage``).
* **replaced**: tunes DeepSpeed's own machinery (buffer counts, bucket sizes, ``pin_memory``); accepted
  with a one-time warning naming what replaces it in infinity, and mapped onto our byte budgets where
  the value carries meaning (``stage3_max_live_parameters`` -> ``zero.max_live_bytes``).
* **rejected**: behaviour we do not implement (``zero_quantized_weights``, a ``scheduler``...): an
  error naming the key and what to do instead, never accepted and ignored. A rejected key set to its
  DeepSpeed default (which means "off") is accepted.
* anything else: an unknown key, an error with a "did you mean" suggestion.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from infinity._common import warn_once
from infinity.config._checks import AUTO
from infinity.config._native import did_you_mean
from infinity.config._sections import (DTYPE_BYTES, InfinityConfig, MemoryConfig, OffloadConfig,
                                       OptimizerConfig, PrecisionConfig, SwapperConfig, ZeroConfig)

# Keys accepted only at their DeepSpeed default (the value that means "feature off").
_Default = object


def _replaced(replacement: str) -> tuple[str, str]:
    return ("replaced", replacement)


def _rejected(reason: str, default: Any = _Default) -> tuple[str, str, Any]:
    return ("rejected", reason, default)


_ZERO_KEYS: dict[str, Any] = {
    "stage": "mapped",
    "offload_param": "mapped",
    "offload_optimizer": "mapped",
    "cpu_offload": "mapped",  # legacy boolean spelling of offload_optimizer.device = 'cpu'
    "cpu_offload_param": "mapped",
    "sub_group_size": "mapped",
    "stage3_prefetch_bucket_size": "mapped",
    "prefetch_bucket_size": "mapped",
    "stage3_param_persistence_threshold": "mapped",
    "param_persistence_threshold": "mapped",
    "stage3_max_live_parameters": "mapped",
    "max_live_parameters": "mapped",
    "stage3_max_reuse_distance": "mapped",
    "max_reuse_distance": "mapped",
    "stage3_module_granularity_threshold": "mapped",
    "module_granularity_threshold": "mapped",
    "contiguous_gradients": _replaced("gradients always land in one contiguous shard per unit"),
    "overlap_comm": _replaced("collectives and I/O always overlap compute"),
    "reduce_scatter": _replaced("stages 2 and 3 always reduce-scatter per unit"),
    "reduce_bucket_size": _replaced("one collective per unit (units set by zero.unit_min_numel)"),
    "allgather_bucket_size": _replaced("one all-gather per unit (units set by zero.unit_min_numel)"),
    "allgather_partitions": _replaced("parameters are always all-gathered per unit"),
    "round_robin_gradients": _replaced("gradient shards are contiguous per unit"),
    "elastic_checkpoint": _replaced("checkpoints load at any world size"),
    "load_from_fp32_weights": _replaced("checkpoints always restore the fp32 master"),
    "memory_efficient_linear": _replaced("gathered parameters are views; no special linear needed"),
    "ignore_unused_parameters": _replaced("unused parameters are always tolerated"),
    "use_multi_rank_bucket_allreduce": _replaced("one collective per unit"),
    "legacy_stage1": _replaced("one mechanism serves stages 0-3"),
    "stage3_gather_16bit_weights_on_model_save": _replaced(
        "engine.full_state_dict() / `infinity consolidate` gather weights on demand"),
    "stage3_gather_fp16_weights_on_model_save": _replaced(
        "engine.full_state_dict() / `infinity consolidate` gather weights on demand"),
    "gather_16bit_weights_on_model_save": _replaced(
        "engine.full_state_dict() / `infinity consolidate` gather weights on demand"),
    "zero_quantized_weights": _rejected("quantized weight communication (ZeRO++) is not implemented",
                                        False),
    "zero_quantized_nontrainable_weights": _rejected("quantized frozen weights are not implemented",
                                                     False),
    "zero_quantized_gradients": _rejected(
        "quantized gradient communication (ZeRO++) is not implemented", False),
    "zero_hpz_partition_size": _rejected("hierarchical partitioning (ZeRO++ hpZ) is not implemented",
                                         1),
    "mics_shard_size": _rejected("MiCS sub-group sharding is not implemented", -1),
    "mics_hierarchical_params_gather": _rejected("MiCS is not implemented", False),
    "offload_states": _rejected("offloading states between steps is not implemented", None),
}

_OFFLOAD_PARAM_KEYS: dict[str, Any] = {
    "device": "mapped",
    "nvme_path": "mapped",
    "max_in_cpu": "mapped",
    "pin_memory": _replaced("host memory is one arena, pinned whenever CUDA is present"),
    "buffer_count": _replaced("memory.host_budget_bytes (one arena, carved per shard)"),
    "buffer_size": _replaced("memory.host_budget_bytes (one arena, carved per shard)"),
}

_OFFLOAD_OPTIMIZER_KEYS: dict[str, Any] = {
    "device": "mapped",
    "nvme_path": "mapped",
    "ratio": _rejected("partial optimizer offload (ratio < 1) is not implemented", 1.0),
    "pin_memory": _replaced("host memory is one arena, pinned whenever CUDA is present"),
    "buffer_count": _replaced("memory.host_budget_bytes and zero.sub_group_numel"),
    "fast_init": _replaced("optimizer state is always created directly in its home tier"),
    "pipeline": _replaced("the optimizer's NVMe pipeline is always on"),
    "pipeline_read": _replaced("the optimizer's NVMe pipeline is always on"),
    "pipeline_write": _replaced("the optimizer's NVMe pipeline is always on"),
}

_AIO_KEYS: dict[str, Any] = {
    "block_size": "mapped",
    "queue_depth": "mapped",
    "thread_count": "mapped",
    "intra_op_parallelism": "mapped",
    "single_submit": _replaced("swapper.queue_depth requests are always kept in flight"),
    "overlap_events": _replaced("I/O always overlaps compute"),
    "use_gds": _rejected("GPUDirect Storage is not implemented", False),
}

_FP16_KEYS: dict[str, Any] = {
    "enabled": "mapped",
    "loss_scale": "mapped",
    "initial_scale_power": "mapped",
    "loss_scale_window": "mapped",
    "hysteresis": "mapped",
    "min_loss_scale": "mapped",
    "consecutive_hysteresis": _rejected("consecutive hysteresis is not implemented", False),
    "auto_cast": _rejected("fp16 auto_cast of inputs is not implemented; cast inputs yourself",
                           False),
    "fp16_master_weights_and_grads": _rejected("fp16 master weights are not implemented", False),
}

_BF16_KEYS: dict[str, Any] = {
    "enabled": "mapped",
    "immediate_grad_update": _replaced("gradients are reduced per unit as soon as they are ready"),
    "check_grad_overflow": _rejected("overflow checks with bf16 are not implemented", False),
}

_OPTIMIZER_PARAMS: dict[str, Any] = {
    "lr": "mapped",
    "betas": "mapped",
    "eps": "mapped",
    "weight_decay": "mapped",
    "bias_correction": "mapped",
    "adam_w_mode": "mapped",
    "torch_adam": _replaced("infinity.optim.cpu_adam runs off-device state; torch Adam runs on-device"),
    "fused": _replaced("the Adam step is always fused"),
    "amsgrad": _rejected("AMSGrad is not implemented", False),
    "maximize": _rejected("maximize is not implemented", False),
}

_TOP_KEYS: dict[str, Any] = {
    "zero_optimization": "mapped",
    "aio": "mapped",
    "bf16": "mapped",
    "bfloat16": "mapped",
    "fp16": "mapped",
    "optimizer": "mapped",
    "gradient_clipping": "mapped",
    "gradient_accumulation_steps": "mapped",
    "train_micro_batch_size_per_gpu": "mapped",
    "train_batch_size": "mapped",
    "steps_per_print": _replaced("engine.stats() and the CLI's progress bar"),
    "wall_clock_breakdown": _replaced("engine.stats() reports stall and transfer time"),
    "zero_allow_untested_optimizer": _replaced("the engine runs its own Adam/AdamW only"),
    "zero_force_ds_cpu_optimizer": _replaced("infinity.optim.cpu_adam is always used off-device"),
    "memory_breakdown": _replaced("engine.stats() reports bytes per tier"),
    "dump_state": _replaced("engine.stats()"),
    "prescale_gradients": _rejected("gradient prescaling is not implemented", False),
    "gradient_predivide_factor": _rejected("gradient predivide is not implemented", 1.0),
    "communication_data_type": "mapped",  # -> precision.reduce_dtype (see _precision)
    "scheduler": _rejected(
        "DeepSpeed LR schedulers are not built in; wrap engine.optimizer in a torch.optim.lr_scheduler"),
    "activation_checkpointing": _rejected(
        "DeepSpeed's section configures its own checkpoint API (deepspeed.checkpointing), which is "
        "not implemented; use the native 'activation_checkpointing' section instead "
        "({\"units\": \"all\" or [\"Block\"], \"offload_to_host\": true} in a native config, or "
        "config.replace(activation_checkpointing=ActivationCheckpointingConfig(...))), or "
        "torch.utils.checkpoint(use_reentrant=False) in the model"),
    "flops_profiler": _rejected("the FLOPs profiler is not implemented", None),
    "tensorboard": _rejected("monitor back-ends are not implemented; log engine.stats() yourself"),
    "wandb": _rejected("monitor back-ends are not implemented; log engine.stats() yourself"),
    "csv_monitor": _rejected("monitor back-ends are not implemented; log engine.stats() yourself"),
    "comet": _rejected("monitor back-ends are not implemented; log engine.stats() yourself"),
    "compression_training": _rejected("compression training is not implemented"),
    "data_efficiency": _rejected("data efficiency is not implemented"),
    "curriculum_learning": _rejected("curriculum learning is not implemented"),
    "sparse_attention": _rejected("sparse attention is not implemented"),
    "pipeline": _rejected("pipeline parallelism is not implemented"),
    "amp": _rejected("apex AMP is not supported; use bf16 or fp16"),
    "elasticity": _rejected("elastic training is not implemented"),
    "autotuning": _rejected("autotuning is not implemented; see `infinity plan`"),
    "checkpoint": _rejected("DeepSpeed checkpoint options are not implemented"),
    "gradient_accumulation_dtype": _rejected(
        "a separate gradient accumulation dtype is not implemented", None),
}


_NATIVE_TOP_KEYS = frozenset({"zero", "offload_param", "offload_optimizer", "memory", "swapper",
                               "precision", "optimizer", "activation_checkpointing", "gradient_clipping",
                               "gradient_accumulation_steps", "train_micro_batch_size_per_gpu",
                               "device"})
DS_ONLY_TOP_KEYS = frozenset(_TOP_KEYS) - _NATIVE_TOP_KEYS
"""Top-level keys that only a DeepSpeed config has: one of them makes ``load_config`` map the dict."""


def _is_default(value: Any, default: Any) -> bool:
    if default is _Default:
        return False
    if isinstance(default, bool) or default is None:
        return value is default or value == default
    return value == default


def _screen(section: str, raw: Mapping[str, Any], table: Mapping[str, Any]) -> None:
    """Raise for unknown and rejected keys, warn once for replaced ones."""
    for key, value in raw.items():
        where = f"{section}.{key}" if section else key
        if key not in table:
            raise ValueError(f"unknown DeepSpeed config key {where!r}{did_you_mean(key, list(table))}")
        kind = table[key]
        if kind == "mapped":
            continue
        if kind[0] == "replaced":
            warn_once(f"ds:{where}", f"DeepSpeed key {where!r} tunes DeepSpeed's own machinery and has "
                                     f"no effect here: {kind[1]}")
        elif kind[0] == "rejected" and not _is_default(value, kind[2]):
            raise ValueError(f"DeepSpeed key {where!r} = {value!r} is not supported: {kind[1]}. "
                             f"Remove it from the config to continue.")


def _section(raw: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any]:
    value = raw.get(key, {})
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{path}: expected an object, got {value!r}")
    return value


def _numel_to_bytes(value: Any, param_bytes: int) -> Any:
    """DeepSpeed counts elements where we count bytes; 'auto' stays 'auto'."""
    if value == AUTO:
        return AUTO
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return value  # let the native field's validation name the problem
    return value * param_bytes


def _as_int(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _offload(raw: Mapping[str, Any], name: str, table: Mapping[str, Any]) -> OffloadConfig:
    _screen(f"zero_optimization.{name}", raw, table)
    device = raw.get("device", "none")
    return OffloadConfig(name=name, device=device, nvme_path=raw.get("nvme_path"))


_COMM_DTYPES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16",
                "fp16": "fp16", "float16": "fp16"}


def _reduce_dtype(raw: Mapping[str, Any], compute: str) -> str:
    """``communication_data_type``: 'fp32', or the compute dtype itself ('compute'). Absent: our
    default, fp32 (DeepSpeed's is the compute dtype; set it to keep DeepSpeed's bytes)."""
    value = raw.get("communication_data_type")
    if value is None:
        return "fp32"
    name = _COMM_DTYPES.get(str(value).lower())
    if name == "fp32":
        return "fp32"
    if name == compute:
        return "compute"
    raise ValueError(f"communication_data_type: {value!r} is not supported with compute dtype "
                     f"{compute}; use 'fp32' or {compute!r}")


def _precision(raw: Mapping[str, Any]) -> PrecisionConfig:
    bf16 = _section(raw, "bf16", "bf16") or _section(raw, "bfloat16", "bfloat16")
    fp16 = _section(raw, "fp16", "fp16")
    _screen("bf16", bf16, _BF16_KEYS)
    _screen("fp16", fp16, _FP16_KEYS)
    bf16_on, fp16_on = bool(bf16.get("enabled", False)), bool(fp16.get("enabled", False))
    if bf16_on and fp16_on:
        raise ValueError("bf16.enabled and fp16.enabled are both true; enable at most one")
    if not fp16_on:
        extra = sorted(set(fp16) - {"enabled"})
        if extra:
            warn_once("ds:fp16-off", f"fp16 keys {extra} have no effect while fp16.enabled is false")
        return PrecisionConfig(dtype="bf16" if bf16_on else "fp32",
                               reduce_dtype=_reduce_dtype(raw, "bf16" if bf16_on else "fp32"))
    kwargs = {k: _as_int(fp16[k]) for k in ("initial_scale_power", "loss_scale_window", "hysteresis")
              if k in fp16}
    kwargs["reduce_dtype"] = _reduce_dtype(raw, "fp16")
    for key in ("loss_scale", "min_loss_scale"):
        if key in fp16:
            kwargs[key] = fp16[key]
    return PrecisionConfig(dtype="fp16", **kwargs)


def _optimizer(raw: Mapping[str, Any]) -> OptimizerConfig:
    opt = _section(raw, "optimizer", "optimizer")
    if not opt:
        return OptimizerConfig()
    for key in opt:
        if key not in ("type", "params"):
            raise ValueError(f"unknown DeepSpeed config key 'optimizer.{key}'"
                             f"{did_you_mean(key, ['type', 'params'])}")
    type_name = str(opt.get("type", "AdamW"))
    params = _section(opt, "params", "optimizer.params")
    _screen("optimizer.params", params, _OPTIMIZER_PARAMS)
    lowered = type_name.lower()
    if lowered in ("adamw", "fusedadamw", "cpuadamw"):
        opt_type = "adamw"
    elif lowered in ("adam", "fusedadam", "cpuadam", "deepspeedcpuadam"):
        # DeepSpeed's "Adam" defaults to decoupled weight decay (adam_w_mode=True).
        opt_type = "adamw" if params.get("adam_w_mode", True) else "adam"
    else:
        raise ValueError(f"optimizer.type = {type_name!r} is not supported: infinity runs Adam and AdamW "
                         f"(set optimizer.type to 'AdamW' or 'Adam')")
    if lowered == "adamw" and params.get("adam_w_mode") is False:
        raise ValueError("optimizer.params.adam_w_mode = false contradicts optimizer.type 'AdamW'; "
                         "use type 'Adam' for L2-style weight decay")
    kwargs: dict[str, Any] = {"type": opt_type}
    for key in ("lr", "eps", "weight_decay", "bias_correction"):
        if key in params:
            kwargs[key] = params[key]
    if "betas" in params:
        betas = params["betas"]
        kwargs["betas"] = tuple(betas) if isinstance(betas, (list, tuple)) else betas
    return OptimizerConfig(**kwargs)


def _swapper(raw: Mapping[str, Any]) -> SwapperConfig:
    aio = _section(raw, "aio", "aio")
    _screen("aio", aio, _AIO_KEYS)
    kwargs: dict[str, Any] = {}
    if "block_size" in aio:
        kwargs["block_size_bytes"] = _as_int(aio["block_size"])
    if "queue_depth" in aio:
        kwargs["queue_depth"] = _as_int(aio["queue_depth"])
    # DeepSpeed splits each request across thread_count x intra_op_parallelism workers; our pool's
    # thread count is the same knob.
    threads = [_as_int(aio[k]) for k in ("thread_count", "intra_op_parallelism") if k in aio]
    if threads:
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in threads):
            raise ValueError(f"aio.thread_count / aio.intra_op_parallelism: expected integers >= 1, "
                             f"got {threads!r}")
        kwargs["num_io_threads"] = max(threads)
    return SwapperConfig(**kwargs)


def _zero(zero: Mapping[str, Any], param_bytes: int) -> tuple[ZeroConfig, OffloadConfig,
                                                              OffloadConfig, MemoryConfig]:
    _screen("zero_optimization", zero, _ZERO_KEYS)

    def pick(*names: str) -> Any:
        present = [n for n in names if n in zero]
        if len(present) > 1:
            raise ValueError(f"zero_optimization: {present[0]!r} and {present[1]!r} are the same "
                             f"setting; keep one")
        return zero[present[0]] if present else None

    kwargs: dict[str, Any] = {}
    if "stage" in zero:
        kwargs["stage"] = _as_int(zero["stage"])
    conversions: list[tuple[tuple[str, ...], str, Callable[[Any], Any]]] = [
        (("sub_group_size",), "sub_group_numel", _as_int),
        (("stage3_prefetch_bucket_size", "prefetch_bucket_size"), "prefetch_lookahead_bytes",
         lambda v: _numel_to_bytes(v, param_bytes)),
        (("stage3_param_persistence_threshold", "param_persistence_threshold"),
         "persistence_threshold_numel", _as_int),
        (("stage3_max_live_parameters", "max_live_parameters"), "max_live_bytes",
         lambda v: _numel_to_bytes(v, param_bytes)),
        (("stage3_max_reuse_distance", "max_reuse_distance"), "max_reuse_distance_numel", _as_int),
        (("stage3_module_granularity_threshold", "module_granularity_threshold"), "unit_min_numel",
         _as_int),
    ]
    for ds_names, native, convert in conversions:
        value = pick(*ds_names)
        if value is not None:
            kwargs[native] = convert(value)
    if kwargs.get("max_live_bytes") == 0:
        kwargs["max_live_bytes"] = AUTO
    if kwargs.get("unit_min_numel") == 0:
        kwargs.pop("unit_min_numel")  # DeepSpeed's 0 means "off": keep our size default

    op_raw = _section(zero, "offload_param", "zero_optimization.offload_param")
    oo_raw = _section(zero, "offload_optimizer", "zero_optimization.offload_optimizer")
    if zero.get("cpu_offload") and not oo_raw:
        oo_raw = {"device": "cpu"}
    if zero.get("cpu_offload_param") and not op_raw:
        op_raw = {"device": "cpu"}
    offload_param = _offload(op_raw, "offload_param", _OFFLOAD_PARAM_KEYS)
    offload_optimizer = _offload(oo_raw, "offload_optimizer", _OFFLOAD_OPTIMIZER_KEYS)
    memory = MemoryConfig()
    if "max_in_cpu" in op_raw and offload_param.device == "nvme":
        # DeepSpeed keeps up to max_in_cpu parameter elements in host memory before spilling to NVMe.
        memory = MemoryConfig(host_budget_bytes=_numel_to_bytes(op_raw["max_in_cpu"], param_bytes))
    return ZeroConfig(**kwargs), offload_param, offload_optimizer, memory


def _batch(raw: Mapping[str, Any]) -> tuple[Any, Any]:
    gas = _as_int(raw.get("gradient_accumulation_steps", 1))
    micro = _as_int(raw.get("train_micro_batch_size_per_gpu"))
    total = _as_int(raw.get("train_batch_size"))
    if total is not None and total != AUTO and gas != AUTO and micro not in (None, AUTO):
        # train_batch_size = micro * gas * world_size; world size is checked at initialize().
        if not isinstance(total, int) or total % (micro * gas):
            raise ValueError(f"train_batch_size = {total!r} is not a multiple of "
                             f"train_micro_batch_size_per_gpu * gradient_accumulation_steps = "
                             f"{micro * gas}")
    return gas, micro


def config_from_deepspeed(raw: Mapping[str, Any]) -> InfinityConfig:
    """Map a DeepSpeed config dict onto :class:`InfinityConfig` (see the module docstring)."""
    _screen("", raw, _TOP_KEYS)
    precision = _precision(raw)
    zero_raw = _section(raw, "zero_optimization", "zero_optimization")
    zero, offload_param, offload_optimizer, memory = _zero(zero_raw, DTYPE_BYTES[precision.dtype])
    gas, micro = _batch(raw)
    return InfinityConfig(
        zero=zero,
        offload_param=offload_param,
        offload_optimizer=offload_optimizer,
        memory=memory,
        swapper=_swapper(raw),
        precision=precision,
        optimizer=_optimizer(raw),
        gradient_clipping=raw.get("gradient_clipping", 0.0),
        gradient_accumulation_steps=gas,
        train_micro_batch_size_per_gpu=micro,
    )


def config_to_deepspeed(config: InfinityConfig) -> dict[str, Any]:
    """The DeepSpeed-style form of a config (what ``infinity plan`` writes beside the native one)."""
    zero: dict[str, Any] = {"stage": config.zero.stage}
    for name in ("offload_param", "offload_optimizer"):
        off: OffloadConfig = getattr(config, name)
        if off.device != "none":
            zero[name] = {"device": off.device}
            if off.nvme_path:
                zero[name]["nvme_path"] = off.nvme_path
    z = config.zero
    param_bytes = config.precision.param_bytes
    if z.sub_group_numel != AUTO:
        zero["sub_group_size"] = z.sub_group_numel
    if z.persistence_threshold_numel != AUTO:
        zero["stage3_param_persistence_threshold"] = z.persistence_threshold_numel
    if z.prefetch_lookahead_bytes != AUTO:
        zero["stage3_prefetch_bucket_size"] = z.prefetch_lookahead_bytes // param_bytes
    if z.max_live_bytes != AUTO:
        zero["stage3_max_live_parameters"] = z.max_live_bytes // param_bytes
    if z.max_reuse_distance_numel != AUTO:
        zero["stage3_max_reuse_distance"] = z.max_reuse_distance_numel
    out: dict[str, Any] = {"zero_optimization": zero}
    p = config.precision
    if p.dtype != "fp32":  # DeepSpeed's own default would be the compute dtype: say which
        out["communication_data_type"] = p.dtype if p.reduce_dtype == "compute" else "fp32"
    if p.dtype == "bf16":
        out["bf16"] = {"enabled": True}
    elif p.dtype == "fp16":
        out["fp16"] = {"enabled": True, "loss_scale": p.loss_scale,
                       "initial_scale_power": p.initial_scale_power,
                       "loss_scale_window": p.loss_scale_window, "hysteresis": p.hysteresis,
                       "min_loss_scale": p.min_loss_scale}
    o = config.optimizer
    out["optimizer"] = {"type": "AdamW" if o.type == "adamw" else "Adam",
                        "params": {"lr": o.lr, "betas": list(o.betas) if o.betas != AUTO else AUTO,
                                   "eps": o.eps, "weight_decay": o.weight_decay,
                                   "bias_correction": o.bias_correction}}
    if o.type == "adam":
        out["optimizer"]["params"]["adam_w_mode"] = False
    s = config.swapper
    out["aio"] = {"block_size": s.block_size_bytes, "queue_depth": s.queue_depth,
                  "thread_count": s.num_io_threads}
    out["gradient_clipping"] = config.gradient_clipping
    out["gradient_accumulation_steps"] = config.gradient_accumulation_steps
    if config.train_micro_batch_size_per_gpu is not None:
        out["train_micro_batch_size_per_gpu"] = config.train_micro_batch_size_per_gpu
    return out
