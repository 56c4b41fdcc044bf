"""Run a worker function on 2 ranks over gloo (loopback file rendezvous) with a timeout.

From a test::

    results = launch(__file__, "worker_fn", world_size=2, timeout_s=120, args={...})

starts ``world_size`` fresh Python processes running this file as a script. Each imports the
test file by path, initialises the default process group (gloo, ``file://`` rendezvous in a temp
directory, a process-group timeout), calls ``worker_fn(rank, world_size, out_dir, **args)`` and
writes its return value with ``torch.save``. ``launch`` returns the per-rank values, or raises
with every rank's stderr tail if a rank failed or the whole run exceeded ``timeout_s`` (the
processes are killed then, so a hang costs the timeout, never the suite).
"""

from __future__ import annotations

import datetime
import importlib.util
import json
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
        procs = []
        for rank in range(world_size):
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")
            procs.append((subprocess.Popen([sys.executable, __file__, spec_path, str(rank)],
                                           stdout=log, stderr=subprocess.STDOUT, env=env), log))
        deadline = time.monotonic() + timeout_s
        timed_out = False
        for proc, _ in procs:
            left = max(0.1, deadline - time.monotonic())
            try:
                proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        if timed_out:
            for proc, _ in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        logs = []
        for rank, (proc, log) in enumerate(procs):
            log.seek(0)
            logs.append(f"--- rank {rank} (exit {proc.returncode}) ---\n{log.read()[-6000:]}")
            log.close()
        if timed_out or any(proc.returncode != 0 for proc, _ in procs):
            why = f"timed out after {timeout_s:.0f} s" if timed_out else "a rank failed"
            raise AssertionError(f"distributed run of {fn_name} {why}:\n" + "\n".join(logs))
        return [torch.load(os.path.join(tmp, f"result{rank}.pt"), weights_only=False)
                for rank in range(world_size)]


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
