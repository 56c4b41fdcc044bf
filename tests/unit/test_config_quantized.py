"""The ZeRO++ quantization fields of ZeroConfig (issue #17, part 3): validation and DeepSpeed's keys."""

from __future__ import annotations

import warnings

import pytest

from infinity.config import load_config
from infinity.config._deepspeed import config_to_deepspeed
from infinity.config._sections import ZeroConfig
from infinity.zero._quantize import QuantPolicy, QuantSpec, quant_policy


def test_defaults_are_off_with_2048_element_blocks_and_int8_gradients():
    z = ZeroConfig()
    assert (z.quantized_weights, z.quantized_frozen_weights, z.quantized_gradients) == (
        False, False, False)
    assert (z.quantization_block_numel, z.quantized_gradient_bits) == (2048, 8)
    assert quant_policy(z) == QuantPolicy(weights=None, frozen_only=False, gradients=None)


@pytest.mark.parametrize("kwargs, message", [
    (dict(quantized_gradient_bits=2), "zero.quantized_gradient_bits: expected 8 or 4"),
    (dict(quantized_gradient_bits=True), "zero.quantized_gradient_bits"),
    (dict(quantization_block_numel=0), "zero.quantization_block_numel"),
    (dict(quantized_weights=1), "zero.quantized_weights: expected true or false"),
    (dict(stage=1, quantized_gradients=True), "zero.quantized_gradients.*stage to 2 or 3"),
])
def test_invalid_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ZeroConfig(**kwargs)


def test_quantized_weights_below_stage_3_warn_that_they_do_nothing():
    with pytest.warns(UserWarning, match="no effect at stage 2"):
        ZeroConfig(stage=2, quantized_weights=True)


def test_native_settings_resolve_to_specs():
    z = ZeroConfig(quantized_weights=True, quantized_gradients=True, quantized_gradient_bits=4,
                   quantization_block_numel=512)
    policy = quant_policy(z)
    assert policy == QuantPolicy(weights=QuantSpec(bits=8, block_numel=512), frozen_only=False,
                                 gradients=QuantSpec(bits=4, block_numel=512))
    assert policy.quantizes_gather(True) == policy.quantizes_gather(False) == policy.weights
    frozen = quant_policy(ZeroConfig(quantized_frozen_weights=True))
    assert frozen.weights == QuantSpec(bits=8, block_numel=2048) and frozen.frozen_only is True
    # frozen groups' gathers quantize, trained ones' stay exact
    assert frozen.quantizes_gather(False) == frozen.weights and frozen.quantizes_gather(True) is None
    both = quant_policy(ZeroConfig(quantized_frozen_weights=True, quantized_weights=True))
    assert both.frozen_only is False  # all weights include the frozen ones


def test_native_config_loads_the_fields():
    config = load_config({"zero": {"stage": 3, "quantized_weights": True,
                                   "quantized_gradients": True, "quantized_gradient_bits": 4,
                                   "quantization_block_numel": 1024}})
    z = config.zero
    assert (z.quantized_weights, z.quantized_gradients, z.quantized_gradient_bits,
            z.quantization_block_numel) == (True, True, 4, 1024)


def test_deepspeed_keys_map_onto_the_native_fields():
    z = load_config({"zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                           "zero_quantized_gradients": True}}).zero
    # DeepSpeed's qgZ reduces in int4 (runtime/comm/coalesced_collectives.py), so its key does.
    assert (z.quantized_weights, z.quantized_frozen_weights, z.quantized_gradients,
            z.quantized_gradient_bits) == (True, False, True, 4)
    z = load_config({"zero_optimization": {
        "stage": 3, "zero_quantized_nontrainable_weights": True}}).zero
    assert (z.quantized_weights, z.quantized_frozen_weights, z.quantized_gradients) == (
        False, True, False)
    z = load_config({"zero_optimization": {"stage": 3, "zero_quantized_weights": False,
                                           "zero_quantized_gradients": False}}).zero
    assert (z.quantized_weights, z.quantized_gradients, z.quantized_gradient_bits) == (
        False, False, 8)


def test_deepspeed_quantized_gradients_below_stage_2_are_refused():
    with pytest.raises(ValueError, match="zero.quantized_gradients"):
        load_config({"zero_optimization": {"stage": 1, "zero_quantized_gradients": True}})


def test_the_deepspeed_form_round_trips():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = load_config({"zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                                    "zero_quantized_gradients": True}})
        ds = config_to_deepspeed(config)["zero_optimization"]
    assert ds["zero_quantized_weights"] is True and ds["zero_quantized_gradients"] is True
    assert load_config({"zero_optimization": ds}).zero == config.zero


def test_reduce_dtype_compute_under_quantized_gradients_warns_that_it_does_nothing():
    from infinity.config._sections import PrecisionConfig

    with pytest.warns(UserWarning, match="reduce_dtype 'compute' has no effect"):
        quant_policy(ZeroConfig(quantized_gradients=True),
                       PrecisionConfig(dtype="bf16", reduce_dtype="compute"))
