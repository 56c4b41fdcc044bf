"""``infinity bench step --link-gbps X``: the step time of several ranks over a modeled link,
against the step without it and the link's own time: does communication hide behind compute?

Reproduce (2 gloo ranks, the anchor GPT, the link set so that a step's link time equals its
compute time)::

    infinity bench step --model 135m --seq-len 128 --world-size 2 --link-gbps auto \\
        --modes stage3,stage2,stage3-hpz --steps 4 --warmup 3

One rank, parameters on HOST and the link under the host<->device copies, both directions (the
350M preset: on the 135M one the least device budget the engine accepts, three of its
38.6M-parameter root, holds almost every shard, so little crosses the link). There every updated
shard must reach the device between the step that updates it and the forward that reads it, and
the gradients must come down in the backward: with L = T0 that is most of L inside the forward
and all the gradients' bytes inside the backward, and ``schedule_bound_s`` (not max(T0, L)) is
the least step any schedule reaches::

    infinity bench step --model 350m --seq-len 128 --world-size 1 --link-gbps auto \
        --modes stage3-cpu --steps 4 --warmup 3

Each mode runs twice in fresh processes (``--world-size`` ranks, gloo, file rendezvous, the cores
shared): first with a free link (it counts the wire bytes and costs no time), giving T0, the
step's compute time with every collective as fast as this machine does it; then with a link of
``--link-gbps`` GB/s (``auto``: the bandwidth at which the step's wire bytes take T0) and
``--link-latency-us``, under every collective ([Note: the modeled link] in
infinity/_modeled_link.py). L is the seconds per step the link was busy. A design that waits for
each collective where it is issued takes about T0 + L; one that overlaps them, max(T0, L)
plus what cannot hide (the first gather of a step, the last reduction). The ranks keep their
freed memory ([Note: the link's ranks keep their freed memory]): three warm-up steps bring
their heaps to size.
Reported per mode: ``t0_s``, ``link_s`` (L), ``step_s``, ``x_max`` = step_s / max(T0, L) (the
issue's figure: <= 1.25), ``x_serial`` = (T0 + L) / max(T0, L) (what waiting at every issue
would give), the seconds per step the training thread waited on collectives
(``exposed_comm_s``, by phase) with the link and without (``exposed_comm_s_free``), and
``schedule_bound_s`` ([Note: the schedule bound]): the least step any schedule reaches given in
which phase each byte arises, ``bound_x_max`` its ratio to max(T0, L) and ``x_schedule_bound``
the step's ratio to it. Medians over ``--steps`` timed steps; with ``--rounds``, the round with
the median ``x_max`` (every round's in ``round_x_max``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

from infinity.bench.progress import progress
from infinity.bench.report import Report

LINK_MODES = ("stage3", "stage2", "stage2-overlap", "stage3-hpz", "stage3-cpu")
"""The engine's modes that run over ranks and links (plain PyTorch and DeepSpeed run one
process); stage2-overlap is stage 2 with ``zero.overlap_param_gather`` (its after-step all-gather
waited in the next forward); stage3-cpu puts a bounded DEVICE tier in the read path, so that the
parameters cross the copy link ([Note: the modeled link])."""
DEFAULT_LINK_MODES = "stage3,stage2"
FREE_LINK = {"bandwidth_gbytes_per_s": 1e9, "latency_us": 0.0}
"""Counts the wire bytes; costs no time (a microsecond per terabyte)."""


def check_arguments(args: argparse.Namespace) -> list[str]:
    """The modes to run; raises ``ValueError`` naming the option that cannot work."""
    if args.world_size < 1:
        raise ValueError(f"--world-size: expected an integer >= 1, got {args.world_size}")
    if args.link_gbps is None:
        raise ValueError("--world-size > 1 measures overlap over a modeled link: give "
                         "--link-gbps X (GB/s) or --link-gbps auto")
    if args.link_gbps != "auto":
        try:
            gbps = float(args.link_gbps)
        except ValueError:
            gbps = -1.0
        if not gbps > 0:
            raise ValueError(f"--link-gbps: expected a bandwidth in GB/s > 0 or 'auto', got "
                             f"{args.link_gbps!r}")
    if args.link_latency_us < 0:
        raise ValueError(f"--link-latency-us: expected >= 0, got {args.link_latency_us}")
    modes = [m.strip() for m in (args.modes or DEFAULT_LINK_MODES).split(",") if m.strip()]
    bad = [m for m in modes if m not in LINK_MODES]
    if bad:
        raise ValueError(f"--link-gbps: mode {bad[0]!r} does not run over ranks; choose from "
                         f"{', '.join(LINK_MODES)}")
    if "stage3-hpz" in modes and args.world_size % 2:
        raise ValueError(f"--modes stage3-hpz: the secondary partition (2 ranks) must divide "
                         f"--world-size {args.world_size}")
    return modes


KEPT_HEAP_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**62)}
"""[Note: the link's ranks keep their freed memory]
The processes of a modeled link stand in for GPUs, whose memory comes from a caching allocator:
a block freed in one step is handed out again in the next, never returned to the driver. On the
CPU, glibc hands every block of 32 MiB or more (and the engine's own buffers from 128 KiB:
[Note: freed buffers leave the process] in infinity/io/_host_malloc.py) to the kernel at its free
and faults it in again, page by page, at the next allocation. On this project's VM a page fault
costs 2 to 26 us (the host backs the page anew): the 135M GPT at stage 2 over 2 ranks took
150-270k faults and 0.6-2.1 s of kernel time per rank per step beside 3.0 s of user time, 0.1-1.3
s of it in the loss's backward alone (its two 100 MB fp32 buffers), differing from step to step
and rank to rank. That is neither compute nor communication, and it lands on the critical path
unevenly (a late first gradient delays every reduction behind it). So the ranks of both runs
(the free link's T0 and the modeled one) run with glibc's mmap off and its trim off: freed memory
stays in the process heap, and after three steps (the heap at its size) 11-39k faults and
0.2-0.5 s of kernel time remain (gloo's loopback copies). ``--link-heap system`` runs without it.
Host memory figures of these runs are not the engine's (its buffers stay in the heap)."""


def _run_ranks(mode: str, args: argparse.Namespace, worker_args: dict[str, Any],
               link: dict[str, float]) -> dict[str, Any]:
    """One mode on ``--world-size`` fresh processes; rank 0's record."""
    with tempfile.TemporaryDirectory(prefix="infinity-overlap-") as tmp, \
            contextlib.ExitStack() as logs:
        spec = json.dumps({"mode": mode, **worker_args, "world_size": args.world_size,
                           "init_file": os.path.join(tmp, "rendezvous"), "link": link,
                           "dir": os.path.join(worker_args["dir"], mode)})
        procs = []
        for rank in range(args.world_size):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(args.world_size),
                   "LOCAL_RANK": str(rank),
                   **(KEPT_HEAP_ENV if args.link_heap == "kept" else {})}
            log = logs.enter_context(
                open(os.path.join(tmp, f"rank{rank}.log"), "w+", encoding="utf-8"))
            procs.append((subprocess.Popen(
                [sys.executable, "-m", "infinity.bench._step_worker", spec],
                stdout=subprocess.PIPE if rank == 0 else log, stderr=log, text=True, env=env),
                log))
        try:
            out, _ = procs[0][0].communicate(timeout=args.mode_timeout_s)
            codes = [p.wait(timeout=60) for p, _ in procs]
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            return {"mode": mode, "error": f"timed out after {args.mode_timeout_s} s"}
        for line in reversed((out or "").splitlines()):
            if line.startswith("{") and not any(codes):
                return json.loads(line)
        tails = []
        for rank, (_, log) in enumerate(procs):
            log.seek(0)
            text = log.read().strip().splitlines()
            tails.append(f"rank {rank} exit {codes[rank]}: {text[-1] if text else ''}")
        return {"mode": mode, "error": "; ".join(tails)}


def _link_bytes(record: dict[str, Any]) -> float:
    """Bytes per step on the busier of the two links (each lane has its own)."""
    return max(record.get("comm_link_bytes_per_step") or 0.0,
               record.get("copy_link_bytes_per_step") or 0.0)


FORWARD_PHASES = ("forward-gather", "broadcast")
BACKWARD_PHASES = ("backward-gather", "secondary-gather", "reduce-grad", "replicate-reduce",
                   "flush", "reduce-rows", "other")
"""Which collectives a phase of the step carries (Phase values); the rest (step-gather, norm)
run in ``engine.step()``."""
BACKWARD_GATHER_PHASES = ("backward-gather", "secondary-gather")
"""The backward's gathers, which may start in the forward's tail ([Note: the backward's gathers
start in the forward's tail] in infinity/zero/_gather_ahead.py)."""
REDUCE_PHASES = ("reduce-grad", "replicate-reduce", "flush", "reduce-rows")
"""The gradient reductions among them ([Note: what cannot hide])."""


_UNIT = re.compile(r" of unit (\d+) |^(?:param/)?u(\d+)\.")
"""A collective's context ("reduce-grad of unit 3 'h.2' (micro-step 0)"), a flat group's key
("u3.bfloat16.0") or its parameter shard's store key ("param/u3.bfloat16.0") -> the unit."""
COPY_UP_TAGS = ("HOST->DEVICE",)
COPY_DOWN_TAGS = ("grad DEVICE->HOST",)


def _unit_of(what: str | None) -> str | None:
    match = _UNIT.search(what or "")
    return (match.group(1) or match.group(2)) if match else what


def _units(log: list[tuple[str, str | None, float]], tags: tuple[str, ...]
           ) -> list[tuple[str | None, float]]:
    return [(_unit_of(w), d) for tag, w, d in log if tag in tags]


def link_edges_s(head_log: list[tuple[str, str | None, float]],
                 tail_log: list[tuple[str, str | None, float]], *,
                 head_tags: tuple[str, ...], tail_tags: tuple[str, ...]) -> dict[str, float]:
    """[Note: what cannot hide]
    The transfers of a step no schedule overlaps with compute, from the links' logs of one step
    ((tag, what, seconds) in issue order). ``head_s``: the first unit's transfers to the device
    in the forward (``head_tags`` in ``head_log``: its gather, or its updated shard's copy up):
    nothing computes before that unit has arrived, and it cannot leave before the step that
    changed it has begun. ``tail_s``: the gradient transfers (``tail_tags`` in ``tail_log``: the
    reductions, or the copies down) from that same unit's last one to the end: the unit the
    forward computes first is the one the backward computes last, so its gradient, and those of
    the units reduced after it (an always-gathered unit's, at the end of backward), are complete
    only when the backward's compute ends, and the step reads them. On a GPT with tied
    embeddings that unit is the root (the embedding is used first, the tied head's gradient
    is summed into it last): on the 135M preset 29 % of the parameters, so the largest gather
    and the largest reduction of the step. With several ranks its embeddings' gradient crosses
    as rows ([Note: embedding rows cross ranks as rows] in infinity/zero/_embedding_rows.py):
    the head's part is reduced at the start of the backward, and the root's last transfer, the
    tail, is the rows' all-gather (a few MB). A unit's transfers in a row count together (its
    groups; hpZ's or the replicas' second collective). Without a forward gather to name the
    first unit (stages 1-2) the tail is the last unit's transfers alone: a looser bound."""
    heads = _units(head_log, head_tags)
    head, first = 0.0, heads[0][0] if heads else None
    for unit, d in heads:
        if unit != first:
            break
        head += d
    tails = _units(tail_log, tail_tags)
    if not tails:
        return {"head_s": head, "tail_s": 0.0}
    units = [unit for unit, _ in tails]
    anchor = first if first in units else units[-1]
    start = len(units) - 1 - units[::-1].index(anchor)
    while start > 0 and units[start - 1] == anchor:
        start -= 1
    return {"head_s": head, "tail_s": sum(d for _, d in tails[start:])}


def comm_edges_s(log: list[tuple[str, str | None, float]]) -> dict[str, float]:
    """:func:`link_edges_s` of the collectives' link: the first forward gather, the reductions
    from that unit's on."""
    return link_edges_s(log, log, head_tags=FORWARD_PHASES, tail_tags=REDUCE_PHASES)


def copy_edges_s(to_device: list[tuple[str, str | None, float]],
                 to_host: list[tuple[str, str | None, float]]) -> dict[str, float]:
    """:func:`link_edges_s` of the host<->device copy link: the first parameter shard copied up,
    the gradients copied down from that unit's on (each direction its own log)."""
    return link_edges_s(to_device, to_host, head_tags=COPY_UP_TAGS, tail_tags=COPY_DOWN_TAGS)


def schedule_bound_s(free: dict[str, Any], linked: dict[str, Any], *,
                     step_gather_in_forward: bool = False) -> float | None:
    """[Note: the schedule bound]
    max(T0, L) assumes the link can work at any time. It cannot: a gradient is reduced after the
    backward made it and before the step uses it, a unit is gathered after the last step changed
    it. So each phase of the step (forward, backward, ``engine.step()``) takes at least the
    larger of its compute (the free run's median phase seconds) and its link time (the linked
    run's link seconds of the collectives that phase carries). Copies under the host<->device
    link (parameters offloaded) go both ways, each direction its own queue: every updated
    parameter shard crosses to the device between its update (in the step) and its read (in
    the next forward), so the step and the forward together last at least those bytes' link
    time; the backward sends the gradients down (to an offloaded optimizer); the other copies
    into the device (the backward's reads of released units) may run in either.
    The sum is the least time any schedule of these transfers can reach: the best overlap,
    given where the bytes arise. Two transfers cannot overlap compute at all ([Note: what
    cannot hide], the linked run's ``comm_link_edges_s_per_step`` and
    ``copy_link_edges_s_per_step``): the step and the forward last at least the first unit's
    arrival (gather, copy up) plus the forward's compute, the backward at least its compute plus
    the gradient transfers (reductions, copies down) from that unit's on.
    The backward's gathers may run in the forward's tail (issued ahead, [Note: the backward's
    gathers start in the forward's tail] in infinity/zero/_gather_ahead.py): they bound the
    forward and the backward together (with every other byte of both), not the backward alone.
    ``step_gather_in_forward``: the after-step all-gather is waited in the next forward
    (stage2-overlap: [Note: the after-step gather overlaps the next forward] in
    infinity/zero/_step_gathers.py), so its link time is the forward's."""
    phases = free.get("phase_s")
    if not phases:
        return None
    comm = linked.get("comm_link_busy_s_by_phase_per_step") or {}
    copy_s = linked.get("copy_link_busy_s_per_step") or 0.0
    forward_phases = FORWARD_PHASES + (("step-gather",) if step_gather_in_forward else ())
    fwd = sum(comm.get(p, 0.0) for p in forward_phases)
    ahead = sum(comm.get(p, 0.0) for p in BACKWARD_GATHER_PHASES)
    bwd = sum(comm.get(p, 0.0) for p in BACKWARD_PHASES if p not in BACKWARD_GATHER_PHASES)
    step = sum(v for p, v in comm.items() if p not in forward_phases + BACKWARD_PHASES)
    f, b, o = phases["forward"], phases["backward"], phases["optimizer"]
    per_byte_s = _per_byte_s(linked)
    shards_s = (linked.get("updated_shard_bytes") or 0) * per_byte_s
    down_s = (linked.get("copy_bytes_to_host_per_step") or 0.0) * per_byte_s
    edges = [linked.get(f"{lane}_link_edges_s_per_step") or {} for lane in ("comm", "copy")]
    head = max(e.get("head_s", 0.0) for e in edges)  # each a bound on its own
    tail = max(e.get("tail_s", 0.0) for e in edges)
    # The copies' link beside the collectives' (a lane each): it bounds the whole step.
    step_and_forward = max(max(o, step) + max(f, fwd), shards_s, head + f)
    return max(step_and_forward + max(b, bwd, down_s, b + tail),
               max(o, step) + fwd + ahead + bwd, copy_s)


def _per_byte_s(linked: dict[str, Any]) -> float:
    """Seconds a byte takes on the linked run's copy link (0 without one)."""
    busy, moved = (linked.get("copy_link_busy_s_per_step") or 0.0,
                   linked.get("copy_link_bytes_per_step") or 0.0)
    return busy / moved if moved else 0.0


def _row(mode: str, free: dict[str, Any], linked: dict[str, Any], gbps: float) -> dict[str, Any]:
    if "error" in free or "error" in linked:
        return {"mode": mode, "note": (free.get("error") or linked.get("error"))[:200]}
    t0, step = free["step_s"], linked["step_s"]
    comm_s = linked.get("comm_link_busy_s_per_step") or 0.0
    copy_s = linked.get("copy_link_busy_s_per_step") or 0.0
    link_s = max(comm_s, copy_s)  # two links side by side: the busier one bounds the step
    bound = max(t0, link_s)
    schedule = schedule_bound_s(free, linked, step_gather_in_forward=mode == "stage2-overlap")
    return {"mode": mode, "link_gbps": gbps, "t0_s": t0, "link_s": link_s, "step_s": step,
            "x_max": step / bound, "x_serial": (t0 + link_s) / bound,
            "schedule_bound_s": schedule,
            "bound_x_max": None if schedule is None else schedule / bound,
            "x_schedule_bound": None if schedule is None else step / schedule,
            "phase_s_free": free.get("phase_s"),
            "comm_link_s_by_phase": {k: round(v, 3) for k, v in (
                linked.get("comm_link_busy_s_by_phase_per_step") or {}).items()},
            "comm_link_s": comm_s, "copy_link_s": copy_s,
            "comm_link_edges_s": linked.get("comm_link_edges_s_per_step"),
            "copy_link_edges_s": linked.get("copy_link_edges_s_per_step"),
            "exposed_comm_s": linked.get("comm_exposed_s_per_step"),
            "exposed_comm_s_by_phase": {k: round(v, 3) for k, v in (
                linked.get("comm_exposed_s_by_phase_per_step") or {}).items()},
            "exposed_copy_s": linked.get("copy_exposed_s_per_step"),
            "exposed_comm_s_free": free.get("comm_exposed_s_per_step"),
            "exposed_copy_s_free": free.get("copy_exposed_s_per_step"),
            "comm_mib_per_step": (free.get("comm_link_bytes_per_step") or 0.0) / 2**20,
            "copy_mib_per_step": (free.get("copy_link_bytes_per_step") or 0.0) / 2**20,
            "copy_mib_to_device_per_step": (free.get("copy_bytes_to_device_per_step")
                                            or 0.0) / 2**20,
            "copy_mib_to_host_per_step": (free.get("copy_bytes_to_host_per_step") or 0.0) / 2**20,
            "updated_shard_mib": (free.get("updated_shard_bytes") or 0) / 2**20,
            "collectives_per_step": free.get("comm_issued_per_step"),
            "final_loss": linked.get("final_loss")}


def run(args: argparse.Namespace, worker_args: dict[str, Any]) -> int:
    modes = check_arguments(args)
    rounds = max(1, args.rounds)
    per_mode: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    bar = progress(len(modes) * rounds * 2, desc="bench step (link)")
    for k in range(rounds):
        for mode in (modes if k % 2 == 0 else modes[::-1]):
            bar.set_postfix(running=f"{mode} (free link)")
            free = _run_ranks(mode, args, worker_args, FREE_LINK)
            bar.update(1)
            if "error" in free:
                per_mode[mode].append(_row(mode, free, free, 0.0))
                bar.update(1)
                continue
            gbps = (_link_bytes(free) / free["step_s"] / 1e9
                    if args.link_gbps == "auto" else float(args.link_gbps))
            bar.set_postfix(running=f"{mode} ({gbps:.3g} GB/s)")
            linked = _run_ranks(mode, args, worker_args,
                                {"bandwidth_gbytes_per_s": gbps,
                                 "latency_us": args.link_latency_us})
            per_mode[mode].append(_row(mode, free, linked, gbps) | {"round": k})
            bar.update(1)
    bar.close()
    rows = []
    for mode in modes:
        ok = sorted((r for r in per_mode[mode] if "step_s" in r), key=lambda r: r["x_max"])
        row = ok[(len(ok) - 1) // 2] if ok else per_mode[mode][0]
        if len(ok) > 1:
            row = {**row, "round_x_max": [r["x_max"] for r in ok]}
        rows.append(row)
    report = Report(
        name="step-link",
        title=f"infinity bench step: GPT {args.model}, {args.dtype}, batch {args.batch_size} x "
              f"{args.seq_len} per rank, {args.world_size} gloo ranks over a modeled link "
              f"({args.link_gbps} GB/s, {args.link_latency_us:g} us), median of {args.steps} "
              f"steps" + (f", median of {rounds} rounds" if rounds > 1 else ""),
        rows=rows, columns=list(dict.fromkeys(k for r in rows for k in r)),
        params={**worker_args, "world_size": args.world_size, "link_gbps": args.link_gbps,
                "link_latency_us": args.link_latency_us, "rounds": rounds, "modes": modes,
                "link_heap": args.link_heap},
        extra={"rounds_raw": per_mode},
        notes=["t0_s: the step with a free link (T0); link_s: seconds per step the modeled "
               "link was busy (L); x_max: step_s / max(T0, L) (overlap's target: <= 1.25); "
               "x_serial: (T0 + L) / max(T0, L), what waiting for each collective where it is "
               "issued costs",
               "exposed_comm_s: seconds per step the training thread waited on collectives "
               "(with the link); exposed_comm_s_free: the same with the free link",
               "link_gbps auto: the step's wire bytes / T0, so that L = T0",
               "comm_link_s / copy_link_s: the collectives' link and the host<->device copies' "
               "link (each lane its own link of the same bandwidth; L is the busier); "
               "exposed_copy_s: seconds per step the training thread waited on the store "
               "(copies, and NVMe reads where there are any)"])
    report.emit(as_json=args.json, results_dir=args.results_dir, save=not args.no_save)
    return 0 if all("step_s" in r for r in rows) else 1
