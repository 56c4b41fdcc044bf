"""``infinity bench io``: swapper bandwidth against the disk's limit, fio and DeepSpeed's aio.

Reproduce (the cores are shared, so take the lock):
    flock /tmp/infinity-bench.lock infinity bench io --size-bytes 2147483648 --repeats 3
    flock /tmp/infinity-bench.lock infinity bench io --sweep --plot io-sweep.png

One tensor of ``--size-bytes`` is written and read back through :class:`infinity.io.Swapper`
(both buffers allocated once and touched before timing). In the same run, the references run
in the same rounds (round by round, so drift on a shared disk hits all alike): a raw direct-I/O probe
moving the same buffers (16 MiB aligned blocks from several threads: the disk's practical limit),
fio (libaio, direct) when installed, and DeepSpeed's aio handle when ``/root/dsvenv`` has it (a
server subprocess of that interpreter, locked buffer, best of a small settings grid; see
``benchmarks/io_reference.py``). Every figure is a median of ``--repeats`` rounds after one warm-up
round; the page cache is bypassed (direct I/O; the buffered fallback runs fsync +
POSIX_FADV_DONTNEED inside the timed region).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from infinity._common import GiB, MiB, format_bytes
from infinity.bench.plot import save_plot
from infinity.bench.progress import progress
from infinity.bench.report import Report, add_common_arguments, format_table
from infinity.config import SwapperConfig
from infinity.io import Swapper, aligned_empty, memory_at

DS_PYTHON = "/root/dsvenv/bin/python"
DS_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "io_reference.py"
RAW_BLOCK_BYTES = 16 * MiB
RAW_NUM_THREADS = 8
SWEEP_BLOCK_BYTES = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
SWEEP_QUEUE_DEPTHS = (2, 4, 8, 16, 32)
# `infinity bench all --quick`: a size that still spans many swapper blocks, no slow references.
QUICK_ARGS = ("--size-bytes", str(256 * MiB), "--repeats", "2", "--no-deepspeed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default="./infinity-data/bench-io", help="directory on the disk to test")
    parser.add_argument("--size-bytes", type=int, default=2 * GiB, help="tensor size (default 2 GiB)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure (median)")
    parser.add_argument("--block-size-bytes", type=int, default=None, help="override the swapper's")
    parser.add_argument("--queue-depth", type=int, default=None, help="override the swapper's")
    parser.add_argument("--num-io-threads", type=int, default=None, help="override the swapper's")
    parser.add_argument("--no-fio", action="store_true", help="skip the fio reference")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed reference")
    parser.add_argument("--sweep", action="store_true",
                        help="also measure block size x queue depth (threads = queue depth)")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="draw the sweep: bandwidth against block size and queue depth "
                        "(implies --sweep; needs pip install 'infinity[plot]')")
    add_common_arguments(parser)


def _config(args: argparse.Namespace) -> SwapperConfig:
    changes = {k: v for k, v in (("block_size_bytes", args.block_size_bytes),
                                 ("queue_depth", args.queue_depth),
                                 ("num_io_threads", args.num_io_threads)) if v is not None}
    return dataclasses.replace(SwapperConfig(), **changes)


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _timed_swap(sw: Swapper, key: str, src: torch.Tensor, dst: torch.Tensor, write: bool) -> float:
    """Seconds for one swap-out (write) or swap-in; buffered mode pays fsync + cache drop inside."""
    if not write and not sw.direct_io:
        _drop_cache(sw.path_of(key))
    t0 = time.perf_counter()
    if write:
        sw.swap_out(key, src).wait()
        if not sw.direct_io:
            _drop_cache(sw.path_of(key))
    else:
        sw.swap_in(key, dst).wait()
    return time.perf_counter() - t0


def raw_probe(path: str, buf: torch.Tensor, *, write: bool, direct: bool,
              block_bytes: int = RAW_BLOCK_BYTES, num_threads: int = RAW_NUM_THREADS) -> float:
    """Seconds to move ``buf`` (from :func:`aligned_empty`) to/from ``path`` in aligned blocks."""
    nbytes = buf.numel() * buf.element_size()
    if direct:  # O_DIRECT needs whole pages; aligned_empty maps whole pages, so the tail is there
        nbytes = (nbytes + 4095) // 4096 * 4096
    flags = (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY) | (os.O_DIRECT if direct else 0)
    if not write and not direct:
        _drop_cache(path)
    fd = os.open(path, flags, 0o600)
    offsets = list(range(0, nbytes, block_bytes))
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            while True:
                with lock:
                    if not offsets:
                        return
                    off = offsets.pop()
                n = min(block_bytes, nbytes - off)
                mem = memory_at(buf.data_ptr() + off, n)
                done = os.pwrite(fd, mem, off) if write else os.preadv(fd, [mem], off)
                if done != n:
                    raise OSError(f"raw probe: short {'write' if write else 'read'} at {off}")
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(num_threads)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if write and not direct:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    dt = time.perf_counter() - t0
    os.close(fd)
    if errors:
        raise errors[0]
    return dt


PROBE_BYTES = 256 << 20
"""Bytes moved by each direction of the disk probe (a few times the largest single swap file of
the presets; large enough that the drive's cache does not flatter the write)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiskBandwidth:
    read_bytes_per_s: float
    write_bytes_per_s: float
    direct: bool
    """Measured with O_DIRECT (False where the file system refused it: buffered, then fsynced)."""
    mixed_read_bytes_per_s: float | None = None
    mixed_write_bytes_per_s: float | None = None
    """Each direction's rate while the other streams too (the third measurement of
    :func:`probe_disk`); None: not probed, and reads and writes add up."""

    def seconds(self, read_bytes: float, write_bytes: float) -> float:
        """[Note: the mixed disk roofline]
        The least time this disk moves ``read_bytes`` in and ``write_bytes`` out. One after the
        other: the sum of each alone. Both at once, where the probe measured it: while both
        directions stream each goes at its mixed rate, and what is left of the longer one goes
        alone; on this VM's disk (fio, 16 MiB blocks, depth 8) reads fell from 1.03-1.11 to
        0.77-0.87 GB/s and writes from 1.53-1.98 to 0.71-0.78 GB/s beside each other, so a step
        that reads and writes about equal bytes moves them 15-20 % sooner both at once. Whichever
        is less is the bound (an engine may schedule either way). The mixed rates are each
        direction's bytes over its own time from a common start, so the longer direction's
        includes some time alone: optimistic, as a roofline must be."""
        serial = read_bytes / self.read_bytes_per_s + write_bytes / self.write_bytes_per_s
        if not (self.mixed_read_bytes_per_s and self.mixed_write_bytes_per_s):
            return serial
        both_s = min(read_bytes / self.mixed_read_bytes_per_s,
                     write_bytes / self.mixed_write_bytes_per_s)
        mixed = (both_s
                 + (read_bytes - both_s * self.mixed_read_bytes_per_s) / self.read_bytes_per_s
                 + (write_bytes - both_s * self.mixed_write_bytes_per_s) / self.write_bytes_per_s)
        return min(serial, mixed)


def probe_disk(directory: str, *, nbytes: int = PROBE_BYTES, mixed: bool = True) -> DiskBandwidth:
    """Raw aligned write, then read bandwidth of ``directory``'s disk, then (``mixed``) both at
    once: the file just written read back while a second one is written, each direction timed
    from the common start (the probe files are removed)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f".infinity-roofline-probe-{os.getpid()}")
    other = path + "-mixed"
    buf = aligned_empty(nbytes, torch.uint8, direct_io=True)  # as the engine's arena
    buf.fill_(7)  # touched once: the write reads resident pages, not zero-fill faults
    direct = True
    mixed_rates: dict[str, float] = {}
    try:
        try:
            write_s = raw_probe(path, buf, write=True, direct=True)
        except OSError:  # a file system without O_DIRECT (tmpfs, some overlays)
            direct = False
            write_s = raw_probe(path, buf, write=True, direct=False)
        read_s = raw_probe(path, buf, write=False, direct=direct)
        if mixed:
            into = aligned_empty(nbytes, torch.uint8, direct_io=True)
            into.zero_()
            times = _both_at_once(lambda: raw_probe(path, into, write=False, direct=direct),
                                  lambda: raw_probe(other, buf, write=True, direct=direct))
            mixed_rates = {"mixed_read_bytes_per_s": nbytes / times[0],
                           "mixed_write_bytes_per_s": nbytes / times[1]}
    finally:
        for p in (path, other):
            try:
                os.unlink(p)
            except OSError:
                pass
    return DiskBandwidth(read_bytes_per_s=nbytes / read_s, write_bytes_per_s=nbytes / write_s,
                         direct=direct, **mixed_rates)


def _both_at_once(*probes) -> list[float]:
    """Run the probes on threads of their own from one start; each one's seconds from it."""
    start = threading.Barrier(len(probes) + 1)
    times: list[float] = [0.0] * len(probes)
    errors: list[BaseException] = []

    def run(i: int, probe) -> None:
        start.wait()
        t0 = time.perf_counter()
        try:
            probe()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
        times[i] = time.perf_counter() - t0

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(probes)]
    for t in threads:
        t.start()
    start.wait()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return times


