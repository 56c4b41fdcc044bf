"""``infinity train``: the README's main job, a GPT trained with parameters and optimizer on NVMe.

Reproduce: ``infinity train`` (embedded default: GPT 'demo' preset, 25M parameters, byte-level,
bf16, 32 steps on the project's own source text, parameters and optimizer state on NVMe under
./infinity-data/train, with a host budget of a quarter of the full training state).

The default is sized so that the model's full training state (bf16 parameters and gradients, fp32
master and Adam moments: 16 bytes per parameter) does not fit the host budget it is given, and the
run still finishes in a few minutes on 2 CPU cores. Flags scale it up (``--model 135m``,
``--steps``, ``--batch-size``). It prints a progress bar (loss, step time, bytes moved per tier,
stall fraction) and a final summary: the ledger's estimate against what the engine measured,
per-tier traffic, and where the time went.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import statistics
import time
from typing import Any, Callable

import psutil
import torch

from infinity._common import format_bytes
from infinity._compute_dtype import auto_compute_dtype
from infinity._dtypes import torch_dtype
from infinity.bench.progress import progress
from infinity.bench.report import peak_rss_bytes
from infinity.bench.roofline import (OPTIMIZER_KINDS, gpt_compute_s, init_roofline,
                                     nvme_moved_bytes, nvme_per_step, probe_disk, roofline,
                                     staging_bound, steady_steps)
from infinity.cli._consolidate import parse_bytes
from infinity.cli._resume_check import ResumeCheck, deterministic_kernels
from infinity.cli._train_report import print_summary
from infinity.config import AUTO, DTYPE_BYTES, load_config
from infinity.ledger import ModelShape, Tier, activation_bytes, estimate_from_config
from infinity.models.data import VOCAB_SIZE, text_batch, text_corpus
from infinity.models.gpt import GPT, PRESETS, GPTConfig, gpt_for_params, synthetic_batch
from infinity.tiers import AUTO_HOST_RAM_FRACTION
from infinity.zero import (BuildProgress, init, initialize, least_host_budget_bytes,
                           resolve_device)

logger = logging.getLogger(__name__)

DEFAULT_DIR = "./infinity-data/train"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="demo", help="GPT preset: demo (default, byte-level), tiny, "
                        "small, medium, deep (byte-level, 32 narrow layers: long-context "
                        "activations), 135m, gpt2-124m, 350m, 1b, 3b (3.3B: 53 GB of state)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--params", type=float, help="instead of --model: a GPT of about this many "
                      "parameters (e.g. 1e9), in the 3b preset's shape")
    size.add_argument("--state-ram-multiple", type=float, help="instead of --model: a GPT whose "
                      "training state (16 B per parameter) is this multiple of the machine's RAM "
                      "(e.g. 2)")
    parser.add_argument("--width", type=int, help="with --params / --state-ram-multiple: the "
                        "model's width (a multiple of 128), the layers making up the size")
    parser.add_argument("--no-roofline", action="store_true", help="skip the roofline probes (a "
                        "256 MiB raw disk probe of --dir and one block's compute, a few seconds)")
    parser.add_argument("--data", choices=("auto", "text", "synthetic"), default="auto",
                        help="text: the project's own source as bytes (byte-level models); synthetic: "
                        "generated tokens; auto: text when the model's vocabulary is 256")
    parser.add_argument("--steps", type=int, default=32, help="optimizer steps (default 32)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (past the "
                        "preset's block_size, its position table grows to it)")
    parser.add_argument("--activations", choices=("auto", "none", "device", "host", "nvme"),
                        default="auto",
                        help="activation checkpointing and where the blocks' saved inputs live "
                        "(activation_checkpointing.offload): none (no checkpointing), device "
                        "(checkpointing, kept where torch keeps them), host, nvme; auto "
                        "(default): checkpointing with offload 'auto' when the ledger's "
                        "activations without it pass the device's room (half a GPU's free "
                        "memory; an eighth of the RAM on a CPU), else none")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                        help="compute dtype; auto (default): bf16 where this device multiplies "
                        "bf16 matrices at most 2x slower than fp32 (a GPU with bf16; a CPU with "
                        "AVX-512 BF16 or AMX: measured in a fraction of a second), else fp32")
    parser.add_argument("--offload", choices=("nvme", "cpu", "none"), default="nvme",
                        help="where parameters and optimizer state live (default nvme)")
    parser.add_argument("--dir", default=DEFAULT_DIR, help=f"swap directory (default {DEFAULT_DIR})")
    parser.add_argument("--host-budget-fraction", type=float, default=0.4,
                        help="host budget as a fraction of the full training state (default 0.4: "
                        "the gradient accumulators live on the host, bf16 with one micro-batch "
                        "per step and fp32 with accumulation, and the NVMe pipeline needs staging)")
    parser.add_argument("--host-budget", type=_host_budget, default=None, metavar="auto|BYTES",
                        help="instead of --host-budget-fraction: 'auto' (the engine's default "
                        "rule) or a size such as 4GiB (raised to the least that works, with a "
                        "warning)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--config", help="a config file (native or DeepSpeed) instead of the flags")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--resume-check", action="store_true", help="save a checkpoint after "
                        "half the steps (under --dir/checkpoint), then load it and rerun the rest: "
                        "losses and fp32 masters must be bitwise equal (or the save is refused "
                        "up front when the disk cannot hold it)")


def _host_budget(text: str) -> str | int:
    return "auto" if text == "auto" else parse_bytes(text)


def _config(args: argparse.Namespace, model: Any) -> dict[str, Any]:
    if args.config:
        with open(args.config, encoding="utf-8") as f:
            return json.load(f)
    config: dict[str, Any] = {
        # 'auto' sub-groups: the largest whose NVMe staging (a few sub-groups of master +
        # moments, 12 B per element) fits the host budget. A fixed 2**18 (3 MiB requests) made
        # the 3.3B model's step Python-bound on 38,000 requests at 0.4 GB/s.
        "zero": {"stage": 3, "unit_class_names": ["Block"], "sub_group_numel": "auto"},
        "precision": {"dtype": args.dtype},
        "optimizer": {"type": "adamw", "lr": args.lr, "weight_decay": 0.01},
        "gradient_clipping": 1.0,
        "gradient_accumulation_steps": args.grad_accum,
    }
    if args.offload != "none":
        path = os.path.abspath(args.dir)
        os.makedirs(path, exist_ok=True)
        off = {"device": args.offload, **({"nvme_path": path} if args.offload == "nvme" else {})}
        config["offload_param"] = dict(off)
        config["offload_optimizer"] = dict(off)
    if args.offload == "nvme" and args.host_budget == "auto":
        config["memory"] = {"host_budget_bytes": "auto"}
    elif args.offload != "nvme" and isinstance(args.host_budget, int):
        config["memory"] = {"host_budget_bytes": args.host_budget}
    elif args.offload == "nvme":
        numel = sum(p.numel() for p in model.parameters())
        flag = "--host-budget" if args.host_budget is not None else "--host-budget-fraction"
        wanted = (args.host_budget if args.host_budget is not None
                  else int(full_state_bytes(config, numel) * args.host_budget_fraction))
        # A small model's state can sit below the fixed NVMe staging the pipeline needs: raise
        # the budget to the least that works rather than refuse the flag.
        least = least_host_budget_bytes(model, load_config(config))
        if wanted < least:
            logger.warning("%s gives %d bytes, below the %d the NVMe pipeline needs for this "
                           "model; using %d", flag, wanted, least, least)
        config["memory"] = {"host_budget_bytes": max(wanted, least)}
    offload = _activation_offload(args)
    if offload is not None:
        config["activation_checkpointing"] = {"units": ["Block"], "offload": offload}
        if offload in ("nvme", "auto") and args.offload != "nvme":
            config["activation_checkpointing"]["nvme_path"] = os.path.abspath(args.dir)
            os.makedirs(os.path.abspath(args.dir), exist_ok=True)
    return config


def _activation_offload(args: argparse.Namespace) -> str | None:
    """``--activations``: the checkpointed blocks' offload ('none': checkpointed and kept on the
    device, 'host', 'nvme', 'auto'), or None for no checkpointing. 'auto' checkpoints, offloading
    'auto', where the ledger's activations of a micro-batch without checkpointing pass the
    device's room (:func:`device_activation_room_bytes`)."""
    if args.activations == "none":
        return None
    if args.activations != "auto":
        return {"device": "none"}.get(args.activations, args.activations)
    plain = activation_bytes(_shape(args), micro_batch=args.batch_size,
                             dtype_bytes=DTYPE_BYTES[args.dtype]).total_bytes
    return "auto" if plain > device_activation_room_bytes() else None


