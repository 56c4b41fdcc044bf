"""The NVMe swapper: round trips checked against bytes read back, layout, concurrency, async face.

Error paths live in ``test_swapper_errors.py``. The directory is under pytest's ``tmp_path`` (a disk
file system here, so direct I/O is exercised); tmpfs cases use /dev/shm.
"""

from __future__ import annotations

import asyncio
import os
import stat
import struct
import threading

import pytest
import torch

from infinity.config import SwapperConfig
from infinity.io import Swapper, aligned_empty, aligned_view
from tests._support.tensors import random_bytes, same_bytes

DTYPES = [torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.int64, torch.float64]
NUMELS = [1, 7, 4095, 4097, 2**20 + 3]
SMALL = SwapperConfig(block_size_bytes=64 * 1024, queue_depth=8, num_io_threads=4)


@pytest.fixture(scope="module")
def swapper(tmp_path_factory):
    with Swapper(tmp_path_factory.mktemp("swap")) as sw:
        yield sw


def test_direct_io_used_on_disk(swapper):
    assert swapper.direct_io, "pytest's tmp dir should be on a disk file system that takes O_DIRECT"
    assert swapper.alignment_bytes >= 512 and swapper.alignment_bytes & (swapper.alignment_bytes - 1) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", NUMELS)
def test_round_trip_sizes_and_dtypes(swapper, numel, dtype):
    gen = torch.Generator().manual_seed(numel)
    for aligned in (True, False):
        src = random_bytes(numel, dtype, gen=gen, aligned=aligned, misalign=1)
        key = f"rt/{numel}/{dtype}/{aligned}"
        swapper.swap_out(key, src).wait()
        out = random_bytes(numel, dtype, gen=gen, aligned=not aligned, misalign=3)
        swapper.swap_in(key, out).wait()
        assert same_bytes(out, src), (numel, dtype, aligned)


def test_shapes_round_trip(swapper):
    for shape in [(3, 5), (2, 3, 4097), (1, 1, 1, 7), ()]:
        src = torch.randn(shape, dtype=torch.float32)
        swapper.swap_out(f"shape{shape}", src).wait()
        out = torch.empty(shape, dtype=torch.float32)
        swapper.swap_in(f"shape{shape}", out).wait()
        assert same_bytes(out, src)


def test_empty_tensor(swapper):
    """Zero bytes: a file with a valid header and no payload, read back only as what was written."""
    src = torch.empty(0, dtype=torch.float16)
    swapper.swap_out("empty", src).wait()
    assert "empty" in swapper.keys()
    with open(swapper.path_of("empty"), "rb") as f:
        data = f.read()
    assert data[:8] == b"INFSWAP\x01" and len(data) == swapper.header_bytes
    out = torch.empty(0, dtype=torch.float16)
    swapper.swap_in("empty", out).wait()
    with pytest.raises(ValueError, match="float16"):
        swapper.swap_in("empty", torch.empty(0, dtype=torch.float32)).wait()


@pytest.mark.slow
def test_large_round_trip(swapper):
    nbytes = 256 * 2**20 if os.environ.get("INFINITY_SLOW") == "1" else 32 * 2**20 + 12345
    src = random_bytes(nbytes, torch.uint8)
    swapper.swap_out("large", src).wait()
    out = aligned_empty(nbytes, torch.uint8)
    swapper.swap_in("large", out).wait()
    assert same_bytes(out, src)


def test_bytes_on_disk_match(swapper):
    """Read the file ourselves: a header block, then the payload verbatim, padded to alignment."""
    src = random_bytes(10_001, torch.float32)  # 40004 bytes: not a multiple of 4096
    swapper.swap_out("disk", src).wait()
    path = swapper.path_of("disk")
    with open(path, "rb") as f:
        data = f.read()
    payload = src.numel() * 4
    assert data[:8] == b"INFSWAP\x01"
    assert data[swapper.header_bytes:swapper.header_bytes + payload] == src.numpy().tobytes()
    assert len(data) % swapper.alignment_bytes == 0
    assert set(data[swapper.header_bytes + payload:]) <= {0}


