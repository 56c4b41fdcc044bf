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


_NOTE = re.compile(r"\[Note:\s+([^\]]+?)\]")


def _notes() -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """(note name -> files that state it, [(file, note, cited path)]): a note is stated where it
    is not followed by ``in <path>``; a citation names the file that states it."""
    stated: dict[str, set[str]] = {}
    cited: list[tuple[str, str, str]] = []
    paths = sorted((ROOT / "infinity").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    for path in paths:
        text = path.read_text(encoding="utf-8")
        rel = str(path.relative_to(ROOT))
        for m in _NOTE.finditer(text):
            name = " ".join(m.group(1).replace("#", " ").split())
            where = re.match(r"\]?\s*(?:\)|,|;)?\s*in\s+(?:``)?((?:infinity|tests)/[\w/.]+\.py)",
                             text[m.end() - 1:m.end() + 120])
            if where:
                cited.append((rel, name, where.group(1)))
            else:
                stated.setdefault(name, set()).add(rel)
    return stated, cited


def test_note_citations_name_the_file_that_states_the_note():
    stated, cited = _notes()
    assert cited, "the checker found no citation at all"
    wrong = [(f, n, p) for f, n, p in cited if p not in stated.get(n, set())]
    assert not wrong, f"[Note: ...] cited in a file that does not state it: {wrong}"
    for f, n, p in cited:
        assert (ROOT / p).is_file(), f"{f}: [Note: {n}] cites {p}, which does not exist"
