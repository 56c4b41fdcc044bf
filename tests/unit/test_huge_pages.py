"""advise_huge_pages ([Note: first touch of large host buffers] in infinity/io/_aligned.py): the
kernel's own accounting (/proc/self/smaps) shows huge pages behind an advised buffer once touched."""

from __future__ import annotations

import pathlib

import pytest
import torch

from infinity.io import advise_huge_pages
from tests._support.smaps import anon_huge_bytes

THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.fixture(autouse=True)
def _advice_on(monkeypatch):
    """These tests check what the advice does where it is given ([Note: when huge pages cost
    more than they save] decides where that is)."""
    from infinity.io import _huge_pages
    monkeypatch.setattr(_huge_pages, "_decision", True)


def test_small_and_empty_buffers_are_left_alone():
    assert advise_huge_pages(torch.empty(1024)) is False
    assert advise_huge_pages(torch.empty(0)) is False


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="transparent huge pages are off on this kernel")
def test_advised_buffer_is_backed_by_huge_pages_once_touched():
    nbytes = 64 * 2**20
    advised = torch.empty(nbytes, dtype=torch.uint8)
    assert advise_huge_pages(advised) is True
    advised.fill_(1)
    # At least half of the 2 MiB-aligned interior: the kernel may fall back to 4 KiB pages for
    # some ranges when it cannot find free huge pages at once (defrag "madvise" compacts, but
    # not always in time).
    assert anon_huge_bytes(advised.data_ptr(), nbytes) >= nbytes // 2
    if "[madvise]" in THP.read_text():  # only the advice turns them on: the control has none
        plain = torch.empty(nbytes, dtype=torch.uint8)
        plain.fill_(1)
        assert anon_huge_bytes(plain.data_ptr(), nbytes) == 0
