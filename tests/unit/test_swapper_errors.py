"""Every error path of the swapper, and the file system left consistent after each.

Short writes, short reads and ENOSPC are simulated by wrapping ``os.pwrite``/``os.preadv`` (what the
I/O threads call); a real full disk and a read-only directory use small tmpfs mounts when the tests
run as root (skipped otherwise). Corruption is made by editing the files directly.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import warnings

import pytest
import torch

from infinity._common import reset_warnings_for_tests
from infinity.config import SwapperConfig
from infinity.errors import SwapIOError
from infinity.io import Swapper, aligned_empty
from tests._support.tensors import random_bytes, same_bytes

CFG = SwapperConfig(block_size_bytes=64 * 1024, queue_depth=4, num_io_threads=2)


@pytest.fixture
def sw(tmp_path):
    with Swapper(tmp_path, CFG) as s:
        yield s


@contextlib.contextmanager
def tmpfs(path, options: str):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs")
    os.makedirs(path, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                         capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"cannot mount tmpfs here: {res.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def swapped(sw: Swapper, key: str, numel: int = 100_000, dtype=torch.float32) -> torch.Tensor:
    src = random_bytes(numel, dtype)
    sw.swap_out(key, src).wait()
    return src


def assert_failed_key_is_unreadable(sw: Swapper, key: str, like: torch.Tensor) -> None:
    """After a failed swap-out: no file under the key, and swap-in refuses (no stale bytes)."""
    assert not os.path.exists(sw.path_of(key))
    assert [n for n in os.listdir(sw.directory) if n.startswith(os.path.basename(sw.path_of(key)))] == []
    with pytest.raises(SwapIOError, match="last swap-out failed"):
        sw.swap_in(key, torch.empty_like(like)).wait()


# -- missing, unknown, mismatched --------------------------------------------------------------


def test_unknown_key_names_key_and_path(sw):
    with pytest.raises(KeyError) as info:
        sw.swap_in("nobody", torch.empty(3))
    assert "nobody" in str(info.value) and sw.directory in str(info.value)


def test_wrong_shape_or_dtype(sw):
    swapped(sw, "k", 1000)
    with pytest.raises(ValueError, match="shape"):
        sw.swap_in("k", torch.empty(999))
    with pytest.raises(ValueError, match="dtype"):
        sw.swap_in("k", torch.empty(1000, dtype=torch.float64))
    with pytest.raises(ValueError, match="shape"):
        sw.swap_in("k", torch.empty(10, 100))


def test_missing_file(sw):
    src = swapped(sw, "k")
    os.unlink(sw.path_of("k"))
    with pytest.raises(SwapIOError) as info:
        sw.swap_in("k", torch.empty_like(src)).wait()
    assert info.value.errno == errno.ENOENT and info.value.path == sw.path_of("k")
    assert "missing" in str(info.value)


def test_truncated_file(sw):
    src = swapped(sw, "k", 100_000)  # 400000 payload bytes
    path = sw.path_of("k")
    os.truncate(path, sw.header_bytes + 200_000)
    with pytest.raises(SwapIOError, match="truncated") as info:
        sw.swap_in("k", torch.empty_like(src)).wait()
    assert info.value.path == path
    a = sw.alignment_bytes
    assert info.value.expected_bytes == sw.header_bytes + (400_000 + a - 1) // a * a  # padded
    assert info.value.actual_bytes == sw.header_bytes + 200_000


def test_truncated_header(sw):
    src = swapped(sw, "k", 10)
    os.truncate(sw.path_of("k"), 100)
    with pytest.raises(SwapIOError, match="truncated"):
        sw.swap_in("k", torch.empty_like(src)).wait()


def test_corrupted_header(sw):
    src = swapped(sw, "k")
    with open(sw.path_of("k"), "r+b") as f:
        f.seek(30)
        byte = f.read(1)
        f.seek(30)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(SwapIOError, match="checksum"):
        sw.swap_in("k", torch.empty_like(src)).wait()


def test_bad_magic(sw):
    src = swapped(sw, "k")
    with open(sw.path_of("k"), "r+b") as f:
        f.write(b"NOTSWAP!")
    with pytest.raises(SwapIOError, match="magic"):
        sw.swap_in("k", torch.empty_like(src)).wait()


def test_file_of_another_shape_or_generation_is_rejected(sw):
    a = swapped(sw, "a", 5000)
    swapped(sw, "b", 7000)
    shutil.copyfile(sw.path_of("b"), sw.path_of("a"))
    with pytest.raises(SwapIOError, match="header"):
        sw.swap_in("a", torch.empty_like(a)).wait()
    # A stale file of the same key (older generation) is refused too.
    sw.swap_out("a", a).wait()
    shutil.copyfile(sw.path_of("a"), sw.path_of("a") + ".old")
    newer = random_bytes(5000, torch.float32)
    sw.swap_out("a", newer).wait()
    os.replace(sw.path_of("a") + ".old", sw.path_of("a"))
    with pytest.raises(SwapIOError, match="generation"):
        sw.swap_in("a", torch.empty_like(a)).wait()


# -- short and failed writes / reads -------------------------------------------------------------


def test_short_write_leaves_no_valid_file(sw, monkeypatch):
    old = swapped(sw, "k", 100_000)  # a valid older version exists
    real = os.pwrite

    def short_pwrite(fd, buf, offset):
        n = real(fd, buf, offset)
        return n - 512 if offset > sw.header_bytes else n

    monkeypatch.setattr(os, "pwrite", short_pwrite)
    with pytest.raises(SwapIOError, match="short write") as info:
        sw.swap_out("k", random_bytes(100_000, torch.float32)).wait()
    assert info.value.path == sw.path_of("k")
    assert info.value.actual_bytes == info.value.expected_bytes - 512
    assert info.value.offset > sw.header_bytes
    monkeypatch.setattr(os, "pwrite", real)
    assert_failed_key_is_unreadable(sw, "k", old)
    # The key works again after a successful swap-out; other keys were never affected.
    fresh = swapped(sw, "k", 100_000)
    out = torch.empty_like(fresh)
    sw.swap_in("k", out).wait()
    assert same_bytes(out, fresh)


def test_enospc_during_payload(sw, monkeypatch):
    real = os.pwrite

    def full_disk(fd, buf, offset):
        if offset >= sw.header_bytes + 2 * CFG.block_size_bytes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, buf, offset)

    monkeypatch.setattr(os, "pwrite", full_disk)
    src = random_bytes(1_000_000, torch.uint8)
    with pytest.raises(SwapIOError, match="disk full") as info:
        sw.swap_out("k", src).wait()
    assert info.value.errno == errno.ENOSPC and info.value.path == sw.path_of("k")
    monkeypatch.setattr(os, "pwrite", real)
    assert_failed_key_is_unreadable(sw, "k", src)


def test_header_write_failure_leaves_no_file(sw, monkeypatch):
    """The validating header is written last; if it fails, the half-done file is removed."""
    swapped(sw, "k", 5000)  # an older valid version: the overwrite invalidates it first
    real = os.pwrite
    calls = {"header": 0}

    def fail_second_header(fd, buf, offset):
        if offset == 0:
            calls["header"] += 1
            if calls["header"] == 2:  # 1: invalidation, 2: the final header
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buf, offset)

    monkeypatch.setattr(os, "pwrite", fail_second_header)
    src = random_bytes(5000, torch.float32)
    with pytest.raises(SwapIOError):
        sw.swap_out("k", src).wait()
    monkeypatch.setattr(os, "pwrite", real)
    assert_failed_key_is_unreadable(sw, "k", src)


def test_short_read(sw, monkeypatch):
    src = swapped(sw, "k", 100_000)
    real = os.preadv

    def short_preadv(fd, buffers, offset):
        n = real(fd, buffers, offset)
        return n - 4096 if offset > sw.header_bytes else n

    monkeypatch.setattr(os, "preadv", short_preadv)
    with pytest.raises(SwapIOError, match="short read") as info:
        sw.swap_in("k", torch.empty_like(src)).wait()
    assert info.value.path == sw.path_of("k")
    assert info.value.expected_bytes - info.value.actual_bytes == 4096
    monkeypatch.setattr(os, "preadv", real)
    out = torch.empty_like(src)  # the file itself is intact: a retry succeeds
    sw.swap_in("k", out).wait()
    assert same_bytes(out, src)


def test_real_full_disk(tmp_path):
    with tmpfs(tmp_path / "small", "size=1M"):
        with Swapper(tmp_path / "small", CFG) as s:
            small = swapped(s, "small", 1000)
            big = random_bytes(2 * 2**20, torch.uint8)
            with pytest.raises(SwapIOError) as info:
                s.swap_out("big", big).wait()
            assert info.value.errno == errno.ENOSPC and "disk full" in str(info.value)
            assert_failed_key_is_unreadable(s, "big", big)
            out = torch.empty_like(small)
            s.swap_in("small", out).wait()
            assert same_bytes(out, small)
            swapped(s, "after", 1000)  # the space was given back: a small write fits again
        assert os.listdir(tmp_path / "small") == []


# -- directories and set-up ----------------------------------------------------------------------


def test_read_only_directory_mount(tmp_path):
    with tmpfs(tmp_path / "ro", "ro,size=1M"):
        with pytest.raises(RuntimeError, match="writable") as info:
            Swapper(tmp_path / "ro")
        assert str(tmp_path / "ro") in str(info.value)


def test_read_only_directory_permissions(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions; covered by the read-only mount test")
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(RuntimeError, match="writable"):
        Swapper(ro)


def test_direct_io_refused_falls_back_with_one_warning(tmp_path, monkeypatch):
    real = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    reset_warnings_for_tests()
    with pytest.warns(UserWarning, match="O_DIRECT"):
        first = Swapper(tmp_path, CFG)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = Swapper(tmp_path, CFG)  # same file system: no second warning
    with first, second:
        assert not first.direct_io and not second.direct_io
        for numel in (1, 4097, 70_001):
            src = swapped(first, f"k{numel}", numel, torch.float16)
            out = torch.empty_like(src)
            first.swap_in(f"k{numel}", out).wait()
            assert same_bytes(out, src)
    with pytest.raises(RuntimeError, match="refuses O_DIRECT"):
        Swapper(tmp_path, SwapperConfig(direct_io="on"))
    assert os.listdir(tmp_path) == []


def test_tmpfs_dev_shm(tmp_path):
    """/dev/shm: direct I/O where this kernel's tmpfs takes it (6.6+), else buffered + warning."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    reset_warnings_for_tests()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = Swapper("/dev/shm", CFG)
    with s:
        assert s.directory.startswith("/dev/shm/infinity-swap-")
        warned = [w for w in caught if "O_DIRECT" in str(w.message)]
        assert len(warned) == (0 if s.direct_io else 1)
        src = swapped(s, "k", 12_345, torch.bfloat16)
        out = torch.empty_like(src)
        s.swap_in("k", out).wait()
        assert same_bytes(out, src)
    assert not os.path.exists(s.directory)


def test_buffered_mode_round_trip(tmp_path):
    with Swapper(tmp_path, SwapperConfig(direct_io="off", block_size_bytes=4096)) as s:
        assert not s.direct_io
        for numel in (1, 7, 4095, 4097, 2**16 + 3):
            src = random_bytes(numel, torch.float64, aligned=False, misalign=1)
            s.swap_out("k", src).wait()
            out = aligned_empty(numel, torch.float64)
            s.swap_in("k", out).wait()
            assert same_bytes(out, src)


def test_errors_do_not_poison_other_keys(sw, monkeypatch):
    good = swapped(sw, "good", 50_000)
    bad = swapped(sw, "bad", 50_000)
    os.truncate(sw.path_of("bad"), 10)
    out_good, out_bad = torch.empty_like(good), torch.empty_like(bad)
    h_bad, h_good = sw.swap_in("bad", out_bad), sw.swap_in("good", out_good)
    with pytest.raises(SwapIOError):
        h_bad.wait()
    h_good.wait()
    assert same_bytes(out_good, good)
