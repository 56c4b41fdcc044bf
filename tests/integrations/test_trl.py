"""TRL's SFTTrainer through InfinityTrainerMixin against plain SFTTrainer: TRL's defaults as they
are (activation checkpointing on, its fused LM head, its loss), fp32 (bf16 off), 6 steps of 2
micro-batches: same losses, grad norms and lrs, same final weights."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from infinity.integrations.hf import InfinityTrainerMixin  # noqa: E402
from tests.integrations._hf import UNITS, VOCAB, assert_same_run, tiny  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class SFT(InfinityTrainerMixin, trl.SFTTrainer):
    pass


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the words w0..w61 (no download)."""
    vocab = {f"w{i}": i for i in range(VOCAB - 2)}
    vocab.update({"<pad>": VOCAB - 2, "<unk>": VOCAB - 1})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>",
                                   unk_token="<unk>", eos_token="<pad>")


def dataset():
    texts = [" ".join(f"w{(s + 3 * j) % (VOCAB - 2)}" for j in range(8 + s % 5))
             for s in range(40)]
    return datasets.Dataset.from_dict({"text": texts})


def sft_config(output_dir: str):
    return trl.SFTConfig(output_dir=output_dir, per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, max_steps=6, learning_rate=1e-2,
                         lr_scheduler_type="cosine", warmup_steps=2, weight_decay=0.1,
                         max_grad_norm=0.5, adam_epsilon=1e-6, logging_steps=1,
                         save_strategy="no", report_to=[], use_cpu=True, seed=0, bf16=False,
                         max_length=16, disable_tqdm=True)


def test_sft_trainer_through_the_mixin_matches_plain_sft_trainer(tmp_path):
    initial = {k: v.clone() for k, v in tiny("llama").state_dict().items()}
    plain = trl.SFTTrainer(model=tiny("llama"), args=sft_config(str(tmp_path / "plain")),
                           train_dataset=dataset(), processing_class=tokenizer())
    plain.train()
    ours = SFT(model=tiny("llama"), args=sft_config(str(tmp_path / "ours")),
               train_dataset=dataset(), processing_class=tokenizer(),
               infinity_config={"zero": {"stage": 3, "unit_class_names": [UNITS["llama"]],
                                         "unit_min_numel": 1}})
    assert ours.args.gradient_checkpointing  # TRL's default, kept
    ours.train()
    assert_same_run(ours, plain, initial=initial)
