"""Ending a process that used ``torch.distributed`` without the interpreter's finalization.

[Note: gloo teardown at exit]
torch 2.13's gloo backend aborts now and then while the interpreter finalizes a process whose
process group was used ("terminate called without an active exception", no Python frame, exit
-6), even after ``destroy_process_group``: a C++ thread of the group is destroyed unjoined while
the objects that hold it are freed in finalization's order. It happens when the machine is busy:
2 of 5 runs of a 2-rank test on 2026-12-04, 2 of 80 runs of ``infinity bench comm --ranks 2``
with both cores loaded on 2026-12-05, once in CI (rank 0 of ``bench comm``, its result already
written). Work done is not at risk, only the exit status, which launchers (``torchrun``, our
benchmark's parent) read as a failed rank. So a process of ours whose work is done, with a process
group still initialized, destroys the group, flushes what it printed and logged, and leaves with
``os._exit``. Our callers need no finalization: their files are written inside ``with`` blocks,
and ``infinity train`` closes its engine (deleting its swap files) before it returns; a caller that
left an engine open would keep its swap directory, whose removal is the finalizer's job. Library
code never does this: a user's own script decides how it exits.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_after_distributed(code: int) -> None:
    """Return if no process group is initialized (the caller exits as usual); else destroy it,
    flush stdout, stderr and logging, and end the process with ``code`` at once
    ([Note: gloo teardown at exit])."""
    dist = sys.modules.get("torch.distributed")  # not imported: no group (and no torch import)
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return
    dist.destroy_process_group()
    _exit_now(code)


def _exit_now(code: int) -> NoReturn:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
