"""The tiers: where bytes live (the vocabulary of DESIGN.md), shared by the ledger and the store.

One enum for both, so that an estimate and the engine's own accounting name a tier the same way:
its ``value`` ('device', 'host', 'nvme') is what the ledger's JSON and the config's offload
devices use, its ``name`` what messages print.
"""

from __future__ import annotations

import enum


class Tier(str, enum.Enum):
    """Where bytes live, fastest first.

    DEVICE: compute-device memory (GPU; CPU memory on a machine without a GPU).
    HOST: host RAM (the store's arena: pinned when the engine's device is a GPU, page-aligned always).
    NVME: files on a local disk (one swap file per shard).
    """

    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"

    @property
    def label(self) -> str:
        """Lower-case name: config fields and stats keys (``memory.host_budget_bytes``)."""
        return self.value

    @classmethod
    def of_offload(cls, device: str) -> "Tier":
        """The home tier of an ``offload_*.device``: 'none' -> DEVICE, 'cpu' -> HOST, 'nvme' -> NVME."""
        try:
            return _OFFLOAD[device]
        except KeyError:
            raise ValueError(f"offload device: expected one of 'none', 'cpu', 'nvme', got "
                             f"{device!r}") from None


_OFFLOAD = {"none": Tier.DEVICE, "cpu": Tier.HOST, "nvme": Tier.NVME}
