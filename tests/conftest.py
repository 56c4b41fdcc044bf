"""Shared fixtures and the rules that keep the suite bounded on a 2-core CI machine."""

from __future__ import annotations

import os

import pytest

SLOW = os.environ.get("INFINITY_SLOW") == "1"


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run benchmarks/gpu_check.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _cpu_unless_gpu_test(request, monkeypatch):
    """[Note: tests outside tests/gpu run on the CPU] in tests/_support/cpu_only.py."""
    if "gpu" not in request.keywords:
        from tests._support.cpu_only import hide_cuda

        hide_cuda(monkeypatch)
    yield


@pytest.fixture(autouse=True)
def _fresh_one_time_warnings():
    """Each test sees one-time warnings afresh, so tests can assert on them."""
    from infinity._common import reset_warnings_for_tests

    reset_warnings_for_tests()
    yield


@pytest.fixture
def slow_scale():
    """Multiplier for soak/scale tests: 1 in CI (bounded), larger with INFINITY_SLOW=1."""
    return 8 if SLOW else 1


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matrices: one intra-op thread is several times faster on a shared 2-core machine
    (modules opt in with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
