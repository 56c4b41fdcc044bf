"""[Note: 16-byte aligned slots] in the engine: odd-sized parameters in fp32 and bf16 get 16-byte
aligned views and shards, the engine's layout is the ledger's, and training still matches plain
PyTorch (the padding between slots stays zero and never reaches the parameters)."""

from __future__ import annotations

import pytest
import torch

import infinity
from infinity.ledger import flat_layout
from infinity.models.gpt import GPTConfig
from tests._support.engine import assert_parity, batches, engine_config, tiny_gpt

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ODD = GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=1, n_embd=13)
"""Every parameter an odd number of elements (13, 169, 61 x 13, ...)."""


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 3])
def test_views_and_shards_are_16_byte_aligned(dtype, stage):
    engine = infinity.initialize(tiny_gpt(config=ODD), engine_config(
        stage=stage, dtype=dtype, persistence_threshold_numel=0))
    groups = [g for u in engine.manager.units for g in u.groups]
    assert groups
    seen = []

    def check_views(module, args):  # after the engine's own pre-hook: the unit is gathered
        for p in module.parameters(recurse=False):
            seen.append(p.data_ptr() % 16)

    for m in engine.module.modules():
        m.register_forward_pre_hook(check_views)
    x, y = batches(1, 1, config=ODD)[0][0]
    engine.backward(engine(x, y))
    assert seen and set(seen) == {0}
    for g in groups:
        item = g.full.element_size()
        lay = flat_layout([s.numel for s in g.slots], 1, item)  # world size 1 here
        assert [s.offset for s in g.slots] == list(lay.offsets)
        assert g.padded_numel == lay.padded_numel and g.shard_numel == lay.shard_numel
        assert g.shard_numel * item % 16 == 0
        for s in g.slots:
            assert s.offset * item % 16 == 0, (g.key, s.name, s.offset)
            if g.full.untyped_storage().size():  # gathered: the parameter is a view of it
                assert s.param.data_ptr() % 16 == 0, (g.key, s.name)
                assert s.param.data_ptr() - g.full.data_ptr() == s.offset * item


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_odd_parameters_train_like_pytorch(dtype):
    assert_parity(lambda: tiny_gpt(config=ODD), stage=3, dtype=dtype, steps=4,
                  data=batches(4, 1, config=ODD), persistence_threshold_numel=0)
