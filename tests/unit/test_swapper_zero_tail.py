"""[Note: zero tails of new files are not written] (infinity/io/_swapper.py): a zero tail promised
to ``swap_out`` is not written to a new file, whose reserved space reads back as zeros; a file
that exists is written whole. The store passes set-up's promise (``register(zero_tail_numel=)``)
to the first write only. Bytes are read back from the files themselves.

The tests break the promise on purpose (a non-zero tail) so that what was not written shows."""

from __future__ import annotations

import pytest
import torch

from infinity.config import SwapperConfig
from infinity.io import Swapper, aligned_empty
from infinity.tiers import Residency, Tier
from tests._support.store import make_store

SMALL = SwapperConfig(block_size_bytes=64 * 1024, queue_depth=8, num_io_threads=2)


def _on_disk(swapper: Swapper, key: str, nbytes: int) -> torch.Tensor:
    with open(swapper.path_of(key), "rb") as f:
        f.seek(swapper.header_bytes)
        return torch.frombuffer(bytearray(f.read(nbytes)), dtype=torch.uint8)


def _pattern(nbytes: int, value: int) -> torch.Tensor:
    t = aligned_empty(nbytes, torch.uint8)
    t.fill_(value)
    return t


@pytest.mark.parametrize("nbytes, tail", [(300_000, 200_000), (300_000, 300_000),
                                          (300_000, 5), (4096 * 40, 4096 * 13)])
def test_a_new_file_does_not_get_the_zero_tail_written(tmp_path, nbytes, tail):
    with Swapper(tmp_path, SMALL) as sw:
        sw.swap_out("k", _pattern(nbytes, 7), zero_tail_bytes=tail).wait()
        disk = _on_disk(sw, "k", nbytes)
        # Whole alignment units of the tail are left unwritten (they read as zeros); the unit the
        # head ends in is written whole.
        written = min(nbytes, -(-(nbytes - tail) // sw.alignment_bytes) * sw.alignment_bytes)
        assert torch.all(disk[:written] == 7) and torch.all(disk[written:] == 0)
        assert written < nbytes or tail < sw.alignment_bytes
        # The swapper reads the file back as it is on disk, header checked
        back = aligned_empty(nbytes, torch.uint8)
        sw.swap_in("k", back).wait()
        assert torch.equal(back, disk)


def test_a_file_that_exists_is_written_whole(tmp_path):
    with Swapper(tmp_path, SMALL) as sw:
        sw.swap_out("k", _pattern(300_000, 1)).wait()
        sw.swap_out("k", _pattern(300_000, 2), zero_tail_bytes=200_000).wait()
        assert torch.all(_on_disk(sw, "k", 300_000) == 2)


@pytest.mark.parametrize("bad", [-1, 300_001, 1.5, True])
def test_a_zero_tail_outside_the_tensor_is_refused(tmp_path, bad):
    with Swapper(tmp_path, SMALL) as sw:
        with pytest.raises(ValueError, match="zero_tail_bytes"):
            sw.swap_out("k", _pattern(300_000, 1), zero_tail_bytes=bad)


def test_the_store_passes_set_up_s_zero_tail_to_the_first_write_only(tmp_path):
    n = 100_000  # fp32 elements
    with make_store(tmp_path, host_bytes=4 << 20) as (store, swapper):
        store.register("opt", 3 * n, torch.float32, Tier.NVME, fill=lambda t: t.fill_(3.0),
                       keep_host_copy=False, zero_tail_numel=2 * n)
        store.write_back("opt").wait()
        assert store.state("opt", Tier.HOST) is Residency.ABSENT
        disk = _on_disk(swapper, "opt", 12 * n).view(torch.float32)
        head = -(-4 * n // swapper.alignment_bytes) * swapper.alignment_bytes // 4
        assert torch.all(disk[:head] == 3.0) and torch.all(disk[head:] == 0)
        # An update is written whole
        copy = store.acquire("opt", Tier.HOST).wait()
        copy.fill_(5.0)
        store.mark_dirty("opt", Tier.HOST)
        store.release("opt", Tier.HOST)
        store.write_back("opt").wait()
        assert torch.all(_on_disk(swapper, "opt", 12 * n).view(torch.float32) == 5.0)


def test_register_refuses_a_zero_tail_outside_the_shard(tmp_path):
    with make_store(tmp_path) as (store, _):
        with pytest.raises(ValueError, match="zero_tail_numel"):
            store.register("k", 10, torch.float32, Tier.NVME, zero_tail_numel=11,
                           initial=torch.zeros(10))
