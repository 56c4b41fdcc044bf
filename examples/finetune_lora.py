"""LoRA fine-tuning with peft through the engine: the frozen base on NVMe, the adapters and their
optimizer in memory, the adapter saved in peft's format.

    pip install 'infinity[hf]'                  # transformers + peft
    python examples/finetune_lora.py            # a small Llama, ~10 s here
    python examples/finetune_lora.py --shape 7b --dtype bf16 --steps 4 --nvme-dir /local/nvme
    python examples/finetune_lora.py --trainer  # the same through transformers.Trainer

No download. The small shape first saves a randomly initialised base model (safetensors) under
``--base-dir``, as a stand-in for a real checkpoint; the run then builds the model on the meta device
under ``infinity.init`` (LoRA included), materialises it unit by unit into NVMe-homed shards, loads
the base weights by byte range (``load_base_weights``), trains the adapters, saves them with
``save_adapter`` and checks that ``PeftModel.from_pretrained`` on a plain copy of the base gives the
engine's outputs. ``--trainer`` runs the training and the adapter save through
:class:`infinity.integrations.hf.InfinityTrainer` (TrainingArguments drive batch, steps, lr,
clipping, bf16, logging; ``trainer.save_model`` writes peft's adapter files). ``--shape 7b`` builds Llama-2-7B's shape with random weights (13.5 GB of bf16 base
on NVMe; pass ``--base-dir`` of a local checkpoint of that shape to load it instead).
"""

from __future__ import annotations

import argparse
import os

import torch

import infinity

SHAPES = {
    "tiny": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=256, max_position_embeddings=256),
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
               max_position_embeddings=4096),
    # Llama-2-7B's decoder layer, 8 of them: the 7B scenario's per-unit traffic in a quarter of
    # the time and disk (with a host budget below the base, as at 7B, every unit streams).
    "7b-8l": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=8,
                  num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                  max_position_embeddings=4096),
}


DEFAULTS = {"tiny": dict(batch_size=4, seq_len=64, lr=1e-2),
            "7b": dict(batch_size=1, seq_len=128, lr=2e-4),
            "7b-8l": dict(batch_size=1, seq_len=128, lr=2e-4)}
"""Per shape: a quick demonstration, and issue #16's scenario (batch 1 x 128)."""


def engine_config(args: argparse.Namespace) -> dict:
    return {
        "zero": {"stage": 3, "unit_class_names": ["LlamaDecoderLayer"]},
        "precision": {"dtype": args.dtype},
        "optimizer": {"type": "adamw", "lr": args.lr, "weight_decay": 0.0},
        "offload_param": {"device": "nvme", "nvme_path": args.nvme_dir},  # the frozen base
        "gradient_clipping": 1.0,
    }


