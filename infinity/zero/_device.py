"""Which device this rank computes on: one rule, a pure function of the config, the launcher's
environment and the number of visible GPUs, so that it is tested without a GPU.

[Note: one rank per device]
- ``device: cpu`` is the CPU; ``auto`` is the CPU when no GPU is visible.
- ``auto`` and ``cuda`` (no index) take ``LOCAL_RANK % device_count``: under ``torchrun`` every
  local rank gets its own GPU; where the launcher gives each process one GPU through
  ``CUDA_VISIBLE_DEVICES`` (SLURM), ``device_count`` is 1 and every rank takes its ``cuda:0``.
- ``cuda:N`` is taken as written, which under a launch with several local ranks puts them all on
  GPU N: refused unless each process sees a single GPU of its own.
- Two local ranks on one GPU (more local ranks than GPUs visible to each) is an error naming the
  fix, never a silent share: NCCL refuses it later with "Duplicate GPU detected", and memory
  budgets sized for one rank per GPU would overrun the card.
  Where ``CUDA_VISIBLE_DEVICES`` is set and shows one GPU, the rule trusts the launcher to give
  each process a different one (nothing in one process can tell); NCCL still catches a shared GPU.
"""

from __future__ import annotations

import os
from typing import Mapping

import torch

AUTO = "auto"


def _env_int(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key, "")
    if raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {key}={raw!r} is not an integer; unset it or set "
                         f"it to this process's value (the launcher sets it)") from None


def choose_device(requested: str, *, env: Mapping[str, str], device_count: int) -> torch.device:
    """The compute device for ``config.device == requested`` ([Note: one rank per device]).

    ``env``: the process environment (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``CUDA_VISIBLE_DEVICES``); ``device_count``: GPUs this process sees (0 without CUDA).
    Raises ``ValueError`` for a device the machine does not have or ranks that would share one.
    """
    if requested == "cpu" or (requested == AUTO and device_count == 0):
        return torch.device("cpu")
    device = torch.device("cuda") if requested == AUTO else torch.device(requested)
    if device.type != "cuda":
        raise ValueError(f"device: {requested!r} is not a device the engine runs on; use 'auto', "
                         f"'cpu', 'cuda' or 'cuda:N'")
    if device_count == 0:
        raise ValueError(f"device: {requested!r} requested but CUDA is not available; set device "
                         f"to 'auto' or 'cpu'")
    local_rank = _env_int(env, "LOCAL_RANK", 0)
    local_world = _env_int(env, "LOCAL_WORLD_SIZE", 1)
    index = local_rank % device_count if device.index is None else device.index
    if index >= device_count:
        raise ValueError(f"device: {requested!r} but this process sees {device_count} GPU(s) "
                         f"(cuda:0..cuda:{device_count - 1}); use 'auto' or an index below "
                         f"{device_count}")
    # One visible GPU under a set CUDA_VISIBLE_DEVICES: the launcher's per-process GPU (trusted).
    own_gpu = device_count == 1 and env.get("CUDA_VISIBLE_DEVICES", "") != ""
    if local_world > 1 and not own_gpu:
        if device.index is not None:
            raise ValueError(
                f"device: {requested!r} with LOCAL_WORLD_SIZE={local_world} puts every local "
                f"rank on GPU {index}; use device 'auto' or 'cuda' (each rank takes LOCAL_RANK % "
                f"device_count), or give each process its own GPU with CUDA_VISIBLE_DEVICES")
        if local_world > device_count:
            raise ValueError(
                f"LOCAL_WORLD_SIZE={local_world} local ranks but {device_count} GPU(s) visible: "
                f"ranks {local_rank % device_count} and {local_rank % device_count + device_count}"
                f" would share GPU {index}; launch at most {device_count} process(es) per node "
                f"(torchrun --nproc_per_node {device_count}), or set device 'cpu'")
    return torch.device("cuda", index)


def visible_device_count() -> int:
    """GPUs this process sees (0 when torch has no usable CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(requested: str) -> torch.device:
    """:func:`choose_device` for this process (its environment and its visible GPUs)."""
    return choose_device(requested, env=os.environ, device_count=visible_device_count())
