"""Benchmarks behind ``infinity bench io|adam|step|all``.

Each module exposes ``add_arguments(parser)`` and ``run(args) -> int`` and reports through
:mod:`infinity.bench.report`, so all share one output style: a table for people, ``--json`` for
machines, results saved with hardware, versions, date and command.
"""
