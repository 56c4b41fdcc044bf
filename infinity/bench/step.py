"""``infinity bench step``: training-step time, stall fraction, hit rate and peak RSS per offload mode.

Reproduce: ``infinity bench step --model 135m --batch-size 4 --seq-len 256 --dtype bf16``

Every mode runs in its own fresh process (peak RSS is per process), one after another, on the same
model (a GPT preset, or a Hugging Face one: below) and synthetic tokens: plain PyTorch (the
reference every ratio is taken against), ours at stage 3 without offload, with CPU offload, with
parameters and optimizer on NVMe, and DeepSpeed ZeRO-3 with the same settings when ``--deepspeed-python`` points at an interpreter with DeepSpeed.
Plain PyTorch builds the model eagerly; ours build it under ``infinity.init`` (the README's way:
the fp32 model never exists in full), with bitwise the same initial values.

The prefetcher alone (issue #5): ``--modes stage3-mem-params,stage3-nvme-params`` runs parameters
on NVMe against the same configuration with the parameters in memory (see PARAMS_MODES), and
reports the time to read the parameters from NVMe next to the reference's compute time.

Overlap over a modeled link (issue #30): ``--world-size 2 --link-gbps auto`` runs the engine's
modes on 2 gloo ranks with and without a link under the collectives (infinity/bench/overlap.py).

A user's config (issue #15): ``--ds-config ds_config.json`` runs the ``user-config`` mode, the
engine under that very file (DeepSpeed-style or native, units as it chooses them), beside plain
PyTorch in the same run (``--modes`` defaults to ``plain,user-config`` then). The file's
precision, micro-batch size and gradient accumulation drive every mode, so x_plain compares one
optimizer step of each on the same batches: ``infinity bench step --model 135m --ds-config
ds_config.json --rounds 3``. ``--modes plain,stage3`` with it adds the tuned native config
(the model's blocks as units) to compare with, and the ``x_native`` column (user-config / stage3).

Hugging Face models (issue #15, item 9): ``--model hf-llama-135m`` (SmolLM-135M's shape) or
``hf-gpt2-124m`` (GPT-2 small) builds ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` from a config in
code (random init, no download; needs transformers), with the GPT preset's loss on the logits; the
native modes use ``LlamaDecoderLayer`` / ``GPT2Block`` as units: ``infinity bench step --model
hf-llama-135m --seq-len 128 --dtype fp32 --ds-config benchmarks/configs/ds_zero3.json --modes
plain,user-config,stage3 --rounds 2``. The DeepSpeed reference (``ds-*``) builds GPT presets only.

The roofline (issue #16; the formula and its functions are :mod:`infinity.bench.roofline`'s, the
same ``infinity train`` and ``infinity bench scale`` use): every row reports the NVMe bytes it read
and wrote per timed step (``nvme_read_mib_per_step``, ``nvme_write_mib_per_step``, from
``engine.stats()``), ``disk_s`` = the least time the disk reads and writes those bytes at the raw
direct-I/O bandwidths of ``--dir``, alone or both at once ([Note: the mixed disk roofline] in
infinity/bench/io.py), probed once in the same run (:func:`~infinity.bench.roofline.probe_disk`, after the
modes, only when one of them moved NVMe bytes), ``cpu_s`` = plain PyTorch's median step (the
same model's forward, backward and optimizer with everything in memory), ``roofline_s`` =
max(cpu_s, disk_s), ``bound`` (which side is larger) and ``x_roofline`` = step_s / roofline_s. A
mode without NVMe traffic has disk_s 0, so its ratio is against cpu_s alone. ``io_threads_cpu_s``
is the CPU seconds per step of the engine's own threads (the swapper's I/O threads, the store's
copy threads; :mod:`infinity.bench.thread_cpu`): on few cores they compete with the compute.
Where the optimizer is on NVMe, ``staging_bound_s`` and ``x_staging_bound`` add what the host
budget allows ([Note: the staging bound] in infinity/bench/roofline.py: the updates' NVMe traffic
beyond the budget's room must cross the disk between a backward's end and the next forward's end),
from plain PyTorch's forward, backward and optimizer seconds, timed apart in its worker.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import TYPE_CHECKING, Any

from infinity.bench.plot import save_plot
from infinity.bench.progress import progress
from infinity.bench.report import Report, add_common_arguments

from infinity.bench._step_roofline import (disk_bandwidth, disk_record, roofline_columns,
                                           roofline_notes)

if TYPE_CHECKING:  # the module imports no torch until run
    from infinity.bench.roofline import DiskBandwidth

OURS_MODES = ("stage3", "stage3-cpu", "stage3-nvme")
PARAMS_MODES = ("stage3-nvme-params", "stage3-mem-params")
"""Issue #5's comparison: parameters on NVMe (host room for a fraction of them, the optimizer in
host memory, the device budget bounded) against the same configuration with every parameter in
host memory; ``x_params_in_memory`` is the first's step time over the second's."""
PARAMS_REF = "stage3-mem-params"
DS_MODES = ("ds-stage3", "ds-stage3-cpu", "ds-stage3-nvme")
USER_MODE = "user-config"
"""The engine under ``--ds-config FILE`` as the user wrote it."""
NATIVE_MODE = "stage3"
"""The tuned native config ``x_native`` divides ``user-config`` by: units = the model's blocks."""
DEFAULT_BATCH_SIZE = 4
DEFAULT_DS_PYTHON = "/root/dsvenv/bin/python"
# `infinity bench all --quick`: the tiny preset, plain PyTorch against ours, a few steps.
QUICK_ARGS = ("--model", "tiny", "--seq-len", "64", "--steps", "3", "--warmup", "1",
              "--modes", "plain,stage3")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _workload_arguments(parser)
    _mode_arguments(parser)
    _link_arguments(parser)
    parser.add_argument("--activations", choices=("none", "device", "host", "nvme", "auto"),
                        default="none",
                        help="activation checkpointing of the model's blocks and where their "
                        "saved inputs live (activation_checkpointing.offload; 'device': kept "
                        "where torch keeps them); plain PyTorch checkpoints the same blocks "
                        "(torch.utils.checkpoint), so the roofline's compute has the recompute "
                        "and its disk side the activations' NVMe bytes")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="draw a per-step timeline (compute, I/O, stall) per mode "
                        "(needs pip install 'infinity[plot]')")
    add_common_arguments(parser)


