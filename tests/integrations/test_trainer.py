"""InfinityTrainer against plain ``transformers.Trainer`` (no DeepSpeed): 10 steps, cosine schedule
with warmup, HF's no-decay groups, clipping, gradient accumulation 2. Same logged losses (1e-4),
grad norms and lrs, same final weights (1e-3), at stage 3 and with parameters and optimizer
offloaded to the host; ``save_model`` writes weights ``from_pretrained`` loads; a checkpoint at
step 5 resumed in a fresh trainer ends where the uninterrupted run does."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import AutoModelForCausalLM, Trainer  # noqa: E402

from infinity.integrations.hf import InfinityTrainer  # noqa: E402
from tests.integrations._hf import (UNITS, Tokens, assert_same_run, logs_of,  # noqa: E402
                                    tiny, training_args, weights_of)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def stage3(kind: str, **extra):
    return {"zero": {"stage": 3, "unit_class_names": [UNITS[kind]], "unit_min_numel": 1,
                     "persistence_threshold_numel": 64}, **extra}


CASES = {
    "gpt2-stage3": ("gpt2", stage3("gpt2")),
    "llama-stage3": ("llama", stage3("llama")),
    "llama-offload-host": ("llama", stage3("llama", offload_param={"device": "cpu"},
                                           offload_optimizer={"device": "cpu"})),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_plain_trainer(tmp_path, case):
    kind, config = CASES[case]
    initial = {k: v.clone() for k, v in tiny(kind).state_dict().items()}
    plain = Trainer(model=tiny(kind), args=training_args(str(tmp_path / "plain")),
                    train_dataset=Tokens())
    plain.train()
    ours = InfinityTrainer(model=tiny(kind), args=training_args(str(tmp_path / "ours")),
                           train_dataset=Tokens(), infinity_config=config)
    ours.train()
    assert_same_run(ours, plain, initial=initial)

    # The engine got HF's groups: decayed weights, and biases/norm weights without decay.
    decay_names = set(plain.get_decay_parameter_names(ours.model))
    params = dict(ours.model.named_parameters())  # a tied weight under its first name
    decay = {id(p) for n, p in params.items() if n in decay_names}
    groups = ours.engine.optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert {id(p) for p in groups[0]["params"]} == decay
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in params.values()} - decay
    assert any(part in n for n, p in params.items() if id(p) not in decay
               for part in ("bias", "ln_", "norm"))

    if case == "gpt2-stage3":  # save_model: HF-format weights that from_pretrained loads
        ours.save_model(str(tmp_path / "saved"))
        loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
        expected = weights_of(ours)
        got = loaded.state_dict()
        assert expected.keys() <= got.keys()
        for k, v in expected.items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)


def test_resume_from_step_5_equals_uninterrupted(tmp_path):
    config = stage3("gpt2")
    args = training_args(str(tmp_path / "run"), save_strategy="steps", save_steps=5)
    full = InfinityTrainer(model=tiny("gpt2"), args=args, train_dataset=Tokens(),
                           infinity_config=config)
    full.train()
    checkpoint = tmp_path / "run" / "checkpoint-5"
    assert (checkpoint / "infinity").is_dir() and (checkpoint / "model.safetensors").is_file()

    resumed = InfinityTrainer(model=tiny("gpt2", seed=1), args=args, train_dataset=Tokens(),
                              infinity_config=config)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 10
    # The log history comes back with the trainer state; steps 6-10 are the resumed run's.
    assert len(logs_of(resumed)) == 10
    assert logs_of(resumed)[5:] == logs_of(full)[5:]
    a, b = weights_of(resumed), weights_of(full)
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)


def test_unsupported_arguments_are_refused(tmp_path):
    for overrides, named in [({"optim": "sgd"}, "optim='sgd'"),
                             ({"torch_compile": True}, "torch_compile")]:
        with pytest.raises(ValueError, match=named):
            InfinityTrainer(model=tiny("gpt2"), args=training_args(str(tmp_path), **overrides),
                            train_dataset=Tokens())


def test_config_that_disagrees_with_the_arguments_is_refused_before_training(tmp_path):
    trainer = InfinityTrainer(model=tiny("gpt2"), args=training_args(str(tmp_path)),
                              train_dataset=Tokens(),
                              infinity_config={"gradient_accumulation_steps": 4,
                                               "optimizer": {"lr": 1e-4}})
    with pytest.raises(ValueError) as e:
        trainer.train()
    message = str(e.value)
    assert "gradient_accumulation_steps is 4" in message and "2 from TrainingArguments" in message
    assert "optimizer.lr is 0.0001" in message and "TrainingArguments.learning_rate" in message
    assert not os.path.exists(tmp_path / "checkpoint-1")


def test_peft_model_matches_plain_trainer_and_saves_loadable_adapter_files(tmp_path):
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    def lora_model():
        model = tiny("llama")
        torch.manual_seed(1)  # "gaussian": B is not zero, so the adapters change the outputs
        return peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
            init_lora_weights="gaussian"))

    args = dict(max_steps=6)
    plain = Trainer(model=lora_model(), args=training_args(str(tmp_path / "plain"), **args),
                    train_dataset=Tokens())
    plain.train()
    ours = InfinityTrainer(model=lora_model(), args=training_args(str(tmp_path / "ours"), **args),
                           train_dataset=Tokens(), infinity_config=stage3("llama"))
    ours.train()
    assert_same_run(ours, plain)
    assert {id(p) for g in ours.engine.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in ours.model.parameters() if p.requires_grad}  # the adapters only

    ours.save_model(str(tmp_path / "adapter"))
    plain.save_model(str(tmp_path / "plain-adapter"))
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    reference = load_file(str(tmp_path / "plain-adapter" / "adapter_model.safetensors"))
    assert saved.keys() == reference.keys() and saved
    for k in reference:
        torch.testing.assert_close(saved[k], reference[k], rtol=0, atol=1e-3, msg=k)
    loaded = peft.PeftModel.from_pretrained(tiny("llama"), str(tmp_path / "adapter"))
    ids = torch.arange(16).unsqueeze(0) % 64
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, plain.model(input_ids=ids).logits,
                                   rtol=0, atol=1e-3)
