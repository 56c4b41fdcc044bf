"""The default unit choice (issue #15, item 9): with no ``zero.unit_class_names`` the units are the
model's repeated blocks, exactly as if the block class had been named; a model without blocks is
chosen by size; an explicit ``unit_min_numel`` always chooses by size.

The reference for each model is the unit choice with the block class given by hand (what the
tuned benchmarks and the README configure), compared unit by unit: names, parameters, hooks.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib

import pytest
import torch
from torch import nn

from infinity.config import ZeroConfig, load_config
from infinity.models.gpt import GPT, PRESETS
from infinity.models.hf import HF_PRESETS, build_hf
from infinity.zero._unit_choice import (AUTO_UNIT_MIN_NUMEL, UnitChoice, block_class_names,
                                        choose_units, units_of)

transformers = pytest.importorskip("transformers")

THRESHOLD = 40  # persistence: norms and biases of the tiny models go to the persistent unit


def _summary(choice: UnitChoice) -> list[tuple[str, list[str], bool]]:
    return [(u.name, [n for n, _ in u.params], u.persistent) for u in choice.units]


def _hooks(choice: UnitChoice) -> list[tuple[str, list[str]]]:
    return [(name, [choice.units[i].name for i in idx]) for _, name, idx in choice.hooked]


def _assert_same_choice(got: UnitChoice, want: UnitChoice) -> None:
    assert _summary(got) == _summary(want)
    assert _hooks(got) == _hooks(want)
    assert [id(p) for u in got.units for _, p in u.params] == [
        id(p) for u in want.units for _, p in u.params]


def _default(model: nn.Module) -> UnitChoice:
    return units_of(model, ZeroConfig(persistence_threshold_numel=THRESHOLD))


def _by_class(model: nn.Module, *names: str) -> UnitChoice:
    return units_of(model, ZeroConfig(unit_class_names=names,
                                      persistence_threshold_numel=THRESHOLD))


def _tiny_llama(layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))


def _tiny_gpt2() -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=3, n_head=2))


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_gpt_presets_default_is_the_block_choice(preset):
    with torch.device("meta"):  # the large presets: shapes only, no bytes
        model = GPT(PRESETS[preset])
    assert block_class_names(model) == ("Block",)
    got, want = _default(model), _by_class(model, "Block")
    _assert_same_choice(got, want)
    blocks = [u.name for u in got.units if u.name.startswith("blocks.")]
    assert blocks == [f"blocks.{i}" for i in range(PRESETS[preset].n_layer)]


@pytest.mark.parametrize("make, block", [(_tiny_llama, "LlamaDecoderLayer"),
                                         (_tiny_gpt2, "GPT2Block")])
def test_hf_models_default_is_the_decoder_layer_choice(make, block):
    model = make()
    assert block_class_names(model) == (block,)
    got = _default(model)
    _assert_same_choice(got, _by_class(model, block))
    # every decoder layer is its own unit (nothing of the model was skipped)
    assert sum(type(m).__name__ == block for m in model.modules()) == sum(
        1 for _, name, _ in got.hooked if type(model.get_submodule(name)).__name__ == block)


def test_one_layer_llama_uses_no_split_modules():
    model = _tiny_llama(layers=1)  # a stack of one: not repeated, Hugging Face names the class
    assert block_class_names(model) == ("LlamaDecoderLayer",)
    _assert_same_choice(_default(model), _by_class(model, "LlamaDecoderLayer"))


def test_peft_wrapped_llama_finds_the_decoder_layers():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_tiny_llama(), peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8))
    assert block_class_names(model) == ("LlamaDecoderLayer",)
    _assert_same_choice(_default(model), _by_class(model, "LlamaDecoderLayer"))


class _Wide(nn.Module):
    """No repeated blocks: a stack of layers (Linear is not a block) and a head."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(600, 600) for _ in range(3))  # 360600 each
        self.head = nn.Linear(600, 2000)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def test_model_without_blocks_is_chosen_by_size():
    model = _Wide()
    assert block_class_names(model) == ()
    got = _default(model)
    _assert_same_choice(got, choose_units(model, unit_min_numel=AUTO_UNIT_MIN_NUMEL,
                                          persistence_threshold_numel=THRESHOLD))
    # by size at 1e6: the head (1.2e6) is a unit, the three small layers stay with the root
    assert [u.name for u in got.units] == ["<root>", "head"]


