"""The design card's modules (issue #32 item 1): ``infinity.tiers``, ``infinity.swapper``,
``infinity.prefetch``, ``infinity.cpu_adam`` and ``infinity.stage3`` import, and each is the public
face of the package that holds the code: its nouns are the very objects of that package (no
second copy), none of its names is private, and each does its job when used through it alone."""

from __future__ import annotations

import importlib

import pytest
import torch

CARD = ("infinity.tiers", "infinity.swapper", "infinity.prefetch", "infinity.cpu_adam",
        "infinity.stage3")


@pytest.mark.parametrize("name", CARD)
def test_card_module_imports_with_public_names_only(name):
    module = importlib.import_module(name)
    assert module.__doc__ and module.__all__
    assert not [n for n in module.__all__ if n.startswith("_")]
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, missing


def test_card_nouns_are_the_holding_packages_objects():
    import infinity
    import infinity.cpu_adam
    import infinity.io
    import infinity.optim.cpu_adam
    import infinity.stage3
    import infinity.swapper
    import infinity.zero

    assert infinity.swapper.Swapper is infinity.io.Swapper
    assert infinity.swapper.SwapHandle is infinity.io.SwapHandle
    assert infinity.cpu_adam.CPUAdam is infinity.optim.cpu_adam.CPUAdam
    assert infinity.cpu_adam.adam_step_flat is infinity.optim.cpu_adam.adam_step_flat
    assert infinity.stage3.initialize is infinity.initialize is infinity.zero.initialize
    assert infinity.stage3.init is infinity.init


def test_swapper_round_trip_through_the_card_module(tmp_path):
    from infinity.swapper import Swapper, SwapperConfig, aligned_empty

    values = torch.randn(100_003, generator=torch.Generator().manual_seed(0))
    with_tail = aligned_empty(values.numel(), torch.float32)
    with_tail.copy_(values)
    swapper = Swapper(tmp_path, SwapperConfig(block_size_bytes=64 * 1024))
    try:
        swapper.swap_out("w", with_tail).wait()
        assert swapper.keys() == ["w"]
        back = aligned_empty(values.numel(), torch.float32)
        swapper.swap_in("w", back).wait()
        assert torch.equal(back, values)
    finally:
        swapper.close()


def test_cpu_adam_from_the_card_module_steps_like_torch_adamw():
    from infinity.cpu_adam import CPUAdam

    torch.manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(1000))
    ref = torch.nn.Parameter(ours.detach().clone())
    opt = CPUAdam([ours], lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1)
    for step in range(5):
        grad = torch.randn(1000, generator=torch.Generator().manual_seed(step))
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-5, atol=1e-6)


def test_stage3_engine_from_the_card_module_gathers_and_releases_units():
    from infinity.stage3 import ParameterManager, UnitState, UnitUse, initialize
    from tests._support.engine import (assert_close_run, batches, engine_config, engine_train,
                                       reference_train, tiny_gpt)

    data = batches(3, 1)
    ref_losses, ref_state = reference_train(tiny_gpt(), data)
    engine = initialize(tiny_gpt(), engine_config(stage=3))
    try:
        assert isinstance(engine.manager, ParameterManager)
        losses = engine_train(engine, data)
        on_demand = [u for u in engine.manager.units if u.use is not UnitUse.PINNED]
        assert on_demand and all(u.state is UnitState.RELEASED for u in on_demand)
        assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    finally:
        engine.close()