class _Engine:
    """One way of moving the bytes: ``sample(write)`` returns GB/s for one full pass."""

    def __init__(self, name: str, sample, note: str, close=lambda: None):
        self.name, self.sample, self.note, self.close = name, sample, note, close
        self.runs: dict[str, list[float]] = {"write": [], "read": []}


def _ours_and_raw(args, config, sw: Swapper, src, dst) -> list[_Engine]:
    nbytes = src.numel()
    raw_path = os.path.join(args.dir, "raw-probe.bin")
    checked = []

    def ours(write: bool) -> float:
        if not write:
            dst.zero_()
        dt = _timed_swap(sw, "bench", src, dst, write)
        if not write and not checked:  # once: the bytes read back are the bytes written
            if not torch.equal(src, dst):
                raise RuntimeError("bench io: bytes read back differ from bytes written")
            checked.append(True)
        return nbytes / dt / 1e9

    def raw(write: bool) -> float:
        return nbytes / raw_probe(raw_path, src if write else dst, write=write,
                                  direct=sw.direct_io) / 1e9

    return [_Engine("infinity swapper", ours, f"swapper {config}"),
            _Engine("raw direct I/O probe", raw,
                    f"raw probe: {format_bytes(RAW_BLOCK_BYTES)} blocks, {RAW_NUM_THREADS} threads, "
                    "same buffers", close=lambda: _unlink_quiet(raw_path))]


