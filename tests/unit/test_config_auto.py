""""auto" values: fill_auto fills them from what a trainer knows; load_config resolves the rest to
what transformers.TrainingArguments' defaults give, with one warning naming each value."""

from __future__ import annotations

import copy
import warnings

import pytest
import transformers

from infinity.config import (AUTO, InfinityConfig, OptimizerConfig, SchedulerConfig, fill_auto,
                             load_config)
from tests._support.configs import HF_ZERO3_OFFLOAD

def _load(raw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = load_config(raw)
    return config, [str(w.message) for w in caught if "'auto'" in str(w.message)]


def test_training_arguments_defaults_are_what_the_defaults_say():
    """The defaults infinity resolves to are transformers' own (read from the installed class)."""
    args = {f.name: f.default for f in transformers.TrainingArguments.__dataclass_fields__.values()}
    config, _ = _load(HF_ZERO3_OFFLOAD)
    o = config.optimizer
    assert o.lr == args["learning_rate"]
    assert o.betas == (args["adam_beta1"], args["adam_beta2"])
    assert o.eps == args["adam_epsilon"] and o.weight_decay == args["weight_decay"]
    assert config.gradient_clipping == args["max_grad_norm"]
    assert config.gradient_accumulation_steps == args["gradient_accumulation_steps"]
    assert config.scheduler.warmup_num_steps == args["warmup_steps"]
    assert config.precision.dtype == "fp32" and not args["bf16"] and not args["fp16"]


def test_hf_zero3_offload_config_with_every_auto_loads_with_one_warning_naming_each():
    raw = copy.deepcopy(HF_ZERO3_OFFLOAD)
    config, messages = _load(raw)
    assert raw == HF_ZERO3_OFFLOAD, "the caller's dict is not modified"
    assert len(messages) == 1, messages
    for named in ("fp16.enabled=False", "bf16.enabled=False", "gradient_clipping=1.0",
                  "gradient_accumulation_steps=1", "optimizer.params.lr=5e-05",
                  "optimizer.params.betas=(0.9, 0.999)", "optimizer.params.eps=1e-08",
                  "optimizer.params.weight_decay=0.0", "scheduler.params.warmup_min_lr=0.0",
                  "scheduler.params.warmup_max_lr=5e-05", "scheduler.params.warmup_num_steps=0"):
        assert named in messages[0], (named, messages[0])
    assert config.precision.dtype == "fp32"  # not "bf16.enabled and fp16.enabled are both true"
    assert config.gradient_clipping == 1.0  # not "expected a number, got 'auto'"
    assert config.scheduler == SchedulerConfig(type="warmup_lr", warmup_min_lr=0.0,
                                               warmup_max_lr=5e-5, warmup_num_steps=0)
    assert (config.offload_param.device, config.offload_optimizer.device) == ("cpu", "cpu")
    assert config.train_micro_batch_size_per_gpu == AUTO  # from the first batch, as before
    assert config.zero.prefetch_lookahead_bytes == AUTO
    assert config.zero.persistence_threshold_numel == AUTO
    config.check_resolved("initialize")


def test_fill_auto_fills_only_autos_and_leaves_the_input_alone():
    raw = copy.deepcopy(HF_ZERO3_OFFLOAD)
    raw["optimizer"]["params"]["weight_decay"] = 0.1  # set by the user: kept
    values = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "train_batch_size": 8, "gradient_clipping": 0.5, "optimizer.params.lr": 2e-5,
              "optimizer.params.betas": (0.9, 0.95), "optimizer.params.eps": 1e-6,
              "optimizer.params.weight_decay": 0.0, "bf16.enabled": True, "fp16.enabled": False,
              "scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": 2e-5,
              "scheduler.params.warmup_num_steps": 10,
              "scheduler.params.total_num_steps": 100}  # absent from raw: not added
    filled = fill_auto(raw, values)
    assert raw["optimizer"]["params"]["lr"] == "auto", "the input is not modified"
    assert filled["optimizer"]["params"] == {"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-6,
                                             "weight_decay": 0.1}
    assert "total_num_steps" not in filled["scheduler"]["params"]
    assert filled["bf16"] == {"enabled": True} and filled["fp16"]["enabled"] is False
    assert filled["zero_optimization"]["stage3_prefetch_bucket_size"] == "auto"
    config, messages = _load(filled)
    assert messages == [], "nothing left to resolve"
    assert config.precision.dtype == "bf16"
    assert (config.gradient_accumulation_steps, config.train_micro_batch_size_per_gpu,
            config.gradient_clipping) == (2, 4, 0.5)
    assert config.scheduler.warmup_num_steps == 10 and config.scheduler.warmup_max_lr == 2e-5


def test_fill_auto_refuses_names_deepspeed_does_not_know_and_knows_bfloat16():
    with pytest.raises(ValueError, match=r"fill_auto: 'optimizer\.param\.lr' is not a "
                                         r"DeepSpeed config key"):
        fill_auto(HF_ZERO3_OFFLOAD, {"optimizer.param.lr": 1e-4})
    assert fill_auto({"bfloat16": {"enabled": "auto"}},
                     {"bf16.enabled": True}) == {"bfloat16": {"enabled": True}}


def test_one_precision_enabled_and_the_other_auto_keeps_the_enabled_one():
    config, messages = _load({"bf16": {"enabled": "auto"}, "fp16": {"enabled": True}})
    assert config.precision.dtype == "fp16" and "bf16.enabled=False" in messages[0]
    config, _ = _load({"bf16": {"enabled": True}, "fp16": {"enabled": "auto"}})
    assert config.precision.dtype == "bf16"


def test_an_auto_without_a_default_names_itself_and_the_fix():
    raw = {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}}
    with pytest.raises(ValueError, match=r"scheduler\.params\.total_num_steps: 'auto' has no "
                                         r"default .*fill_auto"):
        load_config(raw)
    assert load_config(fill_auto(raw, {"scheduler.params.total_num_steps": 50})
                       ).scheduler.total_num_steps == 50
    with pytest.raises(ValueError, match=r"scheduler\.params\.cos_min_ratio: 'auto'"):
        load_config({"scheduler": {"type": "WarmupCosineLR",
                                   "params": {"total_num_steps": 9, "cos_min_ratio": "auto"}}})


def test_native_configs_and_config_objects_resolve_the_same_way():
    config, messages = _load({"optimizer": {"lr": "auto", "betas": "auto"},
                              "gradient_clipping": "auto"})
    assert (config.optimizer.lr, config.optimizer.betas, config.gradient_clipping) == (
        5e-5, (0.9, 0.999), 1.0)
    assert len(messages) == 1 and "optimizer.params.lr=5e-05" in messages[0]
    raw = InfinityConfig(optimizer=OptimizerConfig(eps="auto"), gradient_accumulation_steps="auto")
    config, messages = _load(raw)
    assert (config.optimizer.eps, config.gradient_accumulation_steps) == (1e-8, 1)
    resolved = InfinityConfig()
    assert load_config(resolved) is resolved  # nothing to resolve: the same object