def _shape(args: argparse.Namespace) -> ModelShape:
    """The ledger's shape of the GPT ``args`` trains, at its ``--seq-len``."""
    gpt = getattr(args, "gpt_config", None) or _model_config(args)
    return ModelShape(kind="gpt2", num_layers=gpt.n_layer, hidden_size=gpt.n_embd,
                      num_heads=gpt.n_head, vocab_size=gpt.vocab_size, seq_len=args.seq_len)


def device_activation_room_bytes() -> int:
    """What ``--activations auto`` lets a step's activations take on the compute device before
    it checkpoints and offloads them: half the GPU's free memory (the states and the working set
    take the rest), or, on a CPU, AUTO_HOST_RAM_FRACTION of the RAM (the share an 'auto' host
    budget may take: activations beyond it would crowd the page cache the NVMe traffic uses)."""
    if torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info()
        return free // 2
    return int(psutil.virtual_memory().total * AUTO_HOST_RAM_FRACTION)


def full_state_bytes(raw_config: dict[str, Any], numel: int) -> int:
    """The model's whole training state on one rank (all tiers), from the ledger."""
    return estimate_from_config(load_config(raw_config), numel, 1).total_bytes


STATE_BYTES_PER_PARAM = 16
"""bf16 parameters and gradients, fp32 master and moments: what --state-ram-multiple sizes by."""


