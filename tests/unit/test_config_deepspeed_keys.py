"""The fate table of DeepSpeed 0.19.8's config keys (infinity/config/_ds_keys.py): it covers
every key DeepSpeed reads, each fate behaves as documented, and the monitor sections are
accepted (silently when disabled, with one warning naming what is not done when enabled)."""

from __future__ import annotations

import warnings

import pytest

from infinity.config import DEEPSPEED_KEYS, fate_of, load_config

# Written out from DeepSpeed 0.19.8: runtime/constants.py and runtime/config.py (top level), the
# pydantic models (field names and aliases) of runtime/zero/config.py, zero/offload_config.py,
# runtime/precision_config.py, monitor/config.py, comm/config.py, the keys of
# profiling/constants.py, runtime/swap_tensor/constants.py, activation_checkpointing/config.py,
# the keyword arguments of runtime/lr_schedules.py, and the removed-key lists of config.py.
DEEPSPEED_0_19_8_KEYS = """
train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps
managed_gradient_accumulation steps_per_print dump_state disable_python_gc disable_allgather
communication_data_type seq_parallel_communication_data_type prescale_gradients
gradient_predivide_factor gradient_allreduce_op gradient_clipping zero_allow_untested_optimizer
zero_force_ds_cpu_optimizer wall_clock_breakdown memory_breakdown vocabulary_size
dataloader_drop_last log_level use_data_before_expert_parallelism sequence_parallel_size
data_parallel_size
optimizer optimizer.type optimizer.params optimizer.legacy_fusion
optimizer.params.lr optimizer.params.betas optimizer.params.eps optimizer.params.weight_decay
optimizer.params.bias_correction optimizer.params.adam_w_mode optimizer.params.torch_adam
optimizer.params.max_grad_norm
scheduler scheduler.type scheduler.params
scheduler.params.warmup_min_lr scheduler.params.warmup_max_lr scheduler.params.warmup_num_steps
scheduler.params.warmup_type scheduler.params.total_num_steps scheduler.params.warmup_min_ratio
scheduler.params.cos_min_ratio scheduler.params.cycle_min_lr scheduler.params.cycle_max_lr
scheduler.params.decay_lr_rate scheduler.params.cycle_first_step_size
scheduler.params.cycle_second_step_size scheduler.params.cycle_first_stair_count
scheduler.params.cycle_second_stair_count scheduler.params.decay_step_size
scheduler.params.cycle_momentum scheduler.params.cycle_min_mom scheduler.params.cycle_max_mom
scheduler.params.decay_mom_rate scheduler.params.lr_range_test_min_lr
scheduler.params.lr_range_test_step_size scheduler.params.lr_range_test_step_rate
scheduler.params.lr_range_test_staircase scheduler.params.last_batch_iteration
zero_optimization zero_optimization.stage zero_optimization.contiguous_gradients
zero_optimization.reduce_scatter zero_optimization.reduce_bucket_size
zero_optimization.use_multi_rank_bucket_allreduce zero_optimization.allgather_partitions
zero_optimization.allgather_bucket_size zero_optimization.overlap_comm
zero_optimization.compute_grad_norm zero_optimization.load_from_fp32_weights
zero_optimization.elastic_checkpoint zero_optimization.offload_param
zero_optimization.offload_optimizer zero_optimization.zenflow zero_optimization.sub_group_size
zero_optimization.cpu_offload_param zero_optimization.cpu_offload_use_pin_memory
zero_optimization.cpu_offload zero_optimization.prefetch_bucket_size
zero_optimization.stage3_prefetch_bucket_size zero_optimization.param_persistence_threshold
zero_optimization.stage3_param_persistence_threshold zero_optimization.model_persistence_threshold
zero_optimization.stage3_model_persistence_threshold zero_optimization.max_live_parameters
zero_optimization.stage3_max_live_parameters zero_optimization.max_reuse_distance
zero_optimization.stage3_max_reuse_distance zero_optimization.gather_16bit_weights_on_model_save
zero_optimization.stage3_gather_16bit_weights_on_model_save
zero_optimization.module_granularity_threshold
zero_optimization.stage3_module_granularity_threshold
zero_optimization.use_all_reduce_for_fetch_params
zero_optimization.stage3_use_all_reduce_for_fetch_params zero_optimization.allgather_sequential
zero_optimization.stage3_allgather_sequential
zero_optimization.stage3_gather_fp16_weights_on_model_save
zero_optimization.ignore_unused_parameters zero_optimization.legacy_stage1
zero_optimization.round_robin_gradients zero_optimization.parameter_alignment
zero_optimization.zero_hpz_partition_size zero_optimization.zero_quantized_weights
zero_optimization.zero_quantized_nontrainable_weights zero_optimization.zero_quantized_gradients
zero_optimization.memory_efficient_linear zero_optimization.pipeline_loading_checkpoint
zero_optimization.override_module_apply zero_optimization.log_trace_cache_warnings
zero_optimization.enable_sanity_checks zero_optimization.save_muon_momentum_buffer_in_memory
zero_optimization.leaf_module zero_optimization.mics_shard_size
zero_optimization.mics_hierarchical_params_gather zero_optimization.zeropp_loco_param
zero_optimization.offload_param.device zero_optimization.offload_param.nvme_path
zero_optimization.offload_param.buffer_count zero_optimization.offload_param.buffer_size
zero_optimization.offload_param.max_in_cpu zero_optimization.offload_param.pin_memory
zero_optimization.offload_optimizer.device zero_optimization.offload_optimizer.nvme_path
zero_optimization.offload_optimizer.buffer_count zero_optimization.offload_optimizer.pin_memory
zero_optimization.offload_optimizer.pipeline_read zero_optimization.offload_optimizer.pipeline_write
zero_optimization.offload_optimizer.fast_init zero_optimization.offload_optimizer.ratio
zero_optimization.offload_optimizer.super_offload
zero_optimization.offload_optimizer.cpuadam_cores_perc
bf16 bf16.enabled bf16.immediate_grad_update bf16.check_grad_overflow
bf16.bf16_master_weights_and_grads bf16.bf16_optimizer_states bfloat16 bfloat16.enabled
fp16 fp16.enabled fp16.auto_cast fp16.loss_scale fp16.initial_scale_power fp16.loss_scale_window
fp16.hysteresis fp16.consecutive_hysteresis fp16.min_loss_scale fp16.fp16_master_weights_and_grads
torch_autocast torch_autocast.enabled torch_autocast.dtype
torch_autocast.lower_precision_safe_modules
aio aio.block_size aio.queue_depth aio.intra_op_parallelism aio.single_submit aio.overlap_events
aio.use_gds
activation_checkpointing activation_checkpointing.partition_activations
activation_checkpointing.number_checkpoints activation_checkpointing.contiguous_memory_optimization
activation_checkpointing.synchronize_checkpoint_boundary activation_checkpointing.profile
activation_checkpointing.cpu_checkpointing
tensorboard tensorboard.enabled tensorboard.output_path tensorboard.job_name
wandb wandb.enabled wandb.group wandb.team wandb.project
csv_monitor csv_monitor.enabled csv_monitor.output_path csv_monitor.job_name
comet comet.enabled comet.samples_log_interval comet.project comet.workspace comet.api_key
comet.experiment_name comet.experiment_key comet.online comet.mode
comms_logger comms_logger.enabled comms_logger.prof_all comms_logger.prof_ops
comms_logger.verbose comms_logger.debug
flops_profiler flops_profiler.enabled flops_profiler.recompute_fwd_factor
flops_profiler.profile_step flops_profiler.module_depth flops_profiler.top_modules
flops_profiler.detailed flops_profiler.output_file
autotuning autotuning.enabled hybrid_engine hybrid_engine.enabled pipeline pipeline.stages
data_efficiency data_efficiency.enabled checkpoint checkpoint.tag_validation
checkpoint.load_universal checkpoint.use_node_local_storage checkpoint.parallel_write
data_types data_types.grad_accum_dtype data_types.param_dtype data_types.buffer_dtype
data_types.keep_in_fp32_modules compile compile.deepcompile timers timers.throughput
tensor_parallel tensor_parallel.autotp_size expert_parallel datastates_ckpt weight_quantization
nebula compression_training amp quantize_training sparse_gradients eigenvalue sparse_attention
elasticity graph_harvesting curriculum_learning progressive_layer_drop
""".split()


