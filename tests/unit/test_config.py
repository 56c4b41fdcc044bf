"""Configuration: native and DeepSpeed forms, validation messages, the four key groups."""

from __future__ import annotations

import json
import warnings

import pytest

from infinity.config import (AUTO, InfinityConfig, OffloadConfig, SwapperConfig, ZeroConfig,
                             config_from_deepspeed, config_from_native, config_to_deepspeed,
                             load_config)

DS_EXAMPLE = {
    "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp/p"},
                          "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/p"}},
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
    "gradient_clipping": 1.0,
}


def test_defaults_are_valid_and_round_trip_through_native_dict():
    config = InfinityConfig()
    assert config_from_native(config.to_dict()) == config
    assert load_config(None) == config
    assert load_config(config) is config


def test_field_error_names_field_and_choices():
    with pytest.raises(ValueError) as info:
        OffloadConfig(name="offload_param", device="gpu")
    assert str(info.value) == "offload_param.device: expected one of 'none', 'cpu', 'nvme', got 'gpu'"


@pytest.mark.parametrize("kwargs, field", [
    ({"block_size_bytes": 1000}, "swapper.block_size_bytes"),
    ({"block_size_bytes": 3 * 4096}, "swapper.block_size_bytes"),
    ({"queue_depth": 0}, "swapper.queue_depth"),
    ({"num_io_threads": True}, "swapper.num_io_threads"),
    ({"direct_io": "maybe"}, "swapper.direct_io"),
    ({"alignment_bytes": 1000}, "swapper.alignment_bytes"),
])
def test_swapper_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        SwapperConfig(**kwargs)


def test_nvme_needs_a_path_and_param_offload_needs_stage3():
    with pytest.raises(ValueError, match="offload_optimizer.nvme_path"):
        OffloadConfig(name="offload_optimizer", device="nvme")
    with pytest.raises(ValueError, match="stage 3"):
        InfinityConfig(zero=ZeroConfig(stage=2),
                       offload_param=OffloadConfig(name="offload_param", device="cpu"))
    with pytest.raises(ValueError, match="zero_optimization.stage"):
        ZeroConfig(stage=4)


def test_overlap_param_gather_is_a_boolean_named_in_its_error():
    assert load_config({"zero": {"stage": 2, "overlap_param_gather": True}}).zero.overlap_param_gather
    assert not load_config({"zero": {"stage": 2}}).zero.overlap_param_gather  # off by default
    with pytest.raises(ValueError, match=r"zero\.overlap_param_gather"):
        load_config({"zero": {"stage": 2, "overlap_param_gather": "yes"}})


def test_native_unknown_key_suggests_the_close_one():
    with pytest.raises(ValueError, match=r"unknown config key 'swapper.queue_dept'.*did you mean 'queue_depth'"):
        load_config({"swapper": {"queue_dept": 4}})
    with pytest.raises(ValueError, match=r"did you mean 'gradient_clipping'"):
        load_config({"gradient_cliping": 1.0})


def test_deepspeed_example_maps_onto_native_fields():
    config = load_config(DS_EXAMPLE)
    assert config.zero.stage == 3
    assert config.offload_param == OffloadConfig(name="offload_param", device="nvme", nvme_path="/tmp/p")
    assert config.offload_optimizer.device == "nvme"
    assert config.precision.dtype == "bf16"
    assert config.optimizer.type == "adamw"
    assert config.optimizer.lr == 1e-4 and config.optimizer.weight_decay == 0.01
    assert config.gradient_clipping == 1.0


def test_deepspeed_file_path_loads(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(DS_EXAMPLE))
    assert load_config(str(path)) == load_config(DS_EXAMPLE)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json.*not valid JSON"):
        load_config(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="does not exist"):
        load_config(str(tmp_path / "missing.json"))


