"""The process-group-free parts of tensor parallelism composed with ZeRO: where each tensor rank's
checkpoint lives, plain parameters passing through unchanged, and FSDP2-sharded models refused
(the 4-rank parity tests are in tests/distributed/test_tp_dist.py)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from infinity.zero._collectives import Collectives
from infinity.zero._managed import check_not_wrapped
from infinity.zero._tensor_parallel import (TensorParallel, is_tensor_sharded, local_grad,
                                            local_tensor, tensor_rank_dir)


class _Mesh:
    """The two DeviceMesh calls tensor_rank_dir makes, for tensor rank ``rank`` of ``size``."""

    def __init__(self, rank: int, size: int):
        self.rank, self.n = rank, size

    def get_local_rank(self) -> int:
        return self.rank

    def size(self) -> int:
        return self.n


def _tp(rank: int, size: int = 2) -> TensorParallel:
    return TensorParallel(mesh=_Mesh(rank, size), group=None, collectives=Collectives())


def test_each_tensor_rank_has_its_own_checkpoint_folder():
    root = os.path.join("ckpt", "run")
    assert tensor_rank_dir(_tp(1), root) == os.path.join(root, "tensor-1-of-2")
    # Every rank may pass rank 0's folder, or a step folder inside it: mapped to its own.
    assert tensor_rank_dir(_tp(1), os.path.join(root, "tensor-0-of-2")) == \
        os.path.join(root, "tensor-1-of-2")
    assert tensor_rank_dir(_tp(1), os.path.join(root, "tensor-0-of-2", "step-6")) == \
        os.path.join(root, "tensor-1-of-2", "step-6")
    assert tensor_rank_dir(_tp(0), os.path.join(root, "tensor-0-of-2", "step-6")) == \
        os.path.join(root, "tensor-0-of-2", "step-6")


def test_a_checkpoint_of_another_tensor_size_is_refused():
    with pytest.raises(ValueError, match="tensor-parallel size 4, this model has 2"):
        tensor_rank_dir(_tp(0), os.path.join("ckpt", "tensor-3-of-4"))


def test_plain_parameters_pass_through():
    p = nn.Parameter(torch.ones(3))
    g = torch.full((3,), 2.0)
    assert local_tensor(p) is p
    assert not is_tensor_sharded(p)
    assert local_grad(p, g) is g


def test_a_model_sharded_by_fsdp2_is_refused():
    class FSDPModule:  # FSDP2's fully_shard makes the module's class subclass one of this name
        pass

    class FSDPLinear(FSDPModule, nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(2, 2), FSDPLinear(2, 2))
    with pytest.raises(ValueError, match="already sharded by FSDP2"):
        check_not_wrapped(model)
    check_not_wrapped(nn.Sequential(nn.Linear(2, 2)))