def test_the_table_covers_every_deepspeed_key_with_a_fate_and_a_reason():
    missing = [k for k in DEEPSPEED_0_19_8_KEYS if fate_of(k) is None]
    assert not missing, missing
    native = ("zero", "offload_param", "offload_optimizer", "memory", "swapper", "precision",
              "optimizer", "scheduler", "mesh", "gradient_", "train_micro", "checked")
    for key in DEEPSPEED_0_19_8_KEYS:
        fate = fate_of(key)
        assert fate.kind in ("mapped", "replaced", "ignored", "rejected"), key
        if fate.kind == "mapped":  # names the native field it becomes
            assert fate.why.startswith(native), (key, fate.why)
        else:  # says what replaces it, or what is not done
            assert len(fate.why) > 15, (key, fate.why)
    # The written-out list above is not a subset of a table that accepts anything.
    assert fate_of("zero_optimization.stage3_prefetch_bucket_sise") is None
    assert fate_of("scheduler.params.warmup_num_step") is None
    assert fate_of("tensorboard.output_dir") is None
    assert set(DEEPSPEED_KEYS) <= set(DEEPSPEED_0_19_8_KEYS) | {"thread_count"}, (
        sorted(set(DEEPSPEED_KEYS) - set(DEEPSPEED_0_19_8_KEYS)))


