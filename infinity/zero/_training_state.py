"""Where the parameter manager is in the training loop, and when updated stored shards go home:
the states, and the one table of the manager's allowed changes."""

from __future__ import annotations

import enum

from infinity._transitions import TransitionTable


class TrainingState(enum.Enum):
    """Where the manager is in the training loop (which units hold their full buffers on the
    device in each state is the unit's own :class:`UnitState`)."""

    IDLE = "idle"
    """Between steps (before the first forward, after a backward or an evaluation forward): only
    always-gathered units (and units the prefetcher warmed as shard copies) hold bytes."""
    FORWARD = "forward"
    """Inside ``forward_scope``: units are gathered around their modules."""
    AWAITING_BACKWARD = "awaiting-backward"
    """A forward with grad enabled ended; its graph holds the units' saved views."""
    BACKWARD = "backward"
    """Between the backward's start (``begin_backward``, or the first hook of a
    ``loss.backward()``) and ``finish_backward``: units are gathered for their gradients and
    released once those are reduced."""


_I, _F, _A, _B = (TrainingState.IDLE, TrainingState.FORWARD, TrainingState.AWAITING_BACKWARD,
                  TrainingState.BACKWARD)
TRAINING_TRANSITIONS = TransitionTable("parameter manager", {
    (_I, _F): "a forward through the engine starts",
    (_A, _F): "another forward before the backward (several losses summed into one)",
    (_F, _A): "a forward with grad enabled ended: a backward is expected",
    (_F, _I): "a forward without grad ended (evaluation), or a forward raised",
    (_A, _B): "a backward starts: engine.backward(loss), or the first hook of a "
              "loss.backward() ([Note: the end of backward] in _param_manager.py)",
    (_I, _B): "a backward with no forward of the engine since the last one (the module called "
              "directly, hooks only; an evaluation forward in between; retain_graph)",
    (_B, _I): "the backward ended (finish_backward, from engine.backward or from the callback "
              "queued on autograd's engine) or raised (abort_backward)",
})
"""The manager's allowed :class:`TrainingState` changes, each with why."""


class ParamWriteback(enum.Enum):
    """When a stored parameter shard the optimizer updated goes back to its home tier."""

    EAGER = "eager"
    """Right after the update (its write overlaps the updates of later keys)."""
    LAZY = "lazy"
    """On eviction or a flush (checkpoints, weights): the device holds every stored shard and
    the optimizer step is deferred ([Note: deferred optimizer step])."""
