"""Where gradients copied down a modeled link land: a lane thread of their own, and one wait.

[Note: gradients down a modeled link] in infinity/zero/_grad_reducer.py: a CPU engine under a
modeled host<->device link copies each reduced gradient to its host accumulator as a GPU would;
:class:`LinkLanding` queues each copy on the link's device->host direction, runs its landing at
the copy's modeled end, and is where the training thread waits for them.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from infinity._modeled_link import ModeledLink
from infinity.tiers import CopyLane


class LinkLanding:
    """The copies down to host accumulators over one modeled link: each reserved on the link,
    landed on the lane thread at its modeled end, its error kept for :meth:`wait`."""

    def __init__(self, link: ModeledLink, on_wait: Callable[[float], None]):
        self.link = link
        """The link's device->host direction."""
        self._on_wait = on_wait
        """Gets the seconds the training thread waited for the landings (exposed time)."""
        self._lane = CopyLane("infinity-link-grads-down")
        """Runs each landing once its copy's modeled end has passed."""
        self._errors: list[BaseException] = []
        """Landings that raised since the last :meth:`wait` (raised there)."""

    def reserve(self, part: torch.Tensor, key: str) -> float:
        """Queue the copy of ``part`` on the link; returns its modeled end."""
        return self.link.reserve(part.numel() * part.element_size(), "grad DEVICE->HOST", key)

    def submit(self, done_at: float, land: Callable[[], None]) -> None:
        """Run ``land`` on the lane thread once the link reaches ``done_at``."""
        def landed() -> None:
            try:
                land()
            except BaseException as e:  # noqa: BLE001 - raised by wait()
                self._errors.append(e)
        link = self.link
        self._lane.submit(lambda: link.wait_until(done_at), landed)

    def wait(self) -> None:
        """The copies down have landed; raises the first that failed."""
        if self._lane.pending:  # a wait only where there was something to wait for
            start = time.perf_counter()
            self._lane.drain()
            self._on_wait(time.perf_counter() - start)
        if self._errors:
            errors, self._errors = self._errors, []
            raise errors[0]

    def close(self) -> None:
        """Stop the lane thread (after its last landing)."""
        self._lane.close()
