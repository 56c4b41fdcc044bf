"""The model's buffers: ordinary module buffers, replicated on every rank (DDP's default), never
sharded; the engine moves them to its device once and broadcasts rank 0's before each training
forward."""

from __future__ import annotations

import torch
from torch import nn

from infinity.zero._collectives import Collectives, Phase

__all__ = ["broadcast_buffers", "move_buffers"]


def move_buffers(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Buffers stay ordinary module buffers, replicated: move them to the device and cast floating
    ones to the compute dtype (parameters are handled by the parameter manager)."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is None:
                continue
            target = dtype if buf.is_floating_point() else buf.dtype
            if buf.device != device or buf.dtype != target:
                module._buffers[name] = buf.to(device=device, dtype=target)


def broadcast_buffers(model: nn.Module, collectives: Collectives) -> None:
    """DistributedDataParallel's ``broadcast_buffers``: every training forward on every rank
    starts from rank 0's buffers (BatchNorm running statistics, counters). Not after the
    forward: autograd saved some of them (batch norm's running statistics) and an in-place
    write would fail the backward's version check. So that every rank reports the same
    values, ``full_state_dict`` broadcasts too (checkpoints write rank 0's). One broadcast
    per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buf in model.buffers():
        by_dtype.setdefault(buf.dtype, []).append(buf)
    with torch.no_grad():
        for dtype, bufs in by_dtype.items():
            flat = torch.cat([b.reshape(-1) for b in bufs])
            collectives.broadcast(flat, src=0, context=f"buffers ({dtype})",
                                  phase=Phase.BROADCAST)
            offset = 0
            for b in bufs:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()