def _fio(args, nbytes: int) -> tuple[_Engine | None, str]:
    if args.no_fio:
        return None, "fio skipped (--no-fio)"
    if shutil.which("fio") is None:
        return None, "fio not installed: reference skipped (apt-get install fio)"
    path = os.path.join(args.dir, "fio.bin")

    def sample(write: bool) -> float:
        rw = "write" if write else "read"
        cmd = ["fio", "--name=infinity", f"--filename={path}", f"--rw={rw}", "--bs=16M",
               "--direct=1", "--ioengine=libaio", "--iodepth=16", f"--size={nbytes}",
               "--output-format=json"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode:
            raise RuntimeError(f"fio failed: {res.stderr.strip()[:200]}")
        job = json.loads(res.stdout[res.stdout.index("{"):])["jobs"][0]
        return job[rw]["bw_bytes"] / 1e9

    return _Engine("fio", sample, "fio: libaio, direct=1, bs=16M, iodepth=16, one job",
                   close=lambda: _unlink_quiet(path)), ""


def _deepspeed(args, nbytes: int) -> tuple[_Engine | None, str]:
    """DeepSpeed's aio in a server subprocess of its own interpreter (see benchmarks/io_reference.py)."""
    if args.no_deepspeed:
        return None, "DeepSpeed skipped (--no-deepspeed)"
    if not os.path.exists(DS_PYTHON) or not DS_SCRIPT.exists():
        return None, f"DeepSpeed reference skipped: {DS_PYTHON} or {DS_SCRIPT} missing"
    cmd = [DS_PYTHON, str(DS_SCRIPT), "--serve", "--file", os.path.join(args.dir, "deepspeed.bin"),
           "--size-bytes", str(nbytes)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, DS_ACCELERATOR="cpu"))

    def reply() -> dict[str, Any]:
        for line in proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        tail = " | ".join(proc.stderr.read().strip().splitlines()[-3:])
        raise RuntimeError(f"DeepSpeed aio reference exited (rc={proc.wait()}): {tail[:300]}")

    try:
        ready = reply()
    except RuntimeError as e:
        return None, f"DeepSpeed aio skipped: {e}"

    def sample(write: bool) -> float:
        proc.stdin.write("write\n" if write else "read\n")
        proc.stdin.flush()
        return reply()["gbps"]

    def close() -> None:
        proc.stdin.close()
        proc.wait(timeout=120)

    return _Engine("DeepSpeed aio", sample, "DeepSpeed aio_handle, locked buffer, best of a "
                   f"settings grid: {ready['settings']}", close=close), ""


