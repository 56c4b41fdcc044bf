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
import dataclasses
import logging
import math
import sys
import time
from typing import Any, Iterable, Iterator, Mapping

import torch

from infinity._common import TierCapacityError
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

    def drain(self) -> None:
        """Nothing is ever deferred here (the interface of :meth:`OffloadedShardOptimizer.drain`)."""

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
            with open_param_out(self._outs[key], overwrite=True) as out:  # writes it all
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
def open_param_out(param_out, *, overwrite: bool = False) -> Iterator[torch.Tensor | None]:
    """``param_out`` is a tensor, None, or a callable returning a context manager that yields the
    tensor to write (a shard held by the tiered store: acquired, then marked dirty on exit).
    ``overwrite``: the caller writes every element, so a stored shard is not read first."""
    if param_out is None or isinstance(param_out, torch.Tensor):
        yield param_out
    else:
        with param_out(overwrite=overwrite) as tensor:
            yield tensor


class OffloadedShardOptimizer:
    """Adam(W) whose fp32 master and moments live in the tiered store (home HOST or NVME).

    Each key's master is cut into sub-groups of ``sub_group_numel`` elements; each sub-group is one
    store shard ``[master | exp_avg | exp_avg_sq]`` (fp32, one I/O per sub-group). ``step`` is a
    pipeline over the sub-groups of every key: reads run ahead of the update within the read-ahead
    window, and the write-back of each sub-group is issued right after its update, so NVMe reads
    and writes overlap the CPU math. The new parameters are written into ``param_out`` (the
    low-precision copy-out of :func:`infinity.cpu_adam.adam_step_flat`, or a copy of the master for
    fp32 compute).

    [Note: optimizer read-ahead] With an NVME home the step is I/O-bound (12 B per parameter read
    and written), so its reads start during backward: :meth:`prefetch` (called once a key's
    gradient is final in this backward) acquires that key's sub-groups into HOST while they fit the
    window of ``readahead_bytes``, counted in slots of the largest sub-group's extent; the step
    then runs the prefetched keys first, in the order they were prefetched (backward order), and
    keeps the window full of reads for the rest. The window is sized by the plan so that the
    pinned sub-groups leave the host-homed shards and the parameter staging their room; the
    store's budgets are enforced on every read all the same. The update itself still waits for the
    step (exact global-norm clipping needs every gradient first). :meth:`cancel_prefetch` drops
    the reads when no step follows (an fp16 overflow). Stepped sub-groups stay cached in HOST once
    written back; the next step takes the keys still cached right after the ones read ahead, and
    marks them needed soonest for the store's eviction, so that its own reads do not evict them
    first (in a fixed order LRU drops exactly those before the step reaches them). Measured on
    the 2-core VM (135M GPT, `infinity bench step`): with half the training state's bytes as host
    budget the (then fp32) gradient accumulators left room for three sub-groups and the step stayed
    bound by the disk (~3 GB read + written per step); at 0.9 of it the cached sub-groups cut the
    step from 1.1 s to 0.7 s.

    [Note: deferred optimizer step] With an NVME home the step is bound by the disk (12 B per
    parameter read and written), and the window above holds only what the host budget leaves,
    so most of it cannot move into backward. But a unit's new parameters are not needed until
    the next forward reads its shard. ``step(defer=True)`` therefore computes nothing for keys
    whose parameter shard the store holds: it records the step (step number, lr, the gradient
    scale with the exact clip coefficient, the gradients) and starts the reads of the first
    sub-groups in the next forward's order. The store calls :meth:`apply_before_read` before it
    reads any shard (``TieredStore.before_read``); for the shard of a key still pending, the
    update of that key (and of the keys before it in that order) runs right then, on the
    caller's thread, while the reads for the next keys are issued, so the reads and the
    write-backs of the step overlap the forward's compute. Keys without a stored shard (always
    gathered, or parameters not offloaded) are read without the store, so they are updated in
    ``step`` itself. :meth:`drain` runs whatever is left and waits for every write-back; the
    engine calls it before the next backward (the gradients are about to be overwritten) and
    before anything reads or replaces state (``full_state_dict``, checkpoints, weights). Every
    update is the same arithmetic on the same bytes as in ``step(defer=False)``, so training is
    bitwise the same (tests/unit/test_deferred_step.py).
    """

    def __init__(self, config: OptimizerConfig, store: Any, *, home: Any, sub_group_numel: int,
                 readahead_bytes: int = 0, host_resident_bytes: int = 0):
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
        self.readahead_bytes = int(readahead_bytes)
        """Host bytes of sub-groups held pinned at once ([Note: optimizer read-ahead]); below two
        slots the step reads one sub-group ahead."""
        self._resident_left = int(host_resident_bytes) if home is Tier.NVME else 0
        """NVME home: host room left for sub-groups homed on HOST instead, in arena extents
        ([Note: host-resident sub-groups] in infinity/units.py); :meth:`add` takes it in order."""
        self.host_resident_bytes = 0
        """Bytes of optimizer state homed on HOST although the optimizer's home is NVME."""
        self._tier = Tier
        self._numel: dict[str, int] = {}
        self._outs: dict[str, Any] = {}
        self._state_bytes = 0
        self._ahead: dict[str, Any] = {}
        """Store key of a sub-group -> handle of its acquire issued ahead of its update (pinned)."""
        self._ready: dict[str, None] = {}
        """Keys whose gradient is final in this step, in the order :meth:`prefetch` saw them."""
        self._ahead_full = False
        """A prefetch found the window full: later keys are read by the step (keeps a prefix)."""
        self.wait_s = 0.0
        """Seconds the step spent blocked on sub-group fetches (the pipeline's stall)."""
        self.deferred_s = 0.0
        """Seconds spent in updates of deferred steps, run before a shard read (in the forward)."""
        self._param_keys: dict[str, str] = {}
        """Key -> store key of its parameter shard (see :meth:`add`)."""
        self._run: _Run | None = None
        """The step under way: deferred updates not yet run, write-backs not yet waited for."""
        self._pending_params: dict[str, str] = {}
        """Parameter store key -> key, for the keys the current deferred step has not updated."""
        self._advancing = False
        """Inside :meth:`_advance` (the store's read hook must not re-enter it)."""

    @property
    def window_sub_groups(self) -> int:
        """Sub-groups pinned at once at most (read ahead plus the one being updated)."""
        largest = min(self.sub_group_numel, max(self._numel.values(), default=1))
        slot = -(-12 * largest // 4096) * 4096  # an arena extent (as the plan counts it)
        return max(2, self.readahead_bytes // slot)

    def _sub_groups(self, key: str) -> list[tuple[str, int, int]]:
        n = self._numel[key]
        return [(f"opt/{key}/{i}", lo, min(n, lo + self.sub_group_numel))
                for i, lo in enumerate(range(0, n, self.sub_group_numel))]
    def add(self, key: str, master: torch.Tensor, param_out: Any, *,
            param_key: str | None = None) -> None:
        """``param_key``: the store key of the parameter shard ``param_out`` writes, when the
        store holds it: a deferred step updates ``key`` before the store reads that shard."""
        if key in self._numel:
            raise ValueError(f"shard optimizer: key {key!r} added twice")
        if master.dtype != torch.float32 or master.dim() != 1:
            raise ValueError(f"shard optimizer: master for {key!r} must be a flat fp32 tensor")
        self._numel[key] = master.numel()
        self._outs[key] = param_out
        if param_key is not None:
            self._param_keys[key] = param_key
        for shard_key, lo, hi in self._sub_groups(key):
            n = hi - lo
            initial = torch.zeros(3 * n, dtype=torch.float32)
            initial[:n].copy_(master[lo:hi])
            home = self.home
            # The arena's own extent (its alignment may exceed the plan's 4 KiB), so that the
            # resident sub-groups never take more host room than the plan left them.
            extent = self.store.arena.extent_bytes(12 * n) if self._resident_left else 0
            if 0 < extent <= self._resident_left:  # [Note: host-resident sub-groups]
                home = self._tier.HOST
                self._resident_left -= extent
                self.host_resident_bytes += 12 * n
            else:  # a prefix only: no later, smaller sub-group lands between cached copies
                self._resident_left = 0
            self.store.register(shard_key, 3 * n, torch.float32, home, initial=initial)
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
        self.drain()  # a deferred step finishes first
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
            if self._on_nvme(shard_key):
                handles.append(self.store.write_back(shard_key))
        for handle in handles:
            handle.wait()

    def master_values(self, key: str) -> torch.Tensor:
        """A CPU copy of the whole fp32 master of ``key`` (reads every sub-group; for checkpoints)."""
        return self._read(key, 0)

    def state_of(self, key: str) -> dict[str, torch.Tensor]:
        return {"exp_avg": self._read(key, 1), "exp_avg_sq": self._read(key, 2)}

    def _read(self, key: str, part: int) -> torch.Tensor:
        self.drain()  # a deferred step finishes first
        out = torch.empty(self._numel[key], dtype=torch.float32)
        for shard_key, lo, hi in self._sub_groups(key):
            n = hi - lo
            buf = self.store.acquire(shard_key, self._tier.HOST).wait()
            try:
                out[lo:hi].copy_(buf[part * n:(part + 1) * n])
            finally:
                self.store.release(shard_key, self._tier.HOST)
        return out

    def prefetch(self, key: str) -> None:
        """The gradient of ``key`` is final for this step: start reading its sub-groups into HOST
        while the read-ahead window has room ([Note: optimizer read-ahead]). NVME home only."""
        if self.home is not self._tier.NVME or key in self._ready or key not in self._numel:
            return
        self._ready[key] = None
        if self._ahead_full:
            return  # what is read ahead stays a prefix of the step's order
        for shard_key, _lo, _hi in self._sub_groups(key):
            if not self._on_nvme(shard_key):
                continue  # nothing to read: acquiring it later costs nothing
            if len(self._ahead) >= self.window_sub_groups:
                self._ahead_full = True
                return
            try:
                self._ahead[shard_key] = self.store.acquire(shard_key, self._tier.HOST)
            except TierCapacityError:  # optional work: never fail a backward for it
                self._ahead_full = True
                return

    def cancel_prefetch(self) -> None:
        """Drop the reads issued ahead (no step follows them)."""
        self._ready.clear()
        self._ahead_full = False
        self._drop_ahead()

    def _drop_ahead(self) -> None:
        ahead, self._ahead = self._ahead, {}
        for shard_key, handle in ahead.items():
            try:
                handle.wait()
            except Exception:  # noqa: BLE001 - a failed read holds no pin; the step reported it
                continue
            self.store.release(shard_key, self._tier.HOST)

    def _step_items(self, order: Iterable[str] = ()) -> list[tuple[str, str, int, int]]:
        """Sub-groups in step order, one key's sub-groups together (its parameter shard is opened
        once). With an ``order`` (a deferred step): :meth:`_run_order` of it. Otherwise: keys
        whose reads were issued ahead first (backward order: they are a prefix of it), then, NVME
        home, keys with a sub-group still cached in HOST from the previous step (a read saved
        before LRU evicts them), then the rest (backward order, then add order)."""
        if order:
            keys = self._run_order(order)
            if self.home is self._tier.NVME:
                for pos, key in enumerate(keys):  # cached copies: evicted furthest-use first
                    for sk, _lo, _hi in self._sub_groups(key):
                        if self._cached_on_host(sk):
                            self.store.set_next_use(sk, float(pos))
            return [(key, sk, lo, hi) for key in keys for sk, lo, hi in self._sub_groups(key)]
        order = list(self._ready) + [k for k in self._numel if k not in self._ready]
        ahead = {sk.rsplit("/", 1)[0].removeprefix("opt/") for sk in self._ahead}
        head = [k for k in order if k in ahead]
        rest = [k for k in order if k not in ahead]
        if self.home is self._tier.NVME:
            cached = {k for k in rest if any(self._cached_on_host(sk) for sk, _, _ in
                                             self._sub_groups(k))}
            rest = [k for k in rest if k in cached] + [k for k in rest if k not in cached]
            for key in cached:  # evicted last by this step's allocations (Belady: needed soonest)
                for sk, _lo, _hi in self._sub_groups(key):
                    self.store.set_next_use(sk, 0.0)
        return [(key, sk, lo, hi) for key in head + rest for sk, lo, hi in self._sub_groups(key)]

    def _run_order(self, order: Iterable[str]) -> list[str]:
        """Every key once, for a deferred step and its read-ahead: first the keys updated at the
        step itself (no stored parameter shard), then the deferred ones, each part in ``order``
        and then add order. The read-ahead issued in this order is a prefix of the step's."""
        keys = [k for k in dict.fromkeys(order) if k in self._numel]
        listed = set(keys)
        keys += [k for k in self._numel if k not in listed]
        return ([k for k in keys if k not in self._param_keys]
                + [k for k in keys if k in self._param_keys])

    def _on_nvme(self, shard_key: str) -> bool:
        """The sub-group's home is a swap file (not host-resident: [Note: host-resident sub-groups])."""
        return self.store.home(shard_key) is self._tier.NVME

    def _cached_on_host(self, shard_key: str) -> bool:
        from infinity.tiers import Residency

        return self.store.state(shard_key, self._tier.HOST) in (Residency.RESIDENT,
                                                                 Residency.WRITING)

    def step(self, grads: Mapping[str, torch.Tensor], *, grad_scale: float = 1.0,
             lr: float | None = None, defer: bool = False,
             order: Iterable[str] = ()) -> None:
        """One Adam step over every key. ``defer`` (NVME home): [Note: deferred optimizer step]:
        only the keys whose parameter partition is not a stored shard (nothing guards their reads)
        are updated now; the others wait for :meth:`apply_before_read` (the store calls it when a
        parameter shard is about to be read) or :meth:`drain`, in ``order`` (the keys in the order
        the next forward reads them; keys not in it follow in add order). ``grads`` must stay
        unchanged until then."""
        self.drain()
        self.step_count += 1
        run = _Run(step=self.step_count, lr=self.lr if lr is None else lr, grad_scale=grad_scale,
                   grads=grads, items=self._step_items(order if defer else ()))
        self._ready.clear()
        self._ahead_full = False
        self._run = run
        if not (defer and self.home is self._tier.NVME):
            self.drain()
            return
        # Keys without a stored parameter shard come first in the run (_run_order): nothing
        # guards their reads, so they are updated now.
        immediate = sum(1 for item in run.items if item[0] not in self._param_keys)
        self._advance(immediate)
        self._pending_params = {self._param_keys[k]: k for k in self.pending_keys}
        if self._run is not None:
            self._top_up()

    def apply_before_read(self, store_key: str) -> None:
        """The store is about to read ``store_key``: if it is the parameter shard of a key whose
        deferred update has not run, run it now (and every key before it in the step's order)."""
        key = self._pending_params.get(store_key)
        if key is None or self._run is None or self._advancing:
            return
        t0 = time.perf_counter()
        try:
            self._advance(self._run.last_index(key) + 1)
        finally:
            self.deferred_s += time.perf_counter() - t0

    @property
    def pending_keys(self) -> list[str]:
        """Keys whose update of the current (deferred) step has not run yet, in order."""
        run = self._run
        if run is None:
            return []
        return list(dict.fromkeys(item[0] for item in run.items[run.done:]))

    def drain(self) -> None:
        """Finish the step: run every update still deferred and wait for every write-back (their
        errors are raised here). Called before anything reads the state or the gradients change."""
        run = self._run
        if run is None:
            return
        try:
            self._advance(len(run.items))
        finally:
            self._run = None
            self._pending_params = {}
            writebacks, run.writebacks = run.writebacks, []
        for handle in writebacks:
            handle.wait()

    def read_ahead(self, order: Iterable[str]) -> None:
        """Start reading sub-groups into HOST, in ``order``, while the read-ahead window has room
        (NVME home; with a deferred step these are the ones the next forward updates first)."""
        if self.home is not self._tier.NVME or self._run is not None:
            return
        for key in self._run_order(order):
            self.prefetch(key)

    def _top_up(self) -> None:
        """Issue reads ahead of the next update, within the window."""
        run = self._run
        while run.cursor < len(run.items) and len(self._ahead) < run.window(self):
            sk = run.items[run.cursor][1]
            if sk not in self._ahead and self._on_nvme(sk):
                try:
                    self._ahead[sk] = self.store.acquire(sk, self._tier.HOST)
                except TierCapacityError:
                    return  # a read ahead: try again after the next update frees room
            run.cursor += 1

    def _advance(self, upto: int) -> None:
        """Update the run's items up to index ``upto`` (exclusive; a key boundary): reads of later
        items overlap each update, the write-back of each is issued after it (not waited for)."""
        run = self._run
        if run is None or run.done >= upto:
            return
        self._advancing = True
        open_key, out_ctx, out = None, None, None
        try:
            for j in range(run.done, upto):
                key, shard_key, lo, hi = run.items[j]
                if shard_key not in self._ahead:  # the item stepped now: no room is an error
                    self._ahead[shard_key] = self.store.acquire(shard_key, self._tier.HOST)
                # Reads ahead start after this item, also when it was read ahead in backward (a
                # full window leaves the cursor behind): an updated item read again would pin a
                # window slot, and bytes, for the rest of the step.
                run.cursor = max(run.cursor, j + 1)
                self._top_up()
                t0 = time.perf_counter()
                buf = self._ahead.pop(shard_key).wait()
                self.wait_s += time.perf_counter() - t0
                try:
                    if key != open_key:  # one key's parameter shard is open (pinned) at a time
                        if out_ctx is not None:
                            out_ctx.__exit__(None, None, None)
                        # Every sub-group of the key is stepped while it is open: all written.
                        open_key, out_ctx = key, open_param_out(self._outs[key], overwrite=True)
                        out = out_ctx.__enter__()
                    self._update(buf, run.grads.get(key), out, lo, hi, run)
                    self.store.mark_dirty(shard_key, self._tier.HOST)
                finally:
                    self.store.release(shard_key, self._tier.HOST)
                    self.store.set_next_use(shard_key, None)  # stepped: no longer needed soon
                run.done = j + 1
                if self._on_nvme(shard_key):  # its write overlaps the next update
                    run.writebacks.append(self.store.write_back(shard_key))
        except BaseException:
            # An error leaves the open shard unmarked (the store keeps its old bytes, or, written
            # back lazily, the bytes so far) and ends the step: the keys not updated keep their
            # old state; drain() raises nothing more. The window's pins go in any case.
            try:
                if out_ctx is not None:
                    out_ctx.__exit__(*sys.exc_info())
                    out_ctx = None
            finally:
                self._drop_ahead()
                self._run, self._pending_params = None, {}
            raise
        finally:
            self._advancing = False
            if out_ctx is not None:
                out_ctx.__exit__(None, None, None)
        if run.done == len(run.items):
            self._drop_ahead()
            self._pending_params = {}
        else:
            pending = set(self.pending_keys)
            self._pending_params = {sk: k for sk, k in self._pending_params.items() if k in pending}
            self._top_up()

    def _update(self, buf: torch.Tensor, grad: torch.Tensor | None, out: torch.Tensor | None,
                lo: int, hi: int, run: "_Run") -> None:
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
            master, g, exp_avg, exp_avg_sq, step=run.step, lr=run.lr, beta1=beta1,
            beta2=beta2, eps=float(self.config.eps), weight_decay=float(self.config.weight_decay),
            adamw_mode=self.config.adamw_mode, bias_correction=self.config.bias_correction,
            grad_scale=run.grad_scale, out=staging)
        if out is None:
            return
        if not low:
            out[lo:hi].copy_(master)
        elif out.device.type != "cpu":  # staging was a CPU buffer: move the new values up
            out[lo:hi].copy_(staging)


@dataclasses.dataclass(eq=False)
class _Run:
    """One optimizer step of :class:`OffloadedShardOptimizer`, possibly deferred."""

    step: int
    """Adam's step number (bias correction) of this run."""
    lr: float
    grad_scale: float
    grads: Mapping[str, torch.Tensor]
    items: list[tuple[str, str, int, int]]
    """(key, sub-group store key, lo, hi) in update order."""
    done: int = 0
    """Items updated so far (a prefix of ``items``)."""
    cursor: int = 0
    """Items whose read was issued so far (a prefix, >= ``done``)."""
    writebacks: list[Any] = dataclasses.field(default_factory=list)
    """Handles of the sub-group write-backs issued, waited for by ``drain``."""

    def last_index(self, key: str) -> int:
        return max(i for i, item in enumerate(self.items) if item[0] == key)

    def window(self, opt: "OffloadedShardOptimizer") -> int:
        return opt.window_sub_groups if opt.home is opt._tier.NVME else 2


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
