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