@pytest.mark.parametrize("raw, where, suggestion", [
    ({"bf16": {"enabled": True}, "gradient_cliping": 1.0}, "gradient_cliping",
     "gradient_clipping"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x",
                                                          "max_in_cpus": 1}}},
     "zero_optimization.offload_param.max_in_cpus", "max_in_cpu"),
    ({"tensorboard": {"enabled": False, "output_dir": "runs"}}, "tensorboard.output_dir",
     "output_path"),
    ({"bf16": {"enable": True}}, "bf16.enable", "enabled"),
    ({"wandb": {"enabled": False, "projet": "x"}}, "wandb.projet", "project"),
])
def test_keys_deepspeed_does_not_know_get_did_you_mean(raw, where, suggestion):
    with pytest.raises(ValueError, match=rf"unknown DeepSpeed config key '{where}'.*did you "
                                         rf"mean '{suggestion}'"):
        load_config(raw)


def _warnings_of(raw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = load_config(raw)
    return config, [str(w.message) for w in caught]


MONITORS = {
    "tensorboard": ({"output_path": "runs/", "job_name": "ft"}, "TensorBoard monitor"),
    "wandb": ({"project": "ft", "team": "me", "group": "g"}, "Weights & Biases"),
    "csv_monitor": ({"output_path": "csv/", "job_name": "ft"}, "CSV monitor"),
    "comet": ({"project": "ft", "samples_log_interval": 10, "online": False}, "Comet monitor"),
    "comms_logger": ({"verbose": False, "prof_all": True, "debug": False, "prof_ops": []},
                     "communication logger"),
    "flops_profiler": ({"profile_step": 1, "module_depth": -1, "top_modules": 1,
                        "detailed": True, "output_file": None}, "FLOPs profiler"),
}


@pytest.mark.parametrize("name", list(MONITORS))
def test_monitor_sections_disabled_are_accepted_silently(name):
    settings, _ = MONITORS[name]
    base = {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5}
    for section in ({"enabled": False, **settings}, {"enabled": False}, {}):
        config, messages = _warnings_of({**base, name: section})
        assert messages == [], (section, messages)
        assert config == load_config(base)


@pytest.mark.parametrize("name", list(MONITORS))
def test_monitor_sections_enabled_warn_once_naming_what_is_not_implemented(name):
    settings, what = MONITORS[name]
    raw = {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5,
           name: {"enabled": True, **settings}}
    config, messages = _warnings_of(raw)
    assert len(messages) == 1, messages
    assert name in messages[0] and what in messages[0] and "not implemented" in messages[0]
    assert config == load_config({"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5})
    _, again = _warnings_of(raw)
    assert again == [], "one warning per process"


def test_each_fate_behaves_as_documented():
    # replaced: one warning naming the replacement, whatever the value
    _, messages = _warnings_of({"zero_optimization": {"stage": 3, "allgather_bucket_size": 5e8}})
    assert len(messages) == 1 and "one collective per unit" in messages[0]
    # ignored: silent at its off value, one warning when on
    _, messages = _warnings_of({"bf16": {"enabled": True, "check_grad_overflow": False}})
    assert messages == []
    _, messages = _warnings_of({"bf16": {"enabled": True, "check_grad_overflow": True}})
    assert len(messages) == 1 and "not skipped for non-finite gradients" in messages[0]
    _, messages = _warnings_of({"zero_optimization": {"stage": 3},
                                "activation_checkpointing": {"cpu_checkpointing": True}})
    assert len(messages) == 1 and "deepspeed.checkpointing" in messages[0]
    # rejected: accepted at its off value, an error naming the key otherwise
    load_config({"gradient_allreduce_op": "mean", "prescale_gradients": False,
                 "compile": {"deepcompile": False}, "autotuning": {"enabled": False},
                 "activation_checkpointing": {"partition_activations": False,
                                              "cpu_checkpointing": False,
                                              "number_checkpoints": None}})
    for raw, key in [({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op"),
                     ({"compile": {"deepcompile": True}}, "compile"),
                     ({"amp": {"enabled": True}}, "amp"),
                     ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}},
                      "optimizer.params.max_grad_norm"),
                     ({"zero_optimization": {"stage": 3, "offload_optimizer": {
                         "device": "cpu", "super_offload": True}}},
                      "zero_optimization.offload_optimizer.super_offload")]:
        with pytest.raises(ValueError, match=rf"DeepSpeed key '{key}' = .* is not supported"):
            load_config(raw)


def test_deepspeed_default_gradient_clipping_is_deepspeeds_one():
    assert load_config({"zero_optimization": {"stage": 2}}).gradient_clipping == 1.0
    assert load_config({"zero_optimization": {"stage": 2},
                        "gradient_clipping": 0.0}).gradient_clipping == 0.0
    assert load_config({"zero": {"stage": 2}}).gradient_clipping == 0.0  # native: off