def test_overwrite_bumps_generation_and_reads_latest(swapper):
    first = random_bytes(5000, torch.int64)
    swapper.swap_out("ow", first).wait()
    second = random_bytes(33, torch.bfloat16)  # another size and dtype under the same key
    swapper.swap_out("ow", second).wait()
    out = torch.empty(33, dtype=torch.bfloat16)
    swapper.swap_in("ow", out).wait()
    assert same_bytes(out, second)
    with open(swapper.path_of("ow"), "rb") as f:
        header = f.read(64)
    generation = struct.unpack_from("<Q", header, 16)[0]
    assert generation == 2
    assert os.path.getsize(swapper.path_of("ow")) == swapper.header_bytes + swapper.alignment_bytes
    with pytest.raises(ValueError, match="dtype"):
        swapper.swap_in("ow", torch.empty(5000, dtype=torch.int64))


def test_swap_in_issued_before_swap_out_finishes_sees_new_bytes(tmp_path):
    """Operations on one key run in issue order, even when nobody waits in between."""
    with Swapper(tmp_path, SwapperConfig(block_size_bytes=4096, queue_depth=2, num_io_threads=2)) as sw:
        old, new = random_bytes(300_000, torch.uint8), random_bytes(300_000, torch.uint8)
        sw.swap_out("k", old).wait()
        h_out = sw.swap_out("k", new)
        out = aligned_empty(300_000, torch.uint8)
        h_in = sw.swap_in("k", out)
        h_in.wait()
        assert h_out.done()
        assert same_bytes(out, new)


def test_hundreds_in_flight(tmp_path):
    gen = torch.Generator().manual_seed(7)
    with Swapper(tmp_path, SMALL) as sw:
        srcs = {f"t{i}": random_bytes(1 + (i * 7919) % 40_000, DTYPES[i % len(DTYPES)], gen=gen,
                                       aligned=i % 2 == 0, misalign=1) for i in range(300)}
        handles = [sw.swap_out(k, t) for k, t in srcs.items()]
        for h in handles:
            h.wait()
        outs = {k: torch.empty_like(t) for k, t in srcs.items()}
        handles = [sw.swap_in(k, outs[k]) for k in srcs]
        for h in handles:
            h.wait()
        bad = [k for k in srcs if not same_bytes(outs[k], srcs[k])]
        assert not bad


def test_many_threads_issue_concurrently(tmp_path):
    errors: list[BaseException] = []
    with Swapper(tmp_path, SMALL) as sw:
        def client(i: int) -> None:
            try:
                for j in range(20):
                    src = random_bytes(1000 + 97 * j, torch.float32)
                    sw.swap_out(f"c{i}/{j}", src).wait()
                    out = torch.empty_like(src)
                    sw.swap_in(f"c{i}/{j}", out).wait()
                    assert same_bytes(out, src)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors


def test_non_contiguous_rejected(swapper):
    t = torch.randn(8, 8).t()
    with pytest.raises(ValueError, match="contiguous"):
        swapper.swap_out("nc", t)
    swapper.swap_out("nc", torch.randn(8, 8)).wait()
    with pytest.raises(ValueError, match="contiguous"):
        swapper.swap_in("nc", torch.empty(8, 8).t())


def test_private_files_removed_on_close(tmp_path):
    sw = Swapper(tmp_path, rank=3)
    name = os.path.basename(sw.directory)
    assert name.startswith(f"infinity-swap-{os.getpid()}-3-")
    assert os.path.dirname(sw.directory) == str(tmp_path)
    assert stat.S_IMODE(os.stat(sw.directory).st_mode) == 0o700
    sw.swap_out("a", torch.randn(100)).wait()
    sw.swap_out("nested/b", torch.randn(100)).wait()
    for key in ("a", "nested/b"):
        path = sw.path_of(key)
        assert os.path.dirname(path) == sw.directory
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert sorted(os.listdir(sw.directory)) == sorted(
        os.path.basename(sw.path_of(k)) for k in ("a", "nested/b"))
    sw.close()
    assert not os.path.exists(sw.directory)
    assert os.path.isdir(tmp_path)
    sw.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        sw.swap_out("a", torch.randn(1))


