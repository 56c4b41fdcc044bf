"""The package DAG of DESIGN.md, checked on the source: imports point down only, no import cycles.

```
cli ──> bench ──> integrations ──> zero ──┬──> optim ──> tiers ──> io ──> config ──> floor
 │        │                          │    ├──> prefetch ───────────────────────────> floor
 │        │                          │    ├──> checkpoint ──> io
 │        │                          │    └──> ledger ──> config
 │        ├──> models (plain PyTorch, imports nothing of infinity)
 │        └──> pipeline ──> zero (torch.distributed.pipelining over an engine per stage)
 └──> (every package below)
floor: errors, _common, _tier, _transitions, _async_copy, _timing, _process_exit, _modeled_link,
_dtypes, _compute_dtype
(nothing above them)
deepspeed ──> zero (the DeepSpeed drop-in); the design card's modules, each the face of one
package: swapper ──> io, cpu_adam ──> optim, stage3 ──> zero
```
``integrations`` (the hf Trainer and accelerate, optional extras) sits above the engine: nothing
below imports it, so ``import infinity`` never needs transformers or accelerate.

Three rules, over every import in the package (at module level and inside functions):

1. A module's package imports only the packages below it in :data:`ALLOWED` (closed
   transitively); a module in no package of the table fails, so new packages get a place.
2. Another package is imported through its public face: ``infinity.tiers`` (its ``__init__``)
   or a public module of it (``infinity.optim.cpu_adam``), never a private one
   (``infinity.tiers._records``). The floor's modules are the exception: they are the floor.
3. No cycle among the modules, not even through imports inside functions (a lazy import does
   not make a cycle go away, it only hides it from the interpreter's start-up).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "infinity"

FLOOR = frozenset({"errors", "_common", "_tier", "_transitions", "_async_copy", "_timing",
                   "_process_exit", "_modeled_link", "_dtypes", "_compute_dtype"})
"""Top-level modules every package may import."""

ALLOWED: dict[str, set[str]] = {
    "floor": set(),
    "config": {"floor"},
    "ledger": {"config"},  # pure arithmetic: the estimator, the planner's pricing
    "io": {"config"},  # swapper, swap format, aligned memory, safetensors
    "tiers": {"io"},  # the store, residency, arena, budgets, offload budgets
    "prefetch": {"floor"},  # trace, pure planner, executor: knows no tiers
    "optim": {"tiers", "config"},  # shard optimizers, cpu_adam: knows no hooks
    "checkpoint": {"io"},  # takes the engine as an object: imports nothing of zero
    "zero": {"optim", "prefetch", "checkpoint", "tiers", "ledger"},  # the engine, hooks
    "models": set(),  # plain-PyTorch reference models: import nothing of infinity
    "integrations": {"zero"},  # Trainer, accelerate, peft on the engine (optional extras)
    "pipeline": {"zero"},  # torch.distributed.pipelining's schedule over an engine per stage
    "bench": {"integrations", "models", "pipeline"},
    "cli": {"bench"},
    "__init__": {"zero"},  # the package's public surface
    # The design card's modules: each the public face of the package that holds the code.
    "swapper": {"io"},
    "cpu_adam": {"optim"},
    "stage3": {"zero"},
    "deepspeed": {"zero"},  # the DeepSpeed drop-in: initialize, the engine's DeepSpeed names, zero
    "__main__": {"cli"},
}
"""Package -> the packages it may import directly (each may import what those may, too)."""


def _closure(package: str, seen: set[str] | None = None) -> set[str]:
    seen = set() if seen is None else seen
    for dep in ALLOWED.get(package, set()):
        if dep not in seen:
            seen.add(dep)
            _closure(dep, seen)
    return seen


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    if parts[1] in FLOOR:
        return "floor"
    return parts[1]


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _resolve(name: str) -> str:
    """The module an imported name lands in: the longest prefix that is a module of ours."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        candidate = ".".join(parts[:cut])
        if candidate in MODULES:
            return candidate
    return name


def _imports(path: pathlib.Path, module: str) -> set[str]:
    """Modules of ``infinity`` that ``path`` imports anywhere (functions included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import: resolve against the package
                here = module.split(".") if is_package else module.split(".")[:-1]
                here = here[:len(here) - (node.level - 1)]
                base = ".".join(here + ([node.module] if node.module else []))
            # ``from pkg import sub`` imports the module ``pkg.sub``; other names come from ``pkg``.
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
            names = subs + ([base] if len(subs) < len(node.names) else [])
        for name in names:
            if name == "infinity" or name.startswith("infinity."):
                found.add(_resolve(name))
    found.discard(module)
    return found


GRAPH = {m: _imports(p, m) for m, p in MODULES.items()}


def _private_across(importer: str, imported: str) -> bool:
    """``imported`` is a private module of another package than ``importer``'s."""
    if _package_of(imported) in ("floor", "__init__", _package_of(importer)):
        return False
    return any(part.startswith("_") for part in imported.split(".")[2:])


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_through_public_faces(module: str) -> None:
    package = _package_of(module)
    assert package in ALLOWED, f"{module}: give package {package!r} a place in ALLOWED"
    allowed = _closure(package) | {package}
    down = sorted(m for m in GRAPH[module] if _package_of(m) not in allowed)
    assert not down, f"{module} ({package}) imports {down}, which DESIGN.md's layering forbids"
    private = sorted(m for m in GRAPH[module] if _private_across(module, m))
    assert not private, (f"{module} imports private modules of other packages {private}: import "
                         f"the package (its __init__) instead")


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and dep in graph:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle_among_modules() -> None:
    cycle = _cycle(GRAPH)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_package_table_has_no_cycles() -> None:
    for package in ALLOWED:
        assert package not in _closure(package), f"layering cycle through {package!r}"


def test_checker_sees_violations(tmp_path: pathlib.Path) -> None:
    """The checks themselves can fail: a store importing the engine, a private module reached
    from another package, and a cycle hidden in a function-level import are all caught."""
    bad = tmp_path / "store.py"
    bad.write_text("from infinity.zero import initialize\nimport infinity.config\n"
                   "def later():\n    from infinity.tiers._records import StoreConfig\n")
    found = _imports(bad, "infinity.tiers.store")
    assert found == {"infinity.zero", "infinity.config", "infinity.tiers._records"}
    assert "zero" not in _closure("tiers")
    assert _private_across("infinity.optim._offloaded", "infinity.tiers._records")
    assert not _private_across("infinity.tiers.store", "infinity.tiers._records")
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
