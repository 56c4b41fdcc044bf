"""Repository contracts: CI runs exactly the README's test command."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)


def test_readme_starts_with_two_setup_commands():
    commands = _readme_commands()
    assert len(commands) >= 2
    main_job, tests = commands[0], commands[1]
    assert main_job.startswith("bash scripts/setup.sh") and "infinity" in main_job
    assert tests.startswith("bash scripts/setup.sh --dev") and "pytest" in tests


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert _readme_commands()[1] in ci.splitlines()


def test_setup_pins_the_local_torch_build():
    setup = (ROOT / "scripts" / "setup.sh").read_text(encoding="utf-8")
    assert "torch==2.13.0" in setup
