"""Call a test module's function in a fresh Python process and return its JSON result.

Memory tests need it: a process's peak RSS (VmHWM) holds only what that process did, so each
measured case runs alone, with one thread of intra-op work.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[2]


def call_in_fresh_process(module: str, function: str, *args: Any, timeout_s: float = 600) -> Any:
    """``module.function(*args)`` (arguments as Python literals) in a new interpreter run from
    the repository root with ``OMP_NUM_THREADS=1``; its return value, passed back as JSON."""
    call = f"{function}({', '.join(repr(a) for a in args)})"
    code = f"import json; from {module} import {function}; print(json.dumps({call}))"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=timeout_s, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
