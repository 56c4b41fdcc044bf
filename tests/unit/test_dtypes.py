"""One place turns dtype names into torch dtypes (infinity/_dtypes.py): the config's precision
names, and torch's own names as files and keys record them."""

from __future__ import annotations

import pytest
import torch

from infinity._dtypes import PRECISION_DTYPES, from_torch_name, torch_dtype, torch_name
from infinity.config import DTYPE_BYTES, PrecisionConfig


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16"])
def test_every_precision_name_has_one_dtype_whose_size_the_config_states(name):
    PrecisionConfig(dtype=name)  # a name the config accepts
    assert torch_dtype(name) is {"fp32": torch.float32, "bf16": torch.bfloat16,
                                 "fp16": torch.float16}[name]
    assert torch_dtype(name).itemsize == DTYPE_BYTES[name]
    assert set(PRECISION_DTYPES) == set(DTYPE_BYTES)


def test_torch_names_round_trip_and_refuse_what_no_file_holds():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool):
        assert torch_name(dtype) == str(dtype).split(".")[-1]
        assert from_torch_name(torch_name(dtype)) is dtype
    with pytest.raises(ValueError, match="'complex64'"):
        from_torch_name("complex64")
    with pytest.raises(ValueError, match="'half'"):
        torch_dtype("half")
