"""One mode of ``infinity bench step`` in a fresh process; prints one JSON line (see step.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

from infinity._dtypes import torch_dtype
from infinity._modeled_link import LinkModel
from infinity._process_exit import exit_after_distributed
from infinity.bench._step_model import StepModel, step_model
from infinity.bench.overlap import comm_edges_s, copy_edges_s
from infinity.bench.report import peak_rss_bytes
from infinity.bench.roofline import OPTIMIZER_KINDS, nvme_moved_bytes, nvme_per_step
from infinity.bench.thread_cpu import cpu_between, thread_cpu_s
from infinity.config import ActivationCheckpointingConfig, load_config
from infinity.io import Swapper, aligned_empty
from infinity.ledger import StateTerms
from infinity.tiers import SUB_GROUP_BYTES_PER_NUMEL, extent_bytes
from infinity.zero import (apply_activation_checkpointing, host_needs_of, init, initialize,
                           least_host_budget_bytes)

PARAMS_MODES = ("stage3-nvme-params", "stage3-mem-params")
"""Parameters on NVMe against the same configuration with every parameter in memory (issue #5)."""
NVME_MODES = ("stage3-nvme", "stage3-nvme-params")
USER_MODE = "user-config"
"""The engine under the user's ``--ds-config`` file, as written (see step.py)."""
HPZ_PARTITION = 2
"""stage3-hpz: the secondary partition (the ranks of one modeled node)."""


def _device() -> torch.device:
    """Where plain PyTorch computes: the GPU when there is one (the engine's 'auto' picks it too)."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _sync() -> None:
    """Step times cover the GPU's work, copy streams included, not only its launch."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _plain(model: nn.Module, spec: dict[str, Any]):
    """Plain PyTorch mixed precision as a user writes it: low-precision model, fp32 masters, fused AdamW."""
    dtype = torch_dtype(spec["dtype"])
    device = _device()
    model.to(device)  # on the GPU like the engine's (it moves its inputs itself)
    params = [p for p in model.parameters()]
    if dtype != torch.float32:
        masters = [p.detach().float() for p in params]
        model.to(dtype)
    else:
        masters = params
    opt = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.01, fused=True)

    bench_model = step_model(spec["model"])
    loss_of = bench_model.loss
    if spec.get("activations", "none") != "none":  # the same blocks, torch.utils.checkpoint
        apply_activation_checkpointing(model, ActivationCheckpointingConfig(
            units=(bench_model.block_class_name,)))

    def step(micro_batches) -> float:
        forward_s = backward_s = 0.0
        for x, y in micro_batches:  # gradient accumulation: summed in param.grad, as users do
            _sync()
            t0 = time.perf_counter()
            loss = loss_of(model, x.to(device), y.to(device))
            _sync()
            t1 = time.perf_counter()
            (loss / len(micro_batches)).backward()
            _sync()
            forward_s, backward_s = forward_s + t1 - t0, backward_s + time.perf_counter() - t1
        t2 = time.perf_counter()
        if masters is not params:
            for m, p in zip(masters, params):
                m.grad = p.grad.float()
                p.grad = None
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if masters is not params:
            with torch.no_grad():
                for m, p in zip(masters, params):
                    p.copy_(m)
        _sync()
        PLAIN_PHASES.append({"forward": forward_s, "backward": backward_s,
                             "optimizer": time.perf_counter() - t2})
        return loss.item()

    return step, lambda: {}, lambda: None


PLAIN_PHASES: list[dict[str, float]] = []
ENGINE_PHASES: list[dict[str, float]] = []
ENGINE_PHASE_DISK: list[dict[str, dict[str, float]]] = []
"""Per step, the seconds of each phase (forward, backward, optimizer) the disk had reads, writes,
both in flight ([Note: disk activity] in infinity/io/_disk_activity.py): where the two directions
are busy at once, which the mixed disk roofline ([Note: the mixed disk roofline] in
infinity/bench/io.py) counts on."""
"""Per step of the engine's modes: forward, backward and ``engine.step()`` seconds."""
"""Seconds of each plain step's forward, backward and optimizer (clip, AdamW, copy-back): the
compute of [Note: the staging bound] in infinity/bench/roofline.py."""


