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
from tests.integrations._hf import (HF_DS_CONFIG, TRAINER_CASES, Tokens,  # noqa: E402
                                    assert_same_run, logs_of, stage3, tiny, training_args,
                                    weights_of)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("case", sorted(TRAINER_CASES))
def test_matches_plain_trainer(tmp_path, case):
    kind, config = TRAINER_CASES[case]
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

    if case == "gpt2-stage3":
        # Evaluation after training runs through the engine (released parameters at stage 3).
        a, b = ours.evaluate(Tokens(8)), plain.evaluate(Tokens(8))
        assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-4, (a, b)
        # save_model: HF-format weights that from_pretrained loads
        ours.save_model(str(tmp_path / "saved"))
        loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
        expected = weights_of(ours)
        got = loaded.state_dict()
        assert expected.keys() <= got.keys()
        for k, v in expected.items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)


def test_model_built_under_infinity_init_matches_plain_trainer(tmp_path):
    import infinity

    config = stage3("llama")
    with infinity.init(config):
        lazy = tiny("llama")  # meta placeholders: no rank holds the weights
    with pytest.raises(ValueError, match="pass the same config as infinity_config"):
        InfinityTrainer(model=lazy, args=training_args(str(tmp_path)), train_dataset=Tokens())
    args = dict(max_steps=4)
    plain = Trainer(model=tiny("llama"), args=training_args(str(tmp_path / "plain"), **args),
                    train_dataset=Tokens())
    plain.train()
    ours = InfinityTrainer(model=lazy, args=training_args(str(tmp_path / "ours"), **args),
                           train_dataset=Tokens(), infinity_config=config)
    ours.train()
    assert_same_run(ours, plain)


def test_optimizer_and_scheduler_passed_to_the_trainer_drive_the_engine(tmp_path):
    """Trainer(optimizers=(optimizer, scheduler)): the optimizer's groups become the engine's,
    and the scheduler, built on the user's optimizer, sets the engine's lrs."""

    def run(cls, out, **kw):
        model = tiny("llama")
        norms = [p for n, p in model.named_parameters() if "norm" in n]
        rest = [p for n, p in model.named_parameters() if "norm" not in n]
        optimizer = torch.optim.AdamW([{"params": rest, "weight_decay": 0.05, "lr": 2e-2},
                                       {"params": norms, "weight_decay": 0.0, "lr": 5e-3}],
                                      betas=(0.9, 0.95), eps=1e-6)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
        trainer = cls(model=model, args=training_args(str(tmp_path / out), max_steps=6),
                      train_dataset=Tokens(), optimizers=(optimizer, schedule), **kw)
        trainer.train()
        return trainer

    plain = run(Trainer, "plain")
    ours = run(InfinityTrainer, "ours", infinity_config=stage3("llama"))
    initial = {k: v.clone() for k, v in tiny("llama").state_dict().items()}
    assert_same_run(ours, plain, initial=initial)
    assert [g["lr"] for g in ours.engine.optimizer.param_groups] == pytest.approx(
        [2e-2 / 7, 5e-3 / 7])


def test_bf16_arguments_make_the_engine_compute_in_bf16_without_autocast(tmp_path):
    trainer = InfinityTrainer(model=tiny("gpt2"), args=training_args(str(tmp_path), max_steps=2,
                                                                     bf16=True),
                              train_dataset=Tokens(), infinity_config=stage3("gpt2"))
    trainer.train()
    assert trainer.engine.compute_dtype == torch.bfloat16
    assert trainer.engine.config.precision.dtype == "bf16"
    assert not trainer.accelerator.native_amp and trainer.accelerator.scaler is None
    assert all(torch.isfinite(torch.tensor(loss)) for loss, _, _ in logs_of(trainer))
    assert all(v.dtype == torch.float32 for v in weights_of(trainer).values())  # fp32 masters


def test_deepspeed_scheduler_section_is_run_by_the_engine(tmp_path):
    """A config "scheduler" (its "auto" values filled from TrainingArguments) is the engine's:
    stepped after each update, as DeepSpeed does; against the same schedule stepped by a plain
    Trainer. The Trainer logs its lr after the engine stepped it (the next step's, as with
    DeepSpeed's scheduler under the Trainer)."""
    from infinity.optim.schedulers import WarmupDecayLR

    plain = Trainer(model=tiny("gpt2"), args=training_args(str(tmp_path / "plain")),
                    train_dataset=Tokens())
    plain.lr_scheduler = WarmupDecayLR(plain.create_optimizer(), 10, warmup_min_lr=0.0,
                                       warmup_max_lr=3e-3, warmup_num_steps=3,
                                       warmup_type="linear")
    plain.train()
    config = {**HF_DS_CONFIG, "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "total_num_steps": "auto", "warmup_type": "linear"}}}
    ours = InfinityTrainer(model=tiny("gpt2"), args=training_args(str(tmp_path / "ours")),
                           train_dataset=Tokens(), infinity_config=config)
    ours.train()
    assert ours.lr_scheduler.scheduler is ours.engine.lr_scheduler
    a, b = logs_of(ours), logs_of(plain)
    assert [lr for _, _, lr in a[:-1]] == pytest.approx([lr for _, _, lr in b[1:]])
    for (la, ga, _), (lb, gb, _) in zip(a, b):
        assert abs(la - lb) <= 1e-4 and abs(ga - gb) <= 1e-4
    wa, wb = weights_of(ours), weights_of(plain)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wb) <= 1e-3


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