def _workload_arguments(parser: argparse.ArgumentParser) -> None:
    """What one step is: the model, its batch, its dtype, and how many steps are timed."""
    parser.add_argument("--model", default="small", help="GPT preset (tiny, small, medium, 135m, "
                        "gpt2-124m, 350m, 1b) or Hugging Face model built from its config "
                        "(hf-llama-135m: SmolLM-135M's shape, hf-gpt2-124m: GPT-2 small; "
                        "hf-llama-tiny, hf-gpt2-tiny; need transformers); default small")
    parser.add_argument("--batch-size", type=int, default=None,
                        help=f"micro-batch size; default {DEFAULT_BATCH_SIZE}, or the --ds-config "
                        "file's train_micro_batch_size_per_gpu")
    parser.add_argument("--seq-len", type=int, default=None,
                        help=f"tokens per sequence; default 256 ({GPU_PROXY_SEQ_LEN} with "
                        "--gpu-proxy)")
    parser.add_argument("--gpu-proxy", action="store_true",
                        help="[GPU-proxy row] batch 1, a short sequence, the NVMe mode alone: "
                        "compute all but vanishes, as on a GPU, so the step is the engine's I/O "
                        "pipeline; reported against the disk's roofline (x_disk)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                        help="default: the --ds-config file's precision, else bf16 where the "
                        "device computes it at most 2x slower than fp32, else fp32 (as "
                        "infinity train --dtype auto)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per mode (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")


