"""Where the offloaded optimizer's step writes the new parameters: the one key's parameter shard
open while its sub-groups are stepped, and the copy-out to a GPU shard (pinned staging on a side
stream) that the shard waits for before it is closed."""

from __future__ import annotations

import sys
from typing import Any, ContextManager

import torch

from infinity._async_copy import SideStream, StagingRing
from infinity.io import pinned_staging_ring
from infinity.optim._key_table import KeyTable
from infinity.optim._partition import open_param_out
from infinity.optim._runs import covers
from infinity.optim._sub_group import StepRun


class CopyOut:
    """The copy-out of new parameter values to GPU shards: its staging and its stream, made on
    first use."""

    def __init__(self) -> None:
        self._ring: StagingRing | None = None
        """Pinned staging of the copy-out to GPU parameter shards, reused under events (None
        until a GPU shard is written; host bytes outside the arena: two sub-groups of the
        compute dtype)."""
        self._up: SideStream | None = None
        """Where the copy-out to GPU shards runs ([Note: copies on a side stream] in
        infinity/_async_copy.py): the compute stream joins it before a written shard is closed."""

    def stream(self, device: torch.device) -> SideStream:
        if self._up is None:
            self._up = SideStream(device)
        return self._up

    def ring(self, device: torch.device) -> StagingRing:
        """The pinned staging of the copy-out to a GPU shard, made on first use (two slots: one
        filled by Adam while the other's copy runs)."""
        if self._ring is None:
            self._ring = pinned_staging_ring(device)
        return self._ring

    def join(self) -> None:
        """Before a parameter shard written by the copy-out is closed (marked dirty, written
        back, gathered): the compute stream waits for the copies, on the GPU."""
        if self._up is not None:
            self._up.join()


class OpenParamShard:
    """The one key whose parameter shard is open (pinned) while its sub-groups are stepped, in
    :meth:`OffloadedShardOptimizer._advance`: opening another key closes it first (its copies
    out joined, then the shard closed: marked dirty, maybe written back)."""

    def __init__(self, keys: KeyTable, copy_out: CopyOut):
        self._keys = keys
        self._copy_out = copy_out
        self._key: str | None = None
        self._ctx: ContextManager[Any] | None = None
        self._out: Any = None

    def open(self, key: str, run: StepRun) -> Any:
        """What ``key``'s new parameters are written into, opened unless it is open already.
        Every sub-group of a key is stepped while its shard is open: where ``run`` updates the
        key end to end, it is written whole and a stored shard is not read first."""
        if key != self._key:
            self.close()
            overwrite = covers(run.runs[key], self._keys.numel(key))
            ctx = open_param_out(self._keys.outs[key], overwrite=overwrite)
            self._out = ctx.__enter__()
            self._key, self._ctx = key, ctx
        return self._out

    def close(self, exc_info: tuple = (None, None, None)) -> None:
        """Close the open shard (``exc_info``: the error that ends the step, which leaves it
        unmarked); a no-op when none is open. Closed once: a copy out that fails closes it as
        failed too."""
        if self._ctx is None:
            return
        ctx, self._ctx, self._key, self._out = self._ctx, None, None, None
        try:
            self._copy_out.join()
        except BaseException:
            ctx.__exit__(*sys.exc_info())
            raise
        ctx.__exit__(*exc_info)