def batches(vocab_size: int, batch_size: int, seq_len: int, steps: int):
    """A pattern rank-16 adapters can learn: each row counts up by 7 modulo 16 from a random
    start (16 tokens of the vocabulary)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        start = torch.randint(0, 16, (batch_size, 1), generator=g)
        yield (start + 7 * torch.arange(seq_len)) % min(16, vocab_size)


class _Rows(torch.utils.data.Dataset):
    """The rows of :func:`batches` as a dataset, for the Trainer (its sampler: no shuffle)."""

    def __init__(self, vocab_size: int, seq_len: int, num_rows: int):
        rows = torch.cat(list(batches(vocab_size, 1, seq_len, num_rows)))
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def train_with_trainer(model, args: argparse.Namespace, vocab_size: int, base_dir: str | None):
    """InfinityTrainer over the model built under infinity.init; the base weights are loaded
    into the engine's shards once the Trainer has built it (at the first step's start)."""
    from transformers import TrainerCallback, TrainingArguments

    from infinity.integrations.hf import InfinityTrainer
    from infinity.integrations.peft import load_base_weights

    class LoadBase(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kwargs):
            if base_dir is not None and state.global_step == 0:
                load_base_weights(trainer.engine, base_dir)

    targs = TrainingArguments(
        output_dir=os.path.join(args.out, "trainer"), per_device_train_batch_size=args.batch_size,
        max_steps=args.steps, learning_rate=args.lr, weight_decay=0.0, max_grad_norm=1.0,
        lr_scheduler_type="constant", bf16=args.dtype == "bf16", logging_steps=5,
        save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
        dataloader_drop_last=True)
    config = engine_config(args) | {"optimizer": {"type": "adamw", "lr": "auto",
                                                  "weight_decay": "auto"}}
    trainer = InfinityTrainer(model=model, args=targs, infinity_config=config,
                              train_dataset=_Rows(vocab_size, args.seq_len,
                                                  args.steps * args.batch_size),
                              callbacks=[LoadBase()])
    trainer.train()
    trainer.save_model(args.out)  # a peft model: its adapter files, in peft's format
    return trainer.engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--base-dir", default=None,
                        help="base model checkpoint (default for --shape tiny: "
                             "./infinity-data/tiny-llama-base, made on first use)")
    parser.add_argument("--nvme-dir", default="./infinity-data/swap")
    parser.add_argument("--out", default="./infinity-data/lora-adapter")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=None, help="tiny: 4, 7b: 1")
    parser.add_argument("--seq-len", type=int, default=None, help="tiny: 64, 7b: 128")
    parser.add_argument("--lr", type=float, default=None, help="tiny: 1e-2, 7b: 2e-4")
    parser.add_argument("--trainer", action="store_true",
                        help="train and save through transformers.Trainer (InfinityTrainer)")
    args = parser.parse_args()
    for name, value in DEFAULTS[args.shape].items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from infinity.integrations.peft import load_base_weights, save_adapter

    llama = LlamaConfig(**SHAPES[args.shape])
    base_dir = args.base_dir
    if base_dir is None and args.shape == "tiny":
        base_dir = "./infinity-data/tiny-llama-base"
        if not os.path.exists(os.path.join(base_dir, "config.json")):
            torch.manual_seed(1)
            LlamaForCausalLM(llama).save_pretrained(base_dir)
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])

    torch.manual_seed(0)
    with infinity.init(engine_config(args)):  # no tensor of the base is ever whole in memory
        model = LlamaForCausalLM(llama)
    model = get_peft_model(model, lora)  # after the block, as recipes write it: the adapters keep
    #                                      the values peft gives them (infinity/zero/_lazy.py)
    model.print_trainable_parameters()
    if args.trainer:
        engine = train_with_trainer(model, args, llama.vocab_size, base_dir)
        print(f"adapter saved to {args.out}: {sorted(os.listdir(args.out))}")
        check_against_plain(engine, args, llama, base_dir)
        engine.close()
        return
    engine = infinity.initialize(model)
    if base_dir is not None:
        load_base_weights(engine, base_dir)

    before = engine.stats()["bytes_moved"]
    for step, tokens in enumerate(batches(llama.vocab_size, args.batch_size, args.seq_len,
                                          args.steps), 1):
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        if step % 5 == 0 or step == args.steps:
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    stats = engine.stats()
    per_step = {k: (stats["bytes_moved"][k] - before[k]) / args.steps / 2**20
                for k in ("NVME->HOST", "HOST->NVME")}
    print(f"optimizer state {stats['model_state_bytes']['optimizer_state'] / 2**20:.2f} MiB "
          f"(adapters only), NVMe {stats['bytes']['NVME']['current'] / 2**20:.1f} MiB, per step "
          f"read {per_step['NVME->HOST']:.1f} MiB / written {per_step['HOST->NVME']:.2f} MiB")

    save_adapter(engine, args.out)
    print(f"adapter saved to {args.out}: {sorted(os.listdir(args.out))}")
    check_against_plain(engine, args, llama, base_dir)
    engine.close()


def check_against_plain(engine, args: argparse.Namespace, llama, base_dir: str | None) -> None:
    """The saved adapter on a plain copy of the base gives the engine's logits (tiny shape)."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    if base_dir is None or args.shape != "tiny":
        return
    probe = next(batches(llama.vocab_size, 2, 32, 1))
    with torch.no_grad():
        want = engine(input_ids=probe).logits.float()
    plain = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base_dir), args.out)
    with torch.no_grad():
        got = plain(input_ids=probe).logits
    print(f"PeftModel.from_pretrained on a plain base: max |logits - engine's| = "
          f"{(got - want).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