def test_deepspeed_element_counts_become_bytes_of_the_param_dtype():
    raw = {"bf16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "stage3_prefetch_bucket_size": 5e7, "stage3_max_live_parameters": 1e9,
        "stage3_param_persistence_threshold": 1e5, "stage3_max_reuse_distance": 1e9,
        "sub_group_size": 1e9}}
    z = load_config(raw).zero
    assert z.prefetch_lookahead_bytes == 50_000_000 * 2
    assert z.max_live_bytes == 1_000_000_000 * 2
    assert z.persistence_threshold_numel == 100_000
    assert z.max_reuse_distance_numel == 1_000_000_000
    assert z.sub_group_numel == 1_000_000_000


def test_deepspeed_auto_values_of_the_model_stay_for_the_engine_the_trainers_resolve():
    raw = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto"},
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}}}
    with pytest.warns(UserWarning, match=r"TrainingArguments' defaults give: "
                                         r"gradient_accumulation_steps=1, optimizer\.params\.lr="
                                         r"5e-05, optimizer\.params\.betas=\(0\.9, 0\.999\), "
                                         r"optimizer\.params\.eps=1e-08, optimizer\.params\."
                                         r"weight_decay=0\.0"):
        config = load_config(raw)
    assert config.train_micro_batch_size_per_gpu == AUTO  # from the first batch
    assert config.zero.prefetch_lookahead_bytes == AUTO  # the engine's own
    assert config.zero.persistence_threshold_numel == AUTO
    assert config.gradient_accumulation_steps == 1
    o = config.optimizer
    assert (o.lr, o.betas, o.eps, o.weight_decay) == (5e-5, (0.9, 0.999), 1e-8, 0.0)
    config.check_resolved("initialize")


def test_replaced_keys_warn_once_naming_the_replacement():
    raw = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "overlap_comm": True,
                                 "contiguous_gradients": True}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(raw)
        load_config(raw)
    messages = [str(w.message) for w in caught]
    bucket = [m for m in messages if "reduce_bucket_size" in m]
    assert len(bucket) == 1, messages
    assert "one collective per unit" in bucket[0]


