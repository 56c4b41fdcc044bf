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


@dataclasses.dataclass(eq=False)
class Unit:
    index: int
    name: str
    groups: list[FlatGroup]
    always_gathered: bool
    """Stages 0-2, the persistent unit, and units used outside their modules stay gathered."""
    num_trainable: int
    has_frozen: bool
    state: UnitState = UnitState.GATHERED
    refcount: int = 0
    """Forward hooks (and recomputation under activation checkpointing) currently using it."""
    backward_hold: bool = False
    """Gathered for this backward (pre-backward hook) until its gradients are reduced."""
    input_grads_done: bool = False
    """A post-backward hook on the module's inputs fired (its backward finished) in this backward."""
    grads_seen: set[int] = dataclasses.field(default_factory=set)
    """id() of the trainable parameters whose gradient arrived in this backward."""
    pending: list = dataclasses.field(default_factory=list)
    """While GATHERING: the issued all-gathers' handles and what to do once they landed
    (callables: give back a store copy the gather read, keep an hpZ secondary shard)."""

    def transition(self, new: UnitState) -> None:
        UNIT_TRANSITIONS.check(f"{self.index} {self.name}", self.state, new)
        self.state = new
