"""The progress bar of long runs (benchmarks, the main job): ``tqdm`` on stderr, set up once here.

On a terminal it redraws one line a few times a second; elsewhere (CI logs, pipes) it redraws at
most every ``log_every_s`` seconds, so logs stay short. Fields go in tqdm's postfix
(``bar.set_postfix(loss=..., refresh=False)`` then ``bar.update(1)``).
"""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm


def progress(total: int, *, desc: str, stream: TextIO | None = None,
             log_every_s: float = 5.0) -> tqdm:
    """A bar of ``total`` steps named ``desc`` (see the module docstring)."""
    stream = stream or sys.stderr
    tty = bool(getattr(stream, "isatty", lambda: False)())
    return tqdm(total=max(total, 1), desc=desc, file=stream, dynamic_ncols=tty,
                mininterval=0.1 if tty else log_every_s, ascii=not tty, leave=True)
