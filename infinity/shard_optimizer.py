"""The optimizer over flat fp32 shards (one entry per unit flat group, this rank's partition).

Interface (every implementation)::

    opt.add(key, master, param_out)        # master: fp32 flat shard (updated in place)
                                           # param_out: the low-precision shard to write, or None
                                           #            when the master *is* the parameter (fp32)
    opt.step(grads, grad_scale=, lr=)      # grads: {key: fp32 flat gradient shard}
    opt.state_bytes()                      # bytes of Adam moments held
    opt.master_values(key) / opt.state_of(key)   # fp32 values (a copy where offloaded)
    opt.load_state(key, master=, exp_avg=, exp_avg_sq=)   # overwrite (checkpoint loading)
    opt.step_count, opt.lr

:class:`InMemoryShardOptimizer` keeps masters and moments where they were given (the compute
device). The offloaded implementation (host/NVMe, pipelined by sub-group) plugs in behind the same
interface.

The math is :func:`infinity.cpu_adam.adam_step_flat` when that module is importable, else
:func:`_adam_step_flat_reference` below (same signature), which follows ``torch.optim.AdamW``
step for step so that parity tests against it are tight.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from typing import Any, Iterator, Mapping

import torch

from infinity.config import OptimizerConfig

logger = logging.getLogger(__name__)


def _adam_step_flat_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
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


def _adam_kernel(device: torch.device):
    """The CPU kernel of :mod:`infinity.cpu_adam` for CPU tensors, the reference elsewhere."""
    if device.type != "cpu":
        return _adam_step_flat_reference
    try:
        from infinity.cpu_adam import adam_step_flat
    except ImportError:  # built in parallel; the reference has the same signature
        return _adam_step_flat_reference
    return adam_step_flat


class InMemoryShardOptimizer:
    """Adam/AdamW over flat fp32 master shards kept on the device where they were handed in."""

    def __init__(self, config: OptimizerConfig):
        if config.lr == "auto" or config.betas == "auto" or config.eps == "auto" or (
                config.weight_decay == "auto"):
            raise ValueError("optimizer: 'auto' values must be resolved before the engine starts; "
                             "set optimizer.params lr/betas/eps/weight_decay to numbers")
        self.config = config
        self.lr = float(config.lr)
        """Current learning rate (a scheduler may set it between steps)."""
        self.step_count = 0
        """Optimizer steps taken (Adam's bias correction uses it)."""
        self._masters: dict[str, torch.Tensor] = {}
        self._outs: dict[str, torch.Tensor | None] = {}
        self._exp_avg: dict[str, torch.Tensor] = {}
        self._exp_avg_sq: dict[str, torch.Tensor] = {}

    def add(self, key: str, master: torch.Tensor, param_out: torch.Tensor | None) -> None:
        if key in self._masters:
            raise ValueError(f"shard optimizer: key {key!r} added twice")
        if master.dtype != torch.float32 or master.dim() != 1:
            raise ValueError(f"shard optimizer: master for {key!r} must be a flat fp32 tensor, got "
                             f"{master.dtype} with shape {tuple(master.shape)}")
        if isinstance(param_out, torch.Tensor) and param_out.numel() != master.numel():
            raise ValueError(f"shard optimizer: {key!r}: param_out has {param_out.numel()} elements, "
                             f"master {master.numel()}")
        state_dtype = torch.bfloat16 if self.config.state_dtype == "bf16" else torch.float32
        self._masters[key] = master
        self._outs[key] = param_out
        self._exp_avg[key] = torch.zeros(master.numel(), dtype=state_dtype, device=master.device)
        self._exp_avg_sq[key] = torch.zeros(master.numel(), dtype=state_dtype,
                                            device=master.device)

    def keys(self) -> list[str]:
        return list(self._masters)

    def state_of(self, key: str) -> dict[str, torch.Tensor]:
        return {"exp_avg": self._exp_avg[key], "exp_avg_sq": self._exp_avg_sq[key]}

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for d in (self._exp_avg, self._exp_avg_sq) for t in d.values())

    def master_bytes(self) -> int:
        """Bytes of fp32 masters held apart from the parameters (0 where the master is the param)."""
        return sum(m.numel() * 4 for k, m in self._masters.items() if self._outs[k] is not None)

    def master_values(self, key: str) -> torch.Tensor:
        """The live fp32 master of ``key`` (aliases the parameters when they are fp32)."""
        return self._masters[key]

    def load_state(self, key: str, *, master: torch.Tensor, exp_avg: torch.Tensor,
                   exp_avg_sq: torch.Tensor) -> None:
        """Overwrite the master and moments of ``key`` (flat, this partition's numel; any
        device/dtype). The caller refreshes the parameters from the masters afterwards."""
        _check_numel(key, self._masters[key].numel(), master, exp_avg, exp_avg_sq)
        self._masters[key].copy_(master.reshape(-1))
        self._exp_avg[key].copy_(exp_avg.reshape(-1))
        self._exp_avg_sq[key].copy_(exp_avg_sq.reshape(-1))

    def step(self, grads: Mapping[str, torch.Tensor], *, grad_scale: float = 1.0,
             lr: float | None = None) -> None:
        """One step over every key; keys missing from ``grads`` are stepped with a zero gradient
        (as torch's AdamW does for a parameter whose ``.grad`` was zeroed, not set to None)."""
        self.step_count += 1
        lr = self.lr if lr is None else lr
        beta1, beta2 = self.config.betas
        for key, master in self._masters.items():
            grad = grads.get(key)
            if grad is None:
                grad = torch.zeros_like(master)
            with open_param_out(self._outs[key]) as out:
                fused_out = out if out is not None and out.dtype != torch.float32 else None
                _adam_kernel(master.device)(
                    master, grad, self._exp_avg[key], self._exp_avg_sq[key],
                    step=self.step_count, lr=lr, beta1=beta1, beta2=beta2,
                    eps=float(self.config.eps), weight_decay=float(self.config.weight_decay),
                    adamw_mode=self.config.adamw_mode, bias_correction=self.config.bias_correction,
                    grad_scale=grad_scale, out=fused_out)
                if out is not None and fused_out is None:  # an fp32 copy held elsewhere
                    out.copy_(master)


