"""The random generators' states a checkpoint keeps per rank (torch CPU/CUDA, python, numpy)."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import torch

from infinity._common import warn_once
from infinity.io import SafetensorsFile


def rng_state() -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
    """(tensors, metadata) of this process's generators, as one safetensors file stores them."""
    version, ints, gauss = random.getstate()
    tensors = [("torch_cpu", torch.get_rng_state()),
               ("python", torch.tensor(ints, dtype=torch.int64))]
    meta: dict[str, Any] = {"python_version": version, "python_gauss": gauss,
                            "cuda_devices": 0}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states = torch.cuda.get_rng_state_all()
        tensors += [(f"cuda_{i}", s) for i, s in enumerate(states)]
        meta["cuda_devices"] = len(states)
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors.append(("numpy", torch.from_numpy(keys.astype(np.int64))))
    meta["numpy"] = [kind, int(pos), int(has_gauss), float(cached)]
    return tensors, meta


def set_rng_state(f: SafetensorsFile) -> None:
    """Restore the generators from a file :func:`rng_state` wrote (CUDA only on as many devices)."""
    meta = json.loads(f.metadata.get("rng", "{}"))
    torch.set_rng_state(f.get("torch_cpu"))
    random.setstate((meta["python_version"], tuple(f.get("python").tolist()),
                     meta["python_gauss"]))
    if meta.get("cuda_devices") and torch.cuda.is_available():
        states = [f.get(f"cuda_{i}") for i in range(meta["cuda_devices"])]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
        else:
            warn_once("ckpt-cuda-rng", f"{f.path}: saved {len(states)} CUDA RNG states, "
                                       f"{torch.cuda.device_count()} devices now; not restored")
    if "numpy" in meta:
        kind, pos, has_gauss, cached = meta["numpy"]
        np.random.set_state((kind, f.get("numpy").numpy().astype(np.uint32), pos, has_gauss,
                             cached))
