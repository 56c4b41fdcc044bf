"""Adam(W) whose fp32 master and moments live in the tiered store (home HOST or NVME), stepped by
sub-group in a pipeline whose NVMe reads and writes overlap the update (and, deferred, the next
forward). See :class:`OffloadedShardOptimizer` for the notes behind it."""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
from typing import Any, ContextManager, Iterable, Iterator, Mapping, Sequence

import torch

from infinity._async_copy import SideStream, StagingRing
from infinity.config import OptimizerConfig
from infinity.errors import TierCapacityError
from infinity.io import engine_buffers, pinned_staging_ring
from infinity.optim._partition import StoredGrad, check_numel, open_param_out
from infinity.optim._runs import AdamRun, adam_runs, clipped, config_hyperparameters, covers
from infinity.optim._sub_group import (STEP_TRANSITIONS, ReadAhead, StepRun, StepState, SubGroup,
                                       SubGroupState)
from infinity.tiers import SUB_GROUP_BYTES_PER_NUMEL, Residency, Tier, TieredStore, TierHandle

logger = logging.getLogger(__name__)


class OffloadedShardOptimizer:
    """Adam(W) whose fp32 master and moments live in the tiered store (home HOST or NVME).

    Each key's master is cut into sub-groups of ``sub_group_numel`` elements; each sub-group is one
    store shard ``[master | exp_avg | exp_avg_sq]`` (fp32, one I/O per sub-group). ``step`` is a
    pipeline over the sub-groups of every key: reads run ahead of the update within the read-ahead
    window, and the write-back of each sub-group is issued right after its update, so NVMe reads
    and writes overlap the CPU math. The new parameters are written into ``param_out`` (the
    low-precision copy-out of :func:`infinity.optim.cpu_adam.adam_step_flat`, or a copy of the master for
    fp32 compute).

    [Note: optimizer read-ahead] With an NVME home the step is I/O-bound (12 B per parameter read
    and written), so its reads start during backward: :meth:`prefetch` (called once a key's
    gradient is final in this backward) acquires that key's sub-groups into HOST while they fit the
    window of ``window_sub_groups`` (sized by the offload budgets in slots of the largest
    sub-group's extent); the step
    then runs the prefetched keys first, in the order they were prefetched (backward order), and
    keeps the window full of reads for the rest. The window is sized by the offload budgets so that the
    pinned sub-groups leave the host-homed shards and the parameter staging their room; the
    store's budgets are enforced on every read all the same. A read ahead that must wait for room
    (a write-back of a stepped sub-group) waits on the store's room lane, not on the training
    thread ([Note: a read ahead never waits for room on its caller] in infinity/tiers/store.py); one
    that finds no room at all is read again where its update needs it (:meth:`_wait_read`). The
    update itself still waits for the
    step (exact global-norm clipping needs every gradient first). :meth:`cancel_prefetch` drops
    the reads when no step follows (an fp16 overflow). Stepped sub-groups stay cached in HOST once
    written back; the next step takes the keys still cached right after the ones read ahead, and
    marks them needed soonest for the store's eviction, so that its own reads do not evict them
    first (in a fixed order LRU drops exactly those before the step reaches them). Measured on
    the 2-core VM (135M GPT, `infinity bench step`): with half the training state's bytes as host
    budget the (then fp32) gradient accumulators left room for three sub-groups and the step stayed
    bound by the disk (~3 GB read + written per step); at 0.9 of it the cached sub-groups cut the
    step from 1.1 s to 0.7 s.

    [Note: deferred optimizer step] With an NVME home the step is bound by the disk (12 B per
    parameter read and written), and the window above holds only what the host budget leaves,
    so most of it cannot move into backward. But a unit's new parameters are not needed until
    the next forward reads its shard. ``step(defer=True)`` therefore computes nothing for keys
    whose parameter shard the store holds: it records the step (step number, lr, the gradient
    scale with the exact clip coefficient, the gradients) and starts the reads of the first
    sub-groups in the next forward's order. The store calls :meth:`apply_before_read` before it
    reads any shard (its read gate, ``TieredStore.set_read_gate``); for the shard of a key still pending, the
    update of that key (and of the keys before it in that order) runs right then, on the
    caller's thread, while the reads for the next keys are issued, so the reads and the
    write-backs of the step overlap the forward's compute. Keys without a stored shard (always
    gathered, or parameters not offloaded) are read without the store, so they are updated in
    ``step`` itself. :meth:`drain` runs whatever is left and waits for every write-back; the
    engine calls it before the next backward (the gradients are about to be overwritten) and
    before anything reads or replaces state (``full_state_dict``, checkpoints, weights). Every
    update is the same arithmetic on the same bytes as in ``step(defer=False)``, so training is
    bitwise the same (tests/engine/test_deferred_step.py). A HOST home defers too where the
    updated shards cross to a device each step: then the copies up overlap the updates ([Note: a
    deferred step overlaps the copies up] in infinity/zero/_engine.py).

    Each sub-group is a :class:`~infinity.optim._sub_group.SubGroup` record with a state
    (AT_REST, READING, UPDATING, WRITING); the step under way is a
    :class:`~infinity.optim._sub_group.StepRun` and the optimizer's own state a
    :class:`~infinity.optim._sub_group.StepState`, each changed only through its transition table.
    """

    offloaded = True
    """State lives in the tiered store; ``master_values`` and ``state_of`` return CPU copies."""

    def __init__(self, config: OptimizerConfig, store: TieredStore, *, home: Tier,
                 sub_group_numel: int, window_sub_groups: int = 2, host_resident_bytes: int = 0):
        """``config``: resolved hyperparameters (fp32 moments: ``InfinityConfig`` checks it).
        ``home``: HOST or NVME. ``window_sub_groups``: sub-groups pinned in HOST at once at most
        with an NVME home ([Note: optimizer read-ahead]; at least two). ``host_resident_bytes``:
        NVME home, host room in which sub-groups are homed on HOST instead
        ([Note: host-resident sub-groups] in infinity/tiers/_offload_budgets.py)."""
        if home not in (Tier.HOST, Tier.NVME):
            raise ValueError(f"offloaded optimizer: home must be HOST or NVME, got {home!r}")
        self.config = config
        self.lr = float(config.lr)
        """Current learning rate (a scheduler may set it between steps)."""
        self.step_count = 0
        """Optimizer steps taken (Adam's bias correction uses it)."""
        self.store = store
        self.home = home
        self.sub_group_numel = int(sub_group_numel)
        self.window_sub_groups = max(2, int(window_sub_groups)) if home is Tier.NVME else 2
        """Sub-groups pinned at once at most (read ahead plus the one being updated)."""
        self._resident_room_bytes = int(host_resident_bytes) if home is Tier.NVME else 0
        """Host room not yet taken by host-resident sub-groups, in arena extents; :meth:`add`
        takes it in add order (a prefix)."""
        self.host_resident_bytes = 0
        """Bytes of optimizer state homed on HOST although the optimizer's home is NVME."""
        self._sub_groups: dict[str, list[SubGroup]] = {}
        """Key -> its sub-groups in order (the records of every sub-group's state)."""
        self._outs: dict[str, Any] = {}
        """Key -> what the new parameters are written into (see :func:`open_param_out`)."""
        self._param_keys: dict[str, str] = {}
        """Key -> store key of its parameter shard, when the store holds it (see :meth:`add`)."""
        self._state_bytes = 0
        self.state = StepState.IDLE
        """Whether a step is under way (changed only through STEP_TRANSITIONS)."""
        self._run: StepRun | None = None
        """The step under way (PENDING or ADVANCING): updates not run, write-backs not waited."""
        self._reading: dict[str, SubGroup] = {}
        """Store key -> sub-group, for the sub-groups in READING (the window's pins), in issue
        order."""
        self._read_ahead = ReadAhead()
        """The reads issued during backward, before the step exists."""
        self.wait_s = 0.0
        """Seconds the step spent blocked on sub-group fetches (the pipeline's stall)."""
        self.deferred_s = 0.0
        """Seconds spent in updates of deferred steps, run before a shard read (in the forward)."""
        self._held: dict[str, tuple[torch.Tensor, Any, str | None]] | None = None
        """While masters stream in ([Note: masters stream into the optimizer]): the keys whose
        first sub-group will be homed on HOST, held back until :meth:`release_held`; None
        otherwise."""
        self._held_room_bytes = 0
        """While streaming: host room not yet promised to a held key."""
        self._add_order: list[str] = []
        """While streaming: every key in the order it was offered (held or added)."""
        self._ring: StagingRing | None = None
        """Pinned staging of the copy-out to GPU parameter shards, reused under events (None
        until a GPU shard is written; host bytes outside the arena: two sub-groups of the
        compute dtype)."""
        self._up: SideStream | None = None
        """Where the copy-out to GPU shards runs ([Note: copies on a side stream] in
        infinity/_async_copy.py): the compute stream joins it before a written shard is closed."""

    def _to(self, new: StepState) -> None:
        STEP_TRANSITIONS.check("offloaded optimizer", self.state, new)
        self.state = new

    # ------------------------------------------------------------------ keys and their state

    def hold_host_resident(self) -> None:
        """Start streaming masters in ([Note: masters stream into the optimizer]): from here
        until :meth:`release_held`, :meth:`add` registers the sub-groups homed on NVME at once
        and holds back the keys that will have host-resident sub-groups."""
        if self._sub_groups or self._held is not None:
            raise RuntimeError("shard optimizer: hold_host_resident() before the first add()")
        self._held, self._held_room_bytes, self._add_order = {}, self._resident_room_bytes, []

    def release_held(self) -> None:
        """Register the held keys (their host-resident sub-groups are long-lived HOST extents,
        carved now that the set-up copies are gone), then restore the offered order, which is
        the step's tie-break."""
        if self._held is None:
            return
        held, self._held = self._held, None
        for key, (master, param_out, param_key) in held.items():
            self.add(key, master, param_out, param_key=param_key)
        self._sub_groups = {key: self._sub_groups[key] for key in self._add_order}
        self._add_order = []

    def drop_setup_copies(self) -> None:
        """Evict the HOST copies that registering NVME-homed sub-groups left behind (each waits
        for its write), so that the long-lived extents carved next pack at the arena's top
        ([Note: set-up copies strew the home extents] in infinity/zero/_unit_builder.py)."""
        for records in self._sub_groups.values():
            for sg in records:
                if sg.home is Tier.NVME:
                    self.store.evict(sg.store_key, Tier.HOST)

    def _resident_prefix(self, n_total: int, room_bytes: int) -> tuple[int, int]:
        """[Note: host-resident sub-groups] for a key of ``n_total`` elements given
        ``room_bytes`` of host room: how many of its leading sub-groups are homed on HOST, and
        the room left. A prefix only (no later, smaller sub-group lands between cached copies):
        the first sub-group that does not fit leaves no room. Each takes the arena's own extent
        (its alignment may exceed the plan's 4 KiB), so that the resident sub-groups never take
        more host room than the plan left them."""
        resident = 0
        for lo in range(0, n_total, self.sub_group_numel):
            n = min(n_total, lo + self.sub_group_numel) - lo
            extent = self.store.arena.extent_bytes(SUB_GROUP_BYTES_PER_NUMEL * n)
            if extent > room_bytes:
                return resident, 0
            room_bytes -= extent
            resident += 1
        return resident, room_bytes

    def _holds_back(self, key: str, master: torch.Tensor, param_out: Any,
                    param_key: str | None) -> bool:
        """While streaming: whether ``key`` is held back because its first sub-group will be
        homed on HOST (:meth:`_resident_prefix` on the room not yet promised, so the held keys
        are exactly those that :meth:`add` in the offered order would make resident)."""
        if self._held is None:
            return False
        self._add_order.append(key)
        resident, self._held_room_bytes = self._resident_prefix(master.numel(),
                                                                self._held_room_bytes)
        if not resident:
            return False
        self._held[key] = (master, param_out, param_key)
        return True

    def add(self, key: str, master: torch.Tensor, param_out: Any, *,
            param_key: str | None = None) -> None:
        """``param_key``: the store key of the parameter shard ``param_out`` writes, when the
        store holds it: a deferred step updates ``key`` before the store reads that shard."""
        if key in self._sub_groups or (self._held is not None and key in self._held):
            raise ValueError(f"shard optimizer: key {key!r} added twice")
        if master.dtype != torch.float32 or master.dim() != 1:
            raise ValueError(f"shard optimizer: master for {key!r} must be a flat fp32 tensor")
        if self._holds_back(key, master, param_out, param_key):
            return
        self._outs[key] = param_out
        if param_key is not None:
            self._param_keys[key] = param_key
        n_total, sub = master.numel(), self.sub_group_numel
        resident = 0  # streaming: a key that takes host room is held, added at release_held
        if self._held is None:
            resident, self._resident_room_bytes = self._resident_prefix(
                n_total, self._resident_room_bytes)
        records = []
        for i, lo in enumerate(range(0, n_total, sub)):
            hi = min(n_total, lo + sub)
            n = hi - lo
            home = Tier.HOST if i < resident else self.home
            if i < resident:
                self.host_resident_bytes += SUB_GROUP_BYTES_PER_NUMEL * n
            sg = SubGroup(key=key, lo=lo, hi=hi, store_key=f"opt/{key}/{i}", home=home)
            # Dropped once written ([Note: set-up copies are dropped once written] in
            # infinity/tiers/store.py): drop_setup_copies would evict it before the first step.
            self.store.register(sg.store_key, 3 * n, torch.float32, home,
                                fill=functools.partial(_fill_sub_group, master[lo:hi]),
                                keep_host_copy=False)
            self._state_bytes += 8 * n
            records.append(sg)
        self._sub_groups[key] = records

    def keys(self) -> list[str]:
        return list(self._sub_groups)

    def sub_groups(self, key: str) -> list[SubGroup]:
        """The records of ``key``'s sub-groups, in order (their store keys, slices and homes)."""
        return list(self._sub_groups[key])

    def param_store_key(self, key: str) -> str | None:
        """The store key of ``key``'s parameter shard when the store holds it, else None."""
        return self._param_keys.get(key)

    def _numel(self, key: str) -> int:
        records = self._sub_groups[key]
        return records[-1].hi if records else 0

    def state_bytes(self) -> int:
        return self._state_bytes

    def master_bytes(self) -> int:
        return sum(self._numel(k) for k in self._sub_groups) * 4

    def load_state(self, key: str, *, master: torch.Tensor, exp_avg: torch.Tensor,
                   exp_avg_sq: torch.Tensor) -> None:
        """Overwrite the master and moments of ``key`` sub-group by sub-group (each acquired on
        HOST, overwritten, marked dirty, written back to its home)."""
        self.drain()  # a deferred step finishes first
        check_numel(key, self._numel(key), master, exp_avg, exp_avg_sq)
        parts = [t.reshape(-1).to("cpu", torch.float32) for t in (master, exp_avg, exp_avg_sq)]
        handles = []
        for sg in self._sub_groups[key]:
            with self._open_host(sg) as buf:
                n = sg.numel
                for i, part in enumerate(parts):
                    buf[i * n:(i + 1) * n].copy_(part[sg.lo:sg.hi])
            if sg.home is Tier.NVME:
                handles.append(self.store.write_back(sg.store_key))
        for handle in handles:
            handle.wait()

    @contextlib.contextmanager
    def open_master(self, key: str) -> Iterator[list[tuple[int, int, ContextManager[torch.Tensor]]]]:
        """The fp32 master of ``key`` for writing, as windows ``(first, end, context yielding the
        master of [first, end))``, one per sub-group: each opened on HOST when its context is
        entered, marked dirty and written back to its home when it exits without an error (the
        moments keep their bytes). The write-backs are waited for when this context exits."""
        self.drain()  # a deferred step finishes first
        handles: list[TierHandle] = []
        yield [(sg.lo, sg.hi, self._open_master(sg, handles)) for sg in self._sub_groups[key]]
        for handle in handles:
            handle.wait()

    @contextlib.contextmanager
    def _open_master(self, sg: SubGroup, handles: list[TierHandle]) -> Iterator[torch.Tensor]:
        with self._open_host(sg) as buf:
            yield buf[:sg.numel]
        if sg.home is Tier.NVME:
            handles.append(self.store.write_back(sg.store_key))

    @contextlib.contextmanager
    def _open_host(self, sg: SubGroup) -> Iterator[torch.Tensor]:
        """The sub-group's shard acquired on HOST for writing; marked dirty unless the body raised."""
        buf = self.store.acquire(sg.store_key, Tier.HOST).wait()
        try:
            yield buf
            self.store.mark_dirty(sg.store_key, Tier.HOST)
        finally:
            self.store.release(sg.store_key, Tier.HOST)

    def master_values(self, key: str) -> torch.Tensor:
        """A CPU copy of the whole fp32 master of ``key`` (reads every sub-group; for checkpoints)."""
        return self._read(key, 0)

    def state_of(self, key: str) -> dict[str, torch.Tensor]:
        return {"exp_avg": self._read(key, 1), "exp_avg_sq": self._read(key, 2)}

    def _read(self, key: str, part: int) -> torch.Tensor:
        self.drain()  # a deferred step finishes first
        out = torch.empty(self._numel(key), dtype=torch.float32)
        for sg in self._sub_groups[key]:
            n = sg.numel
            buf = self.store.acquire(sg.store_key, Tier.HOST).wait()
            try:
                out[sg.lo:sg.hi].copy_(buf[part * n:(part + 1) * n])
            finally:
                self.store.release(sg.store_key, Tier.HOST)
        return out

    # ------------------------------------------------------------------ reads ahead

    def _issue_read(self, sg: SubGroup, *, ahead: bool = False) -> None:
        """Acquire ``sg`` into HOST (a pin; TierCapacityError when no room can be made), with its
        gradient slice when the step under way has a :class:`StoredGrad` for its key. The record
        changes state first, so an illegal change never leaves a pin behind. ``ahead``: a read
        before its use, which never waits for room here ([Note: a read ahead never waits for room
        on its caller] in infinity/tiers/store.py): its errors come at :meth:`_wait_read`."""
        sg.transition(SubGroupState.READING)
        try:
            sg.read = self.store.acquire(sg.store_key, Tier.HOST, ahead=ahead)
        except BaseException:
            sg.transition(SubGroupState.AT_REST)  # nothing was pinned
            raise
        sg.read_ahead = ahead
        try:
            if self._run is not None:
                sg.grad_read = self._acquire_grad(self._run, sg, ahead=ahead)
        except BaseException:
            handle, sg.read = sg.read, None
            self._unpin(handle)
            sg.transition(SubGroupState.AT_REST)
            raise
        self._reading[sg.store_key] = sg

    def _acquire_grad(self, run: StepRun, sg: SubGroup, *, ahead: bool = False) -> TierHandle | None:
        """Acquire ``sg``'s gradient slice into HOST when ``run``'s gradient of its key is a
        :class:`StoredGrad`; None when the gradient is a tensor (or absent)."""
        grad = run.grads.get(sg.key)
        if not isinstance(grad, StoredGrad):
            return None
        return self.store.acquire(grad.store_key_of(sg.lo, sg.hi), Tier.HOST, ahead=ahead)

    def _wait_read(self, sg: SubGroup) -> torch.Tensor:
        """The HOST buffer of ``sg``'s read, the run's next item (its pin now the caller's;
        READING -> the caller's next state). A read issued ahead that found no room at all
        (TierCapacityError, on the store's room lane) is issued again here, where its bytes are
        needed now, after :meth:`_room_short`; any other error, or the same from a read issued
        here, raises (the sub-group back AT_REST, no pin held)."""
        while True:
            handle, sg.read = sg.read, None
            t0 = time.perf_counter()
            try:
                buf = handle.wait()
            except TierCapacityError:
                retry = sg.read_ahead
                self._drop_grad_read(sg)
                sg.transition(SubGroupState.AT_REST)
                if not retry:
                    raise
                self._room_short()
                self._issue_read(sg)
                self._reading.pop(sg.store_key, None)  # the caller took it out of the window
                continue
            except BaseException:
                self._drop_grad_read(sg)
                sg.transition(SubGroupState.AT_REST)  # a failed read holds no pin
                raise
            finally:
                self.wait_s += time.perf_counter() - t0
            return buf

    def _room_short(self) -> None:
        """A read ahead of the run's next item found no room: the reads ahead still pinned may
        hold it (issued after that one, on the room lane they found the room it did not: what is
        read ahead is then no prefix of the step's order). Let them all go (their copies stay
        cached, unpinned) and read ahead again from the item after the next, as the window
        allows."""
        self._drop_reads()
        if self._run is not None:
            self._run.cursor = min(self._run.cursor, self._run.done + 1)

    def _drop_grad_read(self, sg: SubGroup) -> None:
        handle, sg.grad_read = sg.grad_read, None
        self._unpin(handle)

    def _unpin(self, handle: TierHandle | None) -> bool:
        """Release the pin of an acquire (one whose read failed holds none: False)."""
        if handle is None:
            return False
        try:
            handle.wait()
        except Exception:  # noqa: BLE001 - a failed read holds no pin; its user reported it
            return False
        self.store.release(handle.key, Tier.HOST)
        return True

    def prefetch(self, key: str) -> None:
        """The gradient of ``key`` is final for this step: start reading its sub-groups into HOST
        while the read-ahead window has room ([Note: optimizer read-ahead]). NVME home only."""
        ahead = self._read_ahead
        if self.home is not Tier.NVME or key in ahead.ready or key not in self._sub_groups:
            return
        ahead.ready[key] = None
        if ahead.full:
            return  # what is read ahead stays a prefix of the step's order
        for sg in self._sub_groups[key]:
            if sg.home is not Tier.NVME or sg.state is not SubGroupState.AT_REST:
                continue  # nothing to read (acquiring it later costs nothing), or already held
            if len(self._reading) >= self.window_sub_groups:
                ahead.full = True
                return
            try:
                self._issue_read(sg, ahead=True)
            except TierCapacityError:  # optional work: never fail a backward for it
                ahead.full = True
                return

    def cancel_prefetch(self) -> None:
        """Drop the reads issued ahead (no step follows them)."""
        self._read_ahead.clear()
        self._drop_reads()

    def _drop_reads(self) -> None:
        reading, self._reading = self._reading, {}
        for sg in reading.values():
            handles = (sg.read, sg.grad_read)
            sg.read = sg.grad_read = None
            sg.transition(SubGroupState.AT_REST)
            for handle in handles:
                self._unpin(handle)

    def read_ahead(self, order: Iterable[str]) -> None:
        """Start reading sub-groups into HOST, in ``order``, while the read-ahead window has room
        (NVME home; with a deferred step these are the ones the next forward updates first)."""
        if self.home is not Tier.NVME or self.state is not StepState.IDLE:
            return
        for key in self._run_order(order):
            self.prefetch(key)

    def _cached_on_host(self, sg: SubGroup) -> bool:
        return self.store.state(sg.store_key, Tier.HOST) in (Residency.RESIDENT,
                                                             Residency.WRITING)

    def _step_items(self, order: Iterable[str] = ()) -> list[SubGroup]:
        """Sub-groups in step order, one key's sub-groups together (its parameter shard is opened
        once). With an ``order`` (a deferred step): :meth:`_run_order` of it. Otherwise: keys
        whose reads were issued ahead first (backward order: they are a prefix of it), then, NVME
        home, keys with a sub-group still cached in HOST from the previous step (a read saved
        before LRU evicts them), then the rest (backward order, then add order)."""
        if order:
            keys = self._run_order(order)
            if self.home is Tier.NVME:
                for pos, key in enumerate(keys):  # cached copies: evicted furthest-use first
                    for sg in self._sub_groups[key]:
                        if self._cached_on_host(sg):
                            self.store.set_next_use(sg.store_key, float(pos))
            return [sg for key in keys for sg in self._sub_groups[key]]
        ready = self._read_ahead.ready
        order = list(ready) + [k for k in self._sub_groups if k not in ready]
        ahead = {sg.key for sg in self._reading.values()}
        head = [k for k in order if k in ahead]
        rest = [k for k in order if k not in ahead]
        if self.home is Tier.NVME:
            cached = {k for k in rest if any(self._cached_on_host(sg)
                                             for sg in self._sub_groups[k])}
            rest = [k for k in rest if k in cached] + [k for k in rest if k not in cached]
            for key in cached:  # evicted last by this step's allocations (Belady: needed soonest)
                for sg in self._sub_groups[key]:
                    self.store.set_next_use(sg.store_key, 0.0)
        return [sg for key in head + rest for sg in self._sub_groups[key]]

    def _run_order(self, order: Iterable[str]) -> list[str]:
        """Every key once, for a deferred step and its read-ahead: first the keys updated at the
        step itself (no stored parameter shard), then the deferred ones, each part in ``order``
        and then add order. The read-ahead issued in this order is a prefix of the step's."""
        keys = [k for k in dict.fromkeys(order) if k in self._sub_groups]
        listed = set(keys)
        keys += [k for k in self._sub_groups if k not in listed]
        return ([k for k in keys if k not in self._param_keys]
                + [k for k in keys if k in self._param_keys])

    # ------------------------------------------------------------------ the step

    def default_runs(self, lr: float | None = None) -> dict[str, tuple[AdamRun, ...]]:
        """One run per key over its whole partition at the next step number, with ``lr`` (None:
        :attr:`lr`) and the config's other hyperparameters (what :meth:`step` does without
        ``runs``)."""
        hyper = config_hyperparameters(self.config, self.lr if lr is None else lr)
        return {key: (AdamRun(0, self._numel(key), self.step_count + 1, hyper),)
                for key in self._sub_groups}

    def step(self, grads: Mapping[str, torch.Tensor], *, grad_scale: float = 1.0,
             lr: float | None = None, defer: bool = False,
             order: Iterable[str] = (),
             runs: Mapping[str, Sequence[AdamRun]] | None = None) -> None:
        """One Adam step. ``runs``: per key, the slices to update with their step numbers and
        hyperparameters ([Note: runs of a flat partition]); keys absent are not updated, and
        sub-groups no run reaches are not read. None: :meth:`default_runs` (every key, one run).
        ``defer``: [Note: deferred optimizer step]:
        only the keys whose parameter partition is not a stored shard (nothing guards their reads)
        are updated now; the others wait for :meth:`apply_before_read` (the store calls it when a
        parameter shard is about to be read) or :meth:`drain`, in ``order`` (the keys in the order
        the next forward reads them; keys not in it follow in add order). ``grads`` must stay
        unchanged until then."""
        self.drain()
        if runs is None:
            runs = self.default_runs(lr)
        self.step_count += 1
        runs = {k: tuple(r) for k, r in runs.items() if r and k in self._sub_groups}
        items = [sg for sg in self._step_items(order if defer else ())
                 if sg.key in runs and clipped(runs[sg.key], sg.lo, sg.hi)]
        run = StepRun(runs=runs, grad_scale=grad_scale, grads=grads, items=items,
                      window=self.window_sub_groups)
        self._read_ahead.clear()
        self._run = run
        self._to(StepState.PENDING)
        if not defer:
            self.drain()
            return
        # Keys without a stored parameter shard come first in the run (_run_order): nothing
        # guards their reads, so they are updated now.
        immediate = sum(1 for sg in run.items if sg.key not in self._param_keys)
        self._advance(immediate)
        if self._run is not None:
            run.pending_params = {self._param_keys[k]: k for k in run.pending_keys}
            self._top_up()

    def apply_before_read(self, store_key: str) -> None:
        """The store is about to read ``store_key``: if it is the parameter shard of a key whose
        deferred update has not run, run it now (and every key before it in the step's order)."""
        run = self._run
        if self.state is not StepState.PENDING or store_key not in run.pending_params:
            return
        t0 = time.perf_counter()
        try:
            # In the forward, where activations come from the heap: the update's sub-group
            # temporaries must not stay there ([Note: activations stay in the heap] in infinity/io).
            with engine_buffers():
                self._advance(run.last_of[run.pending_params[store_key]] + 1)
        finally:
            self.deferred_s += time.perf_counter() - t0

    @property
    def pending_keys(self) -> list[str]:
        """Keys whose update of the current (deferred) step has not run yet, in order."""
        return [] if self._run is None else self._run.pending_keys

    def drain(self) -> None:
        """Finish the step: run every update still deferred and wait for every write-back (their
        errors are raised here). Called before anything reads the state or the gradients change."""
        run = self._run
        if run is None:
            return
        writebacks = []
        try:
            self._advance(len(run.items))
        finally:
            if self._run is not None:  # the updates ran: the step ends with its write-backs
                for sg in run.items:
                    if sg.state is SubGroupState.WRITING:
                        writebacks.append(sg.writeback)
                        sg.writeback = None
                        sg.transition(SubGroupState.AT_REST)
                self._run = None
                self._to(StepState.IDLE)
        for handle in writebacks:
            handle.wait()

    def _top_up(self) -> None:
        """Issue reads ahead of the next update, within the window."""
        run = self._run
        while run.cursor < len(run.items) and len(self._reading) < run.window:
            sg = run.items[run.cursor]
            if sg.state is SubGroupState.AT_REST and sg.home is Tier.NVME:
                try:
                    self._issue_read(sg, ahead=True)
                except TierCapacityError:
                    return  # a read ahead: try again after the next update frees room
            run.cursor += 1

    def _advance(self, upto: int) -> None:
        """Update the run's items up to index ``upto`` (exclusive; a key boundary): reads of later
        items overlap each update, the write-back of each is issued after it (not waited for)."""
        run = self._run
        if run is None or run.done >= upto:
            return
        self._to(StepState.ADVANCING)
        shard = _OpenParamShard(self)
        try:
            for j in range(run.done, upto):
                sg = run.items[j]
                if sg.state is not SubGroupState.READING:  # stepped now: no room is an error
                    self._issue_read(sg)
                # Reads ahead start after this item, also when it was read ahead in backward (a
                # full window leaves the cursor behind): an updated item read again would pin a
                # window slot, and bytes, for the rest of the step.
                run.cursor = max(run.cursor, j + 1)
                self._top_up()
                del self._reading[sg.store_key]
                self._update_sub_group(run, sg, self._wait_read(sg), shard)
                run.done = j + 1
                if sg.home is Tier.NVME:  # its write overlaps the next update
                    sg.writeback = self.store.write_back(sg.store_key)
                    sg.transition(SubGroupState.WRITING)
        except BaseException:
            # An error leaves the open shard unmarked (the store keeps its old bytes, or, written
            # back lazily, the bytes so far) and ends the step: the keys not updated keep their
            # old state; drain() raises nothing more. The window's pins go in any case, and the
            # write-backs issued finish on their own.
            try:
                shard.close(sys.exc_info())
            finally:
                self._drop_reads()
                for sg in run.items:
                    if sg.state in (SubGroupState.UPDATING, SubGroupState.WRITING):
                        sg.writeback = None
                        sg.transition(SubGroupState.AT_REST)
                self._run = None
                self._to(StepState.IDLE)
            raise
        finally:
            try:
                shard.close()  # the last key's shard: marked dirty, maybe written back
            finally:
                if self.state is StepState.ADVANCING:  # the updates ran; the step goes on
                    self._to(StepState.PENDING)
        if run.done == len(run.items):
            self._drop_reads()
            run.pending_params = {}
        else:
            pending = set(run.pending_keys)
            run.pending_params = {sk: k for sk, k in run.pending_params.items() if k in pending}
            self._top_up()

    def _update_sub_group(self, run: StepRun, sg: SubGroup, buf: torch.Tensor,
                          shard: "_OpenParamShard") -> None:
        """Step one sub-group whose state is read (``buf``): its gradient (a stored slice, read
        now if it was not read ahead, or a slice of the run's), Adam, the new parameters into
        its key's open shard; its HOST copy is marked dirty and unpinned either way."""
        sg.transition(SubGroupState.UPDATING)
        updated = False
        grad_handle, sg.grad_read = sg.grad_read, None
        try:
            out = shard.open(sg.key, run)
            if grad_handle is None:  # not read ahead with its sub-group
                grad_handle = self._acquire_grad(run, sg)
            if grad_handle is not None:
                t0 = time.perf_counter()
                try:
                    g = grad_handle.wait()
                except TierCapacityError:  # read ahead without room: read it now
                    if not sg.read_ahead:
                        raise
                    self._room_short()
                    grad_handle = self._acquire_grad(run, sg)
                    g = grad_handle.wait()
                self.wait_s += time.perf_counter() - t0
            else:
                grad = run.grads.get(sg.key)
                g = None if grad is None else grad[sg.lo:sg.hi]
            self._update(buf, g, out, sg.lo, sg.hi, run)
            self.store.mark_dirty(sg.store_key, Tier.HOST)
            updated = True
        finally:
            self.store.release(sg.store_key, Tier.HOST)
            self.store.set_next_use(sg.store_key, None)  # stepped: no longer needed soon
            if not (updated and sg.home is Tier.NVME):
                sg.transition(SubGroupState.AT_REST)
            self._done_with_grad(grad_handle, consumed=updated)

    def _done_with_grad(self, handle: TierHandle | None, *, consumed: bool) -> None:
        """Unpin a stored gradient slice; once its update ran, drop its HOST copy too (it is
        never read again: the next backward overwrites it), so its room goes to the next reads."""
        if self._unpin(handle) and consumed:
            self.store.evict(handle.key, Tier.HOST)

    def _update(self, buf: torch.Tensor, grad: torch.Tensor | None, out: torch.Tensor | None,
                lo: int, hi: int, run: StepRun) -> None:
        """Adam on the pinned sub-group ``buf`` of ``[lo, hi)`` (the run's item ``run.done``,
        being updated) with its gradient slice ``grad`` (already that slice; None: zero), over
        the parts of its key's runs in it, writing the new parameters into ``out[lo:hi]``."""
        key = run.items[run.done].key
        n = hi - lo
        master, exp_avg, exp_avg_sq = buf[:n], buf[n:2 * n], buf[2 * n:]
        if grad is None:
            g = torch.zeros(n, dtype=torch.float32)
        else:
            g = grad if grad.device.type == "cpu" else grad.to("cpu")
        low = out is not None and out.dtype in (torch.bfloat16, torch.float16)
        up = out is not None and out.device.type != "cpu"  # the new values go to a GPU shard
        staging, slot = None, None
        if up:  # [Note: event-guarded staging] in infinity/_async_copy.py
            slot, staging = self._out_ring(out.device).take(n, out.dtype)
        elif low:
            staging = out[lo:hi]
        pieces = clipped(run.runs[key], lo, hi)
        adam_runs(master, g, exp_avg, exp_avg_sq, pieces, adamw_mode=self.config.adamw_mode,
                  bias_correction=self.config.bias_correction, grad_scale=run.grad_scale,
                  out=staging if low else None)
        if out is None:
            return
        if not up:
            if not low:
                for a, b, _ in pieces:  # only what was updated: the rest keeps its values
                    out[lo + a:lo + b].copy_(master[a:b])
            return
        with self._copy_out(out.device).issue():  # beside the kernels: _join_copy_out
            for a, b, _ in pieces:
                # The master's extent may be written back or reused once this sub-group is
                # released, so an fp32 copy-out goes through the staging buffer too.
                if not low:
                    staging[a:b].copy_(master[a:b])
                out[lo + a:lo + b].copy_(staging[a:b], non_blocking=True)
            self._out_ring(out.device).done(slot)  # its event on the side stream

    def _copy_out(self, device: torch.device) -> SideStream:
        if self._up is None:
            self._up = SideStream(device)
        return self._up

    def _join_copy_out(self) -> None:
        """Before a parameter shard written by the copy-out is closed (marked dirty, written
        back, gathered): the compute stream waits for the copies, on the GPU."""
        if self._up is not None:
            self._up.join()

    def _out_ring(self, device: torch.device) -> StagingRing:
        """The pinned staging of the copy-out to a GPU shard, made on first use (two slots: one
        filled by Adam while the other's copy runs)."""
        if self._ring is None:
            self._ring = pinned_staging_ring(device)
        return self._ring


