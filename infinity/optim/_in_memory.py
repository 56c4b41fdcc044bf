"""Adam/AdamW over flat fp32 master shards kept on the compute device (no offload)."""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator, Mapping, Sequence

import torch

from infinity.config import OptimizerConfig
from infinity.optim._partition import check_numel, open_param_out
from infinity.optim._runs import AdamRun, adam_runs, clipped, config_hyperparameters, covers


class InMemoryShardOptimizer:
    """Adam/AdamW over flat fp32 master shards kept on the device where they were handed in.

    ``config``: resolved hyperparameters (no 'auto': ``InfinityConfig.check_resolved``)."""

    offloaded = False
    """State lives where it was handed in; ``master_values`` and ``state_of`` return it live."""
    host_resident_bytes = 0
    deferred_s = 0.0
    wait_s = 0.0
    """The offloaded optimizer's counters; nothing is offloaded or deferred here."""

    def __init__(self, config: OptimizerConfig):
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
        check_numel(key, self._masters[key].numel(), master, exp_avg, exp_avg_sq)
        self._masters[key].copy_(master.reshape(-1))
        self._exp_avg[key].copy_(exp_avg.reshape(-1))
        self._exp_avg_sq[key].copy_(exp_avg_sq.reshape(-1))

    @contextlib.contextmanager
    def open_master(self, key: str) -> Iterator[list[tuple[int, int, ContextManager[torch.Tensor]]]]:
        """The live fp32 master of ``key`` as one window over the whole partition (the interface
        of :meth:`OffloadedShardOptimizer.open_master`)."""
        master = self._masters[key]
        yield [(0, master.numel(), contextlib.nullcontext(master))]

    def drain(self) -> None:
        """Nothing is ever deferred here (the interface of :meth:`OffloadedShardOptimizer.drain`)."""

    def cancel_prefetch(self) -> None:
        """Nothing is ever read ahead here (the interface of the offloaded optimizer)."""

    def default_runs(self, lr: float | None = None) -> dict[str, tuple[AdamRun, ...]]:
        """One run per key over its whole partition at the next step number, with ``lr`` (None:
        :attr:`lr`) and the config's other hyperparameters (what :meth:`step` does without
        ``runs``)."""
        hyper = config_hyperparameters(self.config, self.lr if lr is None else lr)
        return {key: (AdamRun(0, m.numel(), self.step_count + 1, hyper),)
                for key, m in self._masters.items()}

    def step(self, grads: Mapping[str, torch.Tensor], *, grad_scale: float = 1.0,
             lr: float | None = None,
             runs: Mapping[str, Sequence[AdamRun]] | None = None,
             on_stepped: Callable[[str], None] | None = None) -> None:
        """One step. ``runs``: per key, the slices to update and their step numbers and
        hyperparameters ([Note: runs of a flat partition]); keys absent from it are not
        updated. None: :meth:`default_runs` (every key, one run). A key missing from ``grads``
        is stepped with a zero gradient (as torch's AdamW does for a gradient zeroed, not set
        to None). ``on_stepped(key)``: called once a key's parameter partition holds its update
        (keys in add order), so that its all-gather can start while the later keys step
        ([Note: the after-step gather overlaps the next forward] in
        infinity/zero/_step_gathers.py)."""
        if runs is None:
            runs = self.default_runs(lr)
        self.step_count += 1
        for key, master in self._masters.items():
            key_runs = runs.get(key)
            if not key_runs:
                continue
            grad = grads.get(key)
            if grad is None:
                grad = torch.zeros_like(master)
            pieces = clipped(key_runs, 0, master.numel())
            # A partition updated end to end is written whole: a stored one is not read first.
            with open_param_out(self._outs[key], overwrite=covers(key_runs, master.numel())) as out:
                fused_out = out if out is not None and out.dtype != torch.float32 else None
                adam_runs(master, grad, self._exp_avg[key], self._exp_avg_sq[key], pieces,
                          adamw_mode=self.config.adamw_mode,
                          bias_correction=self.config.bias_correction, grad_scale=grad_scale,
                          out=fused_out)
                if out is not None and fused_out is None:  # an fp32 copy held elsewhere
                    for a, b, _ in pieces:
                        out[a:b].copy_(master[a:b])
            if on_stepped is not None:
                on_stepped(key)