def test_explicit_unit_min_numel_chooses_by_size():
    with torch.device("meta"):
        model = GPT(PRESETS["small"])
    got = units_of(model, ZeroConfig(unit_min_numel=200_000, persistence_threshold_numel=THRESHOLD))
    _assert_same_choice(got, choose_units(model, unit_min_numel=200_000,
                                          persistence_threshold_numel=THRESHOLD))
    names = [u.name for u in got.units]
    assert "blocks.0.mlp.fc" in names and "blocks.0" not in names  # not the blocks


def test_deepspeed_granularity_threshold_maps_to_by_size():
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    assert load_config(ds).zero.unit_min_numel == "auto"  # a plain DeepSpeed config: blocks
    ds["zero_optimization"]["stage3_module_granularity_threshold"] = 0  # DeepSpeed's "off"
    assert load_config(ds).zero.unit_min_numel == "auto"
    ds["zero_optimization"]["stage3_module_granularity_threshold"] = 5000
    assert load_config(ds).zero.unit_min_numel == 5000
    with pytest.raises(ValueError, match="zero.unit_min_numel"):
        ZeroConfig(unit_min_numel="big")


class _Expert(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _MoEBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.experts = nn.ModuleList(_Expert(d) for _ in range(4))

    def forward(self, x):
        x = x + self.attn(x)
        return x + sum(e(x) for e in self.experts)


class _MambaLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.mix, self.out = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.out(self.mix(x))


class _Hybrid(nn.Module):
    """torchtitan's ModuleDict of layers, two layer classes, experts inside the MoE blocks."""

    def __init__(self, d=16):
        super().__init__()
        self.embed = nn.Embedding(32, d)
        self.layers = nn.ModuleDict({"0": _MambaLayer(d), "1": _MoEBlock(d),
                                     "2": _MambaLayer(d), "3": _MoEBlock(d)})

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers.values():
            x = layer(x)
        return x


def test_stacks_inside_blocks_stay_in_their_block_and_hybrid_stacks_give_both_classes():
    model = _Hybrid()
    assert block_class_names(model) == ("_MambaLayer", "_MoEBlock")
    got = _default(model)
    _assert_same_choice(got, _by_class(model, "_MambaLayer", "_MoEBlock"))
    assert [u.name for u in got.units] == ["<persistent>", "<root>", "layers.0", "layers.1",
                                           "layers.2", "layers.3"]  # no expert is a unit


def test_sequential_stack_of_blocks():
    with torch.device("meta"):
        blocks = GPT(PRESETS["tiny"]).blocks
    model = nn.Sequential(*blocks)
    assert block_class_names(model) == ("Block",)
    assert [u.name for u in _default(model).units][-2:] == ["0", "1"]


def test_the_choice_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="infinity.zero._unit_choice"):
        _default(_tiny_gpt2())
    assert "GPT2Block" in caplog.text and "unit_class_names" in caplog.text


DS_ZERO3 = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "ds_zero3.json"
"""The plain DeepSpeed ZeRO-3 file ``infinity bench step --ds-config`` measures (issue #15)."""


@pytest.mark.filterwarnings("ignore:DeepSpeed key")  # the file's overlap_comm etc.: no effect here
@pytest.mark.parametrize("name", sorted(HF_PRESETS))
def test_bench_hf_presets_under_the_plain_ds_config_are_the_native_choice(name):
    """The bench's Hugging Face models at their measured sizes (on meta: shapes only) under the
    shipped DeepSpeed file: the same units as the tuned native config naming the block class,
    with the file's own persistence and size settings (not the tests' threshold)."""
    preset = HF_PRESETS[name]
    with torch.device("meta"):
        model = build_hf(name)
    zero = load_config(str(DS_ZERO3)).zero
    got = units_of(model, zero)
    want = units_of(model, dataclasses.replace(zero, unit_class_names=(preset.block_class_name,)))
    _assert_same_choice(got, want)
    layers = preset.config["num_hidden_layers" if preset.arch == "llama" else "n_layer"]
    blocks = [n for _, n, _ in got.hooked
              if type(model.get_submodule(n)).__name__ == preset.block_class_name]
    assert len(blocks) == layers and len([u for u in got.units if u.name in blocks]) == layers
