"""The hardware ``infinity plan`` prices for: given on the command line, measured where cheap (RAM,
GPU memory, disk capacity, a direct-I/O probe), assumed otherwise; every figure's origin goes into
the plan's notes."""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import psutil
import torch

from infinity._common import GiB, MiB, format_bytes
from infinity.io import Swapper, aligned_empty
from infinity.ledger import GB, Hardware


def probe_disk_bandwidth(directory: str, nbytes: int = 256 * MiB) -> tuple[float, float, str]:
    """(read, write) bytes/s of ``directory``'s disk from one direct-I/O write and read back.

    Uses :class:`infinity.io.Swapper` (the engine's own I/O path). One large transfer: a rough
    figure, not a benchmark (``infinity bench io`` is that).
    """
    buf = aligned_empty(nbytes, torch.uint8, direct_io=True)  # as the engine's arena
    buf.fill_(7)
    with Swapper(directory) as swapper:
        start = time.perf_counter()
        swapper.swap_out("plan-probe", buf).wait()
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        swapper.swap_in("plan-probe", buf).wait()
        read_s = time.perf_counter() - start
        how = "infinity.io.Swapper" + (" (O_DIRECT)" if swapper.direct_io else " (buffered)")
    return nbytes / read_s, nbytes / write_s, how


def detect_hardware(args: argparse.Namespace) -> Hardware:
    """Hardware from the arguments, measuring what is cheap to measure and assuming the rest."""
    notes: list[str] = []
    cuda_count, cuda_memory = _cuda_devices() if args.gpu_memory_gb is None else (0, 0)
    gpus = args.gpus if args.gpus_given else (cuda_count or 1)
    shared = False
    if args.gpu_memory_gb is not None:
        device_memory = int(args.gpu_memory_gb * GiB)
    elif cuda_memory:
        device_memory = cuda_memory
        notes.append(f"GPU memory measured: {format_bytes(cuda_memory)} per device")
    else:
        device_memory, shared = psutil.virtual_memory().total, True
        notes.append("no GPU: the device tier is CPU memory, shared with the host tier")
    if args.host_memory_gb is not None:
        host_memory = int(args.host_memory_gb * GiB)
    else:
        host_memory = psutil.virtual_memory().total
        notes.append(f"host RAM measured: {format_bytes(host_memory)}")
    nvme_cap, nvme_r, nvme_w = _nvme(args, notes)
    per_node = min(args.gpus_per_node or min(gpus, 8), gpus)

    def figure(value: float | None, assumed: float, what: str) -> float:
        if value is not None:
            return value * GB
        notes.append(f"{what} assumed {assumed:g} GB/s (pass it to sharpen the time model)")
        return assumed * GB

    gpu = not shared
    link_default = (20.0 if per_node == gpus else 12.5) if gpu else 5.0
    flops = args.device_tflops * 1e12 if args.device_tflops else (100e12 if gpu else 0.1e12)
    if not args.device_tflops:
        notes.append(f"device FLOP rate assumed {flops / 1e12:g} TFLOP/s (--device-tflops)")
    return Hardware(
        gpus=gpus, gpus_per_node=per_node, device_memory_bytes=device_memory,
        host_memory_bytes=host_memory, nvme_capacity_bytes=nvme_cap, nvme_read_bytes_per_s=nvme_r,
        nvme_write_bytes_per_s=nvme_w, device_flops=flops,
        device_memory_bytes_per_s=figure(args.device_mem_gbs, 1000.0 if gpu else 10.0,
                                         "device memory bandwidth"),
        link_bytes_per_s=figure(args.link_gbs, link_default, "collective link bandwidth"),
        pcie_bytes_per_s=figure(args.pcie_gbs, 20.0 if gpu else 10.0, "host-device (PCIe) bandwidth"),
        host_memory_bytes_per_s=figure(args.host_mem_gbs, 50.0 if gpu else 10.0,
                                       "host memory bandwidth (CPU Adam)"),
        shared_device_host=shared, notes=tuple(notes))


def _cuda_devices() -> tuple[int, int]:
    if not torch.cuda.is_available():
        return 0, 0
    return torch.cuda.device_count(), torch.cuda.get_device_properties(0).total_memory


def _nvme(args: argparse.Namespace, notes: list[str]) -> tuple[int, float, float]:
    if args.no_nvme:
        return 0, 0.0, 0.0
    path = args.nvme_path or tempfile.gettempdir()
    if args.nvme_gb is not None:
        capacity = int(args.nvme_gb * GiB)
    else:
        capacity = shutil.disk_usage(path).free
        notes.append(f"NVMe capacity measured: {format_bytes(capacity)} free under {path}")
    if args.nvme_read_gbs is not None and args.nvme_write_gbs is not None:
        return capacity, args.nvme_read_gbs * GB, args.nvme_write_gbs * GB
    if args.no_probe:
        read, write = 2.0 * GB, 1.0 * GB
        notes.append("NVMe bandwidth assumed 2 GB/s read, 1 GB/s write (--no-probe)")
    else:
        try:
            read, write, how = probe_disk_bandwidth(path)
            notes.append(f"NVMe bandwidth measured under {path} with {how}: "
                         f"{read / GB:.2f} GB/s read, {write / GB:.2f} GB/s write")
        except (OSError, RuntimeError) as e:  # unwritable or full disk: plan on, say so
            read, write = 2.0 * GB, 1.0 * GB
            notes.append(f"NVMe bandwidth probe under {path} failed ({e}); assumed 2 GB/s read, "
                         "1 GB/s write")
    if args.nvme_read_gbs is not None:
        read = args.nvme_read_gbs * GB
    if args.nvme_write_gbs is not None:
        write = args.nvme_write_gbs * GB
    return capacity, read, write
