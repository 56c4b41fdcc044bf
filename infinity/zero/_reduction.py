"""A unit's gradient reduction once issued: the handles :meth:`GradientReducer.issue` returns.

:class:`~infinity.zero._grad_reducer.GradientReducer` decides how each group's gradient crosses
the ranks and issues the collectives; what it hands back lives here: one handle per group (the
collective issued whole, or a reduce-scatter cut into pieces), and :class:`Reduction`, the
unit's bundle of them, which the unit storage waits for where the buffers are reused
([Note: issue and wait] in infinity/zero/_collectives.py).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from infinity.zero._collectives import CommHandle, Collectives, Phase
from infinity.zero._flat_group import FlatGroup


class _Reducer(Protocol):
    """What a reduction needs of the :class:`~infinity.zero._grad_reducer.GradientReducer` that
    issued it (a protocol: that module imports this one)."""

    coll: Collectives
    data_parallel_size: int

    def _finish(self, g: FlatGroup, part: torch.Tensor) -> None: ...

    def _sum_replicas(self, part: torch.Tensor, *, context: str) -> None: ...


class _GroupReduction:
    """One group's issued reduction: its collective's handle, what turns the collective's
    output into the group's reduced partition (the replicas' sum, a dtype change), and the
    buffers the collective reads and writes (kept alive, and counted, until the wait)."""

    __slots__ = ("reducer", "group", "handle", "result", "buffers")

    def __init__(self, reducer: _Reducer, group: FlatGroup, handle: CommHandle,
                 result: Callable[[], torch.Tensor], buffers: tuple[torch.Tensor, ...]):
        self.reducer = reducer
        self.group = group
        self.handle = handle
        self.result = result
        self.buffers = buffers

    def wait(self) -> None:
        self.handle.wait()
        self.reducer._finish(self.group, self.result())
        self.buffers = ()

    def issue_next(self) -> bool:
        """Nothing left to issue: one collective, issued whole."""
        return False


class _PiecewiseReduction:
    """A reduce-scatter cut into pieces along the shard, issued one piece at a time:
    [Note: a large reduction spread over the backward] in infinity/zero/_grad_reducer.py. Piece
    i is every rank's slice [lo_i, hi_i) of its shard, copied out contiguously and divided by
    the ranks, reduce-scattered into this rank's ``part[lo_i:hi_i]``."""

    def __init__(self, reducer: _Reducer, group: FlatGroup, staging: torch.Tensor,
                 part: torch.Tensor, pieces: int, context: str, *, issue_first: bool = True):
        """``staging``: the unit's gradient, not yet divided by the ranks (each piece is, as it
        is copied out); ``part``: this rank's shard of the sum, in the wire's dtype.
        ``issue_first``: issue the first piece now (its turn); False: the caller issues pieces
        by number first ([Note: the head's gradient reduced as it is made] in
        infinity/zero/_head_grad.py)."""
        self.reducer = reducer
        self.group = group
        self.staging_dtype = staging.dtype
        self.staging: torch.Tensor | None = staging
        self.part = part
        self.buffers: tuple[torch.Tensor, ...] = (staging, part)
        self.context = context
        self.bounds = piece_bounds(group.shard_numel, pieces)
        self.handles: list[CommHandle | None] = [None] * len(self.bounds)
        self._left = len(self.bounds)
        if issue_first:
            self.issue_next()

    def issue_piece(self, i: int) -> None:
        """Issue piece ``i`` (its elements in the staging buffer are final on every rank)."""
        if self.handles[i] is not None:
            raise RuntimeError(f"{self.context}: piece {i + 1} issued twice")
        lo, hi = self.bounds[i]
        coll, ranks = self.reducer.coll, self.reducer.data_parallel_size
        piece = torch.empty((coll.world_size, hi - lo), dtype=self.staging_dtype,
                            device=self.part.device)
        piece.copy_(self.staging.view(coll.world_size, -1)[:, lo:hi])
        piece = piece.view(-1).div_(ranks)
        if piece.dtype != self.part.dtype:
            piece = piece.to(self.part.dtype)
        self.handles[i] = coll.reduce_scatter_sum_async(
            self.part[lo:hi], piece, context=f"{self.context} (piece {i + 1}/{len(self.bounds)})",
            phase=Phase.REDUCE_GRAD)
        self.buffers += (piece,)
        self._left -= 1
        if not self._left:  # all copied out: the staging may go
            self.staging = None
            self.buffers = tuple(b for b in self.buffers[1:])

    def issue_next(self) -> bool:
        """Issue the first piece not issued yet; False when every piece was issued already."""
        for i, handle in enumerate(self.handles):
            if handle is None:
                self.issue_piece(i)
                return True
        return False

    def wait(self) -> None:
        while self.issue_next():
            pass
        for handle in self.handles:
            handle.wait()
        part = self.part
        self.reducer._sum_replicas(part, context=self.context)
        self.reducer._finish(self.group, part.to(self.staging_dtype))
        self.buffers = ()

    def drop(self) -> None:
        """Wait for the pieces in flight and keep nothing (:meth:`GradientReducer.drop_early`)."""
        for handle in self.handles:
            if handle is not None:
                handle.wait()
        self.buffers, self.staging = (), None


def piece_bounds(shard_numel: int, pieces: int) -> list[tuple[int, int]]:
    """The slices [lo, hi) of a shard that a reduction in ``pieces`` reduce-scatters one by one
    (every rank's slice of its own shard, each)."""
    size = -(-shard_numel // pieces)
    return [(lo, min(shard_numel, lo + size)) for lo in range(0, shard_numel, size)]


class Reduction:
    """A unit's gradient reduction, issued by :meth:`GradientReducer.issue`: :meth:`wait`
    completes every group's collective and accumulates it; a second wait does nothing."""

    def __init__(self, groups: list[_GroupReduction | _PiecewiseReduction]):
        self._groups = groups

    def issue_piece(self) -> bool:
        """Issue the next piece of each group reduced in pieces; False when none was left."""
        return any([r.issue_next() for r in self._groups])  # a list: every group issues

    def wait(self) -> None:
        groups, self._groups = self._groups, []
        for i, r in enumerate(groups):
            try:
                r.wait()
            except BaseException:
                self._groups = groups[i + 1:]
                raise

    def tensors(self) -> list[torch.Tensor]:
        """The device buffers in flight (staging, wire, output, pieces), for the device's byte
        count: not a host accumulator staged in place (``_stages_in_host``), which the store
        counts."""
        return [t for r in self._groups for t in r.buffers
                if r.group.grad_host is None or t.untyped_storage().data_ptr()
                != r.group.grad_host.untyped_storage().data_ptr()]