def _mode_arguments(parser: argparse.ArgumentParser) -> None:
    """Which modes run, how often, and where they keep their files."""
    parser.add_argument("--modes", default=None,
                        help="comma-separated subset of plain, "
                        + ", ".join(OURS_MODES + PARAMS_MODES + DS_MODES + (USER_MODE,))
                        + f"; default all but {USER_MODE}, with --ds-config plain,{USER_MODE}")
    parser.add_argument("--ds-config", default=None, metavar="FILE",
                        help=f"a DeepSpeed-style or native config (JSON) for the {USER_MODE} mode, "
                        "measured beside plain PyTorch; its precision, micro-batch size and "
                        "gradient accumulation apply to every mode")
    parser.add_argument("--dir", default="./infinity-data/bench-step", help="NVMe swap directory")
    parser.add_argument("--host-budget-fraction", type=float, default=0.5,
                        help="NVMe modes: host budget as a fraction of the model's training state "
                        "(stage3-nvme-params: of the parameters, beyond the optimizer's host state)")
    parser.add_argument("--deepspeed-python", default=DEFAULT_DS_PYTHON,
                        help="interpreter with DeepSpeed for the ds-* references (skipped if missing)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the modes this many times, every other round in reverse order; "
                        "each mode reports its median round, x_plain and x_params_in_memory the "
                        "median of the per-round ratios")
    parser.add_argument("--mode-timeout-s", type=float, default=None,
                        help="stop a mode's worker after this many seconds and report it as an "
                        "error (the other modes still run; default: no limit)")


def _link_arguments(parser: argparse.ArgumentParser) -> None:
    """Several ranks over a modeled link (infinity/bench/overlap.py)."""
    parser.add_argument("--world-size", type=int, default=1,
                        help="ranks (gloo processes on this machine) for the --link-gbps "
                        "comparison; default 1")
    parser.add_argument("--link-gbps", default=None, metavar="GB/s|auto",
                        help="a modeled link of this bandwidth under every collective; each mode "
                        "runs with a free link (T0) and with this one, and reports the step "
                        "against max(T0, link time) (infinity/bench/overlap.py); auto: the "
                        "bandwidth at which the link time equals T0")
    parser.add_argument("--link-latency-us", type=float, default=0.0,
                        help="--link-gbps: latency added to every transfer; default 0")
    parser.add_argument("--link-heap", choices=("kept", "system"), default="kept",
                        help="--link-gbps: 'kept' (default) runs the ranks with freed memory "
                        "kept in the process, as a GPU's caching allocator keeps device memory "
                        "([Note: the link's ranks keep their freed memory] in "
                        "infinity/bench/overlap.py); 'system': glibc's and the engine's own "
                        "policy, every large block faulted in again each step")
    parser.add_argument("--reduce-dtype", choices=("fp32", "compute"), default="fp32",
                        help="the engine's precision.reduce_dtype: gradients cross ranks in fp32 "
                        "(default) or in the compute dtype (FSDP2's and DeepSpeed's default)")


def _worker_args(args: argparse.Namespace) -> dict[str, Any]:
    return {"model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "dtype": args.dtype, "steps": args.steps, "warmup": args.warmup, "dir": args.dir,
            "host_budget_fraction": args.host_budget_fraction,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "ds_config": args.ds_config, "reduce_dtype": args.reduce_dtype,
            "activations": args.activations}


GPU_PROXY_SEQ_LEN = 16
GPU_PROXY_MODES = "stage3-nvme"


def apply_gpu_proxy(args: argparse.Namespace) -> None:
    """[GPU-proxy row] On a GPU a step's compute is ~100x faster than on these cores, so an
    offloaded step there is the engine's I/O pipeline: its NVMe reads and writes, per-request
    and per-sub-group costs included, that hide behind a CPU's compute here. ``--gpu-proxy``
    makes that step on this machine: batch 1, a short sequence, the NVMe mode alone (plain
    PyTorch is not run: a 3B model's state does not fit in memory), each row's step against
    its disk time (``x_disk``: step_s / disk_s, the mixed disk roofline). The compute left
    still counts in step_s, so x_disk is if anything high."""
    args.seq_len = args.seq_len or (GPU_PROXY_SEQ_LEN if args.gpu_proxy else 256)
    if not args.gpu_proxy:
        return
    args.batch_size = args.batch_size or 1
    args.modes = args.modes or GPU_PROXY_MODES


