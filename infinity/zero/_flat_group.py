"""The records of the parameter manager: a unit, its flat groups, and where each parameter lives
in its flat buffer (the slot). No hooks, no collectives: :mod:`._param_manager` drives them.

:func:`layout_group` places parameters one after another in a flat buffer, each slot at a multiple
of 16 bytes, padded so that the buffer is ``world_size`` shards of a multiple of 16 bytes (the shard
of rank r is the contiguous slice ``[r*S, (r+1)*S)``): [Note: 16-byte aligned slots] in
infinity/ledger/_flat_layout.py.
"""

from __future__ import annotations

import dataclasses
import enum

import torch
from torch import nn

from infinity._transitions import TransitionTable
from infinity.ledger import flat_layout
from infinity.optim import StoredGrad
from infinity.zero._tensor_parallel import local_tensor


@dataclasses.dataclass
class ParamSlot:
    """Where one parameter lives in its flat buffer."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size


def layout_group(params: list[tuple[str, nn.Parameter]], world_size: int, dtype: torch.dtype
                 ) -> tuple[list[ParamSlot], int, int]:
    """Slots for ``params`` in order in a flat buffer of ``dtype``; returns (slots, numel of the
    parameters, padded numel: world_size shards). [Note: 16-byte aligned slots]. A DTensor
    parameter takes its local tensor's numel and shape ([Note: tensor-parallel parameters] in
    infinity/zero/_tensor_parallel.py)."""
    locals_ = [local_tensor(p) for _, p in params]
    layout = flat_layout([t.numel() for t in locals_], world_size, dtype.itemsize)
    slots = [ParamSlot(name=name, param=p, offset=off, numel=t.numel(), shape=t.shape)
             for (name, p), t, off in zip(params, locals_, layout.offsets)]
    return slots, layout.numel, layout.padded_numel


class UnitState(enum.Enum):
    """Where a unit's parameter bytes are (the device tier unless offload moves the shard).

    RELEASED: only this rank's shard holds bytes; the full buffer's storage is 0 bytes.
    GATHERING: the full buffer is allocated on the device and its all-gather is in flight
    (``Unit.pending``): its bytes are not valid until the gather is waited for.
    GATHERED: the full buffer holds every rank's shard on the device; parameters are its views.
    """

    RELEASED = "released"
    GATHERING = "gathering"
    GATHERED = "gathered"


UNIT_TRANSITIONS = TransitionTable("unit", {
    (UnitState.RELEASED, UnitState.GATHERING): "gather issued: the full buffer allocated, every "
                                               "rank's shard on its way (ahead of use, or on "
                                               "demand)",
    (UnitState.GATHERED, UnitState.GATHERING): "refresh issued: the optimizer changed the shards "
                                               "of a unit that stays gathered",
    (UnitState.GATHERING, UnitState.GATHERED): "gather waited: the full buffer holds the unit "
                                               "(forward, backward, or after a step)",
    (UnitState.GATHERED, UnitState.RELEASED): "release: the full buffer's storage resized to 0 "
                                              "([Note: release keeps parameter identity])",
})


@dataclasses.dataclass(eq=False)
class FlatGroup:
    """One flat buffer of a unit: parameters of one dtype and one ``requires_grad``."""

    key: str
    """Stable name ('u3.bfloat16.train'): the optimizer's key and the checkpoint's."""
    slots: list[ParamSlot]
    numel: int
    padded_numel: int
    shard_numel: int
    requires_grad: bool
    full: torch.Tensor
    """Full flat buffer; parameters are views of it (storage freed while the unit is released)."""
    shard: torch.Tensor | None
    """This rank's parameter shard: a view of ``full`` when the unit is always gathered, else its
    own tensor (the copy that stays when the unit is released); None when the store holds it."""
    master: torch.Tensor | None = None
    """fp32 optimizer partition (the shard; the whole buffer at stage 0); aliases the parameter
    partition when the compute dtype is fp32. None for frozen groups."""
    grad_staging: torch.Tensor | None = None
    """fp32 full-size gradient of the current backward (see [Note: gradient ledger])."""
    grad_staged: set[int] = dataclasses.field(default_factory=set)
    """id() of the slots ``grad_staging`` holds a gradient in; the rest of it is not zeroed
    until it is reduced ([Note: staging writes each gradient once] in
    infinity/zero/_grad_reducer.py)."""
    grad_acc: torch.Tensor | None = None
    """fp32 gradient summed over micro-batches: shard (stages 2-3) or full (0-1); None when zero."""
    grad_host: torch.Tensor | None = None
    """Offloaded optimizer: the accumulator (fp32, or the compute dtype: ledger.host_grad_dtype_of)
    over the optimizer's partition in the store's host arena; ``grad_acc`` is it while it holds a
    gradient ([Note: gradient placement])."""
    grad_stored: StoredGrad | None = None
    """Offloaded optimizer on NVMe with gradients there: the accumulator as NVMe-homed slices in
    the store, in place of ``grad_host`` ([Note: gradients on NVMe] in
    infinity/zero/_grad_reducer.py)."""
    store_key: str | None = None
    """Key of the parameter shard in the tiered store (parameter offload), else None."""
    tensor_sharded: bool = False
    """Its parameters are DTensors sharded over the tensor mesh: its gradient's squares are
    summed over the tensor ranks too ([Note: gradient norm across tensor ranks])."""


class UnitUse(enum.Enum):
    """What of the current step still reads a unit: the one state that decides its release
    (:data:`USE_TRANSITIONS`). A unit is released only when IDLE (and no prediction keeps it).

    PINNED: always gathered (stages 0-2, the persistent unit, a unit used outside its modules);
        never released, its hooks track nothing.
    IDLE: nothing of this step reads it.
    FORWARD: inside a forward pre-/post-hook pair (``Unit.users`` pairs: a module called inside
        itself, a recomputation).
    HELD: gathered for its backward (pre-backward hook) until nothing of that backward can still
        read it: every trainable gradient arrived, and for a unit with frozen parameters the hook
        on its module's inputs fired ([Note: backward gather and release] in
        infinity/zero/_param_manager.py).
    HELD_FORWARD: HELD, and inside a forward hook pair (recomputation under activation
        checkpointing runs the forward hooks inside the backward).
    """

    PINNED = "pinned"
    IDLE = "idle"
    FORWARD = "forward"
    HELD = "held"
    HELD_FORWARD = "held, forward"


_P, _I, _F, _H, _HF = (UnitUse.PINNED, UnitUse.IDLE, UnitUse.FORWARD, UnitUse.HELD,
                       UnitUse.HELD_FORWARD)

USE_TRANSITIONS = TransitionTable("unit use", {
    (_I, _F): "forward pre-hook: its module computes",
    (_F, _F): "another forward pre- or post-hook while a pair is open (a module called inside "
              "itself)",
    (_F, _I): "the last open forward pair closed: nothing reads it now",
    (_I, _H): "pre-backward hook: its backward is about to run",
    (_F, _HF): "pre-backward hook while a forward pair is open (a recomputation's order)",
    (_H, _HF): "forward pre-hook inside its backward (recomputation under checkpointing)",
    (_HF, _HF): "another forward hook of a recomputation while a pair is open",
    (_HF, _H): "the recomputation's last forward pair closed; still held",
    (_H, _I): "its backward is done: every trainable gradient arrived, and its inputs' "
              "gradient when it has frozen parameters",
    (_HF, _F): "its backward is done while a recomputation's forward pair is open",
    (_HF, _I): "the step ended with a pair open (a forward that raised, the end of backward)",
    (_I, _P): "pinned: used outside its modules ([Note: parameters used outside their module])",
    (_F, _P): "pinned while its forward runs (the outside-use detector, first forward)",
    (_H, _P): "pinned while held",
    (_HF, _P): "pinned while held and recomputing",
})
"""The allowed (from, to) pairs of a unit's use, each with why. End of step (end of backward, a
forward that raised) takes any unpinned state to IDLE: the FORWARD/HELD edges to IDLE above."""


@dataclasses.dataclass(eq=False)
class Unit:
    """One unit: its flat groups, where its bytes are (:class:`UnitState`, changed by
    :class:`~infinity.zero._unit_storage.UnitStorage`) and what reads it (:class:`UnitUse`,
    changed by the parameter manager's hooks through the methods below)."""

    index: int
    name: str
    groups: list[FlatGroup]
    num_trainable: int
    has_frozen: bool
    use: UnitUse = UnitUse.IDLE
    state: UnitState = UnitState.GATHERED
    users: int = 0
    """Forward hook pairs open now (FORWARD, HELD_FORWARD; 0 otherwise)."""
    inputs_done: bool = False
    """A hook on the module's inputs fired (its backward finished) in this backward: the
    condition of HELD -> IDLE for a unit with frozen parameters."""
    grads_arrived: set[int] = dataclasses.field(default_factory=set)
    """id() of the trainable parameters whose gradient autograd accumulated in this backward: the
    condition of HELD -> IDLE, and of its reduction."""
    rows_only: frozenset[int] = frozenset()
    """id() of the trainable parameters whose gradient comes as rows at the end of backward, not
    from autograd ([Note: embedding rows cross ranks as rows] in
    infinity/zero/_embedding_rows.py): not waited for by :attr:`grads_complete`."""
    rows_arrived: set[int] = dataclasses.field(default_factory=set)
    """id() of the parameters whose rows arrived in this backward."""
    pending: list = dataclasses.field(default_factory=list)
    """While GATHERING: the issued all-gathers' handles and what to do once they landed
    (callables: give back a store copy the gather read, keep an hpZ secondary shard)."""

    def transition(self, new: UnitState) -> None:
        UNIT_TRANSITIONS.check(f"{self.index} {self.name}", self.state, new)
        self.state = new

    def _use(self, new: UnitUse) -> None:
        USE_TRANSITIONS.check(f"{self.index} {self.name}", self.use, new)
        self.use = new

    @property
    def always_gathered(self) -> bool:
        return self.use is UnitUse.PINNED

    @property
    def releasable(self) -> bool:
        """Nothing of this step reads it (a prediction may still keep it)."""
        return self.use is UnitUse.IDLE

    @property
    def in_use(self) -> bool:
        return self.use in (UnitUse.FORWARD, UnitUse.HELD, UnitUse.HELD_FORWARD)

    @property
    def grads_complete(self) -> bool:
        """Every gradient autograd accumulates for it arrived (rows are not waited for)."""
        return len(self.grads_arrived - self.rows_only) == self.num_trainable - len(self.rows_only)

    @property
    def every_grad_arrived(self) -> bool:
        """Every trainable parameter got a gradient, through autograd or as rows."""
        return len(self.grads_arrived | self.rows_arrived) == self.num_trainable

    def enter_forward(self) -> None:
        if self.use is UnitUse.PINNED:
            return
        self.users += 1
        self._use(UnitUse.HELD_FORWARD if self.use in (UnitUse.HELD, UnitUse.HELD_FORWARD)
                  else UnitUse.FORWARD)

    def leave_forward(self) -> None:
        if self.use not in (UnitUse.FORWARD, UnitUse.HELD_FORWARD):
            return  # pinned, or the step was reset while its pair was open
        self.users -= 1
        if self.users:
            self._use(self.use)
        else:
            self._use(UnitUse.IDLE if self.use is UnitUse.FORWARD else UnitUse.HELD)

    def hold_for_backward(self) -> bool:
        """Pre-backward: hold it; False when it is pinned or held already."""
        if self.use is UnitUse.IDLE:
            self._use(UnitUse.HELD)
        elif self.use is UnitUse.FORWARD:
            self._use(UnitUse.HELD_FORWARD)
        else:
            return False
        return True

    def grad_arrived(self, param_id: int) -> tuple[bool, bool]:
        """Note a trainable parameter's gradient; (complete now, was complete already)."""
        late = self.grads_complete
        self.grads_arrived.add(param_id)
        return self.grads_complete, late

    def drop_hold(self) -> bool:
        """Held, and nothing of its backward can still read it: no longer held (True)."""
        if self.use not in (UnitUse.HELD, UnitUse.HELD_FORWARD):
            return False
        if not self.grads_complete or (self.has_frozen and not self.inputs_done):
            return False
        self._use(UnitUse.IDLE if self.use is UnitUse.HELD else UnitUse.FORWARD)
        return True

    def end_step(self) -> None:
        """The backward ended, or a forward raised: nothing of this step reads it any more."""
        self.grads_arrived = set()
        self.rows_arrived = set()
        self.inputs_done = False
        self.users = 0
        if self.use is not UnitUse.PINNED and self.use is not UnitUse.IDLE:
            self._use(UnitUse.IDLE)

    def pin(self) -> None:
        """Always gathered from now on."""
        if self.use is not UnitUse.PINNED:
            self._use(UnitUse.PINNED)
            self.users = 0
