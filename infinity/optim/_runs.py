"""Runs: the slices of a key's flat partition that one Adam kernel call updates.

[Note: runs of a flat partition]
A flat partition holds the parameters of one unit flat group, which may belong to several
parameter groups (a block's weights decay, its biases and norms do not) and may have different
step counts (a parameter without a gradient in a step is not updated, so its bias correction
lags). The engine cuts each key's partition into :class:`AdamRun` s: maximal contiguous slices
whose parameters share the hyperparameters and the step number, in order, leaving out what is not
updated this step. The fused kernel takes its scalars per call, so one call per run (per
sub-group it intersects, offloaded) is the whole cost: with one group and every parameter used, a
key is one run and a sub-group one call, as before. The flat group's zero padding after its last
parameter joins the last run when that one is updated (Adam keeps zeros at zero: zero gradient,
moments and value), so that a key whose every parameter is updated is covered end to end and its
parameter partition can be overwritten without being read first.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import torch

from infinity.optim._reference import adam_kernel_for


@dataclasses.dataclass(frozen=True)
class Hyperparameters:
    """One parameter group's Adam hyperparameters as plain floats, read at a step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


@dataclasses.dataclass(frozen=True)
class AdamRun:
    """``[lo, hi)`` of a key's partition, updated by one kernel call at Adam step ``step``
    (the 1-based count after this update, for bias correction) with ``hyper``."""

    lo: int
    hi: int
    step: int
    hyper: Hyperparameters


def merge_runs(pieces: Iterable[AdamRun]) -> tuple[AdamRun, ...]:
    """``pieces`` in order, adjacent ones with the same step and hyperparameters merged."""
    out: list[AdamRun] = []
    for piece in pieces:
        if piece.hi <= piece.lo:
            continue
        last = out[-1] if out else None
        if (last is not None and last.hi == piece.lo and last.step == piece.step
                and last.hyper == piece.hyper):
            out[-1] = dataclasses.replace(last, hi=piece.hi)
        else:
            out.append(piece)
    return tuple(out)


def covers(runs: Sequence[AdamRun], numel: int) -> bool:
    """The runs update every element of ``[0, numel)`` (merged runs: contiguous from 0)."""
    pos = 0
    for r in runs:
        if r.lo != pos:
            return False
        pos = r.hi
    return pos >= numel


def clipped(runs: Sequence[AdamRun], lo: int, hi: int) -> list[tuple[int, int, AdamRun]]:
    """``(a, b, run)`` for each run's part in ``[lo, hi)``, as offsets from ``lo``."""
    out = []
    for r in runs:
        a, b = max(r.lo, lo), min(r.hi, hi)
        if a < b:
            out.append((a - lo, b - lo, r))
    return out


def adam_runs(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, pieces: Sequence[tuple[int, int, AdamRun]], *,
              adamw_mode: bool, bias_correction: bool, grad_scale: float,
              out: torch.Tensor | None = None) -> None:
    """One kernel call per piece of :func:`clipped` on the slices ``[a, b)`` of these flat
    tensors (``out``: the low-precision copy-out, written in the same pass)."""
    kernel = adam_kernel_for(master.device)
    for a, b, r in pieces:
        h = r.hyper
        kernel(master[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b], step=r.step, lr=h.lr,
               beta1=h.beta1, beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay,
               adamw_mode=adamw_mode, bias_correction=bias_correction, grad_scale=grad_scale,
               out=None if out is None else out[a:b])


def config_hyperparameters(config, lr: float) -> Hyperparameters:
    """``lr`` with the other hyperparameters of an :class:`~infinity.config.OptimizerConfig`."""
    beta1, beta2 = config.betas
    return Hyperparameters(lr=float(lr), beta1=float(beta1), beta2=float(beta2),
                           eps=float(config.eps), weight_decay=float(config.weight_decay))
