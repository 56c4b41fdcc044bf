"""One checker for every state machine of the package: a table of allowed edges, each with why.

Every record with an explicit state (a shard copy's residency, a swap file, a unit, an optimizer
sub-group, the parameter manager's training state) keeps its allowed ``(old, new)`` pairs in one
:class:`TransitionTable`, each edge with the reason it happens, and changes state only through
:meth:`TransitionTable.check`. An edge that is not in the table raises
:class:`~infinity.errors.IllegalTransitionError` naming the record, its key (and tier), both states
and what is allowed from the old one. Same-state "transitions" are illegal unless listed.
"""

from __future__ import annotations

from typing import Any, Generic, Mapping, TypeVar

from infinity.errors import IllegalTransitionError

S = TypeVar("S")


class TransitionTable(Generic[S]):
    """The allowed edges of one kind of record (``kind`` names it in errors)."""

    def __init__(self, kind: str, edges: Mapping[tuple[S, S], str]):
        self.kind = kind
        self.edges: dict[tuple[S, S], str] = dict(edges)
        """(from, to) -> why the record makes that change."""

    def __contains__(self, edge: tuple[S, S]) -> bool:
        return edge in self.edges

    def allowed_from(self, old: S) -> list[str]:
        return sorted(getattr(n, "name", str(n)) for (o, n) in self.edges if o == old)

    def check(self, key: Any, old: S, new: S, *, tier: Any = None) -> None:
        """Raise :class:`IllegalTransitionError` unless ``old -> new`` is an edge of the table."""
        if (old, new) not in self.edges:
            raise IllegalTransitionError(kind=self.kind, key=key, old=old, new=new,
                                         allowed=self.allowed_from(old), tier=tier)