def test_remove(swapper):
    swapper.swap_out("gone", torch.randn(10)).wait()
    path = swapper.path_of("gone")
    assert os.path.exists(path)
    swapper.remove("gone")
    assert not os.path.exists(path)
    with pytest.raises(KeyError, match="gone"):
        swapper.swap_in("gone", torch.empty(10))
    with pytest.raises(KeyError):
        swapper.remove("gone")


@pytest.mark.parametrize("key", ["../x", "/etc/passwd", "a/../../b", "..", "a\0b", "", "a/.."])
def test_keys_cannot_escape(swapper, key):
    with pytest.raises(ValueError):
        swapper.swap_out(key, torch.randn(1))


def test_odd_keys_stay_inside(swapper):
    for key in ("a/b/c", "with space", "ü∆", ".hidden", "x" * 500, "%2F"):
        swapper.swap_out(key, torch.tensor([1.0])).wait()
        assert os.path.dirname(swapper.path_of(key)) == swapper.directory
        out = torch.empty(1)
        swapper.swap_in(key, out).wait()
        assert out.item() == 1.0
    assert swapper.path_of("a/b") != swapper.path_of("a%2Fb")


def test_async_face(swapper):
    src = random_bytes(12345, torch.float16)
    out = torch.empty_like(src)

    async def main() -> None:
        await swapper.swap_out_async("async", src)
        await swapper.swap_in_async("async", out)
        with pytest.raises(KeyError):
            await swapper.swap_in_async("async-missing", out)

    asyncio.run(main())
    assert same_bytes(out, src)


def test_aligned_empty():
    for numel, dtype in [(1, torch.uint8), (4097, torch.float32), (10, torch.bfloat16)]:
        t = aligned_empty(numel, dtype)
        assert t.numel() == numel and t.dtype == dtype and t.device.type == "cpu"
        assert t.data_ptr() % 4096 == 0
        assert t.is_pinned() == torch.cuda.is_available()
    assert aligned_empty(0, torch.float32).numel() == 0
    with pytest.raises(ValueError):
        aligned_empty(-1, torch.float32)


def test_arena_extents_round_trip_without_touching_neighbours(swapper):
    """The tiered store's pattern: one aligned arena, extents at aligned offsets, odd sizes."""
    align = swapper.alignment_bytes
    arena = aligned_empty(8 * align + 3 * 40_000, torch.uint8)
    arena.fill_(0xAB)
    sizes = [(10_001, torch.float32), (3, torch.float16), (4096, torch.uint8)]
    offset, extents = 0, []
    for numel, dtype in sizes:
        view = aligned_view(arena, offset, numel, dtype, alignment_bytes=align)
        extents.append((offset, view))
        offset += (view.numel() * view.element_size() + align - 1) // align * align
    srcs = [random_bytes(v.numel(), v.dtype) for _, v in extents]
    for i, src in enumerate(srcs):
        swapper.swap_out(f"arena{i}", src).wait()
    handles = [swapper.swap_in(f"arena{i}", v) for i, (_, v) in enumerate(extents)]
    for h in handles:
        h.wait()
    expected = torch.full_like(arena, 0xAB)
    for (off, v), src in zip(extents, srcs):
        nbytes = v.numel() * v.element_size()
        expected[off:off + nbytes] = src.view(torch.uint8)
    assert torch.equal(arena, expected)
    with pytest.raises(ValueError, match="multiples"):
        aligned_view(arena, 100, 1, torch.uint8, alignment_bytes=align)
    with pytest.raises(ValueError, match="exceeds"):
        aligned_view(arena, 0, arena.numel() + 1, torch.uint8, alignment_bytes=align)


