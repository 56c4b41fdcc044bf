"""The readable Adam(W) step on flat tensors, and which implementation a device's tensors use.

:func:`adam_step_flat_reference` follows ``torch.optim.AdamW`` step for step (so parity tests
against it are tight); :func:`adam_kernel_for` picks the fused CPU kernel of
:mod:`infinity.optim.cpu_adam` for CPU tensors (same signature, one streaming pass) and the
reference elsewhere.
"""

from __future__ import annotations

import math

import torch

from infinity.optim.cpu_adam import adam_step_flat


def adam_step_flat_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                              exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float,
                              beta2: float, eps: float, weight_decay: float,
                              adamw_mode: bool = True, bias_correction: bool = True,
                              grad_scale: float = 1.0, out: torch.Tensor | None = None) -> None:
    """One Adam(W) step on flat tensors, in place, in the order ``torch.optim.AdamW`` uses."""
    g = grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    if weight_decay:
        if adamw_mode:
            param.mul_(1.0 - lr * weight_decay)
        else:
            g = g.add(param, alpha=weight_decay)
    exp_avg.lerp_(g.to(exp_avg.dtype), 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    bc1 = 1.0 - beta1 ** step if bias_correction else 1.0
    bc2 = 1.0 - beta2 ** step if bias_correction else 1.0
    denom = (exp_avg_sq.float().sqrt() / math.sqrt(bc2)).add_(eps)
    param.addcdiv_(exp_avg.float(), denom, value=-lr / bc1)
    if out is not None:
        out.copy_(param)


def adam_kernel_for(device: torch.device):
    """The CPU kernel of :mod:`infinity.optim.cpu_adam` for CPU tensors, the reference elsewhere
    (same signature)."""
    return adam_step_flat if device.type == "cpu" else adam_step_flat_reference
