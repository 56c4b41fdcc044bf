"""``infinity train --resume-check``: resuming from a checkpoint, checked bitwise at the run's size.

After half the steps the engine saves a checkpoint under ``--dir/checkpoint`` (the swap files' file
system); the remaining steps run; the checkpoint is loaded back and the same steps run again on the
same batches. Both passes' losses and every trainable key's fp32 master (hashed key by key, so one
key is in memory at a time, never the whole state) must be bitwise equal. A save that does not fit
the disk raises :class:`~infinity.errors.DiskSpaceError` before writing anything
([Note: space before a save] in infinity/checkpoint/_save.py); the check then reports that, with
the bytes needed and free, instead of a result (at 3.3B a second copy of the state does not fit
this machine's disk).

Bitwise equality holds where the kernels are deterministic: on a CPU they are; on a GPU the check
turns ``torch.use_deterministic_algorithms`` on first (:func:`deterministic_kernels`, with
cuBLAS's workspace setting) and the summary says so.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from typing import Any, Callable

import torch

from infinity.errors import DiskSpaceError

Batch = Callable[[int], Any]


def masters_digest(engine: Any) -> str:
    """SHA-256 over every trainable key's fp32 master, in key order (after pending updates)."""
    optimizer = engine.shard_optimizer
    optimizer.drain()
    h = hashlib.sha256()
    for key in sorted(optimizer.keys()):
        h.update(key.encode())
        # The in-memory optimizer's master is the live tensor on the engine's device (a GPU's),
        # in fp32 the parameter's own shard: copied first, since .numpy() makes a storage
        # non-resizable and a released unit resizes its buffers (the reload's re-gather failed).
        master = optimizer.master_values(key).detach().cpu().clone()
        h.update(master.contiguous().view(-1).numpy().tobytes())
    return h.hexdigest()


def deterministic_kernels() -> str:
    """Make the run's kernels deterministic where they may not be (CUDA), before the first
    kernel runs; returns what the summary says about it. cuBLAS needs its workspace setting in
    the environment before its first handle (torch's reproducibility notes)."""
    if not torch.cuda.is_available():
        return "CPU kernels (deterministic)"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    return ("torch.use_deterministic_algorithms on (CUBLAS_WORKSPACE_CONFIG="
            f"{os.environ['CUBLAS_WORKSPACE_CONFIG']})")


def run_steps(engine: Any, batch: Batch, first: int, end: int) -> list[float]:
    """Micro-steps ``first`` .. ``end - 1``: their losses."""
    losses = []
    for i in range(first, end):
        x, y = batch(i)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.item()))
    return losses


class ResumeCheck:
    """Saves at ``save_after`` micro-steps (:meth:`maybe_save`, called after each), then
    :meth:`finish` replays the rest from the checkpoint and compares."""

    def __init__(self, directory: str, save_after: int, *, kernels: str):
        self.directory = os.path.abspath(directory)
        self.save_after = save_after
        """Micro-steps after which the checkpoint is saved."""
        self.saved = False
        self.result: dict[str, Any] = {"save_after_micro_steps": save_after, "kernels": kernels}
        """``kernels``: :func:`deterministic_kernels`'s words."""

    def maybe_save(self, engine: Any, micro_steps_done: int) -> bool:
        """Save (or record the refusal) when ``micro_steps_done`` is the point; True then."""
        if micro_steps_done != self.save_after:
            return False
        t0 = time.perf_counter()
        try:
            engine.save_checkpoint(self.directory)
        except DiskSpaceError as e:
            self.result.update(refused=e.message, needed_bytes=e.needed_bytes,
                               free_bytes=e.free_bytes,
                               nothing_written=not os.path.exists(self.directory)
                               or not os.listdir(self.directory))
            return True
        self.saved = True
        self.result["save_s"] = time.perf_counter() - t0
        self.result["checkpoint_bytes"] = _tree_bytes(self.directory)
        return True

    def finish(self, engine: Any, batch: Batch, losses: list[float], end: int) -> dict[str, Any]:
        """Load the checkpoint, rerun micro-steps ``save_after`` .. ``end - 1``, compare."""
        if not self.saved:
            return self.result
        try:
            want_digest = masters_digest(engine)
            t0 = time.perf_counter()
            engine.load_checkpoint(self.directory)
            self.result["load_s"] = time.perf_counter() - t0
            again = run_steps(engine, batch, self.save_after, end)
            got_digest = masters_digest(engine)
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)
        want = losses[self.save_after:end]
        self.result.update(losses=want, resumed_losses=again, masters_sha256=want_digest,
                           resumed_masters_sha256=got_digest,
                           bitwise_equal=want == again and want_digest == got_digest)
        return self.result


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f))
               for root, _, files in os.walk(path) for f in files)
