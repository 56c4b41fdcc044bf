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
backward, in one fixed order: descending unit index (units are numbered in the module tree's
pre-order, :func:`~infinity.zero._unit_choice.choose_units`, so this is the backward's usual
order: the last block first, the root, which holds the embedding, near the end). A unit whose
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


class ReduceOrder:
    """The fixed reduction order over the trainable units, and this backward's place in it."""

    def __init__(self, trainable_units: list[int]):
        self.order: list[int] = sorted(trainable_units, reverse=True)
        """Unit indices in the order their reductions are issued."""
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

    def rest(self) -> list[int]:
        """End of backward: the units not reduced yet, in order; starts the next backward."""
        rest = self.order[self._pos:]
        self._pos, self._ready = 0, set()
        return rest
