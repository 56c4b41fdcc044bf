"""The optional dependencies of the integrations: import them, or say which extra installs them."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from types import ModuleType

EXTRA = "pip install 'infinity[hf]'"
"""What installs transformers, accelerate and peft (pyproject.toml's ``hf`` extra)."""

SUPPORTED: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "transformers": ((5, 0), (6, 0)),  # tested with 5.24
    "accelerate": ((1, 0), (2, 0)),  # tested with 1.16
}
"""Package -> [lowest, first unsupported) version: the integrations override methods of
transformers' Trainer and accelerate's Accelerator whose shape is stable only within a major."""


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3])


def require(name: str, needed_by: str) -> ModuleType:
    """Import ``name`` for ``needed_by`` (an integration module); an ImportError naming the extra
    when it is missing, or outside :data:`SUPPORTED`."""
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"{needed_by} needs {name}, which is not installed ({e}); install the "
                          f"optional dependencies with: {EXTRA}") from e
    if name in SUPPORTED:
        low, high = SUPPORTED[name]
        version = importlib.metadata.version(name)
        if not low <= _version_tuple(version) < high:
            span = f"{'.'.join(map(str, low))} <= version < {'.'.join(map(str, high))}"
            raise ImportError(f"{needed_by} supports {name} {span}, found {version}; install a "
                              f"supported one with: {EXTRA}")
    return module
