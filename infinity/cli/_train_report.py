"""``infinity train``'s summary as text: the tiers, the traffic, where the time went, the roofline.

The numbers are :func:`infinity.cli._train.run`'s summary (what ``--json`` prints); this module
only lays them out, section by section.
"""

from __future__ import annotations

from typing import Any

import psutil

from infinity._common import format_bytes
from infinity.bench.report import format_table


def print_summary(summary: dict[str, Any]) -> None:
    """Print ``summary`` for a reader: one section per question."""
    _print_header(summary)
    a = summary.get("activations")
    if a:
        _print_activations(a)
    _print_host_above_ledger(summary["tiers"]["HOST"])
    _print_traffic_and_time(summary)
    r = summary.get("roofline")
    if r:
        _print_roofline(r, summary)
    c = summary.get("resume_check")
    if c:
        _print_resume_check(c)


def _print_header(summary: dict[str, Any]) -> None:
    """The model, the loss, the step time, and the ledger against the measured tiers."""
    print(f"\nGPT {summary['model']}: {summary['num_params']:,} parameters, {summary['dtype']}, "
          f"offload {summary['offload']}; full training state "
          f"{format_bytes(summary['full_training_state_bytes'])}")
    print(f"loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f} over {summary['steps']} "
          f"steps; median step {summary['median_step_s']:.3f} s; wall {summary['wall_s']:.1f} s\n")
    rows = [{"tier": k, "ledger estimate": format_bytes(v["estimate_bytes"]),
             "measured peak": format_bytes(v["measured_peak_bytes"]),
             "budget": format_bytes(v["budget_bytes"]) if v.get("budget_bytes") else "-"}
            for k, v in summary["tiers"].items()]
    print(format_table(rows))


def _print_activations(a: dict[str, Any]) -> None:
    """The checkpointed blocks' saved inputs: the ledger's bytes beside what was saved."""
    m, led = a["measured"], a["ledger"]
    where = {"none": "kept on the device", "host": "in the host arena",
             "nvme": "on NVMe", "auto": "host arena, then NVMe"}[a["offload"]]
    line = (f"activations (checkpointed blocks' inputs, {where}): ledger "
            f"{format_bytes(led['stored_bytes'])} per micro-batch")
    if "saved_bytes_per_micro_batch" in m:
        line += (f", saved {format_bytes(m['saved_bytes_per_micro_batch'])}; peak held "
                 f"{format_bytes(m['host_peak_bytes'])} in the arena (inside the HOST row), "
                 f"{format_bytes(m['nvme_peak_bytes'])} on NVMe; per step written "
                 f"{format_bytes(m['nvme_written_bytes_per_step'])}, read back "
                 f"{format_bytes(m['nvme_read_bytes_per_step'])}")
    print(line)


def _print_host_above_ledger(host: dict[str, Any]) -> None:
    """What the HOST peak holds above the ledger's row, when it does."""
    if host.get("budget_bytes") and host["measured_peak_bytes"] > host["estimate_bytes"]:
        # The ledger's HOST row is the least the plan needs (homed state, staging); an 'auto'
        # budget leaves room above it that the store fills with evictable parameter copies and
        # the optimizer's read-ahead ([Note: ledger placement]): a policy, not a ledger term.
        above = host["measured_peak_bytes"] - host["estimate_bytes"]
        room = host["budget_bytes"] - host["estimate_bytes"]
        print(f"  HOST above the ledger: {format_bytes(above)} of cached copies and read-ahead, "
              f"within the budget's {format_bytes(room)} of room")


