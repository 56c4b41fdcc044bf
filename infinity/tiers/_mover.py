"""The store's moves: copies between tiers issued on its copy threads and completed on its lanes.

:class:`Mover` is owned by the :class:`~infinity.tiers.TieredStore`: the store decides what moves
where (under the lock, its memory reserved), the mover issues the copy or the swap-in and
completes it (the destination RESIDENT, or ABSENT and its bytes freed on an error). Its copy
threads never allocate ([Note: store locking] in infinity/tiers/_shard_table.py). The write-backs
(:class:`~._writeback.WriteBacks`) use its threads and copies too.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from infinity._async_copy import blocking_event, record_on_current_stream
from infinity._modeled_link import DuplexLink
from infinity.io import Swapper
from infinity.tiers._arena import HostArena
from infinity.tiers._budgets import TierBudgets
from infinity.tiers._copy_lane import CopyLane
from infinity.tiers._records import Counters, _Shard, host_copy
from infinity.tiers._shard_table import ShardTable
from infinity.tiers.residency import Residency, Tier

logger = logging.getLogger(__name__)

_A, _I, _R, _W, _Z = (Residency.ABSENT, Residency.INFLIGHT, Residency.RESIDENT, Residency.WRITING,
                      Residency.ZEROS)


# [Note: device copies complete on the stream] A copy into a DEVICE copy is RESIDENT as soon as it
# is issued on the store's copy stream: the fetch's future resolves then, with a blocking event
# recorded after the copy (``_Copy.ready_event``), and every reader makes its own stream wait on
# that event (``TierHandle.wait`` and ``get`` do it), so a demand fetch holds the training thread
# only for the issue, never until the GPU drains, and wait/stall figures no longer include GPU
# compute. The source copy stays busy (not evictable, not changed) until the copy has run, which a
# copy thread waits for on the blocking event, sleeping; the destination is recorded on the copy
# stream so that an early eviction cannot hand its memory to other work first. A HOST destination
# is read by the CPU (the optimizer, a swap-out), so its copy completes before the future does.


class Mover:
    """Issues and completes the store's moves: host<->device copies (CUDA: on one copy stream;
    a CPU engine: under ``copy_link`` when one is modeled), swap-ins, and the copies of
    write-backs. Every method that changes a record takes the table's lock itself, except
    :meth:`start_move` (the caller holds it)."""

    def __init__(self, *, device: torch.device, num_copy_threads: int, table: ShardTable,
                 budgets: TierBudgets, counters: Counters, arena: HostArena,
                 swapper: Swapper | None, copy_link: DuplexLink | None = None):
        self.device = device
        self._cuda = device.type == "cuda"
        """Copies run on a CUDA copy stream (else: plain host copies on the copy threads)."""
        self._table = table
        self._budgets = budgets
        self.counters = counters
        self.arena = arena
        self.swapper = swapper
        self._pool = ThreadPoolExecutor(num_copy_threads, thread_name_prefix="infinity-tiers")
        """The copy threads: issue copies, complete swaps ([Note: a write-back holds no copy
        thread] in infinity/tiers/_writeback.py)."""
        self._copy_stream = torch.cuda.Stream(device=device) if self._cuda else None
        self._lane = CopyLane()
        """Completes host<->device copies in issue order ([Note: device copies complete on the
        copy lane] in ``_copy_lane.py``)."""
        self.copy_link = copy_link
        """A modeled link under the host<->device copies of a CPU engine ([Note: the modeled
        link] in infinity/_modeled_link.py): moves and write-backs between HOST and DEVICE;
        None: copies take the time they take."""
        self._modeled_lanes = {Tier.DEVICE: CopyLane("infinity-link-to-device"),
                               Tier.HOST: CopyLane("infinity-link-to-host")}
        """Land the modeled copies, one lane per direction: a copy into HOST that the link
        finished first must not wait behind one into DEVICE still on the wire (and the shared
        copy lane above keeps its own order for real device copies)."""

    def start_move(self, shard: _Shard, src: Tier, dst: Tier) -> None:
        """Issue the move of ``shard`` from ``src`` into ``dst`` (its copy is INFLIGHT, allocated)."""
        dst_copy = shard.copies[dst]
        if src is Tier.NVME:
            if shard.copies[Tier.NVME].state is _Z:  # never written: no file to read
                dst_copy.tensor.zero_()
                self._finish_move(shard, src, dst, None, lock=False)
                return
            try:
                handle = self.swapper.swap_in(shard.key, self.arena.raw(dst_copy.extent))
            except BaseException as e:  # noqa: BLE001 - refused at issue: fail through the handle
                self._finish_move_locked(shard, src, dst, e)
                return
            handle.future.add_done_callback(
                lambda f: self.submit(self._finish_move, shard, src, dst, f.exception()))
            return
        src_copy = shard.copies[src]
        src_copy.busy += 1
        ready = self.stream_event()
        if src_copy.state is _I:  # chain after the move into the source
            src_copy.future.add_done_callback(
                lambda f: self.submit(self._copy_then_finish, shard, src, dst, ready,
                                      f.exception()))
        else:
            self.submit(self._copy_then_finish, shard, src, dst, ready, None)

    def _copy_then_finish(self, shard, src: Tier, dst: Tier, ready, error) -> None:
        if error is None and self._modeled(src, dst):
            try:
                self._modeled_copy(shard, src, dst)
                return
            except BaseException as e:  # noqa: BLE001 - delivered through the handle
                error = e
        done = None
        if error is None:
            try:
                done = self._issue_copy(shard.copies[dst].tensor, shard.copies[src].tensor, ready)
            except BaseException as e:  # noqa: BLE001 - delivered through the handle
                error = e
        # [Note: device copies complete on the copy lane]: a blocking event, waited there
        if done is not None and dst is Tier.DEVICE:
            # [Note: device copies complete on the stream]
            self._finish_move(shard, src, dst, None, ready_event=done, release_source=False)
            self._lane.submit(done.synchronize, lambda: self._release_source(shard, src))
            return
        if done is not None:  # HOST destination: the CPU reads it once the copy has landed
            self._lane.submit(done.synchronize, lambda: self._finish_move(shard, src, dst, None))
            return
        self._finish_move(shard, src, dst, error)

    def _modeled_copy(self, shard, src: Tier, dst: Tier) -> None:
        """A CPU engine's copy under ``copy_link``: queued on the link, its bytes land at its
        modeled end on the copy lane (NaN until then where the link asks for it)."""
        dst_t, src_t = shard.copies[dst].tensor, shard.copies[src].tensor
        link, done_at = self._reserve_on_link(shard, src, dst)
        if link.model.poison_until_wait and dst_t.is_floating_point():
            dst_t.fill_(float("nan"))

        def land() -> None:
            error = None
            try:
                host_copy(dst_t, src_t)
            except BaseException as e:  # noqa: BLE001 - delivered through the handle
                error = e
            self._finish_move(shard, src, dst, error)
        self._modeled_lanes[dst].submit(lambda: link.wait_until(done_at), land)

    def _modeled(self, src: Tier, dst: Tier) -> bool:
        """A copy between HOST and DEVICE that ``copy_link`` times (a CPU engine's)."""
        return (self.copy_link is not None and not self._cuda
                and {src, dst} == {Tier.HOST, Tier.DEVICE})

    def _reserve_on_link(self, shard: _Shard, src: Tier, dst: Tier):
        """Queue ``shard``'s copy on ``copy_link``'s direction: (that direction, its end)."""
        link = self.copy_link.toward(device=dst is Tier.DEVICE)
        return link, link.reserve(shard.nbytes, f"{src.name}->{dst.name}", shard.key)

    def writeback_copy(self, shard: _Shard, src: Tier, dst: Tier, ready) -> None:
        """A write-back's copy, complete on return. Under ``copy_link`` this copy thread waits for
        the copy's modeled end, as it waits for a real one's event (:meth:`_copy`); the
        destination is INFLIGHT meanwhile, so nobody reads it early."""
        dst_t, src_t = shard.copies[dst].tensor, shard.copies[src].tensor
        if self._modeled(src, dst):
            link, done_at = self._reserve_on_link(shard, src, dst)
            link.wait_until(done_at)
            host_copy(dst_t, src_t)
        else:
            self._copy(dst_t, src_t, ready)

    def _release_source(self, shard: _Shard, src: Tier) -> None:
        """The copy out of ``src`` has run: the source copy may be evicted or changed again."""
        with self._table:
            shard.copies[src].busy -= 1
            self._table.notify()

    def _finish_move(self, shard: _Shard, src: Tier, dst: Tier, error, lock: bool = True, *,
                     ready_event=None, release_source: bool = True) -> None:
        if lock:
            with self._table:
                self._finish_move_locked(shard, src, dst, error, ready_event=ready_event,
                                         release_source=release_source)
        else:
            self._finish_move_locked(shard, src, dst, error)

    def _finish_move_locked(self, shard: _Shard, src: Tier, dst: Tier, error, *,
                            ready_event=None, release_source: bool = True) -> None:
        copy = shard.copies[dst]
        future, copy.future = copy.future, None
        if src is not Tier.NVME and release_source:
            shard.copies[src].busy -= 1
        copy.ready_event = ready_event
        if error is None:
            shard.set_state(dst, _R)
            if not (src is Tier.NVME and shard.copies[Tier.NVME].state is _Z):
                self.counters.add_moved(src, dst, shard.nbytes, shard.key)
            future.set_result(copy.tensor)
        else:
            shard.set_state(dst, _A)
            copy.pins = 0  # the acquires that pinned it fail with this error
            self._budgets.release_bytes(shard, dst)
            logger.warning("fetch of %r into %s failed: %s", shard.key, dst.name, error)
            future.set_exception(error)
        self._table.notify()

    def submit(self, fn, *args) -> None:
        """Run ``fn`` on a copy thread. Completions must never fail silently (a waiter would hang),
        so an exception escaping one is logged loudly; the functions themselves deliver I/O errors
        through the copy's future."""
        def run() -> None:
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - a bug in the store; make it visible
                logger.exception("internal error in a tiered-store completion (%s)", fn.__name__)
                raise
        try:
            self._pool.submit(run)
        except RuntimeError:
            # [Note: completions after pool shutdown] concurrent.futures stops every pool at
            # interpreter exit, before atexit handlers and finalizers (where owners close the
            # store); a swap still in flight then has nowhere to complete and close() would wait
            # for it forever. Run it on a one-off thread instead -- not inline: a done-callback
            # may fire in a thread that holds the store's lock -- and inline only as the last
            # resort, when the interpreter refuses new threads too (finalizing).
            logger.debug("copy pool is shut down: running %s on its own thread", fn.__name__)
            try:
                threading.Thread(target=run, name="infinity-tiers-late", daemon=True).start()
            except RuntimeError:
                run()

    def stream_event(self):
        """CUDA: a blocking event on the caller's stream, so the copy stream waits (on the GPU,
        not the host) for the work issued so far: it wrote the source, or last used the memory
        the destination was allocated in (the caching allocator orders reuse by stream)."""
        if not self._cuda:
            return None
        return record_on_current_stream(self.device)

    def _issue_copy(self, dst: torch.Tensor, src: torch.Tensor, ready):
        """Copy between HOST and DEVICE. CPU: done on return (None). CUDA: issued on the store's
        copy stream after ``ready``; returns the blocking event recorded after it."""
        if not self._cuda:
            host_copy(dst, src)
            return None
        with torch.cuda.device(self.device), torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(ready)
            dst.copy_(src, non_blocking=True)
            for t in (dst, src):
                if t.is_cuda:  # freed early (an eviction): not reused before the copy has run
                    t.record_stream(self._copy_stream)
            done = blocking_event()
            done.record(self._copy_stream)
        return done

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, ready) -> None:
        """:meth:`_issue_copy`, complete on return (the copy thread sleeps on a blocking event)."""
        done = self._issue_copy(dst, src, ready)
        if done is not None:
            done.synchronize()

    def device_reader(self, shard: _Shard, tier: Tier) -> Callable[[], None] | None:
        """[Note: device copies complete on the stream]: what a reader of ``shard``'s copy on
        ``tier`` runs before using it: on CUDA, its current stream waits for the copy that filled
        it (the GPU waits, the host does not). None: nothing to wait for."""
        if not self._cuda or tier is not Tier.DEVICE:
            return None
        copy = shard.copies[tier]
        device = self.device

        def wait_on_current_stream() -> None:
            event = copy.ready_event
            if event is not None:
                torch.cuda.current_stream(device).wait_event(event)
        return wait_on_current_stream

    def close(self) -> None:
        """Stop the copy threads and lanes once what was submitted has run."""
        self._pool.shutdown(wait=True)
        self._lane.close()
        for lane in self._modeled_lanes.values():
            lane.close()