class _OpenParamShard:
    """The one key whose parameter shard is open (pinned) while its sub-groups are stepped, in
    :meth:`OffloadedShardOptimizer._advance`: opening another key closes it first (its copies
    out joined, then the shard closed: marked dirty, maybe written back)."""

    def __init__(self, optimizer: OffloadedShardOptimizer):
        self._optimizer = optimizer
        self._key: str | None = None
        self._ctx: ContextManager[Any] | None = None
        self._out: Any = None

    def open(self, key: str, run: StepRun) -> Any:
        """What ``key``'s new parameters are written into, opened unless it is open already.
        Every sub-group of a key is stepped while its shard is open: where ``run`` updates the
        key end to end, it is written whole and a stored shard is not read first."""
        if key != self._key:
            self.close()
            overwrite = covers(run.runs[key], self._optimizer._numel(key))
            ctx = open_param_out(self._optimizer._outs[key], overwrite=overwrite)
            self._out = ctx.__enter__()
            self._key, self._ctx = key, ctx
        return self._out

    def close(self, exc_info: tuple = (None, None, None)) -> None:
        """Close the open shard (``exc_info``: the error that ends the step, which leaves it
        unmarked); a no-op when none is open. Closed once: a copy out that fails closes it as
        failed too."""
        if self._ctx is None:
            return
        ctx, self._ctx, self._key, self._out = self._ctx, None, None, None
        try:
            self._optimizer._join_copy_out()
        except BaseException:
            ctx.__exit__(*sys.exc_info())
            raise
        ctx.__exit__(*exc_info)


def _fill_sub_group(master: torch.Tensor, out: torch.Tensor) -> None:
    """[Note: set-up writes in place] A new sub-group's [master | exp_avg | exp_avg_sq], written
    straight into its store copy. Assembled in a buffer of its own first, each sub-group cost a
    fresh 3 x 4 B per element that the kernel faulted in page by page and then freed: 10 s of the
    1B GPT's 45 s set-up on the 2-core VM (250 sub-groups of 48 MiB, cProfile: torch.zeros)."""
    n = master.numel()
    out[:n].copy_(master)
    out[n:].zero_()
