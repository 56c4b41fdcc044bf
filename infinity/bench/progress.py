"""A dependency-free progress bar for long runs (benchmarks, the main job), written to stderr.

On a terminal it redraws one line; elsewhere (CI logs, pipes) it prints a line every
``log_every_s`` seconds so logs stay short.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    def __init__(self, total: int, *, desc: str = "", stream: TextIO | None = None,
                 log_every_s: float = 5.0, width: int = 24) -> None:
        self.total = max(total, 1)
        self.desc = desc
        self.stream = stream or sys.stderr
        self.log_every_s = log_every_s
        self.width = width
        self.count = 0
        self._start = time.perf_counter()
        self._last_log = float("-inf")
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, n: int = 1, **fields: Any) -> None:
        self.count = min(self.count + n, self.total)
        now = time.perf_counter()
        done = self.count == self.total
        if not self._tty and not done and now - self._last_log < self.log_every_s:
            return
        self._last_log = now
        line = self._line(now, fields)
        if self._tty:
            self.stream.write("\r" + line + ("\n" if done else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def _line(self, now: float, fields: dict[str, Any]) -> str:
        frac = self.count / self.total
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = now - self._start
        eta = elapsed / frac - elapsed if frac > 0 else float("nan")
        left = f"{eta:.0f}s" if frac > 0 else "?"
        parts = [f"{self.desc} [{bar}] {self.count}/{self.total}", f"{elapsed:.0f}s<{left}"]
        for key, value in fields.items():
            parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
        return "  ".join(parts)

    def close(self) -> None:
        if self._tty and self.count < self.total:
            self.stream.write("\n")
            self.stream.flush()
