"""``engine.stats()``: what an engine holds per tier, what it moved, where its time went."""

from __future__ import annotations

from typing import Any

from infinity.tiers import Tier

__all__ = ["engine_stats"]


def engine_stats(engine: Any, *, host_activation_bytes: dict[str, int],
                 optimizer_step_s: float) -> dict[str, Any]:
    """:meth:`~infinity.zero._engine.InfinityEngine.stats` of ``engine``, with what only the
    engine knows: the saved activations it keeps in torch's host memory (counted beside the
    arena) and the seconds its optimizer steps took."""
    held = engine.manager.device_bytes()
    state_device = 0 if engine.shard_optimizer.offloaded else engine.shard_optimizer.state_bytes()
    store = engine.store.stats() if engine.store is not None else {}
    grads_on_nvme = engine.offload is not None and engine.offload.grads_on_nvme
    return {
        "world_size": engine.collectives.data_parallel_size,  # R * S: what "mesh" splits
        "mesh": {"replicate": engine.collectives.replicate_size,
                 "shard": engine.collectives.world_size,
                 "tensor": engine.collectives.tensor_size},
        "stage": engine.manager.stage,
        "bytes": _tier_bytes(engine, held, state_device, store, host_activation_bytes,
                             grads_on_nvme),
        "model_state_bytes": {**held, "optimizer_state": engine.shard_optimizer.state_bytes()},
        **_traffic(engine, store),
        "prefetch": engine.manager.prefetch_stats(),
        "num_gathers": engine.manager.storage.num_gathers,
        # [Note: a gathered unit borrows its HOST copy]: group gathers without a copy.
        "num_borrowed_gathers": engine.manager.storage.num_borrowed_gathers,
        # [Note: hpZ secondary shards] in infinity/zero/_hpz.py; None when hpZ is off.
        "hpz": engine.manager.hpz.stats() if engine.manager.hpz is not None else None,
        **_optimizer(engine, optimizer_step_s, grads_on_nvme),
        "global_steps": engine.global_steps,
        "skipped_steps": engine.skipped_steps,
        "loss_scale": engine.scaler.scale,
        "store": store,
        # Which state moves to and from NVMe, so far: see where traffic exceeds the minimum.
        "nvme_bytes_by_kind": (engine.store.nvme_bytes_by_kind() if engine.store is not None
                               else {}),
        # [Note: saved activations are shards of the store] in
        # infinity/zero/_stored_activations.py: bytes per home tier (current, peak, saved so
        # far) and the NVMe bytes they moved; None when they are not in the store.
        "activations": (engine.stored_activations.stats()
                        if engine.stored_activations is not None else None),
    }


def _nvme_bytes(engine: Any, grads_on_nvme: bool) -> int:
    """Bytes the engine's state holds on NVMe: optimizer state, parameter shards, gradients."""
    nvme = 0
    if engine.optimizer_home is Tier.NVME:
        nvme += (engine.shard_optimizer.state_bytes() + engine.shard_optimizer.master_bytes()
                 - engine.shard_optimizer.host_resident_bytes)  # [Note: host-resident sub-groups]
    if engine.config.offload_param.device == "nvme":
        nvme += sum(g.shard_numel * engine.compute_dtype.itemsize for u in engine.manager.units
                    for g in u.groups if g.store_key is not None)
    if grads_on_nvme:  # [Note: gradients on NVMe] in infinity/zero/_grad_reducer.py
        nvme += engine.manager.grad_accumulator_bytes()
    return nvme


def _tier_bytes(engine: Any, held: dict[str, int], state_device: int, store: dict[str, Any],
                host_activation_bytes: dict[str, int], grads_on_nvme: bool) -> dict[str, Any]:
    """``stats()["bytes"]``: what each tier holds now and at its peak."""
    device_now = sum(held.values()) + state_device + store.get("device_used_bytes", 0)
    device_peak = (engine.manager.peak_device_bytes + state_device
                   + store.get("device_peak_bytes", 0))
    nvme = _nvme_bytes(engine, grads_on_nvme)
    return {"DEVICE": {"current": device_now, "peak": max(device_now, device_peak),
                       # What the peak adds up: the manager's parts at its own peak,
                       # the in-memory optimizer state, the store's DEVICE copies.
                       "peak_parts": {**engine.manager.peak_device_parts,
                                      "optimizer_state": state_device,
                                      "store_copies": store.get("device_peak_bytes", 0)}},
            "HOST": {"current": store.get("host_used_bytes", 0),
                     "peak": store.get("host_peak_bytes", 0),
                     "budget": store.get("host_budget_bytes", 0),
                     # [Note: activations on the host]: outside the arena, counted.
                     **host_activation_bytes},
            "NVME": {"current": nvme, "peak": nvme}}


def _traffic(engine: Any, store: dict[str, Any]) -> dict[str, Any]:
    """What moved between tiers and ranks, and the time the training thread waited for it."""
    link = engine.store.copy_link if engine.store is not None else None
    return {
        "bytes_moved": {"NVME->HOST": store.get("bytes_nvme_to_host", 0),
                        "HOST->DEVICE": store.get("bytes_host_to_device", 0),
                        "DEVICE->HOST": store.get("bytes_device_to_host", 0),
                        "HOST->NVME": store.get("bytes_host_to_nvme", 0),
                        "DEVICE<->DEVICE (collectives, sent)": engine.collectives.bytes_moved},
        # Per kind (Phase values: forward-gather, backward-gather, reduce-grad, ...).
        "collective_bytes_sent": dict(engine.collectives.bytes_by_phase),
        # [Note: the modeled link]: seconds the training thread waited on collectives, and
        # the seconds the modeled link under them was busy (None without one).
        "comm": engine.collectives.lane.stats(),
        # The same for the host<->device copies: the seconds the training thread waited on
        # the store (the copies', and any NVMe read's), and the copy link's busy seconds.
        "copy": {"exposed_s": store.get("wait_s", 0.0),
                 **({"link_busy_s": None, "link_bytes": None} if link is None else
                    {"link_busy_s": link.busy_s,
                     "link_bytes": link.bytes,
                     # Per direction (the link's busy seconds and bytes: the busier one's)
                     **{k: v for k, v in link.stats().items()
                        if k.endswith(("_to_device", "_to_host"))}})},
        "stall_s": store.get("wait_s", 0.0),
    }


def _optimizer(engine: Any, optimizer_step_s: float, grads_on_nvme: bool) -> dict[str, Any]:
    """Where the optimizer's time went and where its state and gradients live."""
    return {
        "optimizer_step_s": optimizer_step_s,
        # [Note: deferred optimizer step]: updates run in the next forward, and the part of
        # both spent waiting for sub-group reads.
        "optimizer_deferred_s": engine.shard_optimizer.deferred_s,
        "optimizer_read_wait_s": engine.shard_optimizer.wait_s,
        # [Note: host-resident sub-groups]: optimizer state homed on HOST out of an NVMe home.
        "optimizer_host_resident_bytes": engine.shard_optimizer.host_resident_bytes,
        "grads_on_nvme": grads_on_nvme,
        # The device budget holds every parameter shard: none is staged through the host
        # after its first read (the ledger of the engine's plan leaves that row out).
        "device_holds_params": engine.offload is not None and engine.offload.device_holds_params,
        # The optimizer's sub-group size as resolved ('auto' halves it for small host
        # budgets): the ledger of the engine's plan stages this many (None: nothing offloaded).
        "sub_group_numel": (engine.offload.sub_group_numel if engine.offload is not None
                            else None),
    }
