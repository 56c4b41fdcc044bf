"""``infinity train --activations``: which checkpointing and offload the flag asks of the engine,
and 'auto''s choice against the ledger's activations without checkpointing (Korthikanti et al.
2022: 34sbh per layer in 16-bit with SDPA, which keeps no attention scores, plus the head) and the
device's room."""

from __future__ import annotations

import argparse

import pytest

import infinity.cli._train as train
from infinity.models.gpt import PRESETS


def _args(**kw) -> argparse.Namespace:
    """The flags' defaults, ``--dtype`` resolved to bf16 as run() resolves 'auto' first (the
    16-bit terms below)."""
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args(["--dtype", "bf16"])
    for k, v in kw.items():
        setattr(args, k, v)
    args.gpt_config = PRESETS[args.model]
    return args


@pytest.mark.parametrize("flag, offload", [("none", None), ("device", "none"), ("host", "host"),
                                           ("nvme", "nvme")])
def test_the_flag_names_the_offload(flag, offload):
    assert train._activation_offload(_args(activations=flag)) == offload


def test_auto_offloads_where_the_plain_activations_pass_the_device_room(monkeypatch):
    demo = PRESETS["demo"]  # 8 layers, h = 512, 8 heads, vocabulary 256
    s, b, h = 128, 4, demo.n_embd
    plain = (demo.n_layer * s * b * h * 34  # 16-bit layer terms (SDPA: no scores kept)
             + 4 * s * b * h + 4 * s * b * demo.vocab_size)  # head inputs, fp32 logits
    monkeypatch.setattr(train, "device_activation_room_bytes", lambda: int(plain) + 1)
    assert train._activation_offload(_args(seq_len=s, batch_size=b)) is None
    monkeypatch.setattr(train, "device_activation_room_bytes", lambda: int(plain) - 1)
    assert train._activation_offload(_args(seq_len=s, batch_size=b)) == "auto"