def test_aio_maps_onto_swapper_settings():
    raw = {"zero_optimization": {"stage": 3}, "aio": {"block_size": 1048576, "queue_depth": 16,
                                                      "thread_count": 2, "intra_op_parallelism": 4,
                                                      "single_submit": False, "overlap_events": True}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = load_config(raw).swapper
    assert (s.block_size_bytes, s.queue_depth, s.num_io_threads) == (1048576, 16, 4)


@pytest.mark.parametrize("raw, message", [
    ({"zero_optimization": {"stage": 3, "mics_hierarchical_params_gather": True}}, "MiCS"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
     "partial optimizer offload"),
    ({"aio": {"use_gds": True}}, "GPUDirect"),
    ({"pipeline": {"activation_checkpoint_interval": 1}}, "checkpointing every k-th layer"),
    ({"optimizer": {"type": "Lamb", "params": {}}}, "Lamb"),
    ({"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}}, "AMSGrad"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "at most one"),
    ({"fp16": {"enabled": True, "auto_cast": True}}, "auto_cast"),
])
def test_unimplemented_behaviour_is_rejected(raw, message):
    with pytest.raises(ValueError, match=message):
        load_config(raw)


def test_rejected_key_at_its_off_default_is_accepted():
    config = load_config({"zero_optimization": {"stage": 3, "zero_quantized_weights": False,
                                                "zero_hpz_partition_size": 1, "mics_shard_size": -1},
                          "aio": {"use_gds": False}})
    assert config.zero.stage == 3


def test_deepspeed_unknown_key_suggests_the_close_one():
    with pytest.raises(ValueError, match=r"zero_optimization.stage3_prefetch_bucket_sise.*did you mean "
                                         r"'stage3_prefetch_bucket_size'"):
        load_config({"zero_optimization": {"stage3_prefetch_bucket_sise": 1}})
    with pytest.raises(ValueError, match=r"did you mean 'gradient_accumulation_steps'"):
        load_config({"bf16": {"enabled": True}, "gradient_acumulation_steps": 2})


def test_fp16_section_maps_loss_scaling():
    p = load_config({"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                              "loss_scale_window": 500, "hysteresis": 3, "min_loss_scale": 2}}).precision
    assert (p.dtype, p.loss_scale, p.initial_scale_power, p.loss_scale_window, p.hysteresis,
            p.min_loss_scale) == ("fp16", 0, 12, 500, 3, 2)


def test_deepspeed_adam_defaults_to_decoupled_decay_like_deepspeed():
    assert load_config({"optimizer": {"type": "Adam", "params": {}}}).optimizer.type == "adamw"
    assert load_config({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}
                       ).optimizer.type == "adam"


def test_batch_size_consistency_is_checked():
    with pytest.raises(ValueError, match="train_batch_size"):
        load_config({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4,
                     "gradient_accumulation_steps": 1})


def test_deepspeed_form_round_trips():
    config = load_config(DS_EXAMPLE)
    again = config_from_deepspeed(config_to_deepspeed(config))
    assert again.zero == config.zero
    assert again.offload_param == config.offload_param
    assert again.offload_optimizer == config.offload_optimizer
    assert again.precision == config.precision
    assert again.optimizer == config.optimizer
    assert again.gradient_clipping == config.gradient_clipping


@pytest.mark.parametrize("value,compute,want", [
    (None, "bf16", "fp32"), ("fp32", "bf16", "fp32"), ("bf16", "bf16", "compute"),
    ("bfloat16", "bf16", "compute"), ("fp16", "fp16", "compute"), ("fp32", "fp32", "fp32")])
def test_deepspeed_communication_data_type_maps_to_reduce_dtype(value, compute, want):
    raw = {"zero_optimization": {"stage": 3}}
    if compute != "fp32":
        raw[compute] = {"enabled": True}
    if value is not None:
        raw["communication_data_type"] = value
    config = load_config(raw)
    assert config.precision.reduce_dtype == want
    assert config_from_deepspeed(config_to_deepspeed(config)).precision == config.precision


def test_deepspeed_communication_data_type_other_than_fp32_or_compute_is_refused():
    with pytest.raises(ValueError, match="communication_data_type.*'fp32' or 'bf16'"):
        load_config({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                     "communication_data_type": "fp16"})
    with pytest.raises(ValueError, match="precision.reduce_dtype"):
        load_config({"precision": {"dtype": "bf16", "reduce_dtype": "bf16"}})


def test_bf16_moments_with_an_offloaded_optimizer_are_refused_at_validation():
    with pytest.raises(ValueError, match=r"optimizer\.state_dtype.*offload_optimizer"):
        load_config({"optimizer": {"state_dtype": "bf16"},
                     "offload_optimizer": {"device": "cpu"}})
    assert load_config({"optimizer": {"state_dtype": "bf16"}}).optimizer.state_dtype == "bf16"


def test_two_swap_directories_are_refused_at_validation(tmp_path):
    with pytest.raises(ValueError, match="nvme_path differ"):
        load_config({"offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "a")},
                     "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "b")}})


def test_auto_values_are_valid_config_but_not_a_running_engine():
    from infinity.config import OptimizerConfig

    config = InfinityConfig(optimizer=OptimizerConfig(lr="auto", weight_decay="auto"),
                            gradient_accumulation_steps="auto")
    with pytest.raises(ValueError, match=r"optimizer\.params\.lr, optimizer\.params\."
                                         r"weight_decay, gradient_accumulation_steps: 'auto'.*"
                                         r"initialize"):
        config.check_resolved("initialize")
    config = config.replace(optimizer=config.optimizer.__class__(lr=1e-3, weight_decay=0.0))
    with pytest.raises(ValueError, match="gradient_accumulation_steps: 'auto'"):
        config.check_resolved("initialize")
    config.replace(gradient_accumulation_steps=2).check_resolved("initialize")  # no error