def _default_shape(args: argparse.Namespace) -> None:
    """Without ``--ds-config``: dtype and micro-batch size from the flags or their defaults, one
    micro-batch a step. The default dtype is bf16 where the device computes it ([Note: bf16
    where the device computes it] in infinity/_compute_dtype.py): on an AVX2-only CPU every
    mode's step would be its bf16 matrix products."""
    if args.dtype is None:
        from infinity._compute_dtype import auto_compute_dtype  # torch: only when run
        from infinity.zero import resolve_device
        args.dtype = auto_compute_dtype(resolve_device("auto").type)[0]
    args.batch_size = args.batch_size or DEFAULT_BATCH_SIZE
    args.gradient_accumulation_steps = 1


def resolve_modes(args: argparse.Namespace) -> list[str]:
    """The modes to run, and the settings ``--ds-config`` decides (dtype, micro-batch size,
    gradient accumulation), written back into ``args``. The file is read and validated here, so
    a bad config fails before any worker starts. Raises ``ValueError`` naming the option."""
    from infinity.bench._step_model import check_model  # deferred: imports torch

    bench_model = check_model(args.model, args.seq_len)
    known = ("plain",) + OURS_MODES + PARAMS_MODES + DS_MODES + (USER_MODE,)
    if args.modes is None:  # every mode that can run this model (the ds-* ones: GPT presets)
        modes = ["plain", USER_MODE] if args.ds_config else [
            m for m in known if m != USER_MODE and not (bench_model.is_hf and m in DS_MODES)]
    else:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        unknown = [m for m in modes if m not in known]
        if unknown:
            raise ValueError(f"--modes: unknown mode {unknown[0]!r}; known: {', '.join(known)}")
        ds = [m for m in modes if m in DS_MODES]
        if ds and bench_model.is_hf:
            raise ValueError(f"--modes {ds[0]}: the DeepSpeed reference builds the GPT presets "
                             f"only, not --model {args.model}; drop the ds-* modes")
        if args.ds_config and USER_MODE not in modes:
            modes.append(USER_MODE)
    if not args.ds_config:
        if USER_MODE in modes:
            raise ValueError(f"--modes {USER_MODE} needs --ds-config FILE (the config to measure)")
        _default_shape(args)
        return modes
    from infinity.config import load_config  # deferred: the CLI imports no torch until run

    args.ds_config = os.path.abspath(args.ds_config)
    config = load_config(args.ds_config)
    dtype = config.precision.dtype
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"--ds-config {args.ds_config}: precision {dtype!r} is not measured "
                         f"(plain PyTorch runs bf16 or fp32 here); enable bf16 or neither")
    if args.dtype is not None and args.dtype != dtype:
        raise ValueError(f"--dtype {args.dtype} contradicts --ds-config {args.ds_config} "
                         f"({dtype}); drop --dtype (the file decides)")
    args.dtype = dtype
    micro = config.train_micro_batch_size_per_gpu
    args.batch_size = args.batch_size or (micro if isinstance(micro, int) else DEFAULT_BATCH_SIZE)
    gas = config.gradient_accumulation_steps
    args.gradient_accumulation_steps = gas if isinstance(gas, int) else 1
    ds = [m for m in modes if m in DS_MODES]
    if ds and args.gradient_accumulation_steps > 1:
        raise ValueError(f"--modes {ds[0]}: the DeepSpeed reference steps once per micro-batch, "
                         f"but --ds-config accumulates {args.gradient_accumulation_steps}; drop "
                         f"the ds-* modes or set gradient_accumulation_steps 1 in the file")
    return modes