def _print_traffic_and_time(summary: dict[str, Any]) -> None:
    """The bytes moved, where the time went, peak memory and the NVMe bytes per step."""
    print()
    print(format_table([{"traffic": k, "bytes": format_bytes(v)}
                        for k, v in summary["bytes_moved"].items()]))
    t = summary["time"]
    print()
    print(format_table([
        {"where the time went": "training steps (total)", "seconds": t["steps_s"]},
        {"where the time went": "  of which optimizer step", "seconds": t["optimizer_step_s"]},
        {"where the time went": "  of which deferred updates (in the forward)",
         "seconds": t["optimizer_deferred_s"]},
        {"where the time went": "  of which stalled on data", "seconds": t["stall_s"]},
    ]))
    print(f"stall fraction {t['stall_fraction']:.1%}")
    print(f"init {summary['init_s']:.1f} s; peak RSS {format_bytes(summary['peak_rss_bytes'])} "
          f"({summary['peak_rss_bytes'] / psutil.virtual_memory().total:.1%} of RAM)")
    n = summary["nvme_per_step"]
    print(f"NVMe per step: read {format_bytes(n['read_bytes'])}, write {format_bytes(n['write_bytes'])}"
          f"; least {format_bytes(n['minimum_read_bytes'])} each way ({n['x_minimum']:.2f}x; "
          f"mean over every step {n['x_minimum_mean']:.2f}x)")


def _print_roofline(r: dict[str, Any], summary: dict[str, Any]) -> None:
    """The step against its roofline, the staging bound and the init roofline."""
    print()
    print(format_table([
        {"roofline": "compute: forward + backward (per unit)", "seconds": r["forward_backward_s"]},
        {"roofline": "compute: CPU Adam", "seconds": r["adam_s"]},
        {"roofline": "disk: read at the probed bandwidth", "seconds": r["disk_read_s"]},
        {"roofline": "disk: write at the probed bandwidth", "seconds": r["disk_write_s"]},
        {"roofline": "disk: the least of serial and both at once", "seconds": r["disk_s"]},
        {"roofline": f"roofline max(cpu, disk): {r['bound']}-bound", "seconds": r["roofline_s"]},
        {"roofline": "median step", "seconds": r["median_step_s"]},
    ]))
    print(f"step / roofline {r['x_roofline']:.2f}x (disk probed at "
          f"{r['disk_read_bytes_per_s'] / 1e9:.2f} GB/s read, "
          f"{r['disk_write_bytes_per_s'] / 1e9:.2f} GB/s write alone; "
          f"{(r['disk_mixed_read_bytes_per_s'] or 0) / 1e9:.2f} + "
          f"{(r['disk_mixed_write_bytes_per_s'] or 0) / 1e9:.2f} GB/s both at once); mean step "
          f"{summary['mean_step_s']:.2f} s / its roofline {r['mean']['x_roofline']:.2f}x")
    # [Note: the staging bound] in infinity/bench/roofline.py
    if "staging_bound_s" in r["mean"]:
        print(f"mean step / staging bound {r['mean']['x_staging_bound']:.2f}x (with exact "
              f"clipping the updates fall between a backward's end and the next forward's; "
              f"the host stages {format_bytes(r['mean']['staging_room_bytes'])} of their NVMe "
              f"traffic outside that window: bound {r['mean']['staging_bound_s']:.2f} s)")
    print(f"init / (random values once {r['init_rng_s']:.1f} s + state written "
          f"{r['init_write_s']:.1f} s) = {r['init_x']:.2f}x")


def _print_resume_check(c: dict[str, Any]) -> None:
    """Whether the steps resumed from a checkpoint were bitwise those of the run."""
    print()
    if "refused" in c:
        print(f"resume check: the save was refused before writing anything: {c['refused']}")
    elif "bitwise_equal" in c:
        print(f"resume check: checkpoint of {format_bytes(c['checkpoint_bytes'])} saved in "
              f"{c['save_s']:.1f} s after micro-step {c['save_after_micro_steps']}, loaded in "
              f"{c['load_s']:.1f} s; the resumed steps are "
              f"{'bitwise equal' if c['bitwise_equal'] else 'DIFFERENT'} "
              f"(losses {c['resumed_losses']}, masters sha256 {c['resumed_masters_sha256'][:12]}; "
              f"{c['kernels']})")
