"""``infinity bench step``'s roofline columns: each mode's NVMe bytes against the disk and plain.

The formula and its functions are :mod:`infinity.bench.roofline`'s (the same ``infinity train``
and ``infinity bench scale`` use); this module reads a mode's record, probes the disk once per
run, and writes the columns and notes of :mod:`infinity.bench.step`'s table (its module
docstring says what each column means).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the module imports no torch until run
    from infinity.bench.roofline import DiskBandwidth

DS_MEMORY_MODES = ("ds-stage3", "ds-stage3-cpu")
"""DeepSpeed modes that touch no NVMe (its worker counts no bytes: ds-stage3-nvme's are unknown)."""


def disk_bandwidth(results: list[dict[str, Any]], directory: str
                    ) -> tuple[DiskBandwidth | None, str | None]:
    """The raw direct-I/O bandwidths of ``directory`` and an error message: probed once, after
    every mode has finished (nothing else of this run is on the disk then); (None, None) when no
    mode moved NVMe bytes (a disk time of 0 needs no bandwidth). A failed probe is reported, not
    raised: the modes' own figures stand without it."""
    from infinity.bench.roofline import probe_disk  # deferred: imports torch

    if not any(sum(_nvme_bytes(r) or (0, 0)) for r in results):
        return None, None
    path = os.path.abspath(directory)
    existed = os.path.isdir(path)  # the NVMe modes remove their swap files (and the folder)
    try:
        return probe_disk(path), None
    except OSError as e:
        return None, f"disk probe of {path} failed: {e}"
    finally:
        if not existed:
            try:
                os.rmdir(path)
            except OSError:
                pass


def _nvme_bytes(r: dict[str, Any]) -> tuple[int, int] | None:
    """A record's NVMe bytes (read, written) per timed step; None where they are unknown (an
    error, or DeepSpeed's NVMe mode: its worker counts none)."""
    if "error" in r:
        return None
    moved = r.get("nvme_per_step")
    if moved is None:
        return (0, 0) if r["mode"] in DS_MEMORY_MODES else None
    return moved["read_bytes"], moved["write_bytes"]


def roofline_columns(r: dict[str, Any], plain: dict[str, Any] | None,
                      disk: DiskBandwidth | None) -> dict[str, Any]:
    """The row's roofline (issue #16): its NVMe bytes per step, disk_s at the probed bandwidths,
    cpu_s, roofline_s = max(cpu_s, disk_s), the bound and x_roofline = step_s / roofline_s, by
    :func:`infinity.bench.roofline.roofline` (the formula ``infinity train`` uses)."""
    from infinity.bench.roofline import roofline, staging_bound  # deferred: imports torch

    moved = _nvme_bytes(r)
    if moved is None:
        return {}
    read, write = moved
    cols: dict[str, Any] = {"nvme_read_mib_per_step": read / 2**20,
                            "nvme_write_mib_per_step": write / 2**20}
    acts = r.get("activations_per_step")
    if acts:  # [Note: saved activations are shards of the store]: their share of those bytes
        cols |= {"act_nvme_read_mib_per_step": acts["nvme_read_bytes"] / 2**20,
                 "act_nvme_write_mib_per_step": acts["nvme_written_bytes"] / 2**20}
    threads = {"io_threads_cpu_s": r.get("io_threads_cpu_s")}  # the last column
    if disk is not None and (read or write):  # [GPU-proxy row]: the step against its disk time
        cols["x_disk"] = r["step_s"] / disk.seconds(read, write)
    if plain is None or (disk is None and (read or write)):
        return cols | threads  # no CPU time to divide by, or no bandwidth (the probe failed)
    # CPU time: plain PyTorch's median step. It is this very model's forward, backward and
    # optimizer step with every weight in memory, on the same batches and threads, measured in
    # the same run; infinity train's per-unit estimate (gpt_compute_s) exists for models that do
    # not fit in memory, which a bench step model always does (plain ran it). On a GPU machine
    # plain computes on the GPU, so there "cpu_s" is the compute side of the roofline all the same.
    line = roofline(cpu_s=plain["step_s"], read_bytes=read, write_bytes=write, disk=disk,
                    step_s=r["step_s"])
    cols |= {k: line[k] for k in ("disk_s", "cpu_s", "roofline_s", "bound", "x_roofline")}
    staging, phases = r.get("staging"), plain.get("phase_s")
    if staging and phases and disk is not None and staging["window_read_bytes"]:
        # The optimizer on NVMe: what the host budget lets the disk do outside the update window.
        bound = staging_bound(forward_s=phases["forward"], backward_s=phases["backward"],
                              optimizer_s=phases["optimizer"], disk=disk,
                              roofline_s=line["roofline_s"], step_s=r["step_s"],
                              window_read_bytes=staging["window_read_bytes"],
                              window_write_bytes=staging["window_write_bytes"],
                              staging_room_bytes=staging["staging_room_bytes"])
        cols |= {k: bound[k] for k in ("staging_bound_s", "x_staging_bound")}
    return cols | threads


def disk_record(disk: DiskBandwidth | None, error: str | None) -> dict[str, Any] | None:
    if disk is None:
        return {"error": error} if error else None
    return {"read_bytes_per_s": disk.read_bytes_per_s, "write_bytes_per_s": disk.write_bytes_per_s,
            "mixed_read_bytes_per_s": disk.mixed_read_bytes_per_s,
            "mixed_write_bytes_per_s": disk.mixed_write_bytes_per_s, "direct_io": disk.direct}


def _mixed_words(disk: DiskBandwidth) -> str:
    if not (disk.mixed_read_bytes_per_s and disk.mixed_write_bytes_per_s):
        return "both at once not probed"
    return (f"{disk.mixed_read_bytes_per_s / 1e9:.2f} read + "
            f"{disk.mixed_write_bytes_per_s / 1e9:.2f} write GB/s both at once")


def roofline_notes(disk: DiskBandwidth | None, error: str | None, plain: dict[str, Any] | None) -> list[str]:
    probed = (f"{disk.read_bytes_per_s / 1e9:.2f} GB/s read, {disk.write_bytes_per_s / 1e9:.2f} "
              f"GB/s write alone, {_mixed_words(disk)}"
              f"{'' if disk.direct else ' (buffered: O_DIRECT refused)'}, raw probe of "
              f"--dir in this run" if disk is not None else
              error or "not probed: no mode moved NVMe bytes")
    return ["x_roofline: step_s / roofline_s, roofline_s = max(cpu_s, disk_s); cpu_s: plain "
            "PyTorch's median step (everything in memory); disk_s: the least time the disk reads "
            "and writes a step's NVMe bytes, one direction after the other or both at once "
            f"(the mixed disk roofline) ({probed})"
            + ("" if plain else "; no roofline without the plain mode: add plain to --modes"),
            "x_staging_bound: step_s / staging_bound_s (optimizer on NVMe): with exact clipping "
            "every update falls between the end of a backward and the end of the next forward, "
            "and the host budget stages only so much of the optimizer's NVMe traffic outside that "
            "window; staging_bound_s = max(roofline_s, plain backward + max(plain forward + "
            "optimizer, the disk's least time for R - H read and W - H written, as disk_s)), R, W "
            "the optimizer's NVMe bytes per step, H the host budget less its homed bytes "
            "([Note: the staging bound] in infinity/bench/roofline.py)",
            "io_threads_cpu_s: CPU seconds per step of the engine's own threads (swapper I/O, "
            "store copies), CPU the compute does not get"]