def _model_config(args: argparse.Namespace) -> GPTConfig:
    """The GPT to train: a preset, or one sized by --params / --state-ram-multiple (whose name
    then replaces ``args.model`` in the summary)."""
    numel = args.params
    if args.state_ram_multiple is not None:
        if args.state_ram_multiple <= 0:
            raise ValueError(f"--state-ram-multiple must be > 0, got {args.state_ram_multiple}")
        numel = args.state_ram_multiple * psutil.virtual_memory().total / STATE_BYTES_PER_PARAM
    if numel is not None:
        if numel < 1e6:
            raise ValueError(f"--params: expected at least 1e6 parameters, got {numel:g}")
        config = gpt_for_params(numel, width=getattr(args, "width", None))
        args.model = f"gpt-{config.num_params / 1e9:.2f}b"
        return config
    if args.model not in PRESETS:
        raise ValueError(f"--model: expected one of {', '.join(PRESETS)}, got {args.model!r}")
    return PRESETS[args.model]


def run(args: argparse.Namespace) -> int:
    gpt_config = _resolve_run(args)
    batch = _batch_source(args, gpt_config)
    # Before the first kernel: bitwise resumption needs deterministic ones on a GPU.
    kernels = deterministic_kernels() if args.resume_check else None
    torch.manual_seed(args.seed)
    built = _build(args, gpt_config)
    engine, config = built.engine, built.engine.config
    ledger = _ledger(built)
    micro_steps = args.steps * args.grad_accum
    check = (ResumeCheck(os.path.join(args.dir, "checkpoint"), (args.steps // 2) * args.grad_accum,
                         kernels=kernels) if args.resume_check else None)
    try:
        log = _train_steps(engine, args, batch, check)
        summary = _report(built, ledger, log, args, gpt_config)
        if check is not None:
            summary["resume_check"] = check.finish(engine, batch, log.losses, micro_steps)
    finally:
        engine.close()
        swap_dirs = {s.nvme_path for s in (config.offload_param, config.offload_optimizer)
                     if s.device == "nvme"} | {config.activation_checkpointing.nvme_path}
        if os.path.abspath(args.dir) in swap_dirs and not args.config:
            shutil.rmtree(os.path.abspath(args.dir), ignore_errors=True)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        print_summary(summary)
    return 0


def _resolve_run(args: argparse.Namespace) -> GPTConfig:
    """The model's shape and the compute dtype, checked; sets ``args.dtype_reason`` and
    ``args.gpt_config`` for the summary."""
    gpt_config = _model_config(args)
    args.dtype_reason = f"--dtype {args.dtype}"
    # [Note: bf16 where the device computes it] in infinity/_compute_dtype.py
    if args.dtype == "auto":
        args.dtype, args.dtype_reason = auto_compute_dtype(resolve_device(AUTO).type)
        logger.warning("--dtype auto: %s", args.dtype_reason)
    if args.seq_len < 1:
        raise ValueError(f"--seq-len must be >= 1, got {args.seq_len}")
    if args.seq_len > gpt_config.block_size:
        logger.info("--seq-len %d: the %s preset's position table grows from %d to %d rows",
                    args.seq_len, args.model, gpt_config.block_size, args.seq_len)
        gpt_config = dataclasses.replace(gpt_config, block_size=args.seq_len)
    args.gpt_config = gpt_config
    return gpt_config


def _batch_source(args: argparse.Namespace, gpt_config: GPTConfig) -> Callable[[int], Any]:
    """``batch(i)``: micro-batch ``i`` (``--data``: the text corpus or synthetic tokens), the
    same for the same seed."""
    use_text = args.data == "text" or (args.data == "auto" and gpt_config.vocab_size == VOCAB_SIZE)
    if use_text and gpt_config.vocab_size < VOCAB_SIZE:
        raise ValueError(f"--data text needs a vocabulary of at least {VOCAB_SIZE}; the {args.model} "
                         f"preset has {gpt_config.vocab_size}")
    corpus = text_corpus() if use_text else None

    def batch(i: int):
        seed = args.seed * 10007 + i
        if corpus is not None:
            return text_batch(corpus, args.batch_size, args.seq_len, seed=seed)
        return synthetic_batch(gpt_config, args.batch_size, args.seq_len, seed=seed)
    return batch


@dataclasses.dataclass
class _Built:
    """The model and its engine as :func:`_build` made them, with what their making cost."""

    model: GPT
    engine: Any
    numel: int
    init_s: float
    init_state: dict[str, int]
    """What the init roofline prices: random values drawn, state bytes written to NVMe."""


def _build(args: argparse.Namespace, gpt_config: GPTConfig) -> _Built:
    """Build the model on meta and let ``initialize`` materialise it unit by unit, with a
    progress bar (units built, GB written, ETA)."""
    t_init = time.perf_counter()
    with init() as recording:  # built on meta; initialize materialises it unit by unit (same values)
        model = GPT(gpt_config)
    numel = sum(p.numel() for p in model.parameters())
    raw_config = _config(args, model)
    init_bar = progress(0, desc="init")

    def on_unit(p: BuildProgress) -> None:  # units built, GB written, ETA (tqdm's)
        init_bar.total = p.num_units
        init_bar.set_postfix(nvme_written=format_bytes(p.nvme_written_bytes), refresh=False)
        init_bar.update(p.units_done - init_bar.n)

    engine = initialize(model, raw_config, progress=on_unit)
    init_bar.close()
    init_s = time.perf_counter() - t_init
    init_state = {"random_numel": recording.random_numel,
                  "nvme_state_bytes": int(engine.stats()["bytes"]["NVME"]["current"])}
    return _Built(model=model, engine=engine, numel=numel, init_s=init_s, init_state=init_state)


def _ledger(built: _Built) -> Any:
    """The estimator's ledger of the engine's resolved plan (what the summary compares with)."""
    engine = built.engine
    unit_numel = max(sum(p.numel() for p in b.parameters()) for b in built.model.blocks)
    stats = engine.stats()
    return estimate_from_config(engine.config, built.numel, stats["world_size"],
                                unit_numel=unit_numel,
                                optimizer_host_resident_bytes=stats["optimizer_host_resident_bytes"],
                                grads_on_nvme=stats["grads_on_nvme"],
                                device_holds_params=stats["device_holds_params"],
                                sub_group_numel=stats["sub_group_numel"])


@dataclasses.dataclass
class _StepLog:
    """What the training loop measured, per optimizer step (and per micro-step for losses)."""

    losses: list[float] = dataclasses.field(default_factory=list)
    step_times: list[float] = dataclasses.field(default_factory=list)
    step_moved: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """NVMe bytes (read, written) of each step."""
    step_kinds: list[dict[str, dict[str, int]]] = dataclasses.field(default_factory=list)
    """NVMe bytes of each step per kind of state (param, opt, grad)."""
    wall_s: float = 0.0


def _train_steps(engine: Any, args: argparse.Namespace, batch: Callable[[int], Any],
                 check: ResumeCheck | None) -> _StepLog:
    """``--steps`` optimizer steps of ``--grad-accum`` micro-batches each, timed per step, with
    the NVMe bytes each step moved; a progress bar shows loss, step time, traffic and stall."""
    micro_steps = args.steps * args.grad_accum
    bar = progress(args.steps, desc="train")
    log = _StepLog()
    t_start = time.perf_counter()
    t0 = time.perf_counter()
    moved = engine.stats()["bytes_moved"]
    kinds = engine.stats()["nvme_bytes_by_kind"]
    for i in range(micro_steps):
        x, y = batch(i)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        log.losses.append(float(loss.item()))
        if (i + 1) % args.grad_accum == 0:
            if i + 1 == micro_steps:  # the last update would wait for a forward that never comes
                engine.finish_step()
            log.step_times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            s = engine.stats()
            before, moved = moved, s["bytes_moved"]
            log.step_moved.append(nvme_moved_bytes(before, moved))
            kinds_before, kinds = kinds, s["nvme_bytes_by_kind"]
            log.step_kinds.append({k: {way: n - kinds_before.get(k, {}).get(way, 0)
                                       for way, n in v.items()} for k, v in kinds.items()})
            elapsed = time.perf_counter() - t_start
            bar.set_postfix(loss=f"{log.losses[-1]:.4g}", step_s=f"{log.step_times[-1]:.3g}",
                            nvme_read=format_bytes(moved.get("NVME->HOST", 0)),
                            nvme_write=format_bytes(moved.get("HOST->NVME", 0)),
                            stall=f"{s['stall_s'] / max(elapsed, 1e-9):.1%}", refresh=False)
            bar.update(1)
        if check is not None and check.maybe_save(engine, i + 1):
            t0 = time.perf_counter()  # the save is not part of the next step's time
    bar.close()
    log.wall_s = time.perf_counter() - t_start
    return log


def _report(built: _Built, ledger: Any, log: _StepLog, args: argparse.Namespace,
            gpt_config: GPTConfig) -> dict[str, Any]:
    """The run's summary: the ledger against the measured tiers, the steps' times and NVMe
    bytes, the activations and (NVMe runs) the roofline."""
    engine, micro_steps = built.engine, args.steps * args.grad_accum
    summary = _summary(engine, ledger, built.numel, log.losses, log.step_times, log.wall_s, args)
    summary["init_s"] = built.init_s
    summary["init_state"] = built.init_state
    summary["peak_rss_bytes"] = peak_rss_bytes()  # before the probes below allocate
    summary["activations"] = _activations_summary(engine, args, micro_steps)
    summary["nvme_per_step"] = nvme_per_step(
        log.step_moved, engine.stats(),
        activation_bytes=summary["activations"]["measured"]["nvme_saved_bytes_per_step"]
        if summary["activations"] else 0)
    summary["nvme_per_step"]["by_step"] = [
        {"step_s": t, "read_bytes": r, "write_bytes": w, "by_kind": k}
        for t, (r, w), k in zip(log.step_times, log.step_moved, log.step_kinds)]
    if not args.no_roofline and args.offload == "nvme":
        summary["roofline"] = _roofline(args, gpt_config, summary, engine)
    return summary


def _roofline(args: argparse.Namespace, gpt_config: GPTConfig, summary: dict[str, Any],
              engine: Any) -> dict[str, Any]:
    """The step against max(CPU time, disk time), both measured here ([roofline] module)."""
    disk = probe_disk(os.path.abspath(args.dir))
    dtype = torch_dtype(args.dtype)
    # On the engine's devices: a GPU run's compute is the GPU's (the optimizer's the host's when
    # it is offloaded), not this host's CPU time.
    config = engine.config
    compute = gpt_compute_s(gpt_config, batch_size=args.batch_size, seq_len=args.seq_len,
                            dtype=dtype, device=engine.device,
                            optimizer_device="cpu" if config.offload_optimizer.device != "none"
                            else engine.device,
                            checkpointing=config.activation_checkpointing.enabled)
    per_step = summary["nvme_per_step"]
    cpu_s = compute["forward_backward_s"] * args.grad_accum + compute["adam_s"]
    line = roofline(cpu_s=cpu_s, read_bytes=per_step["read_bytes"],
                    write_bytes=per_step["write_bytes"], disk=disk,
                    step_s=summary["median_step_s"])
    start = init_roofline(random_numel=summary["init_state"]["random_numel"],
                          state_bytes=summary["init_state"]["nvme_state_bytes"], disk=disk,
                          init_s=summary["init_s"])
    mean = roofline(cpu_s=cpu_s, read_bytes=per_step["mean_read_bytes"],
                    write_bytes=per_step["mean_write_bytes"], disk=disk,
                    step_s=summary["mean_step_s"])
    staging = {}
    if config.offload_optimizer.device == "nvme":
        staging = _staging_bounds(args, compute, summary, summary["stats"]["store"], disk,
                                  roofline_s=line["roofline_s"],
                                  mean_roofline_s=mean["roofline_s"])
    return {**line, **compute, **start, **staging.get("median", {}), "cpu_s": cpu_s,
            "mean": {**{k: mean[k] for k in ("disk_s", "roofline_s", "x_roofline")},
                     **staging.get("mean", {})},
            "disk_read_bytes_per_s": disk.read_bytes_per_s,
            "disk_write_bytes_per_s": disk.write_bytes_per_s, "direct_io": disk.direct,
            # [Note: the mixed disk roofline] in infinity/bench/io.py
            "disk_mixed_read_bytes_per_s": disk.mixed_read_bytes_per_s,
            "disk_mixed_write_bytes_per_s": disk.mixed_write_bytes_per_s,
            "median_step_s": summary["median_step_s"]}


def _staging_bounds(args: argparse.Namespace, compute: dict[str, float], summary: dict[str, Any],
                    store: dict[str, Any], disk: Any, *, roofline_s: float,
                    mean_roofline_s: float) -> dict[str, dict[str, float]]:
    """[Note: the staging bound] in infinity/bench/roofline.py, for the median step and for the
    mean of every step (as the roofline): the optimizer's NVMe bytes (its sub-groups and gradient
    slices) per step, the host room beside what is homed there, the per-unit compute's phases."""
    steps = summary["nvme_per_step"]["by_step"]
    window = [{way: sum(st["by_kind"].get(k, {}).get(way, 0) for k in OPTIMIZER_KINDS)
               for way in ("read", "write")} for st in steps]
    room = store["host_budget_bytes"] - store["host_homed_bytes"]
    phases = {"forward_s": compute["forward_s"] * args.grad_accum,
              "backward_s": compute["backward_s"] * args.grad_accum,
              "optimizer_s": compute["adam_s"]}
    steady = steady_steps(window)  # the median step's, as nvme_per_step's
    median = staging_bound(**phases, disk=disk, staging_room_bytes=room, roofline_s=roofline_s,
                           step_s=summary["median_step_s"],
                           window_read_bytes=statistics.median(w["read"] for w in steady),
                           window_write_bytes=statistics.median(w["write"] for w in steady))
    n = max(1, len(window))
    mean = staging_bound(**phases, disk=disk, staging_room_bytes=room, roofline_s=mean_roofline_s,
                         step_s=summary["mean_step_s"],
                         window_read_bytes=sum(w["read"] for w in window) / n,
                         window_write_bytes=sum(w["write"] for w in window) / n)
    return {"median": median, "mean": mean}


def _activations_summary(engine: Any, args: argparse.Namespace,
                         micro_steps: int) -> dict[str, Any] | None:
    """The checkpointed blocks' saved inputs: the ledger's bytes per tier (2sbh per block) beside
    what the engine saved, held at its peak and moved ([Note: saved activations are shards of the
    store] in infinity/zero/_stored_activations.py); None without checkpointing."""
    acts = engine.config.activation_checkpointing
    if not acts.enabled:
        return None
    tier = acts.offload_tier
    stored = engine.stats()["activations"]
    # 'auto' is priced where it put most of them
    priced = tier if tier != "auto" else max(
        (("none", "DEVICE"), ("host", "HOST"), ("nvme", "NVME")),
        key=lambda t: stored[t[1]]["saved"])[0]
    ledger = activation_bytes(_shape(args), micro_batch=args.batch_size, checkpointing=True,
                              offload=priced, dtype_bytes=DTYPE_BYTES[args.dtype])
    steps = max(1, micro_steps // args.grad_accum)
    measured: dict[str, Any] = {"nvme_saved_bytes_per_step": 0}
    if stored is not None:
        measured = {"host_peak_bytes": stored["HOST"]["peak"],
                    "nvme_peak_bytes": stored["NVME"]["peak"],
                    "saved_bytes_per_micro_batch": sum(
                        stored[t]["saved"] for t in ("DEVICE", "HOST", "NVME")) // micro_steps,
                    "nvme_saved_bytes_per_step": stored["NVME"]["saved"] // steps,
                    "nvme_written_bytes_per_step": stored["nvme_written_bytes"] // steps,
                    "nvme_read_bytes_per_step": stored["nvme_read_bytes"] // steps}
    return {"offload": tier, "ledger": ledger.to_dict(), "measured": measured}


def _summary(engine: Any, ledger: Any, numel: int, losses: list[float], step_times: list[float],
             wall_s: float, args: argparse.Namespace) -> dict[str, Any]:
    s = engine.stats()
    tiers = {}
    for tier, key in ((Tier.DEVICE, "DEVICE"), (Tier.HOST, "HOST"), (Tier.NVME, "NVME")):
        measured = s["bytes"][key]
        tiers[key] = {"estimate_bytes": ledger.tier_bytes(tier), "measured_peak_bytes": measured["peak"],
                      "budget_bytes": measured.get("budget")}
    stall = s.get("stall_s", 0.0)
    step_total = sum(step_times)
    return {
        "model": args.model, "num_params": numel, "dtype": args.dtype,
        "dtype_reason": args.dtype_reason, "offload": args.offload,
        "device": str(engine.device),
        "full_training_state_bytes": ledger.total_bytes,
        "steps": len(step_times), "first_loss": losses[0], "final_loss": losses[-1],
        "median_step_s": statistics.median(steady_steps(step_times)),  # [Note: the steady steps]
        "mean_step_s": step_total / max(1, len(step_times)), "wall_s": wall_s,
        "tiers": tiers, "ledger": ledger.to_dict(), "bytes_moved": s["bytes_moved"],
        "time": {"steps_s": step_total, "stall_s": stall,
                 "optimizer_step_s": s.get("optimizer_step_s", 0.0),
                 "optimizer_deferred_s": s.get("optimizer_deferred_s", 0.0),
                 "stall_fraction": stall / max(step_total, 1e-9)},
        "stats": s,
    }