def _measure(args, engines: list[_Engine]) -> None:
    """Rounds of write-then-read, every engine in each round, so drift on a shared disk hits all."""
    bar = progress((args.repeats + 1) * 2 * len(engines), desc="bench io")
    try:
        for round_ in range(args.repeats + 1):  # round 0 is the warm-up
            for write in (True, False):
                for engine in engines:
                    gbps = engine.sample(write)
                    if round_:
                        engine.runs["write" if write else "read"].append(gbps)
                    bar.set_postfix(round=f"{round_}/{args.repeats}", last=engine.name,
                                    refresh=False)
                    bar.update(1)
    finally:
        bar.close()


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _sweep(args, src, dst) -> list[dict[str, Any]]:
    """Bandwidth over block size x queue depth (threads = queue depth), one run after a warm-up."""
    nbytes = min(src.numel(), 512 * MiB)
    a, b = src[:nbytes], dst[:nbytes]
    rows = []
    bar = progress(len(SWEEP_BLOCK_BYTES) * len(SWEEP_QUEUE_DEPTHS), desc="bench io sweep")
    for block in SWEEP_BLOCK_BYTES:
        for depth in SWEEP_QUEUE_DEPTHS:
            cfg = SwapperConfig(block_size_bytes=block, queue_depth=depth, num_io_threads=depth)
            with Swapper(args.dir, cfg) as sw:
                _timed_swap(sw, "s", a, b, True)
                w = _timed_swap(sw, "s", a, b, True)
                _timed_swap(sw, "s", a, b, False)
                r = _timed_swap(sw, "s", a, b, False)
            rows.append({"block_size": format_bytes(block), "block_size_bytes": block,
                         "queue_depth": depth, "write_GBps": nbytes / w / 1e9,
                         "read_GBps": nbytes / r / 1e9})
            bar.set_postfix(block=format_bytes(block), depth=depth, refresh=False)
            bar.update(1)
    bar.close()
    return rows


def _plot(rows: list[dict[str, Any]], path: str) -> str:
    """The one-line outcome of :func:`_plot_sweep`."""
    return _plot_sweep(rows, path)[1]


def _plot_sweep(rows: list[dict[str, Any]], path: str) -> tuple[bool, str]:
    """Bandwidth against block size, one line per queue depth: (written, one-line outcome)."""
    def draw(plt):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
        for ax, col in zip(axes, ("write_GBps", "read_GBps")):
            for depth in SWEEP_QUEUE_DEPTHS:
                pts = [(r["block_size_bytes"] / MiB, r[col]) for r in rows if r["queue_depth"] == depth]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"queue depth {depth}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("block size (MiB)")
            ax.set_title(col.split("_")[0])
            ax.grid(True, alpha=0.3)
        axes[0].set_ylabel("GB/s")
        axes[0].legend()
        return fig

    return save_plot(path, draw, what="sweep plot")


