"""The ``infinity`` command line (:func:`main`): ``train`` (the README's main job), ``estimate``
(the ledger), ``plan`` (a configuration for given hardware), ``consolidate`` (a checkpoint to one
state dict) and ``bench`` (the benchmarks of :mod:`infinity.bench`).

- :mod:`._main`: the parser and the only place that configures logging handlers.
- :mod:`._train`, :mod:`._estimate`, :mod:`._plan` (with the hardware probes of
  :mod:`._hardware`), :mod:`._consolidate`: one command each (``add_arguments`` / ``run``).
"""

from infinity.cli._main import build_parser, console_main, main

__all__ = ["build_parser", "console_main", "main"]
