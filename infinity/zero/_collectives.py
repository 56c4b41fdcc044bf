"""Thin ``torch.distributed`` helpers for the parameter manager and the engine.

Without an initialised process group everything runs as world size 1 and every collective is a
no-op (or a local copy), so the engine needs no ``torchrun`` for single-process use.

Every collective takes a ``context`` string (``"all-gather unit 3 'blocks.1' (step 5)"``): when the
backend raises (a gloo/NCCL timeout, a size mismatch between ranks) the error is re-raised as
:class:`CollectiveError` naming that context and the likely cause, ranks that diverged. An optional
agreement check (:meth:`Collectives.check_agreement`) all-gathers a small tag before a unit's
collective so that diverging ranks fail fast with a message naming what each rank was doing,
instead of hanging or silently exchanging the wrong unit's bytes.
"""

from __future__ import annotations

import enum
import logging
import os

import torch
import torch.distributed as dist

from infinity.errors import InfinityError

logger = logging.getLogger(__name__)

CHECK_ENV = "INFINITY_CHECK_COLLECTIVES"
"""Set to 1 to run the agreement check before every collective (debugging ranks that diverge)."""



class Phase(enum.Enum):
    """What a unit's collective is for: named in errors, and compared across ranks by the
    agreement check (its position in this enum is the tag)."""

    FORWARD_GATHER = "forward-gather"
    BACKWARD_GATHER = "backward-gather"
    REDUCE_GRAD = "reduce-grad"
    STEP_GATHER = "step-gather"
    FLUSH = "flush"
    NORM = "norm"
    STATE_DICT = "state-dict"
    BROADCAST = "broadcast"
    REPLICATE_REDUCE = "replicate-reduce"
    """HSDP: a gradient shard summed across the replicas of its shard group."""
    OTHER = "other"
    """Checkpoint bookkeeping, size agreement and the like: small and rare."""


_PHASES = list(Phase)


class CollectiveError(InfinityError, RuntimeError):
    """A collective failed or ranks disagreed on which collective they were running."""


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def check_env_enabled() -> bool:
    return os.environ.get(CHECK_ENV, "") not in ("", "0")


def bind_device(device: torch.device) -> None:
    """Make ``device`` this process's current CUDA device (a no-op on CPU): before any CUDA work
    and before the process group, so that NCCL and every default-device allocation use this
    rank's GPU, not GPU 0 ([Note: one rank per device] in infinity/zero/_device.py)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def init_from_env_if_launched(device: torch.device) -> bool:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) without a process group yet,
    create the default one (NCCL for CUDA, gloo for CPU), as ``deepspeed.initialize`` does;
    otherwise each launched process would silently train alone. Returns True if it created one.

    The device is bound first, and NCCL is given it as ``device_id``: the communicator is then
    created on this rank's GPU (eagerly), and barriers know their device; without it NCCL guesses
    the device from the rank, and a process that has not called ``set_device`` yet opens a
    context on GPU 0."""
    bind_device(device)
    if is_distributed() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    backend = "nccl" if device.type == "cuda" else "gloo"
    logger.info("initialising the default process group (%s) from the torchrun environment",
                backend)
    if device.type == "cuda":
        dist.init_process_group(backend=backend, device_id=device)
    else:
        dist.init_process_group(backend=backend)
    return True


def init_distributed(device: str = "auto") -> torch.device:
    """DeepSpeed's ``init_distributed`` for scripts that need the rank before the engine (to
    build data or files on rank 0): this rank's device by the engine's rule ([Note: one rank per
    device] in infinity/zero/_device.py), bound, then the default process group from the
    launcher's environment (NCCL with ``device_id`` on CUDA, gloo on CPU) when launched with
    ``WORLD_SIZE`` > 1. Returns the device; ``initialize`` later finds the same group."""
    from infinity.zero._device import resolve_device

    resolved = resolve_device(device)
    init_from_env_if_launched(resolved)
    return resolved


def barrier(device: torch.device) -> None:
    """A barrier over the default group; on CUDA it names this rank's device (NCCL's barrier
    otherwise runs on a device it guesses from the rank and warns). No-op without a group."""
    if not is_distributed():
        return
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index if device.index is not None
                                 else torch.cuda.current_device()])
    else:
        dist.barrier()


def _first_attr(*names: str):
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    raise RuntimeError(f"torch.distributed has none of {names}; torch {torch.__version__} is too old")


