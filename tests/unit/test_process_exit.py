"""[Note: gloo teardown at exit]: a process of ours whose work is done ends with its exit code,
what it printed and logged flushed, its process group destroyed, finalization skipped; without a
process group nothing changes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import atexit, datetime, logging, sys
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
    atexit.register(lambda: print("finalized"))
    import torch.distributed as dist
    if sys.argv[1] == "group":
        dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))
        # a hook that sees the group destroyed before the process ends
        import infinity._process_exit as pe
        real = pe._exit_now
        pe._exit_now = lambda code: (print("group left:", dist.is_initialized()), real(code))
    sys.stdout.write("buffered, no newline")
    logging.getLogger("x").info("logged")
    from infinity._process_exit import exit_after_distributed
    exit_after_distributed(3)
    print(" returned")
""")


def _run(tmp_path, *args):
    return subprocess.run([sys.executable, "-c", _SCRIPT, *args], capture_output=True, text=True,
                          timeout=120)


def test_with_a_process_group_it_is_destroyed_and_the_process_ends_with_the_code(tmp_path):
    out = _run(tmp_path, "group", str(tmp_path / "rdzv"))
    assert out.returncode == 3, out.stderr
    assert out.stdout.startswith("buffered, no newline")
    assert "group left: False" in out.stdout
    assert "returned" not in out.stdout and "finalized" not in out.stdout  # no finalization
    assert "logged" in out.stderr


def test_without_a_process_group_it_returns_and_the_process_exits_as_usual(tmp_path):
    out = _run(tmp_path, "none")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "buffered, no newline returned\nfinalized\n"


def test_the_program_runs_through_console_main():
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["infinity"] == "infinity.cli:console_main"
    out = subprocess.run([sys.executable, "-m", "infinity", "estimate", "--no-such-flag"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--no-such-flag" in out.stderr  # main's code, unchanged
