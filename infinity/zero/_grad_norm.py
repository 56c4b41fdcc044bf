"""The squared L2 norm of a gradient partition, exact enough to clip by, and the global norm: the
sum of these over every partition and rank; the package's one gradient norm."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from infinity.optim import StoredGrad
from infinity.zero._collectives import Phase

_SUM_SQ_CHUNK_NUMEL = 2 ** 18
"""Elements per fp32 dot product in :func:`sum_of_squares` (1 MiB of fp32: stays in cache)."""


def sum_of_squares(g: torch.Tensor) -> torch.Tensor:
    """Sum of squares of ``g`` as an fp64 scalar tensor on ``g``'s device.

    CPU: fp32 dot products over chunks (a low-precision chunk is converted in cache), summed
    in fp64. ``torch.linalg.vector_norm(g, dtype=torch.float32)`` on a CPU bf16 tensor of 39M
    elements (the 135m GPT's embedding gradient) was 0.5 % low and took 67 ms; this is within
    1e-5 of an fp64 reference in 10 ms (2 threads; 18 ms on the 2-core Zen 3 VM, where the CPU
    Adam kernel's fp64 sum it replaced as the second copy of this rule took 23 ms). Other devices
    reduce in a tree: their norm."""
    if g.device.type != "cpu":
        return torch.linalg.vector_norm(g, dtype=torch.float32).double() ** 2
    flat = g.reshape(-1)
    total = 0.0
    for chunk in flat.split(_SUM_SQ_CHUNK_NUMEL):
        c = chunk if chunk.dtype == torch.float32 else chunk.float()
        total += float(torch.dot(c, c))
    return torch.tensor(total, dtype=torch.float64)


def global_norm_sq(grads: Mapping[str, Any], *, sharded_keys: set[str], device: torch.device,
                   collectives: Any | None, tensor_collectives: Any | None,
                   pipeline_collectives: Any | None = None) -> tuple[float, bool]:
    """(the squared global norm of ``grads``, whether it is not finite): the sum of squares over
    the optimizer partitions, summed over ranks by ``collectives`` where they are sharded (None:
    stage 0's partitions are replicated, each rank already holds every gradient once). A
    :class:`~infinity.optim.StoredGrad` brings its own, taken as it was accumulated ([Note:
    gradients on NVMe] in infinity/zero/_grad_reducer.py). With tensor parallelism
    (``tensor_collectives``) the keys in ``sharded_keys`` are summed over the tensor ranks too,
    the others are replicated there ([Note: gradient norm across tensor ranks] in
    infinity/zero/_tensor_parallel.py); without it one value crosses the ranks. With pipeline
    stages (``pipeline_collectives``: this rank's place in every stage) each stage's sum covers
    its own layers, and the stages' sums add up to the model's."""
    total = torch.zeros(1 if tensor_collectives is None else 2, dtype=torch.float64, device=device)
    for key, g in grads.items():
        total[int(key in sharded_keys)] += (g.sum_sq if isinstance(g, StoredGrad)
                                            else sum_of_squares(g))
    if collectives is not None:
        collectives.all_reduce_sum(total, context="global gradient norm", phase=Phase.NORM)
    if tensor_collectives is not None:
        tensor_collectives.all_reduce_sum(total[1:], context="global gradient norm over tensor "
                                          "ranks", phase=Phase.NORM)
    if pipeline_collectives is not None:
        pipeline_collectives.all_reduce_sum(total, context="global gradient norm over pipeline "
                                            "stages", phase=Phase.NORM)
    value = float(total.sum().item())
    return value, not math.isfinite(value)
