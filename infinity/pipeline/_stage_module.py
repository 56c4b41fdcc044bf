"""The stage ``torch.distributed.pipelining`` runs: a module over the stage's engine, and the
count of the activation bytes the stage sends and receives."""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.utils._pytree import tree_leaves, tree_map

logger = logging.getLogger(__name__)

__all__ = ["CountingStage", "P2PCounts", "StageModule", "meta_copy"]


class P2PCounts:
    """Activation bytes one stage sent to and received from its neighbours (forward activations
    and their gradients), counted from the point-to-point operations the schedule issues, in
    all and by neighbour ("prev": the stage before, "next": the one after)."""

    def __init__(self) -> None:
        self.by_neighbour: dict[str, int] = {"send_bytes_prev": 0, "send_bytes_next": 0,
                                             "recv_bytes_prev": 0, "recv_bytes_next": 0}
        """Bytes by direction and neighbour: a first stage's ``_prev`` stay 0, a last stage's
        ``_next``."""

    def add(self, ops: list[dist.P2POp], neighbour: str) -> list[dist.P2POp]:
        for op in ops:
            kind = "send" if op.op is dist.isend else "recv"
            nbytes = op.tensor.numel() * op.tensor.element_size()
            self.by_neighbour[f"{kind}_bytes_{neighbour}"] += nbytes
        return ops

    def as_dict(self) -> dict[str, int]:
        n = self.by_neighbour
        return {"send_bytes": n["send_bytes_prev"] + n["send_bytes_next"],
                "recv_bytes": n["recv_bytes_prev"] + n["recv_bytes_next"], **n}


def meta_copy(module: nn.Module) -> nn.Module:
    """``module``'s structure with every parameter and buffer on the meta device (no bytes
    copied: the copy's tensors are made directly on meta)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"),
                                   requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


class StageModule(nn.Module):
    """Runs ``engine(*args)`` for the schedule (the engine is not a module: ``PipelineStage``
    wants one). The parameters it shows are the engine's module's; nothing of the schedule
    that walks them changes them (its own gradient scaling is off: the engine's shards hold the
    gradients).

    [Note: the stage's shapes from a meta copy]
    On its first step the schedule learns each stage's output shapes by running the stage once
    outside its micro-batches, on empty tensors, and differentiates that run's outputs with
    respect to its inputs for the gradients' shapes. Through the engine that run would gather
    (and, offloaded, read from NVMe) the whole stage twice, and the last stage's loss function
    would see garbage. A forward outside a micro-batch (``in_micro_batch`` False) runs instead a
    copy of the stage's modules on the meta device (built before the engine, no bytes) and
    returns zero tensors of the outputs' shapes, dtypes and ``requires_grad``; the gradients'
    shapes follow from the inputs' (the schedule derives them when nothing connects the two).
    A model whose forward cannot run on meta runs that pass through the engine after all (its
    outputs are still the shape pass's: the loss function's call on them is not a micro-batch's
    loss)."""

    def __init__(self, engine: Any, shape_module: nn.Module | None, *, chunk: int | None = None):
        """``chunk``: with interleaving, which of the rank's chunks this runs (the engine's
        module is a :class:`~infinity.pipeline._engine.RankChunks`); None: the whole module."""
        super().__init__()
        self.inner = engine.module
        self._engine = engine
        self._chunk = chunk
        self._shape_module = shape_module
        self.in_micro_batch = False
        """Set by :class:`CountingStage` around the forwards of the schedule's micro-batches."""
        self._shape_outputs: list[torch.Tensor] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.in_micro_batch:
            return self._run(*args, **kwargs)
        out = self._shapes(*args, **kwargs)
        self._shape_outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out

    def _shapes(self, *args: Any, **kwargs: Any) -> Any:
        """The shape pass's outputs: zeros shaped by the meta copy, or the engine's forward
        where the meta copy cannot run (a traced stage's graph names its device)."""
        if self._shape_module is not None:
            try:
                out = self._shape_module(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
            except (NotImplementedError, RuntimeError) as e:
                logger.info("pipeline: the stage's forward does not run on meta tensors (%s); "
                            "its shapes come from a forward through the engine", e)
                self._shape_module = None
            else:
                device = self._engine.device
                return tree_map(lambda t: _zeros_like_meta(t, device)
                                if isinstance(t, torch.Tensor) else t, out)
        return self._run(*args, **kwargs)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        if self._chunk is None:
            return self._engine(*args, **kwargs)
        return self._engine(self._chunk, *args, **kwargs)

    def is_shape_output(self, value: Any) -> bool:
        """``value`` came from the shape-only pass (the loss function's call on it is not a
        micro-batch's loss)."""
        leaves = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        return bool(leaves) and all(any(t is s for s in self._shape_outputs) for t in leaves)


def _to_meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def _zeros_like_meta(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    out = torch.zeros(t.shape, dtype=t.dtype, device=device)
    return out.requires_grad_(True) if t.requires_grad and t.is_floating_point() else out


class CountingStage(PipelineStage):
    """A ``PipelineStage`` that counts the bytes of the sends and receives it issues (the
    forward's activations and the backward's gradients; the first step's shape inference sends
    metadata objects, not counted)."""

    def __init__(self, module: StageModule, *args: Any, counts: P2PCounts | None = None,
                 **kwargs: Any):
        super().__init__(module, *args, **kwargs)
        self.p2p = P2PCounts() if counts is None else counts
        self._stage_module = module

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        """A micro-batch's forward ([Note: the stage's shapes from a meta copy])."""
        self._stage_module.in_micro_batch = True
        try:
            return super().forward_maybe_with_nosync(*args, **kwargs)
        finally:
            self._stage_module.in_micro_batch = False

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self.p2p.add(super().get_fwd_recv_ops(fwd_chunk_id), "prev")

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self.p2p.add(super().get_bwd_recv_ops(bwd_chunk_id), "next")

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self.p2p.add(super().get_fwd_send_ops(fwd_chunk_id), "next")

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self.p2p.add(super().get_bwd_send_ops(bwd_chunk_id), "prev")
