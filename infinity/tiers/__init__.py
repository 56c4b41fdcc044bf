"""The tiered store: keyed shards over DEVICE / HOST / NVME with byte budgets; and the offload
budgets that size it for one model.

- :mod:`.store`: :class:`TieredStore`, the face (what happens to a shard, and when); the
  components it owns: :mod:`._shard_table` (the records and the one lock, [Note: store locking]),
  :mod:`._budgets`: :class:`~._budgets.TierBudgets`, the byte counts per tier and eviction
  ([Note: eviction policy]), :mod:`._mover` (copies and swap-ins on the store's threads),
  :mod:`._writeback` (dirty copies to their home), :mod:`._room_lane` (reads ahead that wait
  for room), :mod:`._read_out` (reads into callers' buffers, outside the budgets);
  :mod:`._read_gate`: :class:`ReadGate`, how a writer that owes bytes is asked before a read
  ([Note: the read gate]); :mod:`.residency`: the state of one copy and its transition
  table; :mod:`._records`: per-shard records, handles, counters; :mod:`._arena`: the one host
  arena.
- :mod:`._offload_budgets`: pure arithmetic: :class:`StateSizes` (what the store will hold) and
  :class:`OffloadRequest` (where state lives, the budgets asked for) in,
  :class:`OffloadBudgets` out (:func:`resolve_offload_budgets`), or a ``ValueError`` naming the
  field and the bytes needed.
- :mod:`._nvme_space`: the bytes the store will write to NVMe (:func:`nvme_bytes`, exact) and the
  free-space check made before the first (:func:`check_nvme_space`; [Note: NVMe space check] in
  infinity/tiers/_nvme_space.py).

Public API of the store (everything else is private)::

    from infinity.tiers import TieredStore, StoreConfig, Tier, Residency, TierHandle

    store = TieredStore(device, StoreConfig(device_budget_bytes=..., host_budget_bytes=...),
                        swapper=Swapper(nvme_dir),        # needed only for NVME-homed shards
                        next_use=None)                    # optional callable key -> distance | None
    store.register(key, numel, dtype, home: Tier, initial: Tensor | None = None)
    h = store.fetch(key, Tier.DEVICE | Tier.HOST, next_use=None)   # async; h.wait() -> Tensor
    h = store.acquire(key, tier, next_use=None)  # fetch + pin (never evicted until release)
    h = store.acquire(key, Tier.HOST, ahead=True)  # a read ahead: never waits for room here
                                                   # ([Note: a read ahead never waits for room on its caller])
    store.release(key, tier)                     # undo one acquire
    h = store.read_into(key, out)  # current bytes into the caller's host buffer, no room taken;
    # h.wait() -> out: [Note: a read into the caller's buffer takes no room] in infinity/tiers/_read_out.py
    t = store.get(key, tier)                     # tensor of a resident copy (ValueError otherwise)
    store.mark_dirty(key, tier)                  # the copy on tier was modified
    h = store.write_back(key)                    # async; h.wait() -> None
    store.flush()                                # write back every dirty shard and wait
    store.evict(key, tier)                       # drop a non-home copy (dirty: written back first)
    store.unregister(key); store.close()         # (also a context manager)
    store.state(key, tier) -> Residency; store.is_dirty(key) -> Tier | None; store.home(key) -> Tier;
    store.keys(); store.copy_info(key, tier) -> CopyInfo   # a read-only snapshot of one copy
    store.set_read_gate(gate)   # once: gate.apply_before_read(key) before every read
                                # ([Note: the read gate] in infinity/tiers/_read_gate.py)
    store.set_next_use(key, distance); store.stats() -> dict; store.reset_peaks()
    store.budget_bytes(tier); store.used_bytes(tier); store.moved_bytes(src, dst)  # cheap queries
    store.arena  # the HostArena (extents(), holes(), alignment_bytes, extent_bytes(n))

Rules the store keeps:

- Shards: a 1-D tensor of ``numel`` x ``dtype``, registered under a string key with a home tier. The
  home copy always exists: DEVICE/HOST homes hold an allocation for the shard's whole life; an
  NVME home is a swap file (``initial=None``: ZEROS, no file until the first write-back). Tensors the
  store hands out are 1-D views of its own memory: reshape them, do not keep them past an eviction.
- Residency: each copy has a :class:`Residency` (ABSENT, INFLIGHT, RESIDENT, WRITING; ZEROS for an
  NVME home never written) changed only through ``residency.TRANSITIONS``; an illegal change raises
  ``IllegalTransitionError`` (a bug).
- Fetch: a hit returns a completed handle; a copy already in flight is joined (one I/O for any number
  of concurrent fetches, counted 'late'); otherwise (a 'miss') memory is reserved in the caller's
  thread and the move runs on the swapper's / store's threads. NVME -> DEVICE stages through a HOST
  copy, which stays cached (evictable). DEVICE <- HOST and HOST <- DEVICE are copies; HOST <- NVME
  is a direct-I/O read into the arena extent. Use ``acquire`` for a copy compute will read: an
  unpinned copy may be evicted by any later allocation.
- Dirty data ([Note: dirty copy] in ``_records.py``): call ``mark_dirty(key, tier)`` after modifying a
  copy (every time). Other non-home copies are dropped as stale (ValueError if one is acquired).
  If ``tier`` is not home, the home copy is stale until a write-back, which ``write_back``, ``flush``,
  ``evict`` and budget eviction perform (DEVICE -> HOST -> NVME for an NVME home, through a budgeted
  HOST extent). Fetching/getting a stale home copy writes back first (fetch) or raises (get). A failed
  write-back keeps the dirty copy and re-raises from whoever needed the memory.
- Budgets: every DEVICE and HOST allocation (fetch, prefetch, staging, register) is checked. When a
  tier is full the store evicts unpinned, settled, non-home RESIDENT copies: furthest next use first
  (Belady) when a distance is known (``next_use`` callable first, else the last distance given to
  fetch/acquire/set_next_use; unknown counts as furthest), least recently used first otherwise and
  on ties. Dirty victims are written back first. When nothing can go: ``TierCapacityError`` with
  ``tier``, ``requested_bytes``, ``used_bytes`` and ``budget_bytes``. Pinned and in-flight copies are
  never evicted; when only moves already under way (write-backs and their HOST staging, fetches,
  copies being read) hold the room, the store waits for them instead of refusing.
- HOST memory ([Note: one host arena] in ``_arena.py``): one ``swapper.aligned_empty`` buffer of the
  HOST budget, carved into extents aligned to ``max(4096, swapper.alignment_bytes)``; a HOST copy of
  ``n`` bytes costs ``align_up(n, alignment)`` of the budget. Best-fit, coalescing free list; when no
  hole is large enough, copies are evicted (policy order) until one is, else TierCapacityError
  ("fragmented"). A shard's swap file holds its whole extent: ``uint8``, ``arena.extent_bytes(nbytes)``
  long, the shard's bytes first.
- DEVICE memory: ``torch.empty(numel, dtype=dtype, device=device)`` per copy (CPU memory on a machine
  without a GPU). With CUDA, host<->device copies run on one copy stream after an event recorded on
  the caller's current stream, and a move is complete (synchronised) before its handle completes.

``stats()`` keys (stable; :data:`STATS_KEYS`): ``bytes_nvme_to_host``, ``bytes_host_to_device``,
``bytes_device_to_host``, ``bytes_host_to_nvme`` (shard payload bytes moved per tier pair; a zero-fill
of a never-written NVME shard moves nothing; a ``read_into`` from a file counts as NVME -> HOST);
``fetch_hits``, ``fetch_late``, ``fetch_misses``
(fetch/acquire calls that found the copy resident / in flight / absent); ``fetch_overwrites``
(``acquire(overwrite=True)`` calls that allocated an absent copy without reading it); ``wait_s`` and
``num_waits``
(time blocked in ``TierHandle.wait`` and how many waits blocked); ``evictions_device``,
``evictions_host`` (copies dropped by policy or ``evict``); ``writebacks`` (write-backs issued);
``device_used_bytes``/``host_used_bytes`` (now), ``device_peak_bytes``/``host_peak_bytes``
(high-water marks since start or ``reset_peaks``), ``device_budget_bytes``/``host_budget_bytes``,
``host_largest_free_bytes`` (the largest arena hole), ``host_homed_bytes`` (arena bytes of the
shards homed on HOST, which are never evicted: the budget less these is the room for copies that
come and go), ``num_shards``.
"""