def _run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    spec = json.dumps({"mode": mode, **_worker_args(args)})
    env = dict(os.environ)
    if mode.startswith("ds-"):
        if not os.path.exists(args.deepspeed_python):
            return {"mode": mode, "error": f"DeepSpeed interpreter {args.deepspeed_python} not found"}
        script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "ds_step_worker.py")
        cmd = [args.deepspeed_python, os.path.abspath(script), spec]
        env["DS_ACCELERATOR"] = "cpu"
    else:
        cmd = [sys.executable, "-m", "infinity.bench._step_worker", spec]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                              timeout=args.mode_timeout_s)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"timed out after {args.mode_timeout_s:g} s "
                f"(--mode-timeout-s)"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr or proc.stdout)[-2000:]
    return {"mode": mode, "error": f"exit {proc.returncode}: {tail.strip().splitlines()[-1] if tail.strip() else ''}",
            "stderr": tail}


def run(args: argparse.Namespace) -> int:
    apply_gpu_proxy(args)
    if args.link_gbps is not None or args.world_size > 1:
        from infinity.bench import overlap

        _default_shape(args)
        return overlap.run(args, _worker_args(args))
    modes = resolve_modes(args)
    rounds = max(1, args.rounds)
    per_mode = _run_rounds(args, modes, rounds)
    results = [_median_round(per_mode[m]) for m in modes]
    plain = next((r for r in results if r["mode"] == "plain" and "error" not in r), None)
    disk, disk_error = disk_bandwidth(results, args.dir)
    rows = _rows(per_mode, results, plain, disk)
    report = _report(args, modes, rounds, per_mode, results, rows, plain, disk, disk_error)
    if args.plot:
        written, message = _plot(results, args.plot)
        print(message, file=sys.stderr)  # stderr: keeps --json stdout one document
        report.extra["plot"] = args.plot if written else None
    report.emit(as_json=args.json, results_dir=args.results_dir, save=not args.no_save)
    return 0 if all("error" not in r for r in results if not r["mode"].startswith("ds-")) else 1


def _run_rounds(args: argparse.Namespace, modes: list[str], rounds: int
                ) -> dict[str, list[dict[str, Any]]]:
    """Each mode's worker once per round: mode -> its result per round."""
    per_mode: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    bar = progress(len(modes) * rounds, desc="bench step")
    for k in range(rounds):
        # Odd rounds run the modes backwards (ABBA): drift on shared cores hits every mode alike.
        for mode in (modes if k % 2 == 0 else modes[::-1]):
            bar.set_postfix(running=mode)  # modes take minutes: say which one is running
            result = _run_mode(mode, args)
            per_mode[mode].append({**result, "round": k} if rounds > 1 else result)
            bar.set_postfix(done=mode, step_s=result.get("step_s", float("nan")),
                            refresh=False)
            bar.update(1)
    bar.close()
    return per_mode


def _rows(per_mode: dict[str, list[dict[str, Any]]], results: list[dict[str, Any]],
          plain: dict[str, Any] | None, disk: DiskBandwidth | None) -> list[dict[str, Any]]:
    """The table's rows: each mode's median round, its ratios (paired per round) and its
    roofline; the user's config also against the tuned native one."""
    rows = [_row(r, plain, _params_ratio(per_mode, r["mode"]), _paired_x(per_mode, r["mode"], "plain"))
            | roofline_columns(r, plain, disk) for r in results]
    native = _paired_x(per_mode, USER_MODE, NATIVE_MODE, min_pairs=1)
    native_cpu = _paired_x(per_mode, USER_MODE, NATIVE_MODE, min_pairs=1, key="step_cpu_s")
    for row in rows:  # the user's config against the tuned native one (issue #15's 3 %)
        if "step_s" in row:
            row["cpu_x_plain"] = _paired_x(per_mode, row["mode"], "plain", min_pairs=1,
                                           key="step_cpu_s")
        if row["mode"] == USER_MODE and native is not None:
            row["x_native"] = native
            row["cpu_x_native"] = native_cpu
    return rows


