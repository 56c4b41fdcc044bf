"""CPU Adam throughput: ours against torch's fused/foreach AdamW, DeepSpeed, and a copy probe.

Reproduce (the cores are shared, so take the lock)::

    flock /tmp/infinity-bench.lock infinity bench adam --numel 67108864 --threads 2 --processes 5

(``--processes 5``: the median over five fresh processes, see [Note: placement noise].)

Every variant steps the same flat fp32 parameter and gradient (64M = 2**26 elements by default) in
this process: after one warm-up call each, ``--repeats`` rounds time one call of every variant per
round, and each row is the median of its calls, so the figures are ratios against
``torch.optim.AdamW(fused=True)`` measured side by side. ``--hugepages`` puts every variant's
buffers (ours and torch's alike) in ``cpu_adam.zeros_host`` memory: transparent huge pages, each
buffer at its own offset (see [Note: state memory layout] in ``infinity/optim/cpu_adam.py``); the
default is plain torch allocations, as a user's tensors would be.
"GB/s" counts the bytes each variant must move (fp32 Adam: 28 per parameter; our bf16 copy-out
adds 2; a separate ``.to(bfloat16)`` adds 6; bf16 moments take 20 instead of 28), so it shows how
close each is to the copy probe's bandwidth. The step's own memory probe ([memory probe] in
``csrc/cpu_adam.cpp``: the four fp32 streams read and three written, 28 bytes a parameter, no
arithmetic) is the limit the fp32 step is measured against ("at the memory limit": 1.0).
DeepSpeed's ``DeepSpeedCPUAdam`` runs in a subprocess of ``/root/dsvenv/bin/python``
(``DS_ACCELERATOR=cpu``; its op is JIT-built and cached on first use), interleaved there round by
round with our fp32 step, torch's fused AdamW and the memory probe, so its ratios are per-round
ratios too (the same medians of ratios as the in-process rows).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from typing import Any, Callable

import torch

from infinity.bench.plot import save_plot
from infinity.bench.progress import progress
from infinity.bench.report import Report, add_common_arguments, median_time_s
from infinity.optim import cpu_adam

DS_PYTHON = "/root/dsvenv/bin/python"
_HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
PROBE_VARIANT = "memory probe: copy_ fp32"
STEP_PROBE_VARIANT = "memory probe: the step's 28 B (fp32)"
# `infinity bench all --quick`: 4M parameters (64 MiB of fp32 state, past the caches), no subprocess.
QUICK_ARGS = ("--numel", str(1 << 22), "--repeats", "3", "--no-deepspeed")


def add_arguments(parser: Any) -> None:
    parser.add_argument("--numel", type=int, default=1 << 26, help="parameters per step (default 2**26)")
    parser.add_argument("--threads", type=int, default=2, help="torch/kernel threads (default 2)")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (median per variant)")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed subprocess")
    parser.add_argument("--processes", type=int, default=1,
                        help="measure in this many fresh processes, one after another, and report "
                        "the median of each figure over them (see [Note: placement noise])")
    parser.add_argument("--hugepages", action="store_true",
                        help="every variant's buffers from cpu_adam.zeros_host (huge pages, staggered offsets)")
    parser.add_argument("--ds-timeout-s", type=float, default=1200.0,
                        help="DeepSpeed subprocess limit, including its first JIT build")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="draw Gupdates/s and GB/s per variant against the copy probe "
                        "(needs pip install 'infinity[plot]')")
    add_common_arguments(parser)


def _torch_optimizer(p: torch.Tensor, g: torch.Tensor, alloc: Callable, **kw: Any) -> torch.optim.Optimizer:
    param = torch.nn.Parameter(p, requires_grad=False)  # shares p's storage
    param.grad = g
    opt = torch.optim.AdamW([param], **_HYPER, **kw)
    # its moments in the same kind of memory as ours (AdamW uses pre-existing state as is)
    opt.state[param] = {"step": torch.tensor(0.0), "exp_avg": alloc(p.numel(), torch.float32),
                        "exp_avg_sq": alloc(p.numel(), torch.float32)}
    return opt


def _ours(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, threads: int,
          out: torch.Tensor | None = None) -> Callable[[], None]:
    step = [0]

    def run() -> None:
        step[0] += 1
        cpu_adam.adam_step_flat(p, g, m, v, step=step[0], lr=_HYPER["lr"], beta1=0.9, beta2=0.999,
                                eps=_HYPER["eps"], weight_decay=_HYPER["weight_decay"], out=out,
                                num_threads=threads)
    return run


def _measure(args: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    n, threads = args.numel, args.threads
    alloc = cpu_adam.zeros_host if args.hugepages else (lambda k, dt: torch.zeros(k, dtype=dt))
    torch.manual_seed(0)
    p, g = alloc(n, torch.float32).normal_(), alloc(n, torch.float32).normal_(std=1e-2)
    m32, v32 = alloc(n, torch.float32), alloc(n, torch.float32)
    m16, v16 = alloc(n, torch.bfloat16), alloc(n, torch.bfloat16)
    out16, copy_dst = alloc(n, torch.bfloat16), alloc(n, torch.bfloat16)
    fused = _torch_optimizer(p, g, alloc, fused=True)
    foreach = _torch_optimizer(p, g, alloc, foreach=True)
    fused_param = fused.param_groups[0]["params"][0]

    def fused_copy() -> None:
        fused.step()
        copy_dst.copy_(fused_param)

    def fused_to() -> None:
        fused.step()
        fused_param.detach().to(torch.bfloat16)  # allocates, as `param.to(bf16)` in user code does

    src, dst = alloc(n, torch.float32), alloc(n, torch.float32)
    probe = [alloc(n, torch.float32) for _ in range(4)]
    variants: list[tuple[str, Callable[[], None], int, str]] = [
        (PROBE_VARIANT, lambda: dst.copy_(src), 8, "-"),
        *([(STEP_PROBE_VARIANT, lambda: cpu_adam.memory_probe(*probe, num_threads=threads), 28,
            "-")] if cpu_adam.backend() != "torch" else []),  # the probe needs the kernel
        ("torch AdamW fused", fused.step, 28, "fused"),
        ("torch AdamW foreach", foreach.step, 28, "fused"),
        ("ours fp32", _ours(p, g, m32, v32, threads), 28, "fused"),
        ("torch fused + copy_ to bf16", fused_copy, 34, "fused+copy_"),
        ("torch fused + .to(bf16)", fused_to, 34, "fused+copy_"),
        ("ours fp32 + bf16 out", _ours(p, g, m32, v32, threads, out16), 30, "fused+copy_"),
        ("ours bf16 states", _ours(p, g, m16, v16, threads), 20, "ours fp32"),
        ("ours bf16 states + bf16 out", _ours(p, g, m16, v16, threads, out16), 22, "fused+copy_"),
    ]
    samples = _round_robin([(name, fn) for name, fn, _, _ in variants], repeats=args.repeats)
    times = {name: statistics.median(ts) for name, ts in samples.items()}
    if os.environ.get(cpu_adam.BACKEND_ENV, "auto") != "torch":  # slow: fewer repeats, outside the rounds
        fallback = _with_backend("torch", _ours(p, g, m32, v32, threads))
        times["ours, torch fallback path"], _ = median_time_s(fallback, repeats=min(2, args.repeats), warmup=1)
        variants.append(("ours, torch fallback path", fallback, 28, "fused"))
    times["fused+copy_"], times["fused"] = times["torch fused + copy_ to bf16"], times["torch AdamW fused"]
    rows = []
    for name, _, bytes_per, ref in variants:
        t = times[name]
        rows.append({"variant": name, "time_ms": t * 1e3, "Gupdates/s": n / t / 1e9,
                     "GB/s": n * bytes_per / t / 1e9, "bytes/param": bytes_per,
                     "speedup": None if ref == "-" else times[ref] / t,
                     "vs": "-" if ref == "-" else ref})
    return rows, times, samples


SETTLE_S = 0.05
"""[Note: settle between variants] A pause before each timed call. The variants that allocate
(torch's foreach temporaries, ``.to(bfloat16)``) free hundreds of MiB per call, and the guest
kernel then works on one of the two cores for a while (returning the pages; torch's OpenMP team
spinning down). Measured here (2 threads, 64M parameters): our bf16-state step timed right after
a large torch op ran 1.24x faster than our fp32 step, 1.30-1.32x with this pause or with
nothing before it, so without it the slowdown was charged to whichever variant came next."""


def _round_robin(fns: list[tuple[str, Callable[[], None]]], *, repeats: int) -> dict[str, float]:
    """Seconds per variant per round, timing one call of each variant per round.

    The cores are shared: interleaving spreads any slow period over all variants instead of
    charging it to whichever variant happened to run then; the pause before each call
    ([Note: settle between variants]) keeps one variant's aftermath out of the next one's time.
    """
    samples: dict[str, list[float]] = {name: [] for name, _ in fns}
    bar = progress(len(fns) * (repeats + 1), desc="bench adam")
    try:
        for _, fn in fns:  # warm-up: page faults, kernel build, torch's lazy state
            fn()
            bar.set_postfix(round=f"0/{repeats}", refresh=False)
            bar.update(1)
        for round_ in range(1, repeats + 1):
            for name, fn in fns:
                time.sleep(SETTLE_S)  # [Note: settle between variants]
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
                bar.set_postfix(round=f"{round_}/{repeats}", refresh=False)  # after t1: never timed
                bar.update(1)
    finally:
        bar.close()
    return samples


def _with_backend(name: str, fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        old = os.environ.get(cpu_adam.BACKEND_ENV)
        os.environ[cpu_adam.BACKEND_ENV] = name
        try:
            fn()
        finally:
            if old is None:
                del os.environ[cpu_adam.BACKEND_ENV]
            else:
                os.environ[cpu_adam.BACKEND_ENV] = old
    return run


_DS_SCRIPT = textwrap.dedent("""
    # In DeepSpeed's venv, with this repository on PYTHONPATH: DeepSpeedCPUAdam, our fp32 step,
    # torch's fused AdamW and the step's memory probe, each on its own buffers, one call of each
    # per round (after a warm-up call each), a settling pause before every call.
    import json, sys, time, torch
    n, threads, repeats, settle = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                   float(sys.argv[4]))
    torch.set_num_threads(threads)
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from infinity.optim import cpu_adam
    torch.manual_seed(0)
    def param():
        p = torch.nn.Parameter(torch.randn(n)); p.grad = torch.randn(n) * 1e-2
        return p
    ds = DeepSpeedCPUAdam([param()], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                          adamw_mode=True)
    fused = torch.optim.AdamW([param()], lr=1e-3, weight_decay=0.01, fused=True)
    mine = [torch.randn(n), torch.randn(n) * 1e-2, torch.zeros(n), torch.zeros(n)]
    step = [0]
    def ours():
        step[0] += 1
        cpu_adam.adam_step_flat(*mine, step=step[0], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                weight_decay=0.01, num_threads=threads)
    probe = [torch.zeros(n) for _ in range(4)]
    variants = {"ds": ds.step, "ours": ours, "fused": fused.step}
    if cpu_adam.backend() != "torch":  # the probe needs the compiled kernel
        variants["probe"] = lambda: cpu_adam.memory_probe(*probe, num_threads=threads)
    for fn in variants.values():
        fn()
    samples = {k: [] for k in variants}
    for _ in range(repeats):
        for k, fn in variants.items():
            time.sleep(settle)
            t0 = time.perf_counter(); fn(); samples[k].append(time.perf_counter() - t0)
    print("RESULT " + json.dumps(samples))
