"""Tiers, the residency state of one shard copy, and the one table of allowed transitions.

Every state change of a copy goes through :func:`check_transition`; an illegal one is an internal
error (:class:`ResidencyError`) that names the key, the tier and both states.
"""

from __future__ import annotations

import enum

from infinity._common import InfinityError


class Tier(enum.IntEnum):
    """Where bytes live, fastest first (the integer order is the speed order).

    DEVICE: compute-device memory (GPU; CPU memory on a machine without a GPU).
    HOST: the store's host arena (pinned where CUDA exists, page-aligned always).
    NVME: one swap file per shard under the swapper's directory.
    """

    DEVICE = 0
    HOST = 1
    NVME = 2

    @property
    def label(self) -> str:
        return self.name.lower()


class Residency(enum.Enum):
    """State of one copy of a shard in one tier: the memory ledger in miniature.

    ABSENT: this tier holds no bytes for the copy (nothing counted against its budget).
    INFLIGHT: bytes are being moved INTO this tier (a fetch, or a write-back landing here). The
        destination bytes are allocated and counted against this tier's budget, but not yet valid;
        for NVME the swap file is being written.
    RESIDENT: this tier holds valid bytes, counted against its budget (for NVME: the file is valid).
    WRITING: valid bytes are being copied OUT of this tier to a slower one (write-back). They stay
        allocated and counted here, and must not change or be freed until the copy completes.
    """

    ABSENT = "absent"
    INFLIGHT = "inflight"
    RESIDENT = "resident"
    WRITING = "writing"

    @property
    def holds_bytes(self) -> bool:
        return self is not Residency.ABSENT

    @property
    def valid(self) -> bool:
        """Readable bytes (a source for a copy to another tier)."""
        return self in (Residency.RESIDENT, Residency.WRITING)


_A, _I, _R, _W = Residency.ABSENT, Residency.INFLIGHT, Residency.RESIDENT, Residency.WRITING

TRANSITIONS: dict[tuple[Residency, Residency], str] = {
    (_A, _I): "allocate and start moving bytes in (fetch, first write-back to NVMe)",
    (_A, _R): "allocate with known contents (register with initial data or zeros; an overwrite "
              "acquire, whose holder writes every byte before anyone reads)",
    (_I, _R): "the move into this tier completed",
    (_I, _A): "the move into this tier failed; its bytes are freed",
    (_R, _I): "overwrite a stale copy in place (write-back into the home copy)",
    (_R, _W): "start copying the bytes out to a slower tier (write-back)",
    (_W, _R): "the copy out completed (or failed: the bytes here are still valid)",
    (_R, _A): "evict: free the bytes",
}
"""The only allowed (from, to) pairs, each with why it happens. Same-state "transitions" are illegal."""


class ResidencyError(InfinityError, RuntimeError):
    """An illegal residency transition: a bug in the store, never a user mistake."""

    def __init__(self, key: str, tier: Tier, old: Residency, new: Residency):
        allowed = sorted(n.name for (o, n) in TRANSITIONS if o is old)
        super().__init__(f"internal error: shard {key!r} copy on {tier.name}: illegal residency "
                         f"transition {old.name} -> {new.name} (from {old.name} only "
                         f"{', '.join(allowed) or 'nothing'} is allowed); please report this")
        self.key = key
        self.tier = tier
        self.old = old
        self.new = new


def check_transition(key: str, tier: Tier, old: Residency, new: Residency) -> None:
    """Raise :class:`ResidencyError` unless ``old -> new`` is in :data:`TRANSITIONS`."""
    if (old, new) not in TRANSITIONS:
        raise ResidencyError(key, tier, old, new)