def _report(args: argparse.Namespace, modes: list[str], rounds: int,
            per_mode: dict[str, list[dict[str, Any]]], results: list[dict[str, Any]],
            rows: list[dict[str, Any]], plain: dict[str, Any] | None, disk: DiskBandwidth | None,
            disk_error: str | None) -> Report:
    """The report of the run: its title, the rows, the raw results and the notes."""
    columns = list(dict.fromkeys(k for row in rows for k in row))  # later rows may add columns
    gas = args.gradient_accumulation_steps
    kind = "" if args.model.startswith("hf-") else "GPT "
    return Report(name="step", title=f"infinity bench step: {kind}{args.model}, {args.dtype}, "
                  f"batch {args.batch_size} x {args.seq_len}"
                  + (f" x {gas} micro-batches" if gas > 1 else "")
                  + (f", {USER_MODE} {os.path.basename(args.ds_config)}" if args.ds_config else "")
                  + f", median of {args.steps} steps"
                  + (f", median of {rounds} rounds" if rounds > 1 else ""),
                  rows=rows, columns=columns, params={**_worker_args(args), "rounds": rounds, "modes": modes},
                  extra={"raw": results, "disk": disk_record(disk, disk_error)} | (
                      {} if rounds == 1 else {"rounds_raw": [r for m in modes for r in per_mode[m]]}),
                  notes=_notes(args, rows, results, plain, disk, disk_error))


def _notes(args: argparse.Namespace, rows: list[dict[str, Any]], results: list[dict[str, Any]],
           plain: dict[str, Any] | None, disk: DiskBandwidth | None, disk_error: str | None
           ) -> list[str]:
    """What each column means, with the notes of the modes that ran."""
    gas = args.gradient_accumulation_steps
    return ["x_plain: step time / plain PyTorch step time (same run; with --rounds, "
            "the median of the per-round ratios)",
            *([f"{USER_MODE}: the engine under {args.ds_config} as written; a step "
               f"is one optimizer step ({gas} micro-batch(es)) in every mode"]
              if args.ds_config else []),
            "tokens_per_s: tokens of one step / step time; model_tflops: the "
            "model's training FLOPs (6 per weight per token in the matmuls, plus "
            "attention) / step time, in TFLOP/s",
            *([f"x_native: {USER_MODE} step time / {NATIVE_MODE}'s (the tuned "
               f"native config, the model's blocks as units), paired per round, "
               f"median over rounds; cpu_x_native: the same of the CPU seconds "
               f"per step (all threads), steadier than wall time on cores shared "
               f"with other jobs"] if any("x_native" in r for r in rows) else []),
            "step_cpu_s: CPU seconds per step of the mode's process (all "
            "threads); cpu_x_plain: its ratio to plain PyTorch's, paired per "
            "round like x_plain",
            "rss_x_plain: peak RSS / plain PyTorch's peak RSS",
            "stall_frac, hit_rate: over the timed steps (after the warm-up steps)",
            *roofline_notes(disk, disk_error, plain),
            *(PARAMS_NOTES if any(r["mode"] in PARAMS_MODES for r in results) else [])]


PARAMS_NOTES = [
    f"x_params_in_memory: step time / {PARAMS_REF}'s step time (same run, same round: parameters "
    "in host memory, otherwise the same configuration; median over --rounds)",
    "param_read_s: every parameter shard's bytes / the swapper's read bandwidth measured on --dir "
    "(a lower bound); compute_s: the forward + backward of " + PARAMS_REF + " (the window the reads "
    "can hide in); read_lt_compute: param_read_s < compute_s (issue #5's 1.15x precondition)"]