def _ratio(ours: float, ref: float | None) -> str | None:
    return None if not ref else f"{ours / ref:.2f}x"


def run(args: argparse.Namespace) -> int:
    if args.size_bytes < 1 or args.repeats < 1:
        raise ValueError("--size-bytes and --repeats must be >= 1")
    config = _config(args)
    os.makedirs(args.dir, exist_ok=True)
    notes: list[str] = []
    refs = [_fio(args, args.size_bytes), _deepspeed(args, args.size_bytes)]  # DeepSpeed warms up first
    # The memory the engine's arena moves: huge pages where the kernel has them ([Note: direct
    # I/O wants huge pages] in infinity/io/_huge_pages.py).
    src = aligned_empty(args.size_bytes, torch.uint8, direct_io=True)
    src.random_(0, 256)
    dst = aligned_empty(args.size_bytes, torch.uint8, direct_io=True)
    dst.zero_()  # touch once: fresh pages fault at 1-4 GB/s here and would be timed otherwise
    with Swapper(args.dir, config) as sw:
        engines = _ours_and_raw(args, config, sw, src, dst) + [e for e, _ in refs if e is not None]
        notes.append(f"{format_bytes(args.size_bytes)} in {args.dir}; direct I/O "
                     f"{'on' if sw.direct_io else 'off (buffered fallback)'}, alignment "
                     f"{sw.alignment_bytes} B; median of {args.repeats} interleaved rounds")
        try:
            _measure(args, engines)
        finally:
            for engine in engines:
                engine.close()
    notes += [e.note for e in engines] + [note for e, note in refs if e is None]
    med = {e.name: {d: statistics.median(r) for d, r in e.runs.items()} for e in engines}
    ours = med["infinity swapper"]
    rows = [{"engine": name, "write_GBps": m["write"], "read_GBps": m["read"],
             "ours/ref write": _ratio(ours["write"], m["write"]) if i else None,
             "ours/ref read": _ratio(ours["read"], m["read"]) if i else None}
            for i, (name, m) in enumerate(med.items())]
    # The disk's mixed figure ([Note: the mixed disk roofline]):
    # the raw probe reading one file while it writes another, each direction from one start.
    disk = probe_disk(args.dir, nbytes=args.size_bytes)
    rows.append({"engine": "raw, reads and writes at once", "write_GBps":
                 disk.mixed_write_bytes_per_s / 1e9, "read_GBps": disk.mixed_read_bytes_per_s / 1e9,
                 "ours/ref write": None, "ours/ref read": None})
    serial_s = 1e9 / disk.read_bytes_per_s + 1e9 / disk.write_bytes_per_s
    notes.append(f"reads and writes at once (raw, {format_bytes(args.size_bytes)} each way): "
                 f"equal bytes both ways take {disk.seconds(1e9, 1e9) / serial_s:.2f}x the time "
                 "of one direction after the other (the roofline takes the lesser)")
    extra: dict[str, Any] = {"runs_GBps": {e.name: e.runs for e in engines},
                             "mixed_GBps": {"read": disk.mixed_read_bytes_per_s / 1e9,
                                            "write": disk.mixed_write_bytes_per_s / 1e9}}
    if args.sweep or args.plot:
        extra["sweep"] = _sweep(args, src, dst)
        if args.plot:
            written, message = _plot_sweep(extra["sweep"], args.plot)
            print(message, file=sys.stderr)  # stderr: keeps --json stdout one document
            extra["plot"] = args.plot if written else None
    report = Report(name="io", title="NVMe swap bandwidth (GB/s, median; ratio = ours / reference)",
                    rows=rows, notes=notes, params={"size_bytes": args.size_bytes, "dir": args.dir,
                                                    "repeats": args.repeats,
                                                    "swapper": dataclasses.asdict(config)},
                    extra=extra)
    report.emit(as_json=args.json, results_dir=args.results_dir, save=not args.no_save)
    if "sweep" in extra and not args.json:
        print("\nsweep (threads = queue depth):")
        print(format_table(extra["sweep"], ["block_size", "queue_depth", "write_GBps", "read_GBps"]))
    return 0
