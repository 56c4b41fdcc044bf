"""The order in which every rank reduces the units' gradients in each backward.

[Note: every rank reduces every unit in one order]
A collective matches across ranks by its place in the sequence, so every rank must issue the
units' gradient reductions in the same order. Reducing a unit the moment its gradients are
complete breaks that when the ranks run different modules: at 2 ranks, a branch that rank 0
runs and rank 1 does not leaves its unit complete on rank 0 (reduced in the hooks) and
incomplete on rank 1 (reduced at the end of backward), and gloo aborts on the sizes that do not
match. torch's DDP reduces its buckets in a fixed order for this reason, and FSDP2 reduces every
group in every backward.

So with several data-parallel ranks every unit with trainable parameters is reduced in every
backward, in one fixed order: the backward's usual order, the reverse of the forward's, read off
the module tree (:func:`backward_order`): a unit is placed by the first module (pre-order) that
uses one of its parameters whose gradient autograd accumulates, latest first. So the last block
comes first and a root that holds the embedding near the end; a root whose embedding's gradient
crosses ranks as rows and whose other parameter is a tied or untied LM head ([Note: embedding
rows cross ranks as rows] in infinity/zero/_embedding_rows.py) comes first, since the head's
backward completes it. A unit whose
gradients are complete waits for those before it in the order; whatever is left at the end of
backward (a unit with parameters this rank did not use) is reduced then, in the same order, with
zeros where this rank has no gradient. Which parameters got a gradient on no rank at all is
settled at the step ([Note: parameters without a gradient] in infinity/zero/_grad_presence.py):
those are not stepped, as torch's optimizers skip a ``grad`` of None.

The cost of the fixed order: a unit that completes out of it (a parameter this rank did not use,
a model whose backward runs its units in another order) holds its staging, and the staging of
every unit after it in the order, until its turn. At one rank nothing crosses ranks and each
unit is reduced as soon as it is complete.
"""

from __future__ import annotations

from torch import nn

from infinity.zero._flat_group import Unit


def backward_order(model: nn.Module, units: list[Unit], *, skip_modules: set[int] = frozenset()
                   ) -> list[int]:
    """The indices of the units with trainable parameters reduced in the hooks, in the order
    their gradients usually complete: by the first module (pre-order over ``model``) holding a
    trainable parameter of the unit that is not only rows (``Unit.rows_only``), modules in
    ``skip_modules`` (id(); the tapped embeddings) not counted; latest first, ties by index."""
    first: dict[int, int] = {}  # id(parameter) -> position of its first counted holder
    for i, m in enumerate(model.modules()):
        if id(m) in skip_modules:
            continue
        for p in m._parameters.values():
            if p is not None:
                first.setdefault(id(p), i)
    keyed = []
    for u in units:
        ids = [id(s.param) for g in u.groups if g.requires_grad for s in g.slots
               if id(s.param) not in u.rows_only]
        if ids:
            keyed.append((min(first.get(i, -1) for i in ids), u.index))
    return [index for _, index in sorted(keyed, reverse=True)]


SPREAD_RATIO = 1.5
"""A unit is reduced in pieces when it is this many times the largest other unit, or more."""
MIN_PIECE_NUMEL = 1 << 20
"""Smallest piece of a spread reduction (elements): below it a collective's latency, and the
copy out of the staging, are not worth a piece."""


def spread_pieces(order: list[int], numel: dict[int, int]) -> dict[int, int]:
    """[Note: a large reduction spread over the backward] in infinity/zero/_grad_reducer.py:
    unit index -> pieces, for the units of ``order`` at least :data:`SPREAD_RATIO` times every
    other unit's trainable ``numel``: one piece for it and each unit reduced after it, each at
    least :data:`MIN_PIECE_NUMEL`. Units not listed are reduced whole."""
    pieces = {}
    for i, unit in enumerate(order):
        others = [numel[u] for u in order if u != unit]
        if i + 1 == len(order) or numel[unit] < SPREAD_RATIO * max(others):
            continue
        n = min(len(order) - i, numel[unit] // MIN_PIECE_NUMEL)
        if n > 1:
            pieces[unit] = n
    return pieces


class ReduceOrder:
    """The fixed reduction order over the trainable units, and this backward's place in it."""

    def __init__(self, order: list[int]):
        self.order: list[int] = list(order)
        """Unit indices in the order their reductions are issued (:func:`backward_order`)."""
        self._pos = 0
        """Entries of ``order`` reduced in this backward."""
        self._ready: set[int] = set()
        """Units complete in this backward and not yet reduced."""

    def complete(self, unit: int) -> list[int]:
        """``unit``'s gradients are complete: the units due now, in order (possibly none, when
        an earlier one is still incomplete; never a unit already reduced in this backward)."""
        if unit in self.order[:self._pos]:
            return []  # a gradient after its reduction: the end of backward reduces it again
        self._ready.add(unit)
        due = []
        while self._pos < len(self.order) and self.order[self._pos] in self._ready:
            due.append(self.order[self._pos])
            self._ready.discard(self.order[self._pos])
            self._pos += 1
        return due

    def pending(self, unit: int) -> bool:
        """``unit`` was not reduced yet in this backward."""
        return unit not in self.order[:self._pos]

    def rest(self) -> list[int]:
        """End of backward: the units not reduced yet, in order; starts the next backward."""
        rest = self.order[self._pos:]
        self._pos, self._ready = 0, set()
        return rest
