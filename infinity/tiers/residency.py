"""The residency state of one shard copy, and the one table of its allowed transitions.

Every state change of a copy goes through ``TRANSITIONS.check``; an illegal one is an internal
error (:class:`~infinity.errors.IllegalTransitionError`) that names the key, the tier, both states
and what is allowed. :class:`Tier` (where bytes live) is the package-wide enum of
:mod:`infinity._tier`, re-exported here.
"""

from __future__ import annotations

import enum

from infinity._tier import Tier
from infinity._transitions import TransitionTable


class Residency(enum.Enum):
    """State of one copy of a shard in one tier: the memory ledger in miniature.

    ABSENT: this tier holds no bytes for the copy (nothing counted against its budget).
    INFLIGHT: bytes are being moved INTO this tier (a fetch, or a write-back landing here). The
        destination bytes are allocated and counted against this tier's budget, but not yet valid;
        for NVME the swap file is being written.
    RESIDENT: this tier holds valid bytes, counted against its budget (for NVME: the file is valid).
    WRITING: valid bytes are being copied OUT of this tier to a slower one (write-back). They stay
        allocated and counted here, and must not change or be freed until the copy completes.
    ZEROS (NVME only): an NVME home registered without data and never written: its bytes are all
        zeros and no file holds them (nothing on disk, nothing counted); a read fills the
        destination with zeros instead of reading the disk. The first write-back makes it RESIDENT.
    """

    ABSENT = "absent"
    INFLIGHT = "inflight"
    RESIDENT = "resident"
    WRITING = "writing"
    ZEROS = "zeros"

    @property
    def holds_bytes(self) -> bool:
        """Bytes allocated for the copy in its tier (ZEROS: none, not even a file)."""
        return self not in (Residency.ABSENT, Residency.ZEROS)

    @property
    def valid(self) -> bool:
        """Readable bytes (a source for a copy to another tier)."""
        return self in (Residency.RESIDENT, Residency.WRITING, Residency.ZEROS)


_A, _I, _R, _W, _Z = (Residency.ABSENT, Residency.INFLIGHT, Residency.RESIDENT, Residency.WRITING,
                      Residency.ZEROS)

TRANSITIONS = TransitionTable("shard copy", {
    (_A, _I): "allocate and start moving bytes in (fetch, first write-back to NVMe)",
    (_A, _R): "allocate with known contents (register with initial data or zeros; an overwrite "
              "acquire, whose holder writes every byte before anyone reads)",
    (_I, _R): "the move into this tier completed",
    (_I, _A): "the move into this tier failed; its bytes are freed",
    (_R, _I): "overwrite a stale copy in place (write-back into the home copy)",
    (_R, _W): "start copying the bytes out to a slower tier (write-back)",
    (_W, _R): "the copy out completed (or failed: the bytes here are still valid)",
    (_R, _A): "evict: free the bytes",
    (_A, _Z): "register an NVME home without data: zeros, no file (NVME only)",
    (_Z, _I): "the first write-back into the NVME home starts writing its file",
    (_Z, _A): "unregister a never-written NVME home",
})
"""The only allowed (from, to) pairs of a copy's residency, each with why it happens."""

__all__ = ["TRANSITIONS", "Residency", "Tier"]
