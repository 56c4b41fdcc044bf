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
import time
from typing import Callable

import torch
import torch.distributed as dist

from infinity._modeled_link import ModeledLink
from infinity.errors import InfinityError

logger = logging.getLogger(__name__)

CHECK_ENV = "INFINITY_CHECK_COLLECTIVES"
"""Set to 1 to run the agreement check before every collective (debugging ranks that diverge)."""



class Phase(enum.Enum):
    """What a unit's collective is for: named in errors, and compared across ranks by the
    agreement check (its position in this enum is the tag)."""

    FORWARD_GATHER = "forward-gather"
    BACKWARD_GATHER = "backward-gather"
    SECONDARY_GATHER = "secondary-gather"
    """hpZ: a unit gathered in backward from the secondary shards, inside the hpz_partition_size
    group only ([Note: hpZ secondary shards] in infinity/zero/_hpz.py); with hpZ on,
    backward-gather counts only the backward gathers that found no secondary shard."""
    REDUCE_GRAD = "reduce-grad"
    STEP_GATHER = "step-gather"
    FLUSH = "flush"
    NORM = "norm"
    STATE_DICT = "state-dict"
    BROADCAST = "broadcast"
    REPLICATE_REDUCE = "replicate-reduce"
    """HSDP: a gradient shard summed across the replicas of its shard group."""
    REDUCE_ROWS = "reduce-rows"
    """The embeddings' gradient rows of a backward, all-gathered over the data-parallel group
    at its end ([Note: embedding rows cross ranks as rows] in infinity/zero/_embedding_rows.py)."""
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


class CommLane:
    """What the collectives of one engine share (the mesh's groups and hpZ's sub-group alike):
    the modeled link under them, if any ([Note: the modeled link] in infinity/_modeled_link.py),
    and the seconds the training thread spent waiting for them."""

    def __init__(self) -> None:
        self.link: ModeledLink | None = None
        """The modeled link every collective's wire bytes cross; None: the backend's own time."""
        self.exposed_s = 0.0
        """Seconds spent in :meth:`CommHandle.wait` (the training thread waiting on a
        collective: the part of the communication that compute did not hide)."""
        self.issued = 0
        """Collectives issued (world size > 1)."""
        self.exposed_s_by_phase: dict[str, float] = {}
        """``exposed_s`` by the :class:`Phase` each collective was issued for."""

    def stats(self) -> dict[str, float | None]:
        return {"exposed_s": self.exposed_s, "issued": self.issued,
                "exposed_s_by_phase": dict(self.exposed_s_by_phase),
                "link_busy_s": None if self.link is None else self.link.busy_s,
                "link_bytes": None if self.link is None else self.link.bytes,
                "link_busy_s_by_phase": None if self.link is None
                else dict(self.link.busy_s_by_tag)}


class CommHandle:
    """An issued collective ([Note: issue and wait]): :meth:`wait` completes it, raising a
    :class:`CollectiveError` that names what it was for; a second wait returns at once.

    [Note: issue and wait]
    Every collective is issued with ``async_op=True`` and returns this handle: on gloo the
    backend's worker threads run it while the caller computes; on NCCL it runs on the process
    group's own stream and ``wait()`` makes the current stream wait for it (the CPU does not
    block). Tensors handed to a collective must not be read, written or freed before its wait:
    the caller keeps them (and any store copy it read) until then. With a modeled link, ``wait()``
    also returns no earlier than the transfer's modeled end."""

    __slots__ = ("_work", "_done_at", "_lane", "_context", "_rank", "_done", "_deliver", "_phase")

    def __init__(self, work, done_at: float | None, lane: CommLane, context: str, rank: str,
                 deliver=None, phase: str = "other"):
        self._work = work
        self._done_at = done_at
        self._lane = lane
        self._context = context
        self._rank = rank
        self._done = work is None and done_at is None
        self._deliver = deliver
        """Copies the result into its destination at the wait (``poison_until_wait``)."""
        self._phase = phase

    @property
    def done(self) -> bool:
        return self._done

    def wait(self) -> None:
        if self._done:
            return
        self._done = True  # a failed wait is not retried: the error names the collective once
        t0 = time.perf_counter()
        try:
            if self._work is not None:
                self._work.wait()
        except Exception as e:  # gloo/NCCL raise RuntimeError subclasses; keep the cause chained
            raise _collective_error(self._context, self._rank, e) from e
        finally:
            if self._done_at is not None:
                self._lane.link.wait_until(self._done_at)
            waited = time.perf_counter() - t0
            lane = self._lane
            lane.exposed_s += waited
            lane.exposed_s_by_phase[self._phase] = \
                lane.exposed_s_by_phase.get(self._phase, 0.0) + waited
        if self._deliver is not None:
            self._deliver()


