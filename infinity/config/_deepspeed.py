"""Map a DeepSpeed ``ds_config.json`` onto :class:`~infinity.config.InfinityConfig`, and back.

Every DeepSpeed key has one fate, listed with its reason in :mod:`._ds_keys` (audited against
DeepSpeed 0.19.8): **mapped** onto a native field, **replaced** by our own machinery (one warning
naming what replaces it), **ignored** (monitors, profilers: silent while off, one warning naming
what is not done when on), or **rejected** (an error naming the key and what to do, unless set to
its "off" value). A key DeepSpeed does not know either is an error with a "did you mean".

"auto" values left after :func:`~infinity.config.fill_auto` resolve first to what Hugging Face
``TrainingArguments``' defaults give (:func:`._auto.resolve_auto_raw`, one warning naming each).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from infinity._common import warn_once
from infinity.config._auto import resolve_auto_raw
from infinity.config._checks import AUTO
from infinity.config._ds_keys import SCHEDULER_PARAM_FIELDS, SCHEDULER_PARAMS, TOP_KEYS, Fate
from infinity.config._mesh import MeshConfig
from infinity.config._native import did_you_mean
from infinity.config._scheduler import FIELDS_OF, SchedulerConfig
from infinity.config._sections import (DTYPE_BYTES, InfinityConfig, MemoryConfig, OffloadConfig,
                                       OptimizerConfig, PrecisionConfig, SwapperConfig, ZeroConfig)

DS_GRADIENT_CLIPPING_DEFAULT = 1.0
"""DeepSpeed 0.19.8 clips at 1.0 when ``gradient_clipping`` is absent (``runtime/constants.py``);
a DeepSpeed config without the key clips the same here (a native config's default is 0, off)."""

_NATIVE_TOP_KEYS = frozenset({"zero", "offload_param", "offload_optimizer", "memory", "swapper",
                               "precision", "optimizer", "activation_checkpointing", "scheduler",
                               "gradient_clipping", "gradient_accumulation_steps",
                               "train_micro_batch_size_per_gpu", "device", "pipeline"})
DS_ONLY_TOP_KEYS = frozenset(TOP_KEYS) - _NATIVE_TOP_KEYS
"""Top-level keys that only a DeepSpeed config has: one of them makes ``load_config`` map the dict."""


def screen(section: str, raw: Mapping[str, Any], table: Mapping[str, Fate]) -> None:
    """Judge every key of ``raw`` (and of its sections screened key by key) by its fate: raise for
    unknown and rejected keys, warn once for replaced ones and for ignored ones that are on."""
    for key, value in raw.items():
        where = f"{section}.{key}" if section else key
        fate = table.get(key)
        if fate is None:
            raise ValueError(f"unknown DeepSpeed config key {where!r}{did_you_mean(key, list(table))}")
        if fate.kind == "replaced":
            warn_once(f"ds:{where}", f"DeepSpeed key {where!r} tunes DeepSpeed's own machinery and has "
                                     f"no effect here: {fate.why}")
        elif fate.kind == "ignored" and not fate.is_off(value):
            warn_once(f"ds:{where}", f"DeepSpeed key {where!r} is accepted and ignored: {fate.why}")
        elif fate.kind == "rejected" and not fate.is_off(value):
            raise ValueError(f"DeepSpeed key {where!r} = {value!r} is not supported: {fate.why}. "
                             f"Remove it from the config to continue.")
        if fate.keys is not None and isinstance(value, Mapping) and not fate.screened_by_mapping:
            screen(where, value, fate.keys)


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


def _offload(raw: Mapping[str, Any], name: str) -> OffloadConfig:
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
    bf16_on, fp16_on = bf16.get("enabled", False), fp16.get("enabled", False)
    for name, on in (("bf16", bf16_on), ("fp16", fp16_on)):
        if not isinstance(on, bool):  # 'auto' was resolved before (resolve_auto_raw)
            raise ValueError(f"{name}.enabled: expected true, false or 'auto', got {on!r}")
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
    type_name = str(opt.get("type", "AdamW"))
    params = _section(opt, "params", "optimizer.params")
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
        (("zero_hpz_partition_size",), "hpz_partition_size", _as_int),
    ]
    for ds_names, native, convert in conversions:
        value = pick(*ds_names)
        if value is not None:
            kwargs[native] = convert(value)
    for ds_name, native in (("zero_quantized_weights", "quantized_weights"),
                            ("zero_quantized_nontrainable_weights", "quantized_frozen_weights"),
                            ("zero_quantized_gradients", "quantized_gradients")):
        if ds_name in zero:
            kwargs[native] = zero[ds_name]
    if zero.get("zero_quantized_gradients") is True:
        kwargs["quantized_gradient_bits"] = 4  # DeepSpeed's qgZ sends int4 (coalesced_collectives)
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
    offload_param = _offload(op_raw, "offload_param")
    offload_optimizer = _offload(oo_raw, "offload_optimizer")
    memory = MemoryConfig()
    if "max_in_cpu" in op_raw and offload_param.device == "nvme":
        # DeepSpeed keeps up to max_in_cpu parameter elements in host memory (a cache of the
        # NVMe-homed parameters), beside whatever else lives there: it sizes the parameter share
        # of the host budget only, never the whole (issue #15). DeepSpeed ignores it without NVMe.
        memory = MemoryConfig(
            host_param_cache_bytes=_numel_to_bytes(op_raw["max_in_cpu"], param_bytes))
    return ZeroConfig(**kwargs), offload_param, offload_optimizer, memory


