"""The test launcher (tests/_support/launch.py, [Note: ranks forked from a warm server]): a rank
that raises fails the launch with its traceback, a rank that hangs is killed at the timeout, and
every rank sees the launching test's environment and working directory as they are at that launch,
not as they were when the fork server started."""

from __future__ import annotations

import os
import time

import pytest

from tests._support.launch import launch

pytestmark = pytest.mark.distributed


def raises_on_rank_1(rank: int, world_size: int, out_dir: str) -> int:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    return rank


def sleeps(rank: int, world_size: int, out_dir: str) -> None:
    time.sleep(120)


def reads_env(rank: int, world_size: int, out_dir: str) -> tuple[str | None, int, int, str]:
    import torch.distributed as dist

    return os.environ.get("INFINITY_LAUNCH_PROBE"), dist.get_rank(), os.getpid(), os.getcwd()


def test_a_failing_rank_fails_the_launch_with_its_traceback():
    with pytest.raises(AssertionError, match="rank 1 fails on purpose"):
        launch(__file__, "raises_on_rank_1")


def test_a_hanging_rank_is_killed_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(AssertionError, match="timed out after 3 s"):
        launch(__file__, "sleeps", timeout_s=3)
    assert time.monotonic() - start < 60


def test_each_launch_sees_the_environment_of_its_moment(monkeypatch, tmp_path):
    monkeypatch.setenv("INFINITY_LAUNCH_PROBE", "first")
    first = launch(__file__, "reads_env")
    monkeypatch.setenv("INFINITY_LAUNCH_PROBE", "second")
    monkeypatch.chdir(tmp_path)
    second = launch(__file__, "reads_env", world_size=3)
    assert [(v, r) for v, r, _, _ in first] == [("first", 0), ("first", 1)]
    assert [(v, r) for v, r, _, _ in second] == [("second", 0), ("second", 1), ("second", 2)]
    assert {cwd for *_, cwd in second} == {str(tmp_path)}
    pids = {p for _, _, p, _ in first + second}
    assert len(pids) == 5 and os.getpid() not in pids  # a process of its own per rank
