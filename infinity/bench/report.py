"""One output style for every benchmark: a table, ``--json``, and a saved result record.

A benchmark builds a :class:`Report` (title, rows of dicts, notes), then calls :meth:`Report.emit`,
which prints a table (or JSON with ``--json``) and writes the record with hardware, versions, date
and command line to ``benchmarks/results/`` (or ``--results-dir``).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import resource
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any, Callable, Sequence

import psutil
import torch


def median_time_s(fn: Callable[[], Any], *, repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times; return (median seconds, all)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def peak_rss_bytes() -> int:
    """This process's own high-water mark (VmHWM). Not ru_maxrss: Linux carries the parent's
    high-water mark over into a child at fork, so every mode would read at least the parent's."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def environment() -> dict[str, Any]:
    """Hardware and versions recorded with every result."""
    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_bytes": psutil.virtual_memory().total,
    }
    env["torch"] = torch.__version__
    env["torch_threads"] = torch.get_num_threads()
    env["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    try:
        env["infinity"] = version("infinity")
    except Exception:  # noqa: BLE001 - not installed as a distribution (running from a checkout)
        env["infinity"] = "checkout"
    return env


def _cpu_model() -> str | None:
    """The CPU's model name (figures move with it: bf16 matmuls without AVX-512 BF16 or AMX run
    two orders of magnitude slower than fp32 on the same cores)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    if not rows:
        return "(no rows)"
    # Every key of every row, in first-seen order: a row with its own columns (bench scale's 7B
    # LoRA row: x plain, plain step) must not lose them to the first row's.
    columns = list(columns or dict.fromkeys(k for r in rows for k in r))

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
        return "-" if v is None else str(v)

    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths)))
            for row in cells]
    return "\n".join([line, sep, *body])


@dataclass
class Report:
    name: str
    """Short benchmark name ('io', 'adam', 'step'); used in the results file name."""
    title: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    columns: list[str] | None = None
    notes: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    """The benchmark's own settings (sizes, directories, thread counts)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else a machine reader needs (raw per-run times, timelines)."""

    def to_dict(self) -> dict[str, Any]:
        return {"benchmark": self.name, "title": self.title, "environment": environment(),
                "params": self.params, "rows": self.rows, "notes": self.notes, **self.extra}

    def emit(self, *, as_json: bool = False, results_dir: str | None = "benchmarks/results",
             save: bool = True) -> dict[str, Any]:
        record = self.to_dict()
        if as_json:
            print(json.dumps(record, indent=2, default=str))
        else:
            print(f"\n{self.title}")
            print(format_table(self.rows, self.columns))
            for note in self.notes:
                print(f"  * {note}")
        if save and results_dir:
            os.makedirs(results_dir, exist_ok=True)
            stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
            path = os.path.join(results_dir, f"{self.name}-{stamp}.json")
            with open(path, "w", encoding="utf-8") as f:
                json.dump(record, f, indent=2, default=str)
            if not as_json:
                print(f"  saved {path}")
        return record


def add_common_arguments(parser: Any) -> None:
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--results-dir", default="benchmarks/results",
                        help="where the result record is saved (default: benchmarks/results)")
    parser.add_argument("--no-save", action="store_true", help="do not save a result record")
