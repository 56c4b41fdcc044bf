"""[Note: values the trainer drives] in infinity/integrations/_config.py: missing and "auto" values
come from the trainer, explicit ones must agree, in each form a config comes in (DeepSpeed-style
dict, native dict, JSON file, InfinityConfig object, None). Pure: no transformers needed."""

from __future__ import annotations

import json

import pytest

from infinity.config import InfinityConfig, OptimizerConfig, load_config
from infinity.integrations._config import device_name, resolve_config

VALUES = {
    "gradient_accumulation_steps": (2, "TrainingArguments.gradient_accumulation_steps"),
    "train_micro_batch_size_per_gpu": (4, "TrainingArguments.per_device_train_batch_size"),
    "gradient_clipping": (0.5, "TrainingArguments.max_grad_norm"),
    "precision.dtype": ("bf16", "TrainingArguments.bf16/fp16"),
    "optimizer.type": ("adamw", "TrainingArguments.optim"),
    "optimizer.lr": (3e-4, "TrainingArguments.learning_rate"),
    "optimizer.betas": ((0.9, 0.95), "TrainingArguments.adam_beta1/adam_beta2"),
    "optimizer.eps": (1e-6, "TrainingArguments.adam_epsilon"),
    "optimizer.weight_decay": (0.1, "TrainingArguments.weight_decay"),
    "device": ("cpu", "TrainingArguments.device"),
}


def assert_driven(config: InfinityConfig) -> None:
    assert config.gradient_accumulation_steps == 2
    assert config.train_micro_batch_size_per_gpu == 4
    assert config.gradient_clipping == 0.5
    assert config.precision.dtype == "bf16"
    o = config.optimizer
    assert (o.type, o.lr, o.betas, o.eps, o.weight_decay) == ("adamw", 3e-4, (0.9, 0.95), 1e-6,
                                                               0.1)
    assert config.device == "cpu"


@pytest.mark.parametrize("source", [None, {}, {"zero": {"stage": 2}}, InfinityConfig()])
def test_values_the_config_leaves_out_come_from_the_trainer(source):
    config = resolve_config(source, VALUES)
    assert_driven(config)
    if isinstance(source, dict) and source:
        assert config.zero.stage == 2  # the rest of the config is the user's


def test_native_auto_values_are_filled_and_agreeing_explicit_ones_kept(tmp_path):
    raw = {"gradient_accumulation_steps": "auto", "gradient_clipping": 0.5,
           "optimizer": {"lr": "auto", "betas": [0.9, 0.95], "eps": "auto"},
           "precision": {"dtype": "bf16"}, "zero": {"stage": 3}}
    assert_driven(resolve_config(raw, VALUES))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    assert_driven(resolve_config(str(path), VALUES))
    assert raw["optimizer"]["lr"] == "auto"  # the caller's dict is not modified


def test_explicit_values_that_disagree_are_one_error_naming_each():
    raw = {"gradient_accumulation_steps": 8, "precision": {"dtype": "fp16"},
           "optimizer": {"lr": 1e-3}}
    with pytest.raises(ValueError) as e:
        resolve_config(raw, VALUES)
    message = str(e.value)
    for part in ("gradient_accumulation_steps is 8 in the infinity_config but 2 from "
                 "TrainingArguments.gradient_accumulation_steps",
                 "precision.dtype is 'fp16' in the infinity_config but 'bf16' from "
                 "TrainingArguments.bf16/fp16",
                 "optimizer.lr is 0.001", "Set these keys to \"auto\""):
        assert part in message, message


def test_an_object_says_explicitly_what_differs_from_the_defaults():
    assert_driven(resolve_config(InfinityConfig(optimizer=OptimizerConfig(lr=3e-4)), VALUES))
    with pytest.raises(ValueError, match="optimizer.lr is 0.01 in the infinity_config"):
        resolve_config(InfinityConfig(optimizer=OptimizerConfig(lr=1e-2)), VALUES)


def test_only_driven_values_are_accepted():
    with pytest.raises(ValueError, match="not driven config values"):
        resolve_config(None, {"zero.stage": (3, "somewhere")})


def test_device_names():
    assert device_name("cpu:1") == "cpu" and device_name("cuda:1") == "cuda:1"
    assert device_name("cuda") == "cuda:0"
    assert load_config({"device": device_name("cpu:0")}).device == "cpu"


HF_DS_CONFIG = {  # the shape of the DeepSpeed configs in Hugging Face's fine-tuning examples
    "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                             "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
}
SCHEDULE = {"train_batch_size": 8, "scheduler.params.warmup_min_lr": 0.0,
            "scheduler.params.warmup_max_lr": 3e-4, "scheduler.params.warmup_num_steps": 10,
            "scheduler.params.total_num_steps": 100}


def test_deepspeed_auto_values_are_filled_from_the_trainer_without_warnings(recwarn):
    config = resolve_config(HF_DS_CONFIG, VALUES, deepspeed_only=SCHEDULE)
    assert_driven(config)
    assert config.offload_optimizer.device == "cpu" and config.zero.stage == 3
    s = config.scheduler
    assert (s.warmup_min_lr, s.warmup_max_lr, s.warmup_num_steps, s.total_num_steps) == (
        0.0, 3e-4, 10, 100)
    assert not [w for w in recwarn if "auto" in str(w.message)]  # nothing left for defaults


def test_deepspeed_config_without_the_driven_keys_takes_them_all():
    config = resolve_config({"zero_optimization": {"stage": 3}}, VALUES)
    assert_driven(config)


def test_deepspeed_explicit_values_must_agree():
    raw = {**HF_DS_CONFIG, "gradient_clipping": 1.0, "bf16": {"enabled": False},
           "fp16": {"enabled": True}, "train_micro_batch_size_per_gpu": 4}
    with pytest.raises(ValueError) as e:
        resolve_config(raw, VALUES, deepspeed_only=SCHEDULE)
    message = str(e.value)
    assert "gradient_clipping is 1.0 in the infinity_config but 0.5" in message
    assert "precision.dtype is 'fp16'" in message
    assert "train_micro_batch_size_per_gpu" not in message  # 4 agrees
    # Only disabling fp16 says nothing about bf16: the trainer's bf16 stands.
    config = resolve_config({**HF_DS_CONFIG, "fp16": {"enabled": False}, "bf16": {}}, VALUES,
                            deepspeed_only=SCHEDULE)
    assert config.precision.dtype == "bf16"