""")


def _deepspeed(args: Any) -> tuple[dict[str, Any] | None, str]:
    if args.no_deepspeed:
        return None, "DeepSpeed skipped (--no-deepspeed)"
    if not os.path.exists(DS_PYTHON):
        return None, f"DeepSpeed skipped: {DS_PYTHON} not found"
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(args.threads),
               PYTHONPATH=os.pathsep.join(filter(None, (repo, os.environ.get("PYTHONPATH")))))
    if args.hugepages:  # the same memory as ours: torch's allocator madvises huge pages
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    try:
        proc = subprocess.run([DS_PYTHON, "-c", _DS_SCRIPT, str(args.numel), str(args.threads),
                               str(args.repeats), str(SETTLE_S)],
                              capture_output=True, text=True, timeout=args.ds_timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return None, f"DeepSpeed skipped: no result within {args.ds_timeout_s:.0f} s"
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return (json.loads(line[len("RESULT "):]), "DeepSpeed DeepSpeedCPUAdam in its own "
                    "process, interleaved there with our fp32 step, torch fused and the probe")
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return None, f"DeepSpeed skipped: subprocess failed ({tail[0][:200]})"


def _across_processes(args: Any) -> tuple[list[dict[str, Any]], dict[str, float], list[dict[str, float]]]:
    """[Note: placement noise] The same kernel on the same sizes runs a few percent faster or
    slower from one process to the next on this VM (which physical pages, and how the host backs
    them, varies per process: a bf16-state / fp32 ratio of 1.28x in one process, 1.37x in the
    next), while rounds inside one process agree. So ``--processes N`` measures in N fresh
    processes and reports, per variant, the median time, and per ratio the median of the N
    per-process ratios (the spread goes into the notes)."""
    argv = [sys.executable, "-m", "infinity", "bench", "adam", "--json", "--no-save", "--no-deepspeed",
            "--processes", "1", "--numel", str(args.numel), "--threads", str(args.threads),
            "--repeats", str(args.repeats)] + (["--hugepages"] if args.hugepages else [])
    records = []
    for i in range(args.processes):
        print(f"bench adam: process {i + 1}/{args.processes}", file=sys.stderr, flush=True)
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"bench adam: process {i + 1} failed ({proc.returncode}): "
                               f"{proc.stderr.strip()[-500:]}")
        records.append(json.loads(proc.stdout))
    rows = []
    for k, row in enumerate(records[0]["rows"]):
        per = [r["rows"][k] for r in records]
        t = statistics.median(r["time_ms"] for r in per) / 1e3
        speed = [r["speedup"] for r in per if r["speedup"] is not None]
        rows.append({**row, "time_ms": t * 1e3, "Gupdates/s": args.numel / t / 1e9,
                     "GB/s": args.numel * row["bytes/param"] / t / 1e9,
                     "speedup": statistics.median(speed) if speed else None})
    per_process = [r["ratios"] for r in records]
    ratios = {k: statistics.median(p[k] for p in per_process) for k in per_process[0]}
    return rows, ratios, per_process


def run(args: Any) -> int:
    if args.processes > 1:
        rows, targets, per_process = _across_processes(args)
        backend = cpu_adam.backend()
    else:
        torch.set_num_threads(args.threads)
        backend = cpu_adam.backend()  # builds the kernel now, outside the timed region
        rows, times, samples = _measure(args)
        per_process = []
    ds, ds_note = _deepspeed(args)
    if not per_process:
        targets = _targets(samples)
    if ds is not None:
        n, ds_s = args.numel, statistics.median(ds["ds"])
        rows.append({"variant": "DeepSpeed CPUAdam (subprocess)", "time_ms": ds_s * 1e3,
                     "Gupdates/s": n / ds_s / 1e9, "GB/s": n * 28 / ds_s / 1e9,
                     "bytes/param": 28, "speedup": _round_ratio(ds["fused"], ds["ds"]),
                     "vs": "fused (in its process)"})
        targets["fp32 vs DeepSpeedCPUAdam, interleaved in its process (target >= 1.0)"] = \
            _round_ratio(ds["ds"], ds["ours"])
        if "probe" in ds:
            targets["DeepSpeedCPUAdam at the memory limit (probe / step, 1.0: at it)"] = \
                _round_ratio(ds["probe"], ds["ds"])
    notes = [f"{k}: {v:.2f}x" + (f" (median of {len(per_process)} processes: "
                                  + ", ".join(f"{p[k]:.2f}" for p in per_process) + ")"
                                  if per_process else "")
             for k, v in targets.items()]
    notes += [f"backend {backend}; {args.threads} threads; numel {args.numel}; median of {args.repeats} "
              f"rounds (ratios above: median of the per-round ratios)"
              + (f", then the median over {len(per_process)} processes" if per_process else "")
              + f"; buffers of every variant on "
              f"{'huge-page-advised memory' if args.hugepages else 'torch allocations'}",
              "speedup = time of the 'vs' variant / time of this row", ds_note]
    report = Report(name="adam", title=f"CPU Adam, {args.numel} params, {args.threads} threads",
                    rows=rows, columns=["variant", "time_ms", "Gupdates/s", "GB/s", "bytes/param", "speedup", "vs"],
                    notes=notes, params={"numel": args.numel, "threads": args.threads, "repeats": args.repeats,
                                         "backend": backend, "hugepages": args.hugepages,
                                         "processes": args.processes},
                    extra={"ratios": targets, "deepspeed": ds,
                           **({"ratios_per_process": per_process} if per_process else {})})
    if args.plot:
        written, message = _plot(rows, args.plot, title=report.title)
        print(message, file=sys.stderr)  # stderr: keeps --json stdout one document
        report.extra["plot"] = args.plot if written else None
    report.emit(as_json=args.json, results_dir=args.results_dir, save=not args.no_save)
    return 0


def _round_ratio(ref: list[float], variant: list[float]) -> float:
    """Median over rounds of the per-round ratio ref / variant: a slow stretch of the shared
    machine hits both variants of a round, so it cancels here rather than in the medians'
    quotient."""
    return statistics.median(a / b for a, b in zip(ref, variant))


def _targets(samples: dict[str, list[float]]) -> dict[str, float]:
    def ratio(ref: str, variant: str) -> float:
        return _round_ratio(samples[ref], samples[variant])

    at_limit = ({"fp32 at the memory limit (the step's probe / the step, 1.0: at it)":
                 ratio(STEP_PROBE_VARIANT, "ours fp32")} if STEP_PROBE_VARIANT in samples else {})
    return {**at_limit,
        "fp32 vs torch fused AdamW (target >= 1.0)": ratio("torch AdamW fused", "ours fp32"),
        "bf16 out vs fused + copy_ (target >= 1.25)": ratio("torch fused + copy_ to bf16",
                                                            "ours fp32 + bf16 out"),
        "bf16 out vs fused + .to(bf16)": ratio("torch fused + .to(bf16)", "ours fp32 + bf16 out"),
        "bf16 states vs ours fp32 (target >= 1.3)": ratio("ours fp32", "ours bf16 states"),
    }


def _plot(rows: list[dict[str, Any]], path: str, *, title: str) -> tuple[bool, str]:
    """Two bar charts per variant (Gupdates/s, GB/s); the copy probe is the GB/s ceiling line."""
    probe = next((r for r in rows if r["variant"] == PROBE_VARIANT), None)
    bars = [r for r in rows if r is not probe]

    def draw(plt):
        fig, (ax_u, ax_b) = plt.subplots(1, 2, figsize=(12, 0.45 * len(bars) + 1.8), sharey=True)
        ys = range(len(bars))
        colors = ["tab:orange" if r["variant"].startswith("ours") else "tab:blue" for r in bars]
        ax_u.barh(ys, [r["Gupdates/s"] for r in bars], color=colors)
        ax_u.set_yticks(list(ys), [r["variant"] for r in bars])
        ax_u.invert_yaxis()  # table order, top to bottom
        ax_u.set_xlabel("Gupdates/s (parameters per second / 1e9)")
        ax_b.barh(ys, [r["GB/s"] for r in bars], color=colors)
        ax_b.set_xlabel("GB/s moved (bytes/param x updates/s)")
        if probe is not None:
            ax_b.axvline(probe["GB/s"], color="black", linestyle="--",
                         label=f"copy probe {probe['GB/s']:.1f} GB/s")
            # the probe in updates: fp32 Adam moves 28 bytes per parameter
            ax_u.axvline(probe["GB/s"] / 28, color="black", linestyle="--",
                         label=f"copy probe / 28 B = {probe['GB/s'] / 28:.2f}")
            ax_u.legend(loc="lower right")
            ax_b.legend(loc="lower right")
        for ax in (ax_u, ax_b):
            ax.grid(True, axis="x", alpha=0.3)
        fig.suptitle(title + " (orange: ours)")
        return fig

    return save_plot(path, draw, what="adam throughput plot")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="infinity bench adam")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
