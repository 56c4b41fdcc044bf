"""The import direction of DESIGN.md, checked on the source: imports point down only.

```
cli ─> bench ─> engine ─> stage3 ─> tiers ─> swapper ─> config, _common
                   │         ├────> prefetch (knows no tiers)
                   │         └────> cpu_adam (knows no tiers)
estimate ─> config
```
Each module is given a layer; a module may import modules of its own layer group only where listed
and of any lower layer. A module missing from the table fails the test, so new modules get a place.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "infinity"

# module -> the set of infinity modules it may import (transitively closed below).
ALLOWED: dict[str, set[str]] = {
    "_common": set(),
    "config": {"_common"},
    "swapper": {"_common", "config", "_swap_format", "_aligned"},
    "_swap_format": {"_common"},  # the swap file header, names and states: no I/O
    "_aligned": {"_common"},  # aligned (pinned where CUDA exists) host memory
    "tiers": {"swapper"},
    "prefetch": {"_common", "config", "trace", "prefetch_plan"},
    "prefetch_plan": {"_common", "config", "trace"},  # the pure planner under the executor
    "trace": {"_common", "config"},
    "cpu_adam": {"_common", "config", "_cpu_adam_ext"},
    "_cpu_adam_ext": {"_common"},
    "_dist": {"_common", "config"},
    "units": {"_common", "config", "_dist", "estimate"},  # the ledger's rules size the budgets
    "shard_optimizer": {"cpu_adam", "tiers", "_dist"},
    "prefetch_bridge": {"prefetch", "tiers", "trace"},  # executor hops -> store fetches and gathers
    "stage3": {"tiers", "prefetch", "prefetch_bridge", "trace", "cpu_adam", "units", "shard_optimizer",
               "_dist", "_grad_ledger"},
    "_grad_ledger": {"tiers"},  # stage3's gradient half (a mixin): staging, reduction, accumulation
    "engine": {"stage3", "shard_optimizer", "units", "checkpoint", "activations", "weights", "lazy",
               "estimate"},
    "lazy": {"_common", "config"},  # records construction on meta; no engine, no tiers
    "weights": {"checkpoint", "safetensors_io", "shard_optimizer", "_common"},  # HF safetensors in
    "activations": {"_common", "config"},  # which modules run checkpointed; no hooks of stage3
    "checkpoint": {"shard_optimizer", "checkpoint_reader", "safetensors_io", "_common"},  # save/load
    "checkpoint_reader": {"safetensors_io", "_common"},  # manifest checks, range reads: no engine
    "consolidate": {"checkpoint_reader", "safetensors_io"},  # `infinity consolidate`: no process group
    "estimate": {"config"},
    "estimate_cli": {"estimate", "config"},
    "plan": {"planner", "estimate", "estimate_cli", "swapper", "config"},
    "planner": {"estimate", "config"},  # the pure pricing under the `infinity plan` command
    "models": set(),  # plain-PyTorch reference models: import nothing of infinity
    "safetensors_io": set(),  # the file format, by byte range: imports nothing of infinity
    "bench": {"engine", "swapper", "cpu_adam", "estimate", "plan", "tiers", "stage3", "models"},
    "train": {"engine", "bench", "estimate", "models", "units"},
    "cli": {"bench", "estimate_cli", "plan", "train", "consolidate"},
    "__init__": {"engine", "config", "_common", "lazy"},
    "__main__": {"cli"},
}


# Modules that are one layer split over several files.
SAME_LAYER = {"_ds_config": "config"}


def _closure(module: str, seen: set[str] | None = None) -> set[str]:
    seen = set() if seen is None else seen
    for dep in ALLOWED.get(module, set()):
        if dep not in seen:
            seen.add(dep)
            _closure(dep, seen)
    return seen


def _layer_of(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG)
    name = rel.parts[0] if len(rel.parts) > 1 else rel.stem
    return SAME_LAYER.get(name, name)


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against the package
                base = ".".join(path.relative_to(PKG.parent).with_suffix("").parts[:-node.level])
                names = [f"{base}.{node.module}" if node.module else base]
            elif node.module:
                names = [node.module]
                names += [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "infinity" and len(parts) > 1:
                found.add(SAME_LAYER.get(parts[1], parts[1]))
    return found


MODULES = sorted(p for p in PKG.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_imports_point_down(path: pathlib.Path) -> None:
    layer = _layer_of(path)
    assert layer in ALLOWED, f"{path.name}: give module {layer!r} a layer in tests/unit/test_layering.py"
    allowed = _closure(layer) | {layer}
    bad = sorted(_imports(path) - allowed)
    assert not bad, f"{path.relative_to(PKG)} ({layer}) imports {bad}, which DESIGN.md's layering forbids"


def test_table_has_no_cycles() -> None:
    for module in ALLOWED:
        assert module not in _closure(module), f"layering cycle through {module!r}"


def test_checker_sees_a_violation(tmp_path: pathlib.Path) -> None:
    """The checker itself can fail: a swapper that imports the engine is caught."""
    bad = tmp_path / "swapper.py"
    bad.write_text("from infinity.engine import initialize\nimport infinity.config\n")
    found = _imports(bad)
    assert found == {"engine", "config"}
    assert "engine" not in _closure("swapper")
