"""The ``infinity`` command line: ``bench``, ``estimate``, ``plan``, ``train``, ``consolidate``.

Only this module configures logging handlers. Subcommands live in their own modules, each exposing
``add_arguments(parser)`` and ``run(args) -> int`` (and, for benchmarks, ``QUICK_ARGS``); each
defers its heavy imports (torch, the engine) to ``run``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import sys
from typing import NoReturn

from infinity._process_exit import exit_after_distributed
from infinity.bench import adam as bench_adam
from infinity.bench import comm as bench_comm
from infinity.bench import io as bench_io
from infinity.bench import scale as bench_scale
from infinity.bench import step as bench_step
from infinity.cli import _consolidate, _estimate, _plan, _train

BENCHES = {
    "io": (bench_io, "NVMe swapper bandwidth against raw direct I/O, fio and DeepSpeed aio"),
    "adam": (bench_adam, "CPU Adam throughput against torch fused AdamW and DeepSpeed"),
    "step": (bench_step, "training step time, stall fraction and memory per offload mode"),
}
LONG_BENCHES = {
    "scale": (bench_scale, "model size swept at a fixed host budget: peak RSS, step vs roofline"),
    "comm": (bench_comm, "collective bytes per kind for flat / HSDP / hpZ / qwZ+qgZ on gloo, and "
             "the planner's step time past one node"),
}
"""Benchmarks of many minutes or many processes (a fresh training process per row, or a set of
gloo ranks per mode): not part of ``bench all``."""
COMMANDS = {
    "estimate": (_estimate, "memory ledger per ZeRO stage and tier"),
    "plan": (_plan, "recommend a configuration for a model on given hardware"),
    "train": (_train, "train a GPT-style model with offload (the README's main job)"),
    "consolidate": (_consolidate, "checkpoint -> one state dict (safetensors)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infinity", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="benchmarks (io, adam, step, all)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, help_text) in {**BENCHES, **LONG_BENCHES}.items():
        p = bench_sub.add_parser(name, help=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    p_all = bench_sub.add_parser("all", help="every benchmark, one after another (default sizes, "
                                 "or --quick for about a minute)")
    p_all.add_argument("--quick", action="store_true",
                       help="small sizes, no DeepSpeed subprocesses: each bench's QUICK_ARGS")
    p_all.add_argument("--json", action="store_true",
                       help='print one JSON document: {"benchmark": "all", "results": {name: record}}')
    p_all.add_argument("--results-dir", default=None, help="passed to every benchmark")
    p_all.add_argument("--no-save", action="store_true", help="passed to every benchmark")
    p_all.set_defaults(_run=lambda args: _run_all({n: m for n, (m, _) in BENCHES.items()}, args))

    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _run_all(available, args) -> int:
    """Each registered bench with its defaults (or its ``QUICK_ARGS``) and the shared options.

    One failing bench does not stop the others; the exit code is the worst one. With ``--json``
    each bench's stdout is captured and the records are printed as one document, so stdout stays
    machine-readable (progress bars go to stderr).
    """
    shared = ["--json"] if args.json else []
    if args.results_dir is not None:
        shared += ["--results-dir", args.results_dir]
    if args.no_save:
        shared.append("--no-save")
    rc, records = 0, {}
    for name, module in available.items():
        p = argparse.ArgumentParser(prog=f"infinity bench {name}")
        module.add_arguments(p)
        argv = [*(getattr(module, "QUICK_ARGS", ()) if args.quick else ()), *shared]
        print(f"== infinity bench {name} {' '.join(argv)}", file=sys.stderr, flush=True)
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out) if args.json else contextlib.nullcontext():
                code = int(module.run(p.parse_args(argv)) or 0)
        except (ValueError, OSError, RuntimeError) as e:
            if args.verbose:
                raise
            print(f"infinity: bench {name}: error: {e}", file=sys.stderr)
            code = 2
            records[name] = {"benchmark": name, "error": str(e)}
        rc = max(rc, code)
        if args.json and name not in records:
            try:
                records[name] = json.loads(out.getvalue())
            except json.JSONDecodeError:
                records[name] = {"benchmark": name, "error": "output was not JSON",
                                 "output": out.getvalue()[-2000:]}
    if args.json:
        print(json.dumps({"benchmark": "all", "quick": args.quick, "returncode": rc,
                          "results": records}, indent=2, default=str))
    return rc


def console_main() -> NoReturn:
    """The ``infinity`` program (its console script and ``python -m infinity``): :func:`main` on
    ``sys.argv``; a process group left initialized (``torchrun``) is destroyed and the process
    leaves without finalization ([Note: gloo teardown at exit] in infinity/_process_exit.py)."""
    code = main()
    exit_after_distributed(code)
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args._run(args) or 0)
    except (ValueError, OSError, RuntimeError) as e:
        if args.verbose:
            raise
        print(f"infinity: error: {e}", file=sys.stderr)
        return 2

