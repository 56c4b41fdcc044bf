"""Fine-tune a small Hugging Face ``transformers`` model on 2 processes with a DeepSpeed-style config.

    pip install transformers          # optional dependency of this example only
    torchrun --nproc_per_node 2 examples/finetune_hf.py --config examples/ds_config.json

No download: on first use rank 0 builds a small Llama from a config with random weights and saves it
(safetensors) under ``--model-dir``; every rank then loads that local copy, as it would a real
checkpoint. The data is generated (a learnable token pattern), so the loss falls within a few dozen
steps. Runs on CPU with gloo, or on GPUs with NCCL when CUDA is present (one GPU per local rank).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import infinity
from infinity import load_config
from infinity.zero import barrier, init_distributed


def make_local_model(model_dir: str) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)


def batches(vocab_size: int, batch_size: int, seq_len: int, *, rank: int, world: int, steps: int):
    for step in range(steps):
        g = torch.Generator().manual_seed(step * world + rank)
        start = torch.randint(0, vocab_size, (batch_size, 1), generator=g)
        tokens = (start + 7 * torch.arange(seq_len).unsqueeze(0)) % vocab_size
        yield tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "ds_config.json"))
    parser.add_argument("--model-dir", default="./infinity-data/tiny-llama")
    parser.add_argument("--steps", type=int, default=40, help="micro-batches per rank")
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()

    # This rank's device first (LOCAL_RANK % GPUs, the engine's rule), then the process group on
    # it (NCCL with device_id on GPUs, gloo on CPU): rank 0 builds the files before the others read.
    device = init_distributed(load_config(args.config).device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rank == 0 and not os.path.exists(os.path.join(args.model_dir, "config.json")):
        make_local_model(args.model_dir)
    barrier(device)

    from transformers import AutoConfig, AutoModelForCausalLM

    # No rank ever holds the whole model: built on meta, materialised unit by unit into this
    # rank's shards, then each rank reads only its partition of the saved weights.
    with infinity.init(args.config):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model_dir))
    engine = infinity.initialize(model)
    engine.load_weights(args.model_dir)
    micro = engine.config.train_micro_batch_size_per_gpu
    micro = micro if isinstance(micro, int) else 2
    for i, tokens in enumerate(batches(model.config.vocab_size, micro, args.seq_len, rank=rank,
                                       world=world, steps=args.steps)):
        out = engine(input_ids=tokens, labels=tokens)  # CPU tensors: the engine moves them
        engine.backward(out.loss)
        engine.step()
        if rank == 0 and (i + 1) % engine.config.gradient_accumulation_steps == 0:
            print(f"step {engine.global_steps:3d}  loss {out.loss.item():.4f}", flush=True)
    stats = engine.stats()
    if rank == 0:
        print(f"done: world size {world}, bytes per tier {stats['bytes']}")
    engine.close()
    if dist.is_initialized():
        dist.destroy_process_group()
        # torch 2.13's gloo aborts now and then while the interpreter finalizes a process whose
        # group was used ("terminate called without an active exception", exit -6), and torchrun
        # reports a failed rank. The work is done and written: leave without finalization, as
        # infinity's own processes do ([Note: gloo teardown at exit] in infinity/_process_exit.py).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