def model_flops_per_token(model: nn.Module, block_class_name: str, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward, no recomputation): 6 per weight of every
    matrix product (PaLM's model FLOPs, Appendix B: 2-D weights of Linear, GPT-2's Conv1D and the
    output projection; embedding lookups excluded) plus attention's scores and weighted sum,
    12 * n_layer * d_model * seq_len. What "model TFLOP/s" divides by the step time."""
    matmul = sum(m.weight.numel() for m in model.modules()
                 if not isinstance(m, nn.Embedding)
                 and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2)
    n_layer = sum(type(m).__name__ == block_class_name for m in model.modules())
    d_model = next(m.embedding_dim for m in model.modules() if isinstance(m, nn.Embedding))
    return 6 * matmul + 12 * n_layer * d_model * seq_len


def _cpu_device_budget(model: nn.Module, spec: dict[str, Any]) -> int:
    """The host-budget fraction of the parameter bytes, but at least double buffering on the
    device: the unit computing and the next one, each gathered with its shard copy beside it
    (units are the model's blocks here). With room for only one unit ahead in flight (3 of the largest), a
    prefetch waited for the unit computing to release: medium preset at fraction 0.3, hit rate
    0.91 with 5 late fetches per 54; with this, 1.00 while still reading 99.6 % of the
    parameter bytes from NVMe every step."""
    param_bytes = torch_dtype(spec["dtype"]).itemsize
    parts = _unit_numels(model, step_model(spec["model"]).block_class_name)
    total = sum(parts) * param_bytes
    return max(int(total * spec["host_budget_fraction"]), 4 * max(parts) * param_bytes + 2 ** 20)


def _unit_numels(model: nn.Module, block_class_name: str) -> list[int]:
    """Elements per unit: one per block, then the rest (embeddings, final norm) as the root unit."""
    blocks = [m for m in model.modules() if type(m).__name__ == block_class_name]
    numels = [sum(p.numel() for p in b.parameters()) for b in blocks]
    return numels + [sum(p.numel() for p in model.parameters()) - sum(numels)]


PARAMS_SUB_GROUP_NUMEL = 2 ** 18
"""The optimizer's sub-group in PARAMS_MODES (3 MiB of fp32 state): small extents, so that the
fragmentation slack below stays a small part of the parameters' host room."""


def _params_config(model: nn.Module, spec: dict[str, Any], config: dict[str, Any]) -> int:
    """PARAMS_MODES: the optimizer state in host memory in both, the device budget bounded the
    same way in both (on a GPU too: left 'auto' it would cache every shard on the device after the
    first step and nothing would be read from NVMe again). ``stage3-nvme-params`` homes the
    parameters on NVMe with host room for ``host_budget_fraction`` of them beyond what the optimizer
    homes there; ``stage3-mem-params`` homes them in host memory ('auto' host budget): every
    parameter is already in memory, the reference the NVMe mode is divided by. Returns the host
    room for parameters in bytes (0 for the reference)."""
    config["zero"]["sub_group_numel"] = PARAMS_SUB_GROUP_NUMEL
    config["offload_optimizer"] = {"device": "cpu"}
    config["memory"] = {"device_budget_bytes": _cpu_device_budget(model, spec)}
    if spec["mode"] == "stage3-mem-params":
        config["offload_param"] = {"device": "cpu"}
        return 0
    path = os.path.abspath(spec["dir"])
    os.makedirs(path, exist_ok=True)
    config["offload_param"] = {"device": "nvme", "nvme_path": path}
    numels = _unit_numels(model, step_model(spec["model"]).block_class_name)
    item = torch_dtype(spec["dtype"]).itemsize
    # What the optimizer homes in host memory (fp32 master and moments per sub-group, the gradient
    # accumulators) and the store's comfortable NVMe staging for the parameter shards (one read,
    # one prefetched, a spare: below it the engine turns the prefetcher off), from the engine's
    # own sizing.
    needs = host_needs_of(model, load_config(config), PARAMS_SUB_GROUP_NUMEL)
    # Room for parameter shards: the fraction, but at least that staging, plus one optimizer
    # sub-group of slack: at initialize the shards' HOST copies (kept while they are written to
    # NVMe) interleave with the optimizer's extents in the arena, and a budget of exactly the sum
    # can leave no hole for the last one (fragmentation).
    room = max(int(sum(numels) * item * spec["host_budget_fraction"]),
               needs.comfortable_bytes - needs.homed_bytes)
    room += extent_bytes(SUB_GROUP_BYTES_PER_NUMEL * min(PARAMS_SUB_GROUP_NUMEL, max(numels)))
    config["memory"]["host_budget_bytes"] = needs.homed_bytes + room
    return room


def _ours(model: nn.Module, spec: dict[str, Any]):
    mode, bench_model = spec["mode"], step_model(spec["model"])
    # [Note: the modeled link] in infinity/_modeled_link.py: --link-gbps (overlap.py)
    link = LinkModel(**spec["link"]) if spec.get("link") else None
    if mode == USER_MODE:  # the user's file as written: units, budgets, offload are its own
        return _engine_runner(initialize(model, spec["ds_config"], comm_link=link), bench_model)
    config: dict[str, Any] = {  # tuned: the model's blocks are the units
        "zero": {"stage": 2 if mode in ("stage2", "stage2-overlap") else 3,
                 "unit_class_names": [bench_model.block_class_name],
                 **({"hpz_partition_size": HPZ_PARTITION} if mode == "stage3-hpz" else {}),
                 # [Note: the after-step gather overlaps the next forward]
                 **({"overlap_param_gather": True} if mode == "stage2-overlap" else {})},
        "precision": {"dtype": spec["dtype"], "reduce_dtype": spec.get("reduce_dtype", "fp32")},
        "optimizer": {"type": "adamw", "lr": 1e-4, "weight_decay": 0.01},
        "gradient_clipping": 1.0,
        "gradient_accumulation_steps": spec.get("gradient_accumulation_steps", 1),  # --ds-config's
    }
    if mode == "stage3-cpu":
        config["offload_param"] = {"device": "cpu"}
        config["offload_optimizer"] = {"device": "cpu"}
        if link is not None and not torch.cuda.is_available():
            # The link models a GPU's host<->device copies: a device of its own (the bounded
            # DEVICE tier, as the NVMe mode's) in the read path, parameters homed on HOST.
            config["memory"] = {"device_budget_bytes": _cpu_device_budget(model, spec)}
    elif mode == "stage3-nvme":
        path = os.path.abspath(spec["dir"])
        os.makedirs(path, exist_ok=True)
        config["offload_param"] = {"device": "nvme", "nvme_path": path}
        config["offload_optimizer"] = {"device": "nvme", "nvme_path": path}
        numel = sum(p.numel() for p in model.parameters())
        # The paper's 2 + 2 + K (16 B a parameter in every precision), from the ledger's count.
        state_bytes = numel * StateTerms.for_training(dtype=spec["dtype"]).per_param_bytes
        config["memory"] = {"host_budget_bytes": int(state_bytes * spec["host_budget_fraction"])}
        if not torch.cuda.is_available():
            # Without a GPU the DEVICE tier is host RAM too: left 'auto' it caches every parameter
            # shard after the first step and nothing is read from NVMe again. Bound it like the host.
            config["memory"]["device_budget_bytes"] = _cpu_device_budget(model, spec)
        # A small model's state can sit below the fixed NVMe staging the pipeline needs (the tiny
        # preset's half is 0.29 MB of 0.86 MB): raise the budget to the least that works, as
        # `infinity train` does, rather than fail the mode.
        config["memory"]["host_budget_bytes"] = max(config["memory"]["host_budget_bytes"],
                                                    least_host_budget_bytes(model, load_config(config)))
    elif mode in PARAMS_MODES:
        spec["host_param_room_bytes"] = _params_config(model, spec, config)
    activations = spec.get("activations", "none")
    if activations != "none":  # [Note: saved activations are shards of the store]
        config["activation_checkpointing"] = {
            "units": [bench_model.block_class_name],
            "offload": {"device": "none"}.get(activations, activations)}
        if activations in ("nvme", "auto") and mode != "stage3-nvme":
            path = os.path.abspath(spec["dir"])
            os.makedirs(path, exist_ok=True)
            config["activation_checkpointing"]["nvme_path"] = path
    copy_link = link if config.get("offload_param") else None  # the copies' own link
    return _engine_runner(initialize(model, config, comm_link=link, copy_link=copy_link),
                          bench_model)


def _engine_runner(engine, bench_model: StepModel):
    """One optimizer step per call: each micro-batch's forward, backward and ``engine.step()``
    (the engine steps the optimizer at the last of ``gradient_accumulation_steps`` of them)."""
    swapper = None if engine.store is None else engine.store.swapper

    def disk() -> dict[str, float]:
        return {} if swapper is None else swapper.activity.snapshot()

    # The disk's busy seconds are counted from one snapshot to the next without a gap: writes
    # that engine.step() leaves in flight (write-behind) may run, and end, while the benchmark
    # is between two steps. In training the next forward would overlap them, so that is where
    # they are counted; measured from a fresh snapshot they fell in no phase at all.
    last_disk: list[dict[str, float]] = []

    def step(micro_batches) -> float:
        phases = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        busy: dict[str, dict[str, float]] = {k: {} for k in phases}
        for x, y in micro_batches:
            t0, d0 = time.perf_counter(), (last_disk.pop() if last_disk else disk())
            loss = bench_model.loss(engine, x, y)
            t1, d1 = time.perf_counter(), disk()
            engine.backward(loss)
            t2, d2 = time.perf_counter(), disk()
            engine.step()
            t3, d3 = time.perf_counter(), disk()
            last_disk.append(d3)
            for k, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
                phases[k] += dt
            for k, (a, b) in zip(phases, ((d0, d1), (d1, d2), (d2, d3))):
                for name in b:
                    busy[k][name] = busy[k].get(name, 0.0) + b[name] - a[name]
        ENGINE_PHASES.append(phases)  # (wall clock: on a GPU, a breakdown of the launches)
        ENGINE_PHASE_DISK.append(busy)
        return loss.item()

    # The units as built, in the record: the user-config and native rows can be compared on them.
    unit_names = [u.name for u in engine.manager.units]
    # [Note: the schedule bound] in overlap.py: every stored parameter shard crosses to the device
    # after the step that updates it and before the forward reads it.
    shard_bytes = sum(g.shard_numel * g.full.element_size() for u in engine.manager.units
                      for g in u.groups if g.store_key is not None and g.requires_grad)
    # [Note: what cannot hide] in overlap.py: the link's transfers between two calls of stats()
    # (the worker calls it before and after each step), for the step's first gather and last
    # reduction.
    comm_link = engine.collectives.lane.link
    copy_link = None if engine.store is None else engine.store.copy_link
    for link in (comm_link,) if copy_link is None else (comm_link, copy_link.to_device,
                                                         copy_link.to_host):
        if link is not None:
            link.record()

    def stats() -> dict[str, Any]:
        return {**engine.stats(), "unit_names": unit_names, "updated_shard_bytes": shard_bytes,
                "comm_link_edges_s": None if comm_link is None else comm_edges_s(
                    comm_link.take_log()),
                "copy_link_edges_s": None if copy_link is None else copy_edges_s(
                    copy_link.to_device.take_log(), copy_link.to_host.take_log())}
    return step, stats, engine.close


def _timed(after: dict[str, Any], before: dict[str, Any], times: list[float]) -> dict[str, Any]:
    """Prefetch figures over the timed steps only (the first step records the trace: all misses):
    hit rate = hits / unit fetches, stall fraction = seconds waited for parameters / step time."""
    pa, pb = after.get("prefetch") or {}, before.get("prefetch") or {}
    if not pa.get("enabled"):
        return {"hit_rate": None, "stall_fraction": 0.0}
    needs = pa["needs"] - pb["needs"]
    return {"hit_rate": (pa["hits"] - pb["hits"]) / needs if needs else None,
            "stall_fraction": (pa["stall_s_total"] - pb["stall_s_total"]) / max(sum(times), 1e-9),
            "late": pa["late"] - pb["late"], "misses": pa["misses"] - pb["misses"], "needs": needs}


def _param_reads(after: dict[str, Any], before: dict[str, Any], steps: int,
                 spec: dict[str, Any]) -> dict[str, Any]:
    """NVMe parameter reads of the timed steps, and the time to read every parameter shard once
    at the swapper's read bandwidth, measured here on the same directory (one direct-I/O swap-in
    of that many bytes, best of two: the disk's best case, so the time is a lower bound)."""
    read = (after.get("bytes_moved", {}).get("NVME->HOST", 0)
            - before.get("bytes_moved", {}).get("NVME->HOST", 0))
    param_bytes = int(after.get("bytes", {}).get("NVME", {}).get("current", 0))
    out: dict[str, Any] = {"nvme_read_bytes_per_step": read / max(steps, 1),
                           "param_nvme_bytes": param_bytes,
                           "host_param_room_bytes": spec.get("host_param_room_bytes", 0)}
    if not param_bytes:
        return out
    sw = Swapper(os.path.abspath(spec["dir"]))
    try:
        buf = aligned_empty(param_bytes, dtype=torch.uint8, direct_io=True)  # as the arena
        buf.fill_(1)
        sw.swap_out("read-probe", buf).wait()
        seconds = []
        for _ in range(2):
            t0 = time.perf_counter()
            sw.swap_in("read-probe", buf).wait()
            seconds.append(time.perf_counter() - t0)
    finally:
        sw.close()
    bw = param_bytes / min(seconds)
    out.update(read_bytes_per_s=bw, param_read_s=param_bytes / bw, direct_io=sw.direct_io)
    return out


def _staging(after: dict[str, Any], before: dict[str, Any], steps: int) -> dict[str, float]:
    """What [Note: the staging bound] in infinity/bench/roofline.py needs of an engine run: the
    optimizer's NVMe bytes per timed step (its sub-groups and, where they are on NVMe, the
    gradient slices) and the host room left beside what is homed there for good."""
    kinds_a, kinds_b = after.get("nvme_bytes_by_kind", {}), before.get("nvme_bytes_by_kind", {})

    def moved(direction: str) -> float:
        return sum(kinds_a.get(k, {}).get(direction, 0) - kinds_b.get(k, {}).get(direction, 0)
                   for k in OPTIMIZER_KINDS) / max(steps, 1)

    store = after["store"]
    return {"window_read_bytes": moved("read"), "window_write_bytes": moved("write"),
            "staging_room_bytes": store["host_budget_bytes"] - store["host_homed_bytes"]}


def _io_thread_cpu(per_step: list[dict[str, float]]) -> dict[str, Any]:
    """The engine threads' CPU seconds per timed step (median; every step's, and per thread
    group, in the record). Plain PyTorch starts no such threads: zero."""
    totals = [sum(groups.values(), 0.0) for groups in per_step]
    names = sorted({name for groups in per_step for name in groups})
    return {"io_threads_cpu_s": statistics.median(totals) if totals else 0.0,
            "io_threads_cpu_times_s": totals,
            "io_threads_cpu_s_by_group": {n: statistics.median(g.get(n, 0.0) for g in per_step)
                                          for n in names}}


def _join(spec: dict[str, Any]) -> int:
    """Several ranks (overlap.py): join the gloo group (file rendezvous) and share the cores;
    returns this rank."""
    world = spec.get("world_size", 1)
    if world == 1:
        return 0
    import datetime

    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{spec['init_file']}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    return rank


def _lanes_per_step(after: dict[str, Any], before: dict[str, Any], steps: int
                    ) -> dict[str, Any]:
    """The collectives' and the host<->device copies' figures per timed step ([Note: the
    modeled link]): seconds the training thread waited on them, seconds and bytes on the link."""
    out: dict[str, Any] = {}
    for lane in ("comm", "copy"):
        a, b = after.get(lane) or {}, before.get(lane) or {}
        out.update({f"{lane}_{k}_per_step": (a[k] - (b.get(k) or 0)) / max(1, steps)
                    for k in ("exposed_s", "issued", "link_busy_s", "link_bytes",
                              "bytes_to_device", "bytes_to_host")
                    if a.get(k) is not None})
        for key in ("exposed_s_by_phase", "link_busy_s_by_phase"):
            if not a.get(key):
                continue
            before_phase = b.get(key) or {}
            out[f"{lane}_{key}_per_step"] = {
                k: (v - before_phase.get(k, 0.0)) / max(1, steps) for k, v in a[key].items()}
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank = _join(spec)
    bench_model, model = _build(spec)
    runner, stats, close = (_plain if spec["mode"] == "plain" else _ours)(model, spec)
    run = _timed_steps(spec, rank, bench_model, runner, stats)
    s = stats() or {}
    out = _result(spec, model, bench_model, run, s)
    if rank == 0:
        print(json.dumps(out, default=str), flush=True)
    close()  # prefetches may be in flight: stop the store's threads before the interpreter does
    if spec.get("world_size", 1) > 1:
        exit_after_distributed(0)  # [Note: gloo teardown at exit] in infinity/_process_exit.py
    if spec["mode"] in NVME_MODES or spec.get("activations") in ("nvme", "auto"):
        shutil.rmtree(os.path.abspath(spec["dir"]), ignore_errors=True)


def _build(spec: dict[str, Any]) -> tuple[Any, nn.Module]:
    """The benchmark's model, seeded: built plainly for plain PyTorch, and, as the README builds
    a model for the engine, on meta, materialised unit by unit (bitwise the same values:
    final_loss matches plain's)."""
    torch.manual_seed(0)
    bench_model = step_model(spec["model"])
    if spec["mode"] == "plain":
        return bench_model, bench_model.build()
    with init():
        return bench_model, bench_model.build()


@dataclasses.dataclass
class _Run:
    """What the timed steps measured, one entry per timed step."""

    times: list[float] = dataclasses.field(default_factory=list)
    opt_times: list[float] = dataclasses.field(default_factory=list)
    """The optimizer step's share (deferred updates included): step minus it is fwd + bwd."""
    cpu_times: list[float] = dataclasses.field(default_factory=list)
    """CPU seconds of every thread of this process per step: on cores shared with other jobs
    the wall time swings with their load, the work done (CPU time) much less."""
    step_moved: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """NVMe bytes (read, written) per step: the roofline's disk side."""
    io_thread_cpu: list[dict[str, float]] = dataclasses.field(default_factory=list)
    """CPU seconds of the engine's own threads (I/O and copies: on 2 cores they compete with
    the compute)."""
    edges: dict[str, list[dict[str, float]]] = dataclasses.field(
        default_factory=lambda: {"comm": [], "copy": []})
    """[Note: what cannot hide] in infinity/bench/overlap.py, per timed step."""
    loss: float = float("nan")
    warm: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The engine's stats when the warm-up ended (what the timed figures subtract)."""


def _timed_steps(spec: dict[str, Any], rank: int, bench_model: Any, runner: Any,
                 stats: Any) -> _Run:
    """``warmup`` steps, then ``steps`` timed ones, each measured as :class:`_Run` says."""
    run = _Run()
    for i in range(spec["warmup"] + spec["steps"]):
        before = stats() or {}
        if i == spec["warmup"]:
            run.warm = before
        gas = spec.get("gradient_accumulation_steps", 1)
        micro = [bench_model.batch(spec["batch_size"], spec["seq_len"],
                                   seed=i * gas + m + 100_003 * rank)
                 for m in range(gas)]  # gas 1: seed i, as before accumulation was measured
        threads_before = thread_cpu_s()
        _sync()
        t0, c0 = time.perf_counter(), time.process_time()
        run.loss = runner(micro)
        _sync()
        if i >= spec["warmup"]:
            run.times.append(time.perf_counter() - t0)
            run.cpu_times.append(time.process_time() - c0)
            run.io_thread_cpu.append(cpu_between(threads_before, thread_cpu_s()))
            # NVMe optimizer state is read and written in the optimizer step, which the
            # parameter prefetcher does not hide.
            after = stats() or {}
            run.opt_times.append(sum(after.get(k, 0.0) - before.get(k, 0.0)  # deferred: in the forward
                                     for k in ("optimizer_step_s", "optimizer_deferred_s")))
            run.step_moved.append(nvme_moved_bytes(before.get("bytes_moved", {}),
                                                   after.get("bytes_moved", {})))
            for lane, per_step in run.edges.items():
                if after.get(f"{lane}_link_edges_s"):
                    per_step.append(after[f"{lane}_link_edges_s"])
    return run


def _phases(spec: dict[str, Any], s: dict[str, Any], run: _Run) -> dict[str, Any]:
    """The timed steps' median phases (forward, backward, optimizer), and for the engine its
    disk's busy time per phase, its staging and the link's edges."""
    extra: dict[str, Any] = {}
    if spec["mode"] == "plain":
        timed_phases = PLAIN_PHASES[spec["warmup"]:]
        extra["phase_s"] = {k: statistics.median(p[k] for p in timed_phases)
                            for k in ("forward", "backward", "optimizer")}
        return extra
    timed_phases = ENGINE_PHASES[spec["warmup"]:]
    extra["phase_s"] = {k: statistics.median(p[k] for p in timed_phases)
                        for k in ("forward", "backward", "optimizer")}
    timed_disk = ENGINE_PHASE_DISK[spec["warmup"]:]
    if timed_disk and timed_disk[0]["forward"]:  # a swapper: something lives on NVMe
        extra["phase_disk_busy_s"] = {
            k: {name: statistics.median(p[k][name] for p in timed_disk)
                for name in timed_disk[0][k]} for k in ("forward", "backward", "optimizer")}
    if s.get("store"):
        extra["staging"] = _staging(s, run.warm, len(run.times))
    for lane, per_step in run.edges.items():
        if per_step:
            extra[f"{lane}_link_edges_s_per_step"] = {
                k: statistics.median(e[k] for e in per_step) for k in ("head_s", "tail_s")}
    return extra


def _activations_per_step(s: dict[str, Any], run: _Run, extra: dict[str, Any]) -> int:
    """The saved activations' NVMe bytes over the timed steps, per step (into ``extra``);
    returns the bytes saved to NVMe per step (0 without them)."""
    if not s.get("activations"):
        return 0
    now, then = s["activations"], run.warm.get("activations") or {}
    extra["activations_per_step"] = {
        k: (now[k] - then.get(k, 0)) / len(run.times)
        for k in ("nvme_read_bytes", "nvme_written_bytes")}
    return int((now["NVME"]["saved"] - then.get("NVME", {}).get("saved", 0)) / len(run.times))


def _result(spec: dict[str, Any], model: nn.Module, bench_model: Any, run: _Run,
            s: dict[str, Any]) -> dict[str, Any]:
    """The worker's JSON line: the timed steps' figures, the engine's stats after them."""
    times, warm = run.times, run.warm
    extra = _phases(spec, s, run)
    act_nvme = _activations_per_step(s, run, extra)
    timed = _timed(s, warm, times)
    if spec["mode"] == "stage3-nvme-params":
        timed.update(_param_reads(s, warm, len(times), spec))
    step_s = statistics.median(times)
    tokens = spec["batch_size"] * spec["seq_len"] * spec.get("gradient_accumulation_steps", 1)
    flops = model_flops_per_token(model, bench_model.block_class_name, spec["seq_len"])
    return {"mode": spec["mode"], "step_s": step_s, "step_times_s": times,
            "step_cpu_s": statistics.median(run.cpu_times), "step_cpu_times_s": run.cpu_times,
            "device": str(_device()), "tokens_per_step": tokens, "tokens_per_s": tokens / step_s,
            "model_tflops": flops * tokens / step_s / 1e12,
            "fwd_bwd_s": statistics.median(t - o for t, o in zip(times, run.opt_times)),
            "peak_rss_bytes": peak_rss_bytes(), "final_loss": run.loss,
            "num_params": sum(p.numel() for p in model.parameters()),
            "stall_fraction": timed["stall_fraction"], "hit_rate": timed["hit_rate"], "prefetch_timed": timed,
            "io_wait_fraction": (s.get("stall_s", 0.0) - warm.get("stall_s", 0.0)) / max(sum(times), 1e-9)
            if s else 0.0,
            "bytes_moved": sum(s.get("bytes_moved", {}).values()) if isinstance(
                s.get("bytes_moved"), dict) else 0,
            # The timed steps only (the warm-up steps, the first reading cold files, are not
            # among them): plain PyTorch keeps everything in memory and moves nothing.
            "nvme_per_step": nvme_per_step(run.step_moved, s, warm=True,
                                           activation_bytes=act_nvme) if s else {
                "read_bytes": 0, "write_bytes": 0},
            **_io_thread_cpu(run.io_thread_cpu), **_lanes_per_step(s, warm, len(times)), **extra,
            "updated_shard_bytes": s.get("updated_shard_bytes", 0) if s else 0,
            "stats": s}


if __name__ == "__main__":
    main()
