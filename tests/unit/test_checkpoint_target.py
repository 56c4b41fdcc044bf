"""[Note: what a checkpoint touches] in infinity/checkpoint/_target.py: checkpointing sees the engine
only through CheckpointTarget, which the engine's view implements member for member."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from infinity.checkpoint import CheckpointTarget, checkpoint_target
from infinity.zero._checkpoint_view import EngineCheckpointView

ROOT = Path(__file__).resolve().parents[2]


def _members(cls: type) -> set[str]:
    names = set(getattr(cls, "__annotations__", {}))
    names |= {n for n, v in vars(cls).items() if not n.startswith("_") and callable(v)}
    return names


def test_the_engine_view_has_every_member_of_the_target():
    wanted = _members(CheckpointTarget)
    assert len(wanted) >= 20  # the protocol is the whole list, not a stub
    missing = sorted(n for n in wanted if not hasattr(EngineCheckpointView, n))
    assert not missing, f"EngineCheckpointView lacks {missing}"
    for name in wanted:  # methods stay methods, with the protocol's parameters
        want = getattr(CheckpointTarget, name, None)
        if inspect.isfunction(want):
            got = getattr(EngineCheckpointView, name)
            assert inspect.isfunction(got), name
            assert list(inspect.signature(got).parameters) == \
                list(inspect.signature(want).parameters), name


def test_checkpoint_walks_none_of_the_engine_s_parts():
    walks = re.compile(r"\.(manager|shard_optimizer|config)\b")
    found = [f"{p.name}:{i}: {line.strip()}"
             for p in sorted((ROOT / "infinity" / "checkpoint").glob("*.py"))
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if walks.search(line)]
    assert not found, found


def test_a_public_function_takes_the_engine_or_a_target():
    class Engine:
        def checkpoint_view(self):
            return "view"

    target = object()
    assert checkpoint_target(Engine()) == "view"
    assert checkpoint_target(target) is target
