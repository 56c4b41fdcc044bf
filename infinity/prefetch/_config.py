"""The settings of the prefetch executor (:class:`PrefetchConfig`) and what it must know of each
unit before its first hook (:class:`UnitSizes`); [Note: all-gathers at fixed positions] is in
infinity/prefetch/_executor.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

from infinity.prefetch._trace import Level, as_level

__all__ = ["PrefetchConfig", "UnitSizes"]


@dataclass(frozen=True, kw_only=True)
class PrefetchConfig:
    """Knobs of :class:`PrefetchExecutor` (the parameter manager's prefetcher builds it from its budgets)."""

    host_inflight_budget_bytes: int | None = None
    """Bound on bytes of NVME->HOST fetches in flight (demand and prefetch alike); None: unbounded."""
    device_inflight_budget_bytes: int | None = None
    """Bound on bytes of HOST->DEVICE fetches in flight; None: unbounded."""
    gathered_inflight_budget_bytes: int | None = None
    """Bound on gathered bytes of all-gathers in flight; None: unbounded."""
    lookahead_bytes: int | None = None
    """Optional cap on prefetch bytes in flight (``zero.prefetch_lookahead_bytes``); None: from time alone."""
    nvme_to_host_bytes_per_s: float = 2e9
    """Starting estimate of swap-in bandwidth; measured transfers replace it (EMA)."""
    host_to_device_bytes_per_s: float = 8e9
    """Starting estimate of host->device copy bandwidth."""
    all_gather_bytes_per_s: float = 8e9
    """Starting estimate of all-gather bandwidth, in gathered bytes per second."""
    bandwidth_ema_weight: float = 0.3
    """Weight of each new bandwidth measurement in the moving average."""
    transfer_time_safety_factor: float = 1.25
    """Planned transfer times are stretched by this, so jitter in measurements does not make fetches late."""
    resync_window_entries: int = 64
    """How far past the cursor an unexpected unit is looked for before the step counts as diverged."""
    max_trace_variants: int = 4
    """Distinct trace shapes kept per phase ([Note: automatic phase detection] in
    infinity/prefetch/_trace.py)."""
    max_reuse_distance_bytes: int | None = 0
    """keep_gathered: keep when at most this many gathered bytes of other units run before the next use
    (0: only an immediate reuse, e.g. the forward/backward turnaround or a recomputation). Byte-based,
    so every rank decides alike. None: keep when the next use comes sooner than a re-fetch would take
    (time-based; single rank only)."""
    max_plan_entries: int = 4096
    """Most trace entries one planning call scans."""
    gather_lead_entries: int | None = None
    """None: all-gathers are planned by time like the other hops (one rank, or a fixed-size world
    where timing cannot differ). An integer k: entry j's all-gather is issued when entry j - k starts,
    on every rank alike ([Note: all-gathers at fixed positions]); set it whenever the world size > 1.
    Those all-gathers are bounded by k, not by ``gathered_inflight_budget_bytes`` (a byte check would
    decide differently per rank)."""

    def __post_init__(self) -> None:
        for name in ("host_inflight_budget_bytes", "device_inflight_budget_bytes",
                     "gathered_inflight_budget_bytes", "lookahead_bytes", "max_reuse_distance_bytes"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"prefetch.{name}: expected an integer >= 0 or None, got {v!r}")
        for name in ("nvme_to_host_bytes_per_s", "host_to_device_bytes_per_s", "all_gather_bytes_per_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"prefetch.{name}: expected a number > 0, got {v!r}")
        if not 0.0 < self.bandwidth_ema_weight <= 1.0:
            raise ValueError(f"prefetch.bandwidth_ema_weight: expected a number in (0, 1], "
                             f"got {self.bandwidth_ema_weight!r}")
        if not self.transfer_time_safety_factor >= 1.0:
            raise ValueError(f"prefetch.transfer_time_safety_factor: expected a number >= 1, "
                             f"got {self.transfer_time_safety_factor!r}")
        lead = self.gather_lead_entries
        if lead is not None and (isinstance(lead, bool) or not isinstance(lead, int) or lead < 1):
            raise ValueError(f"prefetch.gather_lead_entries: expected an integer >= 1 or None, "
                             f"got {self.gather_lead_entries!r}")
        for name in ("resync_window_entries", "max_trace_variants", "max_plan_entries"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"prefetch.{name}: expected an integer >= 1, got {v!r}")


@dataclass(frozen=True, kw_only=True)
class UnitSizes:
    """What the executor must know about a unit before its first hook."""

    unit: Hashable
    shard_bytes: int
    gathered_bytes: int
    home: Level = Level.NVME

    def __post_init__(self) -> None:
        object.__setattr__(self, "home", as_level(self.home))
        if self.home is Level.GATHERED:
            raise ValueError(f"unit {self.unit!r}: home must be NVME, HOST or DEVICE, got GATHERED")
        for name in ("shard_bytes", "gathered_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"unit {self.unit!r}: {name} expected an integer >= 0, got {v!r}")
