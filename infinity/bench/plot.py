"""Pictures for ``infinity bench ... --plot FILE.png``; matplotlib is an optional extra.

matplotlib is imported only when a picture is asked for, so the benchmarks (and the rest of the
package) run without it. Missing, the benchmark still prints and saves its numbers and says in one
line how to get the picture: ``pip install 'infinity[plot]'``.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'infinity[plot]'"


class PlotUnavailable(ImportError):
    """matplotlib is not importable; the message names the install command."""


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, or :class:`PlotUnavailable`."""
    try:
        import matplotlib

        # Agg: benchmarks run on headless machines and only ever write files.
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotUnavailable(f"matplotlib is not installed ({INSTALL_HINT})") from e
    return plt


def save_plot(path: str, draw: Callable[[Any], Any], *, what: str = "plot") -> tuple[bool, str]:
    """Call ``draw(pyplot) -> Figure`` and write the figure to ``path``.

    Returns (written, one-line message for stderr). Without matplotlib nothing is written and the
    message says how to install it; the caller's exit code does not change.
    """
    try:
        plt = require_matplotlib()
    except PlotUnavailable as e:
        return False, f"--plot {path}: {e}; numbers printed and saved without the picture"
    fig = draw(plt)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)  # benchmarks may draw several; pyplot keeps every open figure alive otherwise
    logger.debug("wrote %s to %s", what, path)
    return True, f"{what} written to {path}"