DS_SCHEDULER_TYPES = {"WarmupLR": "warmup_lr", "WarmupDecayLR": "warmup_decay_lr",
                    "WarmupCosineLR": "warmup_cosine_lr", "OneCycle": "one_cycle",
                    "LRRangeTest": "lr_range_test"}
"""DeepSpeed's schedule names (``deepspeed.runtime.lr_schedules``) and their native ones."""
_LR_LISTS = ("warmup_min_lr", "warmup_max_lr", "cycle_min_lr", "cycle_max_lr", "cycle_min_mom",
             "cycle_max_mom", "lr_range_test_min_lr")


def _scheduler(raw: Mapping[str, Any]) -> SchedulerConfig:
    """``scheduler``: DeepSpeed's five schedules by name, with their parameter names; a torch
    ``lr_scheduler`` named here (DeepSpeed builds those too) is refused with the way to do it."""
    section = _section(raw, "scheduler", "scheduler")
    if not section:
        return SchedulerConfig()
    name = section.get("type")
    if name not in DS_SCHEDULER_TYPES:
        import torch.optim.lr_scheduler as torch_schedulers

        if isinstance(name, str) and hasattr(torch_schedulers, name):
            raise ValueError(
                f"scheduler.type = {name!r}: torch schedulers are not built from the config; "
                f"wrap engine.optimizer yourself (torch.optim.lr_scheduler.{name}"
                f"(engine.optimizer, ...)) and step it after engine.step()")
        raise ValueError(f"scheduler.type = {name!r} is not a DeepSpeed schedule"
                         f"{did_you_mean(str(name), list(DS_SCHEDULER_TYPES))}")
    kind = DS_SCHEDULER_TYPES[name]
    params = _section(section, "params", "scheduler.params")
    readable = [ds for ds, native in SCHEDULER_PARAM_FIELDS.items() if native in FIELDS_OF[kind]]
    kwargs: dict[str, Any] = {"type": kind}
    for key in params:
        if key not in readable and key != "last_batch_iteration":
            raise ValueError(f"scheduler.params.{key}: DeepSpeed's {name} takes no such "
                             f"parameter{did_you_mean(key, readable)}")
    screen("scheduler.params", params, SCHEDULER_PARAMS)
    for key, value in params.items():
        if key == "last_batch_iteration":
            continue  # screened: only -1, the start, is accepted
        field = SCHEDULER_PARAM_FIELDS[key]
        if isinstance(value, list) and field in _LR_LISTS:
            value = tuple(value)
        kwargs[field] = _as_int(value) if field.endswith(("_steps", "_stairs")) else value
    return SchedulerConfig(**kwargs)


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


def _pipeline_stages(raw: Mapping[str, Any]) -> int:
    """``pipeline.stages``: mesh.pipeline ('auto', DeepSpeed's default: the model's
    PipelineModule decides there; here no pipeline unless the number is given)."""
    section = _section(raw, "pipeline", "pipeline")
    stages = _as_int(section.get("stages", AUTO))
    if stages == AUTO:
        return 1
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"pipeline.stages: expected 'auto' or an integer >= 1, got {stages!r}")
    return stages


