"""The vectorized CPU Adam (the design card's ``infinity.cpu_adam``).

- :func:`adam_step_flat`: one fused streaming pass of Adam/AdamW over flat fp32 tensors (master,
  gradient, both moments; bf16 moments rounded stochastically), writing the low-precision
  parameter copy in the same pass; compiled from ``infinity/optim/csrc/cpu_adam.cpp``, with a
  torch fallback of the same math (:func:`backend` says which runs).
- :class:`CPUAdam`: a drop-in ``torch.optim.Optimizer`` over the same kernel, for parameters in
  host memory.

The public face of :mod:`infinity.optim.cpu_adam`; the engine's offloaded optimizer
(:mod:`infinity.optim`) steps its sub-groups with the same kernel.
"""

from infinity.optim.cpu_adam import CPUAdam, adam_step_flat, backend

__all__ = ["CPUAdam", "adam_step_flat", "backend"]
