"""Adam(W) whose fp32 master and moments live in the tiered store (home HOST or NVME), stepped by
sub-group in a pipeline whose NVMe reads and writes overlap the update (and, deferred, the next
forward). See :class:`OffloadedShardOptimizer` for the notes behind it; its parts: the keys and
their sub-groups (:mod:`._key_table`), the read-ahead window (:mod:`._read_window`), where the new
parameters go (:mod:`._param_out`), a key's state outside the step (:mod:`._key_state`), the
records and their state machines (:mod:`._sub_group`)."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Any, ContextManager, Iterable, Iterator, Mapping, Sequence

import torch

from infinity.config import OptimizerConfig
from infinity.errors import TierCapacityError
from infinity.io import engine_buffers
from infinity.optim._key_state import (EXP_AVG, EXP_AVG_SQ, MASTER, master_windows, read_part,
                                       write_parts)
from infinity.optim._key_table import KeyTable
from infinity.optim._param_out import CopyOut, OpenParamShard
from infinity.optim._partition import check_numel
from infinity.optim._read_window import ReadWindow
from infinity.optim._runs import AdamRun, adam_runs, clipped, config_hyperparameters
from infinity.optim._sub_group import (STEP_TRANSITIONS, ReadAhead, StepRun, StepState, SubGroup,
                                       SubGroupState)
from infinity.tiers import Residency, Tier, TieredStore, TierHandle

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
    that finds no room at all is read again where its update needs it
    (:meth:`~infinity.optim._read_window.ReadWindow.wait`). The update itself still waits for the
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

    [Note: set-up writes in place] A new sub-group's [master | exp_avg | exp_avg_sq] is written
    straight into its store copy (:func:`~infinity.optim._key_table._fill_sub_group`). Assembled
    in a buffer of its own first, each sub-group cost a fresh 3 x 4 B per element that the kernel
    faulted in page by page and then freed: 10 s of the 1B GPT's 45 s set-up on the 2-core VM (250
    sub-groups of 48 MiB, cProfile: torch.zeros).
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
        self._keys = KeyTable(store, home=home, sub_group_numel=self.sub_group_numel,
                              host_resident_bytes=int(host_resident_bytes)
                              if home is Tier.NVME else 0)
        """The keys, their sub-groups and where each is homed."""
        self.state = StepState.IDLE
        """Whether a step is under way (changed only through STEP_TRANSITIONS)."""
        self._run: StepRun | None = None
        """The step under way (PENDING or ADVANCING): updates not run, write-backs not waited."""
        self._window = ReadWindow(store)
        """The sub-groups in READING (the window's pins)."""
        self._read_ahead = ReadAhead()
        """The reads issued during backward, before the step exists."""
        self.deferred_s = 0.0
        """Seconds spent in updates of deferred steps, run before a shard read (in the forward)."""
        self._copy_out = CopyOut()
        """The copy-out of new values to GPU parameter shards (made on first use)."""

    @property
    def wait_s(self) -> float:
        """Seconds the step spent blocked on sub-group fetches (the pipeline's stall)."""
        return self._window.wait_s

    @property
    def host_resident_bytes(self) -> int:
        """Bytes of optimizer state homed on HOST although the optimizer's home is NVME."""
        return self._keys.host_resident_bytes

    def _to(self, new: StepState) -> None:
        STEP_TRANSITIONS.check("offloaded optimizer", self.state, new)
        self.state = new

    # ------------------------------------------------------------------ keys and their state

    def hold_host_resident(self) -> None:
        """Start streaming masters in ([Note: masters stream into the optimizer] in
        infinity/zero/_engine_setup.py): from here until :meth:`release_held`, :meth:`add`
        registers the sub-groups homed on NVME at once and holds back the keys that will have
        host-resident sub-groups."""
        self._keys.hold_host_resident()

    def release_held(self) -> None:
        """Register the held keys (their host-resident sub-groups are long-lived HOST extents,
        carved now that the set-up copies are gone), then restore the offered order, which is
        the step's tie-break."""
        self._keys.release_held()

    def drop_setup_copies(self) -> None:
        """Evict the HOST copies that registering NVME-homed sub-groups left behind (each waits
        for its write), so that the long-lived extents carved next pack at the arena's top
        ([Note: set-up copies strew the home extents] in infinity/zero/_unit_builder.py)."""
        self._keys.drop_setup_copies()

    def add(self, key: str, master: torch.Tensor, param_out: Any, *,
            param_key: str | None = None) -> None:
        """``param_key``: the store key of the parameter shard ``param_out`` writes, when the
        store holds it: a deferred step updates ``key`` before the store reads that shard."""
        self._keys.add(key, master, param_out, param_key=param_key)

    def keys(self) -> list[str]:
        return list(self._keys.sub_groups)

    def sub_groups(self, key: str) -> list[SubGroup]:
        """The records of ``key``'s sub-groups, in order (their store keys, slices and homes)."""
        return list(self._keys.sub_groups[key])

    def param_store_key(self, key: str) -> str | None:
        """The store key of ``key``'s parameter shard when the store holds it, else None."""
        return self._keys.param_keys.get(key)

    def _numel(self, key: str) -> int:
        return self._keys.numel(key)

    def state_bytes(self) -> int:
        return self._keys.state_bytes

    def master_bytes(self) -> int:
        return sum(self._numel(k) for k in self._keys.sub_groups) * 4

    def load_state(self, key: str, *, master: torch.Tensor, exp_avg: torch.Tensor,
                   exp_avg_sq: torch.Tensor) -> None:
        """Overwrite the master and moments of ``key`` sub-group by sub-group (each acquired on
        HOST, overwritten, marked dirty, written back to its home)."""
        self.drain()  # a deferred step finishes first
        check_numel(key, self._numel(key), master, exp_avg, exp_avg_sq)
        parts = [t.reshape(-1).to("cpu", torch.float32) for t in (master, exp_avg, exp_avg_sq)]
        write_parts(self.store, self._keys.sub_groups[key], parts)

    @contextlib.contextmanager
    def open_master(self, key: str) -> Iterator[list[tuple[int, int, ContextManager[torch.Tensor]]]]:
        """The fp32 master of ``key`` for writing, as windows ``(first, end, context yielding the
        master of [first, end))``, one per sub-group: each opened on HOST when its context is
        entered, marked dirty and written back to its home when it exits without an error (the
        moments keep their bytes). The write-backs are waited for when this context exits."""
        self.drain()  # a deferred step finishes first
        with master_windows(self.store, self._keys.sub_groups[key]) as windows:
            yield windows

    def master_values(self, key: str) -> torch.Tensor:
        """A CPU copy of the whole fp32 master of ``key`` (reads every sub-group; for checkpoints)."""
        return self._read(key, MASTER)

    def state_of(self, key: str) -> dict[str, torch.Tensor]:
        return {"exp_avg": self._read(key, EXP_AVG), "exp_avg_sq": self._read(key, EXP_AVG_SQ)}

    def _read(self, key: str, part: int) -> torch.Tensor:
        self.drain()  # a deferred step finishes first
        return read_part(self.store, self._keys.sub_groups[key], self._numel(key), part)

    # ------------------------------------------------------------------ reads ahead

    def prefetch(self, key: str) -> None:
        """The gradient of ``key`` is final for this step: start reading its sub-groups into HOST
        while the read-ahead window has room ([Note: optimizer read-ahead]). NVME home only."""
        ahead = self._read_ahead
        if self.home is not Tier.NVME or key in ahead.ready or key not in self._keys.sub_groups:
            return
        ahead.ready[key] = None
        if ahead.full:
            return  # what is read ahead stays a prefix of the step's order
        for sg in self._keys.sub_groups[key]:
            if sg.home is not Tier.NVME or sg.state is not SubGroupState.AT_REST:
                continue  # nothing to read (acquiring it later costs nothing), or already held
            if len(self._window) >= self.window_sub_groups:
                ahead.full = True
                return
            try:
                self._window.issue(sg, self._run, ahead=True)
            except TierCapacityError:  # optional work: never fail a backward for it
                ahead.full = True
                return

    def cancel_prefetch(self) -> None:
        """Drop the reads issued ahead (no step follows them)."""
        self._read_ahead.clear()
        self._window.drop_all()

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
                    for sg in self._keys.sub_groups[key]:
                        if self._cached_on_host(sg):
                            self.store.set_next_use(sg.store_key, float(pos))
            return [sg for key in keys for sg in self._keys.sub_groups[key]]
        ready = self._read_ahead.ready
        order = list(ready) + [k for k in self._keys.sub_groups if k not in ready]
        ahead = self._window.keys_ahead()
        head = [k for k in order if k in ahead]
        rest = [k for k in order if k not in ahead]
        if self.home is Tier.NVME:
            cached = {k for k in rest if any(self._cached_on_host(sg)
                                             for sg in self._keys.sub_groups[k])}
            rest = [k for k in rest if k in cached] + [k for k in rest if k not in cached]
            for key in cached:  # evicted last by this step's allocations (Belady: needed soonest)
                for sg in self._keys.sub_groups[key]:
                    self.store.set_next_use(sg.store_key, 0.0)
        return [sg for key in head + rest for sg in self._keys.sub_groups[key]]

    def _run_order(self, order: Iterable[str]) -> list[str]:
        """Every key once, for a deferred step and its read-ahead: first the keys updated at the
        step itself (no stored parameter shard), then the deferred ones, each part in ``order``
        and then add order. The read-ahead issued in this order is a prefix of the step's."""
        keys = [k for k in dict.fromkeys(order) if k in self._keys.sub_groups]
        listed = set(keys)
        keys += [k for k in self._keys.sub_groups if k not in listed]
        return ([k for k in keys if k not in self._keys.param_keys]
                + [k for k in keys if k in self._keys.param_keys])

    # ------------------------------------------------------------------ the step

    def default_runs(self, lr: float | None = None) -> dict[str, tuple[AdamRun, ...]]:
        """One run per key over its whole partition at the next step number, with ``lr`` (None:
        :attr:`lr`) and the config's other hyperparameters (what :meth:`step` does without
        ``runs``)."""
        hyper = config_hyperparameters(self.config, self.lr if lr is None else lr)
        return {key: (AdamRun(0, self._numel(key), self.step_count + 1, hyper),)
                for key in self._keys.sub_groups}

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
        runs = {k: tuple(r) for k, r in runs.items() if r and k in self._keys.sub_groups}
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
        immediate = sum(1 for sg in run.items if sg.key not in self._keys.param_keys)
        self._advance(immediate)
        if self._run is not None:
            run.pending_params = {self._keys.param_keys[k]: k for k in run.pending_keys}
            self._window.top_up(run)

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

    def _advance(self, upto: int) -> None:
        """Update the run's items up to index ``upto`` (exclusive; a key boundary): reads of later
        items overlap each update, the write-back of each is issued after it (not waited for)."""
        run = self._run
        if run is None or run.done >= upto:
            return
        self._to(StepState.ADVANCING)
        shard = OpenParamShard(self._keys, self._copy_out)
        try:
            for j in range(run.done, upto):
                sg = run.items[j]
                if sg.state is not SubGroupState.READING:  # stepped now: no room is an error
                    self._window.issue(sg, run)
                # Reads ahead start after this item, also when it was read ahead in backward (a
                # full window leaves the cursor behind): an updated item read again would pin a
                # window slot, and bytes, for the rest of the step.
                run.cursor = max(run.cursor, j + 1)
                self._window.top_up(run)
                self._update_sub_group(run, sg, self._window.wait(sg, run), shard)
                run.done = j + 1
                if sg.home is Tier.NVME:  # its write overlaps the next update
                    sg.writeback = self.store.write_back(sg.store_key)
                    sg.transition(SubGroupState.WRITING)
        except BaseException:
            self._abandon(run, shard)
            raise
        finally:
            try:
                shard.close()  # the last key's shard: marked dirty, maybe written back
            finally:
                if self.state is StepState.ADVANCING:  # the updates ran; the step goes on
                    self._to(StepState.PENDING)
        if run.done == len(run.items):
            self._window.drop_all()
            run.pending_params = {}
        else:
            pending = set(run.pending_keys)
            run.pending_params = {sk: k for sk, k in run.pending_params.items() if k in pending}
            self._window.top_up(run)

    def _abandon(self, run: StepRun, shard: OpenParamShard) -> None:
        """An update raised: it leaves the open shard unmarked (the store keeps its old bytes,
        or, written back lazily, the bytes so far) and ends the step: the keys not updated keep
        their old state; drain() raises nothing more. The window's pins go in any case, and the
        write-backs issued finish on their own."""
        try:
            shard.close(sys.exc_info())
        finally:
            self._window.drop_all()
            for sg in run.items:
                if sg.state in (SubGroupState.UPDATING, SubGroupState.WRITING):
                    sg.writeback = None
                    sg.transition(SubGroupState.AT_REST)
            self._run = None
            self._to(StepState.IDLE)

    def _update_sub_group(self, run: StepRun, sg: SubGroup, buf: torch.Tensor,
                          shard: OpenParamShard) -> None:
        """Step one sub-group whose state is read (``buf``): its gradient (a stored slice, read
        now if it was not read ahead, or a slice of the run's), Adam, the new parameters into
        its key's open shard; its HOST copy is marked dirty and unpinned either way."""
        sg.transition(SubGroupState.UPDATING)
        updated = False
        grad_handle, sg.grad_read = sg.grad_read, None
        try:
            out = shard.open(sg.key, run)
            if grad_handle is None:  # not read ahead with its sub-group
                grad_handle = self._window.acquire_grad(run, sg)
            if grad_handle is not None:
                grad_handle, g = self._window.wait_grad(run, sg, grad_handle)
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
        if self._window.unpin(handle) and consumed:
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
            slot, staging = self._copy_out.ring(out.device).take(n, out.dtype)
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
        with self._copy_out.stream(out.device).issue():  # beside the kernels: CopyOut.join
            for a, b, _ in pieces:
                # The master's extent may be written back or reused once this sub-group is
                # released, so an fp32 copy-out goes through the staging buffer too.
                if not low:
                    staging[a:b].copy_(master[a:b])
                out[lo + a:lo + b].copy_(staging[a:b], non_blocking=True)
            self._copy_out.ring(out.device).done(slot)  # its event on the side stream