def config_from_deepspeed(raw: Mapping[str, Any]) -> InfinityConfig:
    """Map a DeepSpeed config dict onto :class:`InfinityConfig` (see the module docstring)."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"DeepSpeed config: expected a dict, got {type(raw).__name__}")
    screen("", raw, TOP_KEYS)
    raw = resolve_auto_raw(raw)
    precision = _precision(raw)
    zero_raw = _section(raw, "zero_optimization", "zero_optimization")
    zero, offload_param, offload_optimizer, memory = _zero(zero_raw, DTYPE_BYTES[precision.dtype])
    gas, micro = _batch(raw)
    mics = _as_int(zero_raw.get("mics_shard_size", -1))
    stages = _pipeline_stages(raw)
    return InfinityConfig(
        mesh=MeshConfig(pipeline=stages) if mics == -1 else MeshConfig(shard=mics,
                                                                        pipeline=stages),
        zero=zero,
        offload_param=offload_param,
        offload_optimizer=offload_optimizer,
        memory=memory,
        swapper=_swapper(raw),
        precision=precision,
        optimizer=_optimizer(raw),
        scheduler=_scheduler(raw),
        gradient_clipping=raw.get("gradient_clipping", DS_GRADIENT_CLIPPING_DEFAULT),
        gradient_accumulation_steps=gas,
        train_micro_batch_size_per_gpu=micro,
    )


def config_to_deepspeed(config: InfinityConfig) -> dict[str, Any]:
    """The DeepSpeed-style form of a config (what ``infinity plan`` writes beside the native one)."""
    out: dict[str, Any] = {"zero_optimization": _zero_to_deepspeed(config)}
    out.update(_precision_to_deepspeed(config.precision))
    out["optimizer"] = _optimizer_to_deepspeed(config.optimizer)
    s = config.swapper
    out["aio"] = {"block_size": s.block_size_bytes, "queue_depth": s.queue_depth,
                  "thread_count": s.num_io_threads}
    if config.scheduler.enabled:
        out["scheduler"] = _scheduler_to_deepspeed(config.scheduler)
    out["gradient_clipping"] = config.gradient_clipping
    out["gradient_accumulation_steps"] = config.gradient_accumulation_steps
    if config.train_micro_batch_size_per_gpu is not None:
        out["train_micro_batch_size_per_gpu"] = config.train_micro_batch_size_per_gpu
    if config.mesh.pipeline > 1:
        # DeepSpeed's pipeline runs gradient_accumulation_steps micro-batches a step; its
        # schedule is its own (1F1B-like): ours is not written.
        out["pipeline"] = {"stages": config.mesh.pipeline}
        if config.gradient_accumulation_steps != AUTO:
            out["gradient_accumulation_steps"] = config.pipeline.resolve_micro_batches(
                config.gradient_accumulation_steps)
    return out


def _zero_to_deepspeed(config: InfinityConfig) -> dict[str, Any]:
    """The ``zero_optimization`` section: the stage, the offloads, and each knob set away from
    'auto' (byte knobs in DeepSpeed's element counts, at the parameters' dtype)."""
    zero: dict[str, Any] = {"stage": config.zero.stage}
    for name in ("offload_param", "offload_optimizer"):
        off: OffloadConfig = getattr(config, name)
        if off.device != "none":
            zero[name] = {"device": off.device}
            if off.nvme_path:
                zero[name]["nvme_path"] = off.nvme_path
    z = config.zero
    param_bytes = config.precision.param_bytes
    cache = config.memory.host_param_cache_bytes
    if cache != AUTO and "offload_param" in zero:
        zero["offload_param"]["max_in_cpu"] = cache // param_bytes
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
    if config.mesh.shard != AUTO and config.mesh.tensor == 1:
        zero["mics_shard_size"] = config.mesh.shard
    if z.quantized_weights:
        zero["zero_quantized_weights"] = True
    if z.quantized_frozen_weights:
        zero["zero_quantized_nontrainable_weights"] = True
    if z.quantized_gradients:  # DeepSpeed has no block size or width knob: its int4 qgZ
        zero["zero_quantized_gradients"] = True
    if z.hpz_partition_size != 1:
        zero["zero_hpz_partition_size"] = z.hpz_partition_size
    return zero


def _precision_to_deepspeed(p: PrecisionConfig) -> dict[str, Any]:
    """The precision keys: the reduction's dtype, and the ``bf16`` or ``fp16`` section."""
    out: dict[str, Any] = {}
    if p.dtype != "fp32":  # DeepSpeed's own default would be the compute dtype: say which
        out["communication_data_type"] = p.dtype if p.reduce_dtype == "compute" else "fp32"
    if p.dtype == "bf16":
        out["bf16"] = {"enabled": True}
    elif p.dtype == "fp16":
        out["fp16"] = {"enabled": True, "loss_scale": p.loss_scale,
                       "initial_scale_power": p.initial_scale_power,
                       "loss_scale_window": p.loss_scale_window, "hysteresis": p.hysteresis,
                       "min_loss_scale": p.min_loss_scale}
    return out


def _optimizer_to_deepspeed(o: OptimizerConfig) -> dict[str, Any]:
    """The ``optimizer`` section (Adam's decoupled weight decay as DeepSpeed spells it)."""
    out = {"type": "AdamW" if o.type == "adamw" else "Adam",
           "params": {"lr": o.lr, "betas": list(o.betas) if o.betas != AUTO else AUTO,
                      "eps": o.eps, "weight_decay": o.weight_decay,
                      "bias_correction": o.bias_correction}}
    if o.type == "adam":
        out["params"]["adam_w_mode"] = False
    return out


def _scheduler_to_deepspeed(sched: SchedulerConfig) -> dict[str, Any]:
    """The DeepSpeed ``scheduler`` section of a native one: its type's fields set away from their
    defaults (the rest are DeepSpeed's own defaults too)."""
    ds_type = next(ds for ds, native in DS_SCHEDULER_TYPES.items() if native == sched.type)
    defaults = SchedulerConfig(type="none")
    params: dict[str, Any] = {}
    for ds, native in SCHEDULER_PARAM_FIELDS.items():
        value = getattr(sched, native)
        if native in FIELDS_OF[sched.type] and (value != getattr(defaults, native)
                                                or native == "total_num_steps"):
            params[ds] = list(value) if isinstance(value, tuple) else value
    return {"type": ds_type, "params": params}
