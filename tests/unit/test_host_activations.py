"""[Note: activations on the host] (infinity/zero/_activations.py): the saved inputs of checkpointed
regions in host memory are counted, live and peak, and come back with the same values.

On this CPU-only machine ``always_copy`` runs the GPU path's bookkeeping: every saved tensor is
copied into its own host buffer, as a GPU's would be. ``save_on_cpu`` (the old path) counted
nothing. Which copies are non-blocking and which event the copy back waits on only a GPU can show
(tests/gpu/test_activations_cuda.py).
"""

from __future__ import annotations

import gc

import torch
from torch.utils.checkpoint import checkpoint

from infinity.zero._activations import HostActivations


def _layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w) @ w.t()


def test_saved_bytes_are_counted_while_alive_and_released_after_backward():
    torch.manual_seed(0)
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(8, 32, requires_grad=True)
    host = HostActivations(always_copy=True)
    with host.hooks():
        y = checkpoint(_layer, x, w, use_reentrant=False)
    # Non-reentrant checkpoint saves the region's inputs: x (8 x 32) and w (32 x 32), fp32.
    assert host.live_bytes == (8 * 32 + 32 * 32) * 4
    y.sum().backward()
    del y
    gc.collect()
    assert host.live_bytes == 0
    assert host.peak_bytes >= (8 * 32 + 32 * 32) * 4
    # Same gradients as without the offload (the values came back intact).
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    checkpoint(_layer, x, w, use_reentrant=False).sum().backward()
    assert torch.equal(gx, x.grad) and torch.equal(gw, w.grad)


def test_peak_follows_the_layers_kept_at_once():
    torch.manual_seed(0)
    ws = [torch.randn(16, 16, requires_grad=True) for _ in range(4)]
    x = torch.randn(4, 16, requires_grad=True)
    host = HostActivations(always_copy=True)
    with host.hooks():
        h = x
        for w in ws:
            h = checkpoint(_layer, h, w, use_reentrant=False)
    per_layer = (4 * 16 + 16 * 16) * 4
    assert host.live_bytes == host.peak_bytes == 4 * per_layer
    h.sum().backward()
    del h
    gc.collect()
    assert host.live_bytes == 0 and host.peak_bytes == 4 * per_layer
    host.reset_peak()
    assert host.peak_bytes == 0


def test_cpu_tensors_stay_where_they_are_by_default():
    host = HostActivations()
    t = torch.randn(3)
    assert host.unpack(host.pack(t)) is t and host.live_bytes == 0