def test_slow_disk_needs_the_wait(tmp_path, monkeypatch):
    """Slow every write down: a swap-in issued right after a swap-out must still see its bytes,
    and a swap-out handle is not complete before its blocks are written (no luck involved)."""
    import time

    real = os.pwrite
    gate = threading.Event()

    def slow_pwrite(fd, buf, offset):
        gate.wait(timeout=30)  # held until the test has looked at the handle
        time.sleep(0.001)
        return real(fd, buf, offset)

    with Swapper(tmp_path, SwapperConfig(block_size_bytes=4096, queue_depth=4, num_io_threads=4)) as sw:
        old, new = random_bytes(64 * 1024, torch.uint8), random_bytes(64 * 1024, torch.uint8)
        sw.swap_out("k", old).wait()
        monkeypatch.setattr(os, "pwrite", slow_pwrite)
        h_out = sw.swap_out("k", new)
        out = aligned_empty(64 * 1024, torch.uint8)
        h_in = sw.swap_in("k", out)
        assert not h_out.done() and not h_in.done()
        gate.set()
        h_in.wait()
        assert h_out.done()
        assert same_bytes(out, new)


def test_disk_activity_counts_each_direction_and_both_at_once(tmp_path):
    """[Note: disk activity] in infinity/io/_disk_activity.py: on a fake clock, a read in flight
    over [0, 3), a write over [1, 4): 3 s each, 2 s both; a real swapper's blocks count too."""
    from infinity.io import DiskActivity

    now = [0.0]
    activity = DiskActivity(clock=lambda: now[0])
    activity.begin("in")
    now[0] = 1.0
    activity.begin("out")
    now[0] = 3.0
    activity.end("in")
    now[0] = 4.0
    activity.end("out")
    now[0] = 9.0  # idle: nothing more
    assert activity.snapshot() == {"read_busy_s": 3.0, "write_busy_s": 3.0, "both_busy_s": 2.0}

    with Swapper(tmp_path / "swap") as swapper:
        data = torch.arange(1 << 20, dtype=torch.float32)
        swapper.swap_out("k", data).wait()
        after_write = swapper.activity.snapshot()
        assert after_write["write_busy_s"] > 0 and after_write["read_busy_s"] == 0
        out = torch.empty_like(data)
        swapper.swap_in("k", out).wait()
        assert torch.equal(out, data)
        assert swapper.activity.snapshot()["read_busy_s"] > 0


@pytest.mark.parametrize("first", ["out", "in"])
def test_a_request_of_one_direction_is_not_queued_behind_the_other(tmp_path, monkeypatch, first):
    """[Note: both directions in flight]: eight one-block requests of one direction wait for two
    threads, then one request of the other direction is issued. It starts as soon as a thread is
    free (the third block; the fourth where the test thread was late), not after the eight (one
    queue in issue order); every request still moves its own bytes."""
    from tests._support.slow_io import slow_io

    config = SwapperConfig(block_size_bytes=4096, queue_depth=2, num_io_threads=2)
    with Swapper(tmp_path, config) as sw:
        old = {f"k{i}": random_bytes(4096, torch.uint8) for i in range(9)}
        new = {key: random_bytes(4096, torch.uint8) for key in old}
        for key, value in old.items():
            sw.swap_out(key, value).wait()
        outs = {key: aligned_empty(4096, torch.uint8) for key in old}
        log = slow_io(monkeypatch, sw, seconds=0.1)
        other = "in" if first == "out" else "out"
        issued = [(first, f"k{i}") for i in range(8)] + [(other, "k8")]
        handles = [sw.swap_out(key, new[key]) if kind == "out" else sw.swap_in(key, outs[key])
                   for kind, key in issued]
        for handle in handles:
            handle.wait(timeout=60)
        assert log.started.index(other) <= 3, log.started
        for kind, key in issued:
            if kind == "in":
                assert same_bytes(outs[key], old[key])
            else:
                sw.swap_in(key, outs[key]).wait()
                assert same_bytes(outs[key], new[key])
