"""The offloaded optimizer's read-ahead window: the sub-groups pinned in HOST ahead of their update
(with their gradient slices), how many at most, and what happens when a read ahead finds no room
([Note: optimizer read-ahead] in infinity/optim/_offloaded.py). It reads and unpins; the step
decides which sub-group comes next."""

from __future__ import annotations

import time

import torch

from infinity.errors import TierCapacityError
from infinity.optim._partition import StoredGrad
from infinity.optim._sub_group import StepRun, SubGroup, SubGroupState
from infinity.tiers import Tier, TieredStore, TierHandle


class ReadWindow:
    """The sub-groups in READING: each holds a pin on its HOST copy (and its gradient slice's)."""

    def __init__(self, store: TieredStore):
        self.store = store
        self.reading: dict[str, SubGroup] = {}
        """Store key -> sub-group, for the sub-groups in READING (the window's pins), in issue
        order."""
        self.wait_s = 0.0
        """Seconds the step spent blocked on sub-group fetches (the pipeline's stall)."""

    def __len__(self) -> int:
        return len(self.reading)

    def keys_ahead(self) -> set[str]:
        """The optimizer keys with a sub-group read ahead."""
        return {sg.key for sg in self.reading.values()}

    def issue(self, sg: SubGroup, run: StepRun | None, *, ahead: bool = False) -> None:
        """Acquire ``sg`` into HOST (a pin; TierCapacityError when no room can be made), with its
        gradient slice when ``run`` (the step under way, if any) has a :class:`StoredGrad` for
        its key. The record changes state first, so an illegal change never leaves a pin behind.
        ``ahead``: a read before its use, which never waits for room here ([Note: a read ahead
        never waits for room on its caller] in infinity/tiers/store.py): its errors come at
        :meth:`wait`."""
        sg.transition(SubGroupState.READING)
        try:
            sg.read = self.store.acquire(sg.store_key, Tier.HOST, ahead=ahead)
        except BaseException:
            sg.transition(SubGroupState.AT_REST)  # nothing was pinned
            raise
        sg.read_ahead = ahead
        try:
            if run is not None:
                sg.grad_read = self.acquire_grad(run, sg, ahead=ahead)
        except BaseException:
            handle, sg.read = sg.read, None
            self.unpin(handle)
            sg.transition(SubGroupState.AT_REST)
            raise
        self.reading[sg.store_key] = sg

    def acquire_grad(self, run: StepRun, sg: SubGroup, *, ahead: bool = False
                     ) -> TierHandle | None:
        """Acquire ``sg``'s gradient slice into HOST when ``run``'s gradient of its key is a
        :class:`StoredGrad`; None when the gradient is a tensor (or absent)."""
        grad = run.grads.get(sg.key)
        if not isinstance(grad, StoredGrad):
            return None
        return self.store.acquire(grad.store_key_of(sg.lo, sg.hi), Tier.HOST, ahead=ahead)

    def top_up(self, run: StepRun) -> None:
        """Issue reads ahead of ``run``'s next update, within its window."""
        while run.cursor < len(run.items) and len(self.reading) < run.window:
            sg = run.items[run.cursor]
            if sg.state is SubGroupState.AT_REST and sg.home is Tier.NVME:
                try:
                    self.issue(sg, run, ahead=True)
                except TierCapacityError:
                    return  # a read ahead: try again after the next update frees room
            run.cursor += 1

    def wait(self, sg: SubGroup, run: StepRun) -> torch.Tensor:
        """The HOST buffer of ``sg``'s read, ``run``'s next item, taken out of the window (its
        pin now the caller's; READING -> the caller's next state). A read issued ahead that found
        no room at all (TierCapacityError, on the store's room lane) is issued again here, where
        its bytes are needed now, after :meth:`room_short`; any other error, or the same from a
        read issued here, raises (the sub-group back AT_REST, no pin held)."""
        del self.reading[sg.store_key]
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
                self.room_short(run)
                self.issue(sg, run)
                self.reading.pop(sg.store_key, None)  # the caller takes it out of the window
                continue
            except BaseException:
                self._drop_grad_read(sg)
                sg.transition(SubGroupState.AT_REST)  # a failed read holds no pin
                raise
            finally:
                self.wait_s += time.perf_counter() - t0
            return buf

    def wait_grad(self, run: StepRun, sg: SubGroup, handle: TierHandle
                  ) -> tuple[TierHandle, torch.Tensor]:
        """``(handle, gradient slice)`` of ``sg``'s stored gradient read ``handle``; one read
        ahead that found no room is read again now, after :meth:`room_short` (the handle
        returned is then that read's)."""
        t0 = time.perf_counter()
        try:
            g = handle.wait()
        except TierCapacityError:  # read ahead without room: read it now
            if not sg.read_ahead:
                raise
            self.room_short(run)
            handle = self.acquire_grad(run, sg)
            g = handle.wait()
        self.wait_s += time.perf_counter() - t0
        return handle, g

    def room_short(self, run: StepRun | None) -> None:
        """A read ahead of the run's next item found no room: the reads ahead still pinned may
        hold it (issued after that one, on the room lane they found the room it did not: what is
        read ahead is then no prefix of the step's order). Let them all go (their copies stay
        cached, unpinned) and read ahead again from the item after the next, as the window
        allows."""
        self.drop_all()
        if run is not None:
            run.cursor = min(run.cursor, run.done + 1)

    def drop_all(self) -> None:
        """Let every read in the window go (their copies stay cached in HOST, unpinned)."""
        reading, self.reading = self.reading, {}
        for sg in reading.values():
            handles = (sg.read, sg.grad_read)
            sg.read = sg.grad_read = None
            sg.transition(SubGroupState.AT_REST)
            for handle in handles:
                self.unpin(handle)

    def _drop_grad_read(self, sg: SubGroup) -> None:
        handle, sg.grad_read = sg.grad_read, None
        self.unpin(handle)

    def unpin(self, handle: TierHandle | None) -> bool:
        """Release the pin of an acquire (one whose read failed holds none: False)."""
        if handle is None:
            return False
        try:
            handle.wait()
        except Exception:  # noqa: BLE001 - a failed read holds no pin; its user reported it
            return False
        self.store.release(handle.key, Tier.HOST)
        return True
