"""The records of the offloaded optimizer: one per sub-group of optimizer state, one per step under
way, one for the reads issued during backward, each with an explicit state and one table of the
changes allowed.

A *sub-group* is the slice ``[lo, hi)`` of one key's fp32 partition that is stepped and swapped as
one piece: one store shard ``[master | exp_avg | exp_avg_sq]``, homed on NVME (a swap file) or,
with room to spare, on HOST ([Note: host-resident sub-groups]).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Mapping

import torch

from infinity._transitions import TransitionTable
from infinity.optim._partition import StoredGrad
from infinity.optim._runs import AdamRun
from infinity.tiers import Tier, TierHandle


class SubGroupState(enum.Enum):
    """Where one sub-group is in the optimizer's pipeline (the store's residency says which tiers
    hold its bytes; this says what the optimizer holds of it).

    AT_REST: the optimizer holds nothing of it; its bytes are in its home (and perhaps cached in
        HOST by the store, evictable).
    READING: an acquire into HOST was issued (read ahead, or on demand for its update): it holds a
        pin on the HOST copy, which counts against the read-ahead window.
    UPDATING: pinned in HOST, Adam running on it.
    WRITING: updated; its write-back to the NVMe home was issued and not yet waited for (no pin:
        the store keeps the HOST copy until the write completes).
    """

    AT_REST = "at-rest"
    READING = "reading"
    UPDATING = "updating"
    WRITING = "writing"


_R, _G, _U, _W = (SubGroupState.AT_REST, SubGroupState.READING, SubGroupState.UPDATING,
                  SubGroupState.WRITING)
SUB_GROUP_TRANSITIONS = TransitionTable("optimizer sub-group", {
    (_R, _G): "an acquire into HOST was issued: read ahead (backward, or the step's window), or "
              "on demand for its update",
    (_G, _U): "its turn in the step: the acquire completed and Adam runs on the pinned copy",
    (_G, _R): "a read ahead dropped unused (no step follows it: fp16 overflow; the step ended), "
              "or the read failed (no pin is left)",
    (_U, _W): "updated: the write-back to its NVMe home was issued",
    (_U, _R): "updated in a HOST home (nothing to write), or the update or its write-back raised; "
              "the pin is gone",
    (_W, _R): "the write-back was waited for (drain), or left to finish on its own by a failed step",
})
"""The allowed :class:`SubGroupState` changes of a sub-group, each with why."""


@dataclasses.dataclass(eq=False, kw_only=True)
class SubGroup:
    """One sub-group of one key's optimizer state (see the module docstring)."""

    key: str
    """The optimizer key (a unit flat group) it belongs to."""
    lo: int
    hi: int
    """Its slice ``[lo, hi)`` of the key's fp32 partition."""
    store_key: str
    """Its shard in the tiered store: ``[master | exp_avg | exp_avg_sq]``, ``3 * numel`` fp32."""
    home: Tier
    """NVME (a swap file), or HOST when homed in host memory ([Note: host-resident sub-groups])."""
    state: SubGroupState = SubGroupState.AT_REST
    read: TierHandle | None = None
    """READING: the acquire's handle (``wait()`` gives the pinned HOST tensor)."""
    read_ahead: bool = False
    """READING: ``read`` was issued ahead of its use (it may fail for want of room, and is then
    issued again where it is needed)."""
    grad_read: TierHandle | None = None
    """READING, when the step's gradient of its key is a :class:`StoredGrad`: the acquire of
    its gradient slice into HOST, pinned with it (None: acquired at its update)."""
    writeback: TierHandle | None = None
    """WRITING: the write-back's handle."""

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    def transition(self, new: SubGroupState) -> None:
        SUB_GROUP_TRANSITIONS.check(self.store_key, self.state, new, tier=self.home)
        self.state = new


class StepState(enum.Enum):
    """Whether the offloaded optimizer has a step under way.

    IDLE: no step under way; reads may be issued ahead for keys whose gradients are final.
    PENDING: a step is recorded (:class:`StepRun`): updates not yet run (deferred into the next
        forward) or write-backs not yet waited for.
    ADVANCING: updates are running (the store's read hook must not re-enter them).
    """

    IDLE = "idle"
    PENDING = "pending"
    ADVANCING = "advancing"


_I, _P, _A = StepState.IDLE, StepState.PENDING, StepState.ADVANCING
STEP_TRANSITIONS = TransitionTable("optimizer step", {
    (_I, _P): "step() recorded a step: its updates run now or, deferred, before their shards are "
              "read in the next forward",
    (_P, _A): "updates run: in step(), before a parameter shard is read (apply_before_read), or "
              "in drain()",
    (_A, _P): "the updates asked for ran; later ones, or write-backs, remain",
    (_A, _I): "an update raised: the step ends there, the keys not updated keep their old state",
    (_P, _I): "drain(): every update ran and every write-back was waited for",
})
"""The allowed :class:`StepState` changes of the offloaded optimizer, each with why (the record of
the step itself is :class:`StepRun`)."""


@dataclasses.dataclass(eq=False)
class StepRun:
    """One optimizer step of the offloaded optimizer, possibly deferred."""

    runs: Mapping[str, tuple[AdamRun, ...]]
    """Key -> the slices this step updates, each with its step number and hyperparameters, read
    when the step was recorded ([Note: runs of a flat partition] in infinity/optim/_runs.py; a
    scheduler may change the groups before a deferred update runs)."""
    grad_scale: float
    """Applied to every gradient: the loss scale's inverse times the clip coefficient."""
    grads: Mapping[str, torch.Tensor | StoredGrad]
    items: list[SubGroup]
    """Sub-groups in update order, one key's together (its parameter shard is opened once)."""
    window: int
    """Sub-groups pinned at once at most (the one updated included)."""
    done: int = 0
    """Items updated so far (a prefix of ``items``)."""
    cursor: int = 0
    """Items whose read was issued so far (a prefix, >= ``done``)."""
    pending_params: dict[str, str] = dataclasses.field(default_factory=dict)
    """Parameter store key -> optimizer key, for the deferred keys not updated yet."""
    last_of: dict[str, int] = dataclasses.field(default_factory=dict)
    """Optimizer key -> index of its last item (a deferred update runs up to a key boundary)."""

    def __post_init__(self) -> None:
        self.last_of = {sg.key: i for i, sg in enumerate(self.items)}

    @property
    def pending_keys(self) -> list[str]:
        """Keys whose update has not run yet, in order."""
        return list(dict.fromkeys(sg.key for sg in self.items[self.done:]))


@dataclasses.dataclass(eq=False)
class ReadAhead:
    """The reads issued during a backward, before the step exists ([Note: optimizer read-ahead])."""

    ready: dict[str, None] = dataclasses.field(default_factory=dict)
    """Keys whose gradient is final in this step, in the order they became final."""
    full: bool = False
    """The window filled up: later keys are read by the step (what is read ahead stays a prefix
    of the step's order)."""

    def clear(self) -> None:
        self.ready.clear()
        self.full = False