def _median_round(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's record: the round with the (lower) median step time; an error only when every
    round failed. Its ``round_step_s`` lists every round's step time."""
    ok = sorted((r for r in runs if "error" not in r), key=lambda r: r["step_s"])
    if not ok:
        return runs[0]
    if len(runs) == 1:
        return ok[0]
    return {**ok[(len(ok) - 1) // 2], "round_step_s": [r["step_s"] for r in runs if "error" not in r]}


def _params_ratio(per_mode: dict[str, list[dict[str, Any]]], mode: str) -> dict[str, Any] | None:
    """For a PARAMS_MODES mode: the median of its per-round step time / the reference's step time
    in the same round (paired, so a slow round slows both), and the reference's median round."""
    if mode not in PARAMS_MODES or PARAMS_REF not in per_mode:
        return None
    x = _paired_x(per_mode, mode, PARAMS_REF, min_pairs=1)
    return None if x is None else {"x": x, "ref": _median_round(per_mode[PARAMS_REF])}


def _paired_x(per_mode: dict[str, list[dict[str, Any]]], mode: str, ref: str, *,
              min_pairs: int = 2, key: str = "step_s") -> float | None:
    """Median over rounds of this mode's step time (``key``) / ``ref``'s in the same round (None
    with fewer than ``min_pairs`` rounds where both ran): a slow round slows both, so the pair's
    ratio is what is stable."""
    pairs = [(r, b) for r, b in zip(per_mode.get(mode, []), per_mode.get(ref, []))
             if "error" not in r and "error" not in b]
    if len(pairs) < min_pairs:
        return None
    if any(key not in r or key not in b for r, b in pairs):
        return None  # a record from before the column existed
    return statistics.median(r[key] / b[key] for r, b in pairs)


def _row(r: dict[str, Any], plain: dict[str, Any] | None, params: dict[str, Any] | None,
         paired: float | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {"mode": r["mode"]}
    if "error" in r:
        row["note"] = r["error"][:120]
        return row
    row["step_s"] = r["step_s"]
    row["x_plain"] = paired if paired is not None else (
        r["step_s"] / plain["step_s"] if plain else None)
    row["tokens_per_s"] = r.get("tokens_per_s")
    row["model_tflops"] = r.get("model_tflops")
    row["step_cpu_s"] = r.get("step_cpu_s")
    row["peak_rss_mib"] = r["peak_rss_bytes"] / 2**20
    row["rss_x_plain"] = r["peak_rss_bytes"] / plain["peak_rss_bytes"] if plain else None
    row["stall_frac"] = r.get("stall_fraction")
    row["hit_rate"] = r.get("hit_rate")
    row["moved_mib"] = r.get("bytes_moved", 0) / 2**20
    row["final_loss"] = r.get("final_loss")
    if r["mode"] in PARAMS_MODES:
        timed = r.get("prefetch_timed") or {}
        row["x_params_in_memory"] = params["x"] if params else None
        row["param_read_s"] = timed.get("param_read_s")
        row["compute_s"] = params["ref"].get("fwd_bwd_s") if params else None
        row["read_lt_compute"] = (row["param_read_s"] < row["compute_s"]
                                  if row["param_read_s"] is not None and row["compute_s"] else None)
    return row


def _plot(results: list[dict[str, Any]], path: str) -> tuple[bool, str]:
    """One row per mode, one segment per step: compute (with overlapped I/O) then stall.

    The worker reports the stall as a fraction of the whole run, so each step's stall segment is
    that fraction of the step: the per-step split is an even spread, the total is measured.
    """
    ok = [r for r in results if "error" not in r and r.get("step_times_s")]
    if not ok:
        return False, f"--plot {path}: no mode finished, nothing to draw"

    def draw(plt):
        fig, ax = plt.subplots(figsize=(9, 0.6 * len(ok) + 1.8))
        for i, r in enumerate(ok):
            left = 0.0
            stall_frac = r.get("stall_fraction") or 0.0
            for k, t in enumerate(r["step_times_s"]):
                stall = t * stall_frac
                ax.barh(i, t - stall, left=left, color="tab:blue", edgecolor="white",
                        label="compute + overlapped I/O" if i == k == 0 else None)
                ax.barh(i, stall, left=left + t - stall, color="tab:red",
                        label="stall (waiting for I/O)" if i == k == 0 else None)
                left += t
            moved = (r.get("bytes_moved") or 0) / 2**20
            if moved:
                ax.text(left, i, f"  {moved:.0f} MiB moved", va="center", fontsize=8)
        ax.set_yticks(range(len(ok)), [r["mode"] for r in ok])
        ax.invert_yaxis()
        ax.set_xlabel("seconds since the first timed step")
        ax.set_title("per-step timeline (one segment per step)")
        ax.legend(loc="lower right", fontsize=8)
        return fig

    return save_plot(path, draw, what="step timeline")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