from infinity.tiers._arena import Extent, HostArena
from infinity.tiers._copy_lane import CopyLane
from infinity.tiers._offload_budgets import (AUTO_HOST_RAM_FRACTION, AUTO_SUB_GROUP_NUMEL,
                                             CUDA_FREE_FRACTION, OPTIMIZER_WINDOW_SLOTS,
                                             DeviceWorkingSet, auto_device_budget_bytes,
                                             SUB_GROUP_BYTES_PER_NUMEL, HostNeeds, OffloadBudgets,
                                             OffloadRequest, StateSizes, extent_bytes, host_needs,
                                             least_host_bytes, resolve_offload_budgets)
from infinity.tiers._nvme_space import NvmeBytes, NvmeDemand, check_nvme_space, nvme_bytes
from infinity.tiers._read_gate import ReadGate
from infinity.tiers._records import STATS_KEYS, CopyInfo, StoreConfig, TierHandle
from infinity.tiers.residency import TRANSITIONS, Residency, Tier
from infinity.tiers.store import TieredStore

__all__ = ["AUTO_HOST_RAM_FRACTION", "AUTO_SUB_GROUP_NUMEL", "CUDA_FREE_FRACTION", "CopyInfo",
           "DeviceWorkingSet", "OPTIMIZER_WINDOW_SLOTS", "STATS_KEYS", "auto_device_budget_bytes",
           "SUB_GROUP_BYTES_PER_NUMEL", "TRANSITIONS", "CopyLane", "Extent", "HostArena", "HostNeeds",
           "NvmeBytes", "NvmeDemand", "OffloadBudgets", "OffloadRequest", "ReadGate", "Residency",
           "StateSizes", "StoreConfig", "Tier", "TierHandle", "TieredStore", "check_nvme_space",
           "extent_bytes", "host_needs", "least_host_bytes", "nvme_bytes",
           "resolve_offload_budgets"]
