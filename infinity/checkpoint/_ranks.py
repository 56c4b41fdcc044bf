"""Errors agreed on by every rank: a save or load that fails on one rank fails on all of them."""

from __future__ import annotations

from typing import Any, Callable

import torch

from infinity.checkpoint._reader import CheckpointError
from infinity.checkpoint._target import CheckpointTarget

_MSG_BYTES = 2048
"""Bytes of an error message shared with the other ranks."""


def on_every_rank(target: CheckpointTarget, what: str, fn: Callable[[], Any],
                  cleanup: Callable[[Any], None] | None = None) -> Any:
    """Run ``fn`` on this rank; if it raised on any rank, raise on every rank (the failing rank
    its own error, the others a CheckpointError quoting it), so no rank goes on to change state
    or waits forever in a later collective. ``cleanup(result)`` runs on a rank whose own ``fn``
    succeeded before it raises for another's."""
    coll = target.collectives.world  # every data-parallel rank ([Note: collectives over a mesh])
    error, result = None, None
    try:
        result = fn()
    except Exception as e:  # shared below, then re-raised
        error = e
    if coll.world_size > 1:
        msgs = torch.zeros(coll.world_size, _MSG_BYTES, dtype=torch.int32, device=target.device)
        if error is not None:
            raw = f"{type(error).__name__}: {error}".encode()[:_MSG_BYTES] or b"?"
            msgs[coll.rank, :len(raw)] = torch.tensor(list(raw), dtype=torch.int32)
        coll.all_reduce_sum(msgs, context=what)
        failed = [r for r in range(coll.world_size) if bool(msgs[r].any())]
        if failed and error is None:
            if cleanup is not None:
                cleanup(result)
            row = msgs[failed[0]].cpu()
            text = bytes(row[row != 0].tolist()).decode(errors="replace")
            raise CheckpointError(f"{what}: rank {failed[0]} failed: {text}", path=what)
    if error is not None:
        raise error
    return result