DONE = CommHandle(None, None, CommLane(), "", "")
"""A handle with nothing to wait for (world size 1: the collective is a local copy or nothing)."""


def _collective_error(context: str, where: str, e: BaseException) -> "CollectiveError":
    return CollectiveError(
        f"collective failed during {context} on rank {where}: {e}. If the ranks ran different "
        f"units (control flow that depends on the rank or the data), make every rank run the "
        f"same modules, or set {CHECK_ENV}=1 to find where they diverge")


def _poisoned(dest: torch.Tensor, args: tuple) -> tuple[tuple, Callable[[], None]]:
    """``poison_until_wait`` ([Note: the modeled link] in infinity/_modeled_link.py): the
    collective writes a scratch tensor (its inputs copied first, since they may alias ``dest``),
    ``dest`` holds NaN, and the returned callable delivers the result at the wait."""
    scratch = dest.clone()  # an all-reduce's input is its output: the clone carries it
    inputs = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args[1:])
    dest.fill_(float("nan"))
    return (scratch, *inputs), lambda: dest.copy_(scratch)


def _first_attr(*names: str):
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    raise RuntimeError(f"torch.distributed has none of {names}; torch {torch.__version__} is too old")


class Collectives:
    """The collectives one parameter manager issues, over one process group: the shard group.

    [Note: collectives over a mesh]
    ``group`` is the shard group (``world_size`` and ``rank`` are the shard degree S and this
    rank's place in it: what sharding divides by). Over a mesh ([Note: mesh dimensions] in
    infinity/config/_mesh.py) two more groups come with it: ``replicate`` (a Collectives over
    the R ranks holding the same shard; :meth:`all_reduce_replicas` sums a gradient shard across
    them) and ``world`` (the R * S data-parallel ranks: broadcasts, agreement and the
    any-rank-has-it maxima run there, so every copy of the model starts and stays the same, and
    ranks of different replicas agree on which collectives follow). Without a mesh both are the
    flat case: no replicas, ``world`` is this object.

    Counts bytes sent by this rank, in total (``bytes_moved``) and per :class:`Phase`
    (``bytes_by_phase``, one dict shared by the mesh's Collectives), so that ``engine.stats()``
    can report traffic per kind of collective.
    """

    def __init__(self, group: "dist.ProcessGroup | None" = None, *,
                 replicate: "Collectives | None" = None, world: "Collectives | None" = None,
                 tensor_group: "dist.ProcessGroup | None" = None,
                 pipeline: "Collectives | None" = None,
                 counts: "Collectives | None" = None):
        self.group = group
        self.world_size = dist.get_world_size(group) if is_distributed() else 1
        self.rank = dist.get_rank(group) if is_distributed() else 0
        self.replicate = replicate
        """The replicate group's collectives (R > 1), or None: no replicas."""
        self.world = self if world is None else world
        """The data-parallel group's collectives (broadcasts, agreement, checkpoints)."""
        self.tensor_group = tensor_group
        """The tensor-parallel group of this rank (T > 1), or None; used by tensor parallelism."""
        self.pipeline = pipeline
        """The ranks at this rank's place in every pipeline stage (P > 1), or None: the global
        gradient norm and the fp16 overflow are summed over them ([Note: mesh dimensions])."""
        shared = counts if counts is not None else world
        self.bytes_by_phase: dict[str, int] = {} if shared is None else shared.bytes_by_phase
        """Bytes this rank contributed to collectives (input sizes) by the ``phase`` each was
        issued for (Phase values), for stats()."""
        self.lane: CommLane = CommLane() if shared is None else shared.lane
        """The modeled link and the wait counters, shared like ``bytes_by_phase``."""
        self._all_gather = _first_attr("all_gather_single", "all_gather_into_tensor")
        self._reduce_scatter = _first_attr("reduce_scatter_single", "reduce_scatter_tensor")

    @property
    def bytes_moved(self) -> int:
        """Bytes this rank contributed to collectives (input sizes), all phases."""
        return sum(self.bytes_by_phase.values())

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate is None else self.replicate.world_size

    @property
    def replicate_rank(self) -> int:
        return 0 if self.replicate is None else self.replicate.rank

    @property
    def tensor_size(self) -> int:
        return 1 if self.tensor_group is None else dist.get_world_size(self.tensor_group)

    @property
    def data_parallel_size(self) -> int:
        """Ranks whose gradients are averaged: replicate x shard (R * S)."""
        return self.world.world_size

    def over(self, group: "dist.ProcessGroup") -> "Collectives":
        """Collectives over ``group`` (a sub-group of these ranks, e.g. hpZ's secondary group)
        whose bytes count in this object's per-phase totals."""
        return Collectives(group, counts=self)

    def _count(self, phase: Phase, nbytes: int) -> None:
        self.bytes_by_phase[phase.value] = self.bytes_by_phase.get(phase.value, 0) + nbytes

    def attach_link(self, link: ModeledLink | None) -> None:
        """Put ``link`` under every collective of this engine (the lane is shared by the mesh's
        groups): [Note: the modeled link] in infinity/_modeled_link.py."""
        self.lane.link = link

    def _issue(self, context: str, wire_bytes: float, fn, *args, dest: torch.Tensor | None = None,
               phase: Phase = Phase.OTHER, **kwargs) -> CommHandle:
        """Issue ``fn`` asynchronously ([Note: issue and wait]); ``wire_bytes``: what this rank
        puts on the link for it ([Note: wire bytes of a collective]). ``dest``: the tensor the
        collective writes (its first argument), poisoned until the wait under a link that asks
        for it."""
        where = f"{self.rank}/{self.world_size}"
        lane = self.lane
        deliver = None
        if (dest is not None and lane.link is not None and lane.link.model.poison_until_wait
                and dest.is_floating_point()):
            args, deliver = _poisoned(dest, args)
        try:
            work = fn(*args, group=self.group, async_op=True, **kwargs)
        except Exception as e:  # gloo/NCCL raise RuntimeError subclasses; keep the cause chained
            raise _collective_error(context, where, e) from e
        lane.issued += 1
        done_at = None if lane.link is None else lane.link.reserve(int(wire_bytes), phase.value,
                                                                   context)
        return CommHandle(work, done_at, lane, context, where, deliver, phase.value)

    def _run(self, context: str, fn, *args, wire_bytes: float = 0, phase: Phase = Phase.OTHER,
             **kwargs) -> None:
        self._issue(context, wire_bytes, fn, *args, phase=phase, **kwargs).wait()

    def _ring(self, nbytes: int) -> float:
        """[Note: wire bytes of a collective]
        What one rank sends for a ring collective over ``nbytes`` (the gathered output, the
        reduced input): (W - 1) / W of it; an all-reduce sends twice that (reduce-scatter, then
        all-gather); a broadcast, the bytes. NCCL's and gloo's ring algorithms move these
        amounts; the modeled link charges them."""
        return nbytes * (self.world_size - 1) / self.world_size

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, *, context: str,
                   phase: Phase = Phase.OTHER) -> None:
        """``out`` (numel = W * shard numel) receives every rank's ``shard``; shard may alias out."""
        self.all_gather_async(out, shard, context=context, phase=phase).wait()

    def all_gather_async(self, out: torch.Tensor, shard: torch.Tensor, *, context: str,
                         phase: Phase = Phase.OTHER) -> CommHandle:
        """:meth:`all_gather`, issued: ``out`` holds the result after the handle's wait."""
        if self.world_size == 1:
            if out.data_ptr() != shard.data_ptr():
                out.copy_(shard)
            return DONE
        self._count(phase, shard.numel() * shard.element_size())
        return self._issue(context, self._ring(out.numel() * out.element_size()),
                           self._all_gather, out, shard, dest=out, phase=phase)

    def reduce_scatter_sum(self, out: torch.Tensor, full: torch.Tensor, *, context: str,
                           phase: Phase = Phase.OTHER) -> None:
        """``out`` receives this rank's slice of the sum of every rank's ``full``."""
        self.reduce_scatter_sum_async(out, full, context=context, phase=phase).wait()

    def reduce_scatter_sum_async(self, out: torch.Tensor, full: torch.Tensor, *, context: str,
                                 phase: Phase = Phase.OTHER) -> CommHandle:
        """:meth:`reduce_scatter_sum`, issued: ``out`` holds the result after the handle's wait."""
        if self.world_size == 1:
            out.copy_(full)
            return DONE
        self._count(phase, full.numel() * full.element_size())
        return self._issue(context, self._ring(full.numel() * full.element_size()),
                           self._reduce_scatter, out, full, dest=out, phase=phase)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, *, context: str,
                   phase: Phase = Phase.OTHER) -> None:
        """Rank r's ``out`` slice s receives rank s's ``inp`` slice r (W equal slices each; the
        quantized reduce-scatter's transport, :mod:`infinity.zero._quantized_collectives`).
        Counted like the reduce-scatter: the whole input, this rank's own slice included."""
        if self.world_size == 1:
            out.copy_(inp)
            return
        self._count(phase, inp.numel() * inp.element_size())
        self._run(context, dist.all_to_all_single, out, inp,
                  wire_bytes=self._ring(inp.numel() * inp.element_size()), phase=phase)

    def all_to_all_uneven(self, out: torch.Tensor, inp: torch.Tensor, *, out_splits: list[int],
                          in_splits: list[int], context: str, phase: Phase = Phase.OTHER
                          ) -> None:
        """Rank r's ``out`` chunk s (``out_splits[s]`` elements) receives rank s's ``inp`` chunk r
        (``in_splits[r]``). Counted and charged to the link as what this rank sends to the
        others (its own chunk stays)."""
        if self.world_size == 1:
            out.copy_(inp)
            return
        sent = (sum(in_splits) - in_splits[self.rank]) * inp.element_size()
        self._count(phase, sent)
        self._run(context, dist.all_to_all_single, out, inp, output_split_sizes=out_splits,
                  input_split_sizes=in_splits, wire_bytes=sent, phase=phase)

    def all_reduce_sum(self, tensor: torch.Tensor, *, context: str,
                       phase: Phase = Phase.OTHER) -> None:
        self.all_reduce_sum_async(tensor, context=context, phase=phase).wait()

    def all_reduce_sum_async(self, tensor: torch.Tensor, *, context: str,
                             phase: Phase = Phase.OTHER) -> CommHandle:
        """:meth:`all_reduce_sum`, issued: ``tensor`` holds the sum after the handle's wait."""
        if self.world_size == 1:
            return DONE
        nbytes = tensor.numel() * tensor.element_size()
        self._count(phase, nbytes)
        return self._issue(context, 2 * self._ring(nbytes), dist.all_reduce, tensor, dest=tensor,
                           phase=phase)

    def all_reduce_replicas(self, tensor: torch.Tensor, *, context: str) -> None:
        """Sum ``tensor`` (a gradient shard) across the replicas ([Note: collectives over a
        mesh]); a no-op without replicas."""
        if self.replicate is not None:
            self.replicate.all_reduce_sum(tensor, context=context, phase=Phase.REPLICATE_REDUCE)

    def all_reduce_max(self, tensor: torch.Tensor, *, context: str) -> None:
        """Over the data-parallel group ([Note: collectives over a mesh])."""
        if self.world is not self:
            self.world.all_reduce_max(tensor, context=context)
            return
        if self.world_size == 1:
            return
        self._run(context, dist.all_reduce, tensor, op=dist.ReduceOp.MAX,
                  wire_bytes=2 * self._ring(tensor.numel() * tensor.element_size()))

    def broadcast(self, tensor: torch.Tensor, *, src: int = 0, context: str,
                  phase: Phase = Phase.OTHER) -> None:
        """From the data-parallel group's rank ``src`` ([Note: collectives over a mesh])."""
        if self.world is not self:
            self.world.broadcast(tensor, src=src, context=context, phase=phase)
            return
        if self.world_size == 1:
            return
        nbytes = tensor.numel() * tensor.element_size()
        self._count(phase, nbytes)
        self._run(context, dist.broadcast, tensor, group_src=src, wire_bytes=nbytes, phase=phase)

    def check_agreement(self, *, step: int, phase: Phase, unit_index: int, unit_name: str,
                        device: torch.device) -> None:
        """All-gather ``(step, phase, unit)`` and raise on every rank if the ranks disagree.

        Costs one tiny collective; run on the first step and when ``INFINITY_CHECK_COLLECTIVES=1``.
        Over the data-parallel group ([Note: collectives over a mesh]).
        """
        if self.world is not self:
            self.world.check_agreement(step=step, phase=phase, unit_index=unit_index,
                                       unit_name=unit_name, device=device)
            return
        if self.world_size == 1:
            return
        mine = torch.tensor([step, _PHASES.index(phase), unit_index], dtype=torch.int64, device=device)
        everyone = torch.empty(self.world_size * 3, dtype=torch.int64, device=device)
        self._run(f"agreement check before {phase.value} of unit {unit_index} {unit_name!r} "
                  f"(step {step})",
                  self._all_gather, everyone, mine, wire_bytes=self._ring(everyone.numel() * 8))
        rows = everyone.view(self.world_size, 3).tolist()
        if any(row != rows[0] for row in rows):
            what = "; ".join(f"rank {r}: step {s}, {_PHASES[p].value} of unit {u}"
                             for r, (s, p, u) in enumerate(rows))
            raise CollectiveError(
                f"ranks diverged: they are about to run different collectives ({what}). Rank "
                f"{self.rank} is at {phase.value} of unit {unit_index} {unit_name!r}. Every rank must run "
                f"the same modules in the same order (control flow that depends on the rank or on "
                f"the data breaks data-parallel training)")
