"""The offload roofline: no step runs faster than the slower of its compute and its disk traffic.

``roofline_s = max(cpu_s, disk_s)`` where

* ``disk_s``: the least time the disk takes to read and write the bytes the step moved to and from
  NVMe (``engine.stats()``), at the bandwidths probed with aligned direct I/O on the swap directory
  itself (:func:`probe_disk`, the raw probe of ``infinity bench io``): reads alone, writes alone,
  and both at once ([Note: the mixed disk roofline] in infinity/bench/io.py,
  :meth:`DiskBandwidth.seconds`);
* ``cpu_s = forward + backward of the model with its weights in memory + the Adam pass over every
  trainable element`` (:func:`gpt_compute_s`), measured per unit in the same run: one block's forward
  and backward times the number of blocks, plus the embedding, final norm and head, plus the fused CPU
  Adam kernel over one block's elements scaled to the model's trainable count. Measuring per unit is
  what makes the figure available for a model that does not fit in memory at all.

:func:`nvme_minimum_bytes` is the least traffic a step can have: every NVMe-resident byte read
once and every byte that changes written once.

Used by ``infinity train`` (and so ``infinity bench scale``), where ``cpu_s`` is measured per unit,
and by ``infinity bench step``, where it is the plain PyTorch mode's median step: both count a
step's bytes with :func:`nvme_moved_bytes` / :func:`nvme_per_step` and divide with :func:`roofline`.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Mapping, Sequence

import torch

# The disk probe lives with the raw probe it runs; re-exported here, where rooflines use it.
from infinity.bench.io import DiskBandwidth, probe_disk
from infinity.models.gpt import Block, GPTConfig
from infinity.optim import adam_kernel_for

def _median_s(fn, repeats: int, device: torch.device = torch.device("cpu")) -> float:
    """Median seconds of ``fn`` on ``device`` (a GPU's work waited for: launches return early)."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm-up: first-touch of the activations, kernel selection
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gpt_compute_s(config: GPTConfig, *, batch_size: int, seq_len: int, dtype: torch.dtype,
                  trainable_numel: int | None = None, repeats: int = 3,
                  device: torch.device | str = "cpu",
                  optimizer_device: torch.device | str | None = None,
                  checkpointing: bool = False) -> dict[str, float]:
    """Seconds of compute in one step of :class:`~infinity.models.gpt.GPT` ``config`` with its
    weights in memory, measured per unit (see the module docstring): ``forward_backward_s`` on
    ``device`` (the engine's: a GPU run's roofline is the GPU's compute, not the CPU's),
    ``adam_s`` on ``optimizer_device`` (default ``device``; the host for an offloaded optimizer)
    and their sum ``cpu_s`` (the name kept: the compute side of the roofline); the forward and
    backward apart too (``forward_s``, ``backward_s``: the backward with its recompute), for
    [Note: the staging bound].
    ``trainable_numel`` defaults to every parameter. ``checkpointing``: every block runs its
    forward once more in the backward (activation checkpointing's recompute)."""
    torch.manual_seed(0)
    device = torch.device(device)
    opt_device = device if optimizer_device is None else torch.device(optimizer_device)
    block_s, block_forward_s, block_numel = _block_s(config, batch_size=batch_size,
                                                     seq_len=seq_len, dtype=dtype,
                                                     repeats=repeats, device=device,
                                                     checkpointing=checkpointing)
    ends_s, ends_forward_s = _ends_s(config, batch_size=batch_size, seq_len=seq_len, dtype=dtype,
                                     repeats=repeats, device=device)
    forward_backward_s = config.n_layer * block_s + ends_s
    forward_s = min(config.n_layer * block_forward_s + ends_forward_s, forward_backward_s)
    numel = config.num_params if trainable_numel is None else trainable_numel
    adam_s = _adam_s(numel, min(numel, block_numel), dtype=dtype, repeats=repeats,
                     device=opt_device)
    return {"forward_backward_s": forward_backward_s, "forward_s": forward_s,
            "backward_s": forward_backward_s - forward_s, "adam_s": adam_s,
            "cpu_s": forward_backward_s + adam_s}


def _block_s(config: GPTConfig, *, batch_size: int, seq_len: int, dtype: torch.dtype,
             repeats: int, device: torch.device, checkpointing: bool
             ) -> tuple[float, float, int]:
    """One block's forward + backward (with its recompute when ``checkpointing``), its forward
    alone, and its parameter count."""
    block = Block(config).to(device=device, dtype=dtype)
    block_numel = sum(p.numel() for p in block.parameters())
    x = torch.randn(batch_size, seq_len, config.n_embd, dtype=dtype, device=device,
                    requires_grad=True)

    def block_step() -> None:
        if checkpointing:
            with torch.no_grad():
                block(x)
        block(x).float().sum().backward()

    block_s = _median_s(block_step, repeats, device)
    block_forward_s = _median_s(lambda: block(x), repeats, device)  # the graph built, not used
    return block_s, block_forward_s, block_numel


def _ends_s(config: GPTConfig, *, batch_size: int, seq_len: int, dtype: torch.dtype,
            repeats: int, device: torch.device) -> tuple[float, float]:
    """Embedding, final norm and head (tied or not, the matmul is the same), and the loss:
    forward + backward, and forward alone."""
    d = config.n_embd
    wte = torch.nn.Embedding(config.vocab_size, d).to(device=device, dtype=dtype)
    ln_f = torch.nn.LayerNorm(d).to(device=device, dtype=dtype)
    idx = torch.randint(0, config.vocab_size, (batch_size, seq_len), device=device)

    def ends_forward() -> torch.Tensor:
        h = wte(idx)
        logits = torch.nn.functional.linear(ln_f(h), wte.weight)
        return torch.nn.functional.cross_entropy(logits.float().view(-1, config.vocab_size),
                                                 idx.view(-1))

    ends_s = _median_s(lambda: ends_forward().backward(), repeats, device)
    return ends_s, _median_s(ends_forward, repeats, device)


def _adam_s(numel: int, chunk: int, *, dtype: torch.dtype, repeats: int,
            device: torch.device) -> float:
    """The engine's Adam over ``numel`` elements, timed on a ``chunk`` of them and scaled."""
    master, grad = (torch.randn(chunk, device=device) for _ in range(2))
    m, v = (torch.zeros(chunk, device=device) for _ in range(2))
    out = (torch.empty(chunk, dtype=dtype, device=device) if dtype != torch.float32
           else None)
    kernel = adam_kernel_for(device)  # the engine's: the CPU kernel, or the device's step

    def adam() -> None:
        kernel(master, grad, m, v, step=1, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
               weight_decay=0.01, out=out)

    return _median_s(adam, repeats, device) * numel / max(chunk, 1)


def nvme_moved_bytes(before: Mapping[str, int], after: Mapping[str, int]) -> tuple[int, int]:
    """NVMe bytes (read, written) between two ``engine.stats()["bytes_moved"]`` samples."""
    return (after.get("NVME->HOST", 0) - before.get("NVME->HOST", 0),
            after.get("HOST->NVME", 0) - before.get("HOST->NVME", 0))


def steady_steps(per_step: Sequence[Any]) -> Sequence[Any]:
    """[Note: the steady steps] The steps of a run that stand for its steady state: all but the
    first (it reads what set-up left cold, and no deferred update overlaps its forward) and the
    last (``engine.finish_step`` runs its deferred update with no forward to hide behind), where
    that leaves any. A run's median step and median bytes per step are both taken over these, so
    that the roofline's ratio divides a step by its own bytes: the 3.3B row's five steps took
    45.7 (cold), 51.3, 38.7, 35.9 and 50.7 s (with the final update: 79 GB read, not 49), and
    the median of all five was the cold step's. The mean over every step stays beside it: the
    throughput of the whole run, cold start and final update included."""
    if len(per_step) >= 3:
        return per_step[1:-1]
    return per_step[1:] if len(per_step) == 2 else per_step


def nvme_per_step(step_moved: Sequence[tuple[int, int]], stats: Mapping[str, Any], *,
                  warm: bool = False, activation_bytes: int = 0) -> dict[str, Any]:
    """Median NVMe bytes per step over the :func:`steady_steps` of ``step_moved`` ((read,
    written) per step; ``warm``: over every one, steps timed after a warm-up), against the least
    a step can move (:func:`nvme_minimum_bytes` of ``stats``, with ``activation_bytes`` saved to
    NVMe per step)."""
    steady = step_moved if warm else steady_steps(step_moved)
    least = nvme_minimum_bytes(stats, activation_bytes=activation_bytes)
    read = statistics.median(r for r, _ in steady) if steady else 0
    write = statistics.median(w for _, w in steady) if steady else 0
    # The mean over every step, the cold one included: a deferred update may run across a step
    # boundary (its first part in one step, the rest in the next), so a median of few steps can
    # take one and a half updates or half of one; the sum over the steps holds each update once.
    n = max(1, len(step_moved))
    mean_read = sum(r for r, _ in step_moved) / n
    mean_write = sum(w for _, w in step_moved) / n
    total_least = max(1, least["read_bytes"] + least["write_bytes"])
    return {"read_bytes": read, "write_bytes": write, "minimum_read_bytes": least["read_bytes"],
            "minimum_write_bytes": least["write_bytes"],
            "x_minimum": (read + write) / total_least,
            "mean_read_bytes": mean_read, "mean_write_bytes": mean_write,
            "x_minimum_mean": (mean_read + mean_write) / total_least}


def nvme_minimum_bytes(stats: Mapping[str, Any], *, activation_bytes: int = 0) -> dict[str, int]:
    """The least NVMe traffic of one step: every NVMe-resident byte read once and written once
    (``engine.stats()["bytes"]["NVME"]``: parameter shards, optimizer state, gradients on NVMe),
    and the step's ``activation_bytes`` saved to NVMe written once and read once ([Note: saved
    activations are shards of the store] in infinity/zero/_stored_activations.py)."""
    nvme = int(stats["bytes"]["NVME"]["current"]) + int(activation_bytes)
    return {"read_bytes": nvme, "write_bytes": nvme}


def roofline(*, cpu_s: float, read_bytes: float, write_bytes: float,
             disk: DiskBandwidth | None, step_s: float | None = None) -> dict[str, float | str]:
    """The roofline of a step that moved ``read_bytes`` / ``write_bytes`` (see the module
    docstring), with its split and which side bounds it; with the step's measured ``step_s``,
    also ``x_roofline`` = step_s / roofline_s. ``disk`` may be None (not probed) only for a step
    that moved no NVMe bytes: its disk time is 0 at any bandwidth."""
    if disk is None:
        if read_bytes or write_bytes:
            raise ValueError(f"roofline: {read_bytes} bytes read and {write_bytes} written need "
                             f"the disk's bandwidth; pass disk=probe_disk(the swap directory)")
        read_s = write_s = 0.0
        disk_s = 0.0
    else:
        read_s = read_bytes / disk.read_bytes_per_s
        write_s = write_bytes / disk.write_bytes_per_s
        disk_s = disk.seconds(read_bytes, write_bytes)  # [Note: the mixed disk roofline]
    line: dict[str, float | str] = {
        "cpu_s": cpu_s, "disk_read_s": read_s, "disk_write_s": write_s, "disk_s": disk_s,
        "disk_serial_s": read_s + write_s,
        "roofline_s": max(cpu_s, disk_s), "bound": "disk" if disk_s >= cpu_s else "cpu"}
    if step_s is not None:
        line["x_roofline"] = step_s / max(max(cpu_s, disk_s), 1e-9)
    return line


OPTIMIZER_KINDS = ("opt", "grad")
"""The kinds of NVMe traffic (``nvme_bytes_by_kind``) that are the optimizer's: its sub-groups
and the gradient slices it reads ([Note: the staging bound]'s R and W)."""


def staging_bound(*, forward_s: float, backward_s: float, optimizer_s: float,
                  window_read_bytes: float, window_write_bytes: float, staging_room_bytes: float,
                  disk: DiskBandwidth, roofline_s: float,
                  step_s: float | None = None) -> dict[str, float]:
    """[Note: the staging bound] The least step time of an engine whose optimizer state lives on
    NVMe, when the host budget cannot stage the whole step's optimizer traffic.

    With exact global-norm clipping no update can start before the backward ends (the clip
    coefficient needs every gradient), and every parameter must be updated before the next
    forward reads it: all updates fall between the end of one backward and the end of the next
    forward. Their reads can start earlier, and their write-backs finish later, only through host
    memory: at most ``staging_room_bytes`` (the host budget less what is homed there for good:
    gradient accumulators, host-resident sub-groups) read ahead before the window, and as many
    left to write after it. The rest crosses the disk inside the window:

        window_disk_s = disk.seconds(max(0, R - H), max(0, W - H))

    (R, W: the optimizer's NVMe bytes per step, ``window_*_bytes``; H: the room; the least of
    one direction after the other and both at once, [Note: the mixed disk roofline]). The window
    holds the forward and the optimizer's compute; the backward lies outside it, so

        staging_bound_s = max(roofline_s, backward_s + max(forward_s + optimizer_s, window_disk_s))

    with plain PyTorch's phases as the compute (nothing computes faster than it). When the room
    holds the traffic the bound is the roofline; when it is short, no schedule, ours or anyone's,
    beats it. With ``step_s``, also ``x_staging_bound`` = step_s / the bound."""
    window = disk.seconds(max(0.0, window_read_bytes - staging_room_bytes),
                          max(0.0, window_write_bytes - staging_room_bytes))
    bound = max(roofline_s, backward_s + max(forward_s + optimizer_s, window))
    line = {"window_disk_s": window, "staging_room_bytes": float(staging_room_bytes),
            "staging_bound_s": bound}
    if step_s is not None:
        line["x_staging_bound"] = step_s / max(bound, 1e-9)
    return line


RNG_PROBE_NUMEL = 1 << 25
"""Elements of the random-fill probe (128 MiB of fp32): long enough to time, short to run."""


def init_roofline(*, random_numel: int, state_bytes: int, disk: DiskBandwidth,
                  init_s: float | None = None) -> dict[str, float]:
    """The least time of a lazy construction (issue #16): drawing the random values eager
    construction draws, once (``random_numel``, :attr:`infinity.zero.Recording.random_numel`, at
    the rate ``normal_`` fills fp32 here, measured now), plus writing ``state_bytes`` (the state
    NVMe holds after ``initialize``) at the probed write bandwidth. With ``init_s``, also
    ``init_x`` = init_s / that sum."""
    buf = torch.empty(RNG_PROBE_NUMEL)
    rate = RNG_PROBE_NUMEL / _median_s(lambda: buf.normal_(0.0, 0.02), 3)
    rng_s = random_numel / rate
    write_s = state_bytes / disk.write_bytes_per_s
    line = {"init_rng_s": rng_s, "init_write_s": write_s, "init_roofline_s": rng_s + write_s,
            "rng_numel_per_s": rate}
    if init_s is not None:
        line["init_x"] = init_s / max(rng_s + write_s, 1e-9)
    return line


__all__ = ["DiskBandwidth", "gpt_compute_s", "init_roofline", "nvme_minimum_bytes",
           "nvme_moved_bytes", "nvme_per_step", "OPTIMIZER_KINDS", "probe_disk", "roofline",
           "staging_bound", "steady_steps"]
