"""Run a worker function on 2 ranks over gloo (loopback file rendezvous) with a timeout.

From a test::

    results = launch(__file__, "worker_fn", world_size=2, timeout_s=120, args={...})

starts ``world_size`` fresh Python processes running this file as a script. Each imports the
test file by path, initialises the default process group (gloo, ``file://`` rendezvous in a temp
directory, a process-group timeout), calls ``worker_fn(rank, world_size, out_dir, **args)`` and
writes its return value with ``torch.save``. ``launch`` returns the per-rank values, or raises
with every rank's stderr tail if a rank failed or the whole run exceeded ``timeout_s`` (the
processes are killed then, so a hang costs the timeout, never the suite).

[Note: ranks forked from a warm server]
Importing torch and infinity takes a fresh process 2-3 CPU-seconds; the suite launches ranks a few
hundred times, 2-4 at once on 2 cores, so imports alone were minutes of CI. The ranks are forked
instead from one server process per test session that imported them once (multiprocessing's
``forkserver``, its preload list below). A rank is still a process of its own: it gets the
launching test's environment (``os.environ`` replaced before the test file is imported) and working
directory, its own log file on stdout and stderr, its own process group, and a kill on timeout. What it shares with
the server is only what importing left in memory, which nothing mutates before the fork (the
server runs no torch op: no thread pool exists yet to be lost by the fork).
``INFINITY_TEST_FRESH_RANKS=1`` starts each rank as a fresh interpreter instead, as before.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import multiprocessing
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[2]


def launch(test_file: str, fn_name: str, *, world_size: int = 2, timeout_s: float = 120.0,
           pg_timeout_s: float = 60.0, args: dict[str, Any] | None = None) -> list[Any]:
    import torch

    with tempfile.TemporaryDirectory(prefix="infinity-dist-") as tmp:
        spec = {"test_file": str(pathlib.Path(test_file).resolve()), "fn": fn_name,
                "world_size": world_size, "init_file": os.path.join(tmp, "rendezvous"),
                "pg_timeout_s": pg_timeout_s, "out_dir": tmp, "args": args or {}}
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
            [str(REPO), os.environ.get("PYTHONPATH", "")]))  # ``tests._support`` importable
        log_paths = [os.path.join(tmp, f"rank{rank}.log") for rank in range(world_size)]
        start = _fresh_rank if os.environ.get(FRESH_ENV) == "1" else _forked_rank
        ranks = [start(spec_path, rank, log_paths[rank], env) for rank in range(world_size)]
        deadline = time.monotonic() + timeout_s
        timed_out = False
        for rank in ranks:
            if not rank.wait(max(0.1, deadline - time.monotonic())):
                timed_out = True
                break
        if timed_out:
            for rank in ranks:
                rank.kill()
        logs = []
        for i, (rank, path) in enumerate(zip(ranks, log_paths)):
            with open(path, errors="replace") as log:
                logs.append(f"--- rank {i} (exit {rank.exit_code()}) ---\n{log.read()[-6000:]}")
        if timed_out or any(rank.exit_code() != 0 for rank in ranks):
            why = f"timed out after {timeout_s:.0f} s" if timed_out else "a rank failed"
            raise AssertionError(f"distributed run of {fn_name} {why}:\n" + "\n".join(logs))
        return [torch.load(os.path.join(tmp, f"result{rank}.pt"), weights_only=False)
                for rank in range(world_size)]


FRESH_ENV = "INFINITY_TEST_FRESH_RANKS"
PRELOAD = ["torch", "torch.distributed", "infinity", "infinity.zero", "infinity.pipeline",
           "tests._support.launch"]
"""What the fork server imports once ([Note: ranks forked from a warm server])."""


class _ForkedRank:
    """A rank forked from the warm server."""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        self._process = process

    def wait(self, timeout_s: float) -> bool:
        self._process.join(timeout_s)
        return self._process.exitcode is not None

    def kill(self) -> None:
        if self._process.exitcode is None:
            self._process.kill()
            self._process.join()

    def exit_code(self) -> int | None:
        return self._process.exitcode


class _FreshRank:
    """A rank started as a fresh interpreter running this file."""

    def __init__(self, process: subprocess.Popen):
        self._process = process

    def wait(self, timeout_s: float) -> bool:
        try:
            self._process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def exit_code(self) -> int | None:
        return self._process.returncode


_SERVER: multiprocessing.context.BaseContext | None = None


def _forked_rank(spec_path: str, rank: int, log_path: str, env: dict[str, str]) -> _ForkedRank:
    global _SERVER
    if _SERVER is None:  # started by the first launch, reused by every later one
        _SERVER = multiprocessing.get_context("forkserver")
        _SERVER.set_forkserver_preload(PRELOAD)
    process = _SERVER.Process(target=_forked_main,
                              args=(spec_path, rank, log_path, env, os.getcwd()),
                              name=f"rank{rank}", daemon=False)
    process.start()
    return _ForkedRank(process)


def _fresh_rank(spec_path: str, rank: int, log_path: str, env: dict[str, str]) -> _FreshRank:
    with open(log_path, "w") as log:  # the child holds its own descriptor
        return _FreshRank(subprocess.Popen([sys.executable, __file__, spec_path, str(rank)],
                                           stdout=log, stderr=subprocess.STDOUT, env=env))


def _forked_main(spec_path: str, rank: int, log_path: str, env: dict[str, str],
                 cwd: str) -> None:
    """A forked rank: the launching test's environment, working directory and its own log,
    then as a fresh one."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)  # the server's is the first launch's
    _main(spec_path, rank)


def _main(spec_path: str, rank: int) -> None:
    import torch
    import torch.distributed as dist

    from infinity._process_exit import exit_after_distributed

    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{spec['init_file']}", rank=rank,
                            world_size=spec["world_size"],
                            timeout=datetime.timedelta(seconds=spec["pg_timeout_s"]))
    try:
        module_spec = importlib.util.spec_from_file_location("_dist_test_module", spec["test_file"])
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        result = getattr(module, spec["fn"])(rank, spec["world_size"], spec["out_dir"],
                                             **spec["args"])
        torch.save(result, os.path.join(spec["out_dir"], f"result{rank}.pt"))
    except BaseException:
        dist.destroy_process_group()
        raise
    # The result is saved: leave without finalization ([Note: gloo teardown at exit] in
    # infinity/_process_exit.py). A failure above still raises and exits 1.
    exit_after_distributed(0)


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]))