# ----------------------------------------------------------------------------------------------
# Offloaded: Adam state on HOST or NVME through the tiered store, stepped by sub-group.


def _check_numel(key: str, numel: int, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.numel() != numel:
            raise ValueError(f"shard optimizer: load_state({key!r}) got {t.numel()} elements, the "
                             f"partition holds {numel}; was the checkpoint saved with another "
                             f"world size or unit layout?")


@contextlib.contextmanager
def open_param_out(param_out) -> Iterator[torch.Tensor | None]:
    """``param_out`` is a tensor, None, or a callable returning a context manager that yields the
    tensor to write (a shard held by the tiered store: acquired, then marked dirty on exit)."""
    if param_out is None or isinstance(param_out, torch.Tensor):
        yield param_out
    else:
        with param_out() as tensor:
            yield tensor


class OffloadedShardOptimizer:
    """Adam(W) whose fp32 master and moments live in the tiered store (home HOST or NVME).

    Each key's master is cut into sub-groups of ``sub_group_numel`` elements; each sub-group is one
    store shard ``[master | exp_avg | exp_avg_sq]`` (fp32, one I/O per sub-group). ``step`` is a
    pipeline over the sub-groups of every key: the fetch of sub-group i+1 is issued before the
    update of i, and the write-back of i is issued right after it, so NVMe reads and writes overlap
    the CPU math. The new parameters are written into ``param_out`` (the low-precision copy-out of
    :func:`infinity.cpu_adam.adam_step_flat`, or a copy of the master for fp32 compute).
    """

    def __init__(self, config: OptimizerConfig, store: Any, *, home: Any, sub_group_numel: int):
        from infinity.tiers import Tier

        if config.state_dtype != "fp32":
            raise ValueError("optimizer.state_dtype='bf16' is not supported with "
                             "offload_optimizer yet; use 'fp32'")
        if home not in (Tier.HOST, Tier.NVME):
            raise ValueError(f"offloaded optimizer: home must be HOST or NVME, got {home!r}")
        self.config = config
        self.lr = float(config.lr)
        """Current learning rate (a scheduler may set it between steps)."""
        self.step_count = 0
        """Optimizer steps taken (Adam's bias correction uses it)."""
        self.store = store
        self.home = home
        self.sub_group_numel = int(sub_group_numel)
        self._tier = Tier
        self._numel: dict[str, int] = {}
        self._outs: dict[str, Any] = {}
        self._state_bytes = 0
        self.wait_s = 0.0
        """Seconds the step spent blocked on sub-group fetches (the pipeline's stall)."""

    def _sub_groups(self, key: str) -> list[tuple[str, int, int]]:
        n = self._numel[key]
        return [(f"opt/{key}/{i}", lo, min(n, lo + self.sub_group_numel))
                for i, lo in enumerate(range(0, n, self.sub_group_numel))]

    def add(self, key: str, master: torch.Tensor, param_out: Any) -> None:
        if key in self._numel:
            raise ValueError(f"shard optimizer: key {key!r} added twice")
        if master.dtype != torch.float32 or master.dim() != 1:
            raise ValueError(f"shard optimizer: master for {key!r} must be a flat fp32 tensor")
        self._numel[key] = master.numel()
        self._outs[key] = param_out
        for shard_key, lo, hi in self._sub_groups(key):
            n = hi - lo
            initial = torch.zeros(3 * n, dtype=torch.float32)
            initial[:n].copy_(master[lo:hi])
            self.store.register(shard_key, 3 * n, torch.float32, self.home, initial=initial)
            self._state_bytes += 8 * n

    def keys(self) -> list[str]:
        return list(self._numel)

    def state_bytes(self) -> int:
        return self._state_bytes

    def master_bytes(self) -> int:
        return sum(self._numel.values()) * 4

    def load_state(self, key: str, *, master: torch.Tensor, exp_avg: torch.Tensor,
                   exp_avg_sq: torch.Tensor) -> None:
        """Overwrite the master and moments of ``key`` sub-group by sub-group (each acquired on
        HOST, overwritten, marked dirty, written back to its home)."""
        _check_numel(key, self._numel[key], master, exp_avg, exp_avg_sq)
        parts = [t.reshape(-1).to("cpu", torch.float32) for t in (master, exp_avg, exp_avg_sq)]
        handles = []
        for shard_key, lo, hi in self._sub_groups(key):
            n = hi - lo
            buf = self.store.acquire(shard_key, self._tier.HOST).wait()
            try:
                for i, part in enumerate(parts):
                    buf[i * n:(i + 1) * n].copy_(part[lo:hi])
                self.store.mark_dirty(shard_key, self._tier.HOST)
            finally:
                self.store.release(shard_key, self._tier.HOST)
            if self.home is self._tier.NVME:
                handles.append(self.store.write_back(shard_key))
        for handle in handles:
            handle.wait()

    def master_values(self, key: str) -> torch.Tensor:
        """A CPU copy of the whole fp32 master of ``key`` (reads every sub-group; for checkpoints)."""
        return self._read(key, 0)

    def state_of(self, key: str) -> dict[str, torch.Tensor]:
        return {"exp_avg": self._read(key, 1), "exp_avg_sq": self._read(key, 2)}

    def _read(self, key: str, part: int) -> torch.Tensor:
        out = torch.empty(self._numel[key], dtype=torch.float32)
        for shard_key, lo, hi in self._sub_groups(key):
            n = hi - lo
            buf = self.store.acquire(shard_key, self._tier.HOST).wait()
            try:
                out[lo:hi].copy_(buf[part * n:(part + 1) * n])
            finally:
                self.store.release(shard_key, self._tier.HOST)
        return out

    def step(self, grads: Mapping[str, torch.Tensor], *, grad_scale: float = 1.0,
             lr: float | None = None) -> None:
        self.step_count += 1
        lr = self.lr if lr is None else lr
        items = [(key, sk, lo, hi) for key in self._numel for sk, lo, hi in self._sub_groups(key)]
        if not items:
            return
        handles = {0: self.store.acquire(items[0][1], self._tier.HOST)}
        writebacks = []
        open_key, out_ctx, out = None, None, None
        try:
            for j, (key, shard_key, lo, hi) in enumerate(items):
                if j + 1 < len(items):  # the read of i+1 overlaps the update of i
                    handles[j + 1] = self.store.acquire(items[j + 1][1], self._tier.HOST)
                t0 = time.perf_counter()
                buf = handles.pop(j).wait()
                self.wait_s += time.perf_counter() - t0
                if key != open_key:  # one key's parameter shard is open (pinned) at a time
                    if out_ctx is not None:
                        out_ctx.__exit__(None, None, None)
                    open_key, out_ctx = key, open_param_out(self._outs[key])
                    out = out_ctx.__enter__()
                self._update(buf, grads.get(key), out, lo, hi, grad_scale=grad_scale, lr=lr)
                self.store.mark_dirty(shard_key, self._tier.HOST)
                self.store.release(shard_key, self._tier.HOST)
                if self.home is self._tier.NVME:  # the write of i overlaps the update of i+1
                    writebacks.append(self.store.write_back(shard_key))
        finally:  # an error leaves the open shard unmarked (the store keeps its old bytes)
            if out_ctx is not None:
                out_ctx.__exit__(*sys.exc_info())
        for handle in writebacks:
            handle.wait()

    def _update(self, buf: torch.Tensor, grad: torch.Tensor | None, out: torch.Tensor | None,
                lo: int, hi: int, *, grad_scale: float, lr: float) -> None:
        n = hi - lo
        master, exp_avg, exp_avg_sq = buf[:n], buf[n:2 * n], buf[2 * n:]
        if grad is None:
            g = torch.zeros(n, dtype=torch.float32)
        else:
            g = grad[lo:hi]
            if g.device.type != "cpu":
                g = g.to("cpu")
        low = out is not None and out.dtype in (torch.bfloat16, torch.float16)
        staging = None
        if low:
            staging = out[lo:hi] if out.device.type == "cpu" else torch.empty(n, dtype=out.dtype)
        beta1, beta2 = self.config.betas
        _adam_kernel(master.device)(
            master, g, exp_avg, exp_avg_sq, step=self.step_count, lr=lr, beta1=beta1,
            beta2=beta2, eps=float(self.config.eps), weight_decay=float(self.config.weight_decay),
            adamw_mode=self.config.adamw_mode, bias_correction=self.config.bias_correction,
            grad_scale=grad_scale, out=staging)
        if out is None:
            return
        if not low:
            out[lo:hi].copy_(master)
        elif out.device.type != "cpu":  # staging was a CPU buffer: move the new values up
            out[lo:hi].copy_(staging)


def build_store(device: torch.device, *, device_budget_bytes: int, host_budget_bytes: int,
                nvme_path: str | None, swapper_config: Any, rank: int) -> tuple[Any, Any]:
    """The tiered store (and its swapper when some home is NVME) the engine's offload uses."""
    from infinity.swapper import Swapper
    from infinity.tiers import StoreConfig, TieredStore

    swapper = Swapper(nvme_path, swapper_config, rank=rank) if nvme_path else None
    store = TieredStore(device, StoreConfig(device_budget_bytes=device_budget_bytes,
                                            host_budget_bytes=host_budget_bytes), swapper=swapper)
    return store, swapper


def tier_of(offload_device: str) -> Any:
    """'cpu' -> Tier.HOST, 'nvme' -> Tier.NVME (the home tier of offloaded shards)."""
    from infinity.tiers import Tier

    return {"cpu": Tier.HOST, "nvme": Tier.NVME}[offload_device]
