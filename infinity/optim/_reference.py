"""The readable Adam(W) step on flat tensors, and which implementation a device's tensors use.

:func:`adam_step_flat_reference` follows ``torch.optim.AdamW`` step for step (so parity tests
against it are tight); :func:`adam_kernel_for` picks the fused CPU kernel of
:mod:`infinity.optim.cpu_adam` for CPU tensors (same signature, one streaming pass) and the
reference elsewhere.
"""

from __future__ import annotations

import math

import torch

from infinity.optim.cpu_adam import adam_step_flat, rounding_seed, store_stochastic_bf16


def adam_step_flat_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                              exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float,
                              beta2: float, eps: float, weight_decay: float,
                              adamw_mode: bool = True, bias_correction: bool = True,
                              grad_scale: float = 1.0, out: torch.Tensor | None = None,
                              seed: int = 0) -> None:
    """One Adam(W) step on flat tensors, in place, in the order ``torch.optim.AdamW`` uses.

    bf16 moments (``optimizer.state_dtype: bf16``, any device) are updated in fp32 and stored
    with stochastic rounding, as the CPU kernel stores them ([Note: bf16 moments use stochastic
    rounding] in infinity/optim/cpu_adam.py): rounded to nearest, ``exp_avg_sq`` stalls at
    beta2 = 0.999, and a run on a GPU would train differently from the same run on a CPU.
    ``seed`` selects the rounding stream (with ``step``), as the kernel's does."""
    if exp_avg.dtype == torch.bfloat16:
        _step_bf16_moments(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1,
                           beta2=beta2, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
                           bias_correction=bias_correction, grad_scale=grad_scale, out=out,
                           seed=seed)
        return
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


def _step_bf16_moments(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                       exp_avg_sq: torch.Tensor, *, seed: int, **kwargs) -> None:
    """The step on fp32 copies of bf16 moments, stored back with stochastic rounding."""
    m, v = exp_avg.float(), exp_avg_sq.float()
    adam_step_flat_reference(param, grad, m, v, **kwargs)
    gen = torch.Generator(device=param.device).manual_seed(rounding_seed(seed, kwargs["step"]))
    store_stochastic_bf16(exp_avg, m, gen)
    store_stochastic_bf16(exp_avg_sq, v, gen)