class Collectives:
    """The collectives one parameter manager issues, over one process group.

    Counts bytes sent by this rank, in total (``bytes_moved``) and per :class:`Phase`
    (``bytes_by_phase``), so that ``engine.stats()`` can report traffic per kind of collective.
    """

    def __init__(self, group: "dist.ProcessGroup | None" = None):
        self.group = group
        self.world_size = dist.get_world_size(group) if is_distributed() else 1
        self.rank = dist.get_rank(group) if is_distributed() else 0
        self.bytes_moved = 0
        """Bytes this rank contributed to collectives (input sizes), for stats()."""
        self.bytes_by_phase: dict[str, int] = {}
        """The same bytes split by the ``phase`` each collective was issued for (Phase values)."""
        self._all_gather = _first_attr("all_gather_single", "all_gather_into_tensor")
        self._reduce_scatter = _first_attr("reduce_scatter_single", "reduce_scatter_tensor")

    def _count(self, phase: Phase, nbytes: int) -> None:
        self.bytes_moved += nbytes
        self.bytes_by_phase[phase.value] = self.bytes_by_phase.get(phase.value, 0) + nbytes

    def _run(self, context: str, fn, *args, **kwargs) -> None:
        try:
            fn(*args, group=self.group, **kwargs)
        except Exception as e:  # gloo/NCCL raise RuntimeError subclasses; keep the cause chained
            raise CollectiveError(
                f"collective failed during {context} on rank {self.rank}/{self.world_size}: {e}. "
                f"If the ranks ran different units (control flow that depends on the rank or the "
                f"data), make every rank run the same modules, or set {CHECK_ENV}=1 to find where "
                f"they diverge") from e

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, *, context: str,
                   phase: Phase = Phase.OTHER) -> None:
        """``out`` (numel = W * shard numel) receives every rank's ``shard``; shard may alias out."""
        if self.world_size == 1:
            if out.data_ptr() != shard.data_ptr():
                out.copy_(shard)
            return
        self._count(phase, shard.numel() * shard.element_size())
        self._run(context, self._all_gather, out, shard)

    def reduce_scatter_sum(self, out: torch.Tensor, full: torch.Tensor, *, context: str,
                           phase: Phase = Phase.OTHER) -> None:
        """``out`` receives this rank's slice of the sum of every rank's ``full``."""
        if self.world_size == 1:
            out.copy_(full)
            return
        self._count(phase, full.numel() * full.element_size())
        self._run(context, self._reduce_scatter, out, full)

    def all_reduce_sum(self, tensor: torch.Tensor, *, context: str,
                       phase: Phase = Phase.OTHER) -> None:
        if self.world_size == 1:
            return
        self._count(phase, tensor.numel() * tensor.element_size())
        self._run(context, dist.all_reduce, tensor)

    def all_reduce_max(self, tensor: torch.Tensor, *, context: str) -> None:
        if self.world_size == 1:
            return
        self._run(context, dist.all_reduce, tensor, op=dist.ReduceOp.MAX)

    def broadcast(self, tensor: torch.Tensor, *, src: int = 0, context: str,
                  phase: Phase = Phase.OTHER) -> None:
        """``tensor`` takes the values of the group's rank ``src`` on every rank."""
        if self.world_size == 1:
            return
        self._count(phase, tensor.numel() * tensor.element_size())
        # ``src`` is a rank of this group; torch.distributed wants the global rank.
        root = src if self.group is None else dist.get_global_rank(self.group, src)
        self._run(context, dist.broadcast, tensor, src=root)

    def check_agreement(self, *, step: int, phase: Phase, unit_index: int, unit_name: str,
                        device: torch.device) -> None:
        """All-gather ``(step, phase, unit)`` and raise on every rank if the ranks disagree.

        Costs one tiny collective; run on the first step and when ``INFINITY_CHECK_COLLECTIVES=1``.
        """
        if self.world_size == 1:
            return
        mine = torch.tensor([step, _PHASES.index(phase), unit_index], dtype=torch.int64, device=device)
        everyone = torch.empty(self.world_size * 3, dtype=torch.int64, device=device)
        self._run(f"agreement check before {phase.value} of unit {unit_index} {unit_name!r} "
                  f"(step {step})",
                  self._all_gather, everyone, mine)
        rows = everyone.view(self.world_size, 3).tolist()
        if any(row != rows[0] for row in rows):
            what = "; ".join(f"rank {r}: step {s}, {_PHASES[p].value} of unit {u}"
                             for r, (s, p, u) in enumerate(rows))
            raise CollectiveError(
                f"ranks diverged: they are about to run different collectives ({what}). Rank "
                f"{self.rank} is at {phase.value} of unit {unit_index} {unit_name!r}. Every rank must run "
                f"the same modules in the same order (control flow that depends on the rank or on "
                f"the data breaks data-parallel training)")
