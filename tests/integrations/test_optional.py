"""Without transformers / accelerate / peft installed, ``import infinity`` (and the engine) work,
and each integration raises an ImportError naming the extra that installs them. Simulated in a
fresh interpreter by blocking the modules (``sys.modules[name] = None`` makes importing it fail)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from infinity.integrations._require import _version_tuple, require

ROOT = pathlib.Path(__file__).resolve().parents[2]

PROBE = r"""
import sys
for name in ("transformers", "accelerate", "peft", "trl"):
    sys.modules[name] = None
import infinity, infinity.zero, infinity.integrations
assert callable(infinity.initialize)
for module in ("infinity.integrations.hf", "infinity.integrations.accelerate"):
    try:
        __import__(module)
    except ImportError as e:
        print(module, "->", e)
    else:
        raise SystemExit(f"{module} imported without its dependencies")
"""


def test_missing_extras_fail_with_the_extra_named():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2, proc.stdout
    for line in lines:
        assert "pip install 'infinity[hf]'" in line, line
    assert "infinity.integrations.hf needs transformers" in lines[0]
    assert "infinity.integrations.accelerate needs accelerate" in lines[1]


def test_unsupported_versions_are_refused(monkeypatch):
    import importlib.metadata

    pytest.importorskip("transformers")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "4.57.1")
    with pytest.raises(ImportError, match=r"supports transformers 5.0 <= version < 6.0, found "
                                          r"4.57.1; .*infinity\[hf\]"):
        require("transformers", "infinity.integrations.hf")
    assert _version_tuple("5.24.0.dev0") == (5, 24, 0) and _version_tuple("1.16.0+cpu") == (1, 16, 0)
