"""DeepSpeed ZeRO-Infinity anchor for the 1B row of ``infinity bench scale`` (issue #16).

Runs DeepSpeed ZeRO-3 with parameters *and* optimizer state on NVMe (``offload_param: nvme``,
``offload_optimizer: nvme``, libaio) on the GPT of ``gpt_for_params(N)`` from infinity/models/gpt.py
(plain PyTorch, loaded by path, so nothing of infinity is imported), built under
``deepspeed.zero.Init(remote_device="nvme")`` so host memory never holds the whole model's parameters
(DeepSpeed still allocates an fp32 gradient buffer of the whole model, 4 B/param, in host memory:
``grad_partitions_flat_buffer`` in deepspeed/runtime/zero/stage3.py). bf16 with
fp32 masters and moments, AdamW (DeepSpeedCPUAdam), gradient clipping 1.0, synthetic batches
(``gpt.synthetic_batch``), batch 1 x 64, 3 steps: the same row as

    infinity train --params 1e9 --data synthetic --steps 3 --batch-size 1 --seq-len 64 \
        --dtype bf16 --host-budget 4GiB

Prints one JSON line: peak RSS (VmHWM; also per phase, by resetting VmHWM through /proc/self/clear_refs
and keeping the running maximum), init time (zero.Init construction + deepspeed.initialize),
per-step times and their median, the bytes of DeepSpeed's swap files on disk, the disk bytes the
process read and wrote per step (/proc/self/io), and the exact DeepSpeed config it ran with.
The swap directory is removed at the end (also on failure).

Reproduce (scratch venv, CPU-only torch; the aio and cpu_adam ops JIT-build on first use, which took
~16 min for async_io (DeepSpeed builds it at -O0) and ~3 min for cpu_adam on 2 busy cores):

    python3 -m venv /work/dsvenv
    /work/dsvenv/bin/pip install torch==2.13.0 numpy deepspeed==0.19.8
    apt-get install -y libaio-dev            # so DeepSpeed's async_io op builds (check ds_report)
    DS_ACCELERATOR=cpu /work/dsvenv/bin/python benchmarks/ds_scale_anchor.py --params 1e8
    DS_ACCELERATOR=cpu /work/dsvenv/bin/python benchmarks/ds_scale_anchor.py --params 1e9 \
        --out benchmarks/results/ds-anchor-1b.json

The defaults of the knobs below are the settings this anchor needed (found by running it; see
benchmarks/results/ds-anchor-*.json, "tuning_log"); ``--deepspeed-defaults`` drops every knob back to
DeepSpeed's own default to see the errors again:

    ... ds_scale_anchor.py --params 1e8 --deepspeed-defaults --max-in-cpu 0
        # AssertionError: Not enough buffers 0 for swapping 1   (fixed by --max-reuse-distance 0)
    ... ds_scale_anchor.py --params 1e8 --buffer-size 2e7
        # AssertionError: More elements 24576000 than buffer size 20000000   (at zero.Init)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import time
import traceback

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for _key, _value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29534", "RANK": "0",
                     "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_SIZE": "1"}.items():
    os.environ.setdefault(_key, _value)

HERE = os.path.dirname(os.path.abspath(__file__))
GPT_FILE = os.path.join(HERE, "..", "infinity", "models", "gpt.py")
DEFAULT_DIR = "/work/main/infinity-data/ds-anchor"


def _load_gpt():
    spec = importlib.util.spec_from_file_location("gpt", GPT_FILE)
    gpt = importlib.util.module_from_spec(spec)
    sys.modules["gpt"] = gpt  # dataclasses look their module up here
    spec.loader.exec_module(gpt)
    return gpt


def _status(field: str) -> int:
    """A /proc/self/status memory field (VmHWM, VmRSS) in bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return -1


class _Peaks:
    """Peak RSS per phase: read VmHWM, then reset it (``echo 5 > /proc/self/clear_refs``), keeping the
    running maximum so the whole-process peak stays exact."""

    def __init__(self) -> None:
        self.overall = 0
        self.can_reset = True

    def phase(self) -> int:
        peak = _status("VmHWM")
        self.overall = max(self.overall, peak)
        if self.can_reset:
            try:
                with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                    f.write("5")
            except OSError:
                self.can_reset = False
        return peak


def _proc_io() -> dict[str, int]:
    """Disk bytes of the whole process (all threads): read_bytes / write_bytes reach the block layer."""
    out = {}
    with open("/proc/self/io", encoding="ascii") as f:
        for line in f:
            key, value = line.split(":")
            out[key.strip()] = int(value)
    return out


def _dir_bytes(path: str) -> dict[str, int]:
    size = blocks = files = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            try:
                st = os.stat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            size += st.st_size
            blocks += st.st_blocks * 512
            files += 1
    return {"files": files, "apparent_bytes": size, "allocated_bytes": blocks}


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=1e9, help="model size for gpt_for_params (1e9)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dir", default=DEFAULT_DIR, help=f"swap directory ({DEFAULT_DIR})")
    p.add_argument("--out", help="also write the JSON record here")
    p.add_argument("--note", action="append", default=[], help="free text kept in the record")
    p.add_argument("--deepspeed-defaults", action="store_true",
                   help="use DeepSpeed's default for every knob below (to reproduce the errors)")
    k = p.add_argument_group("DeepSpeed knobs (defaults: what this anchor needed)")
    # offload_param (DeepSpeed defaults: buffer_count 5, buffer_size 1e8, max_in_cpu 1e9)
    k.add_argument("--buffer-count", type=int, default=None, help="offload_param.buffer_count")
    k.add_argument("--buffer-size", type=float, default=None, help="offload_param.buffer_size (elements)")
    k.add_argument("--max-in-cpu", type=float, default=None, help="offload_param.max_in_cpu (elements)")
    # offload_optimizer (DeepSpeed default buffer_count 4)
    k.add_argument("--opt-buffer-count", type=int, default=None, help="offload_optimizer.buffer_count")
    k.add_argument("--pipeline", action="store_true", help="offload_optimizer.pipeline_read/write")
    # zero_optimization
    k.add_argument("--sub-group-size", type=float, default=None, help="sub_group_size (default 1e9)")
    k.add_argument("--prefetch-bucket-size", type=float, default=None,
                   help="stage3_prefetch_bucket_size (default 5e7)")
    k.add_argument("--max-live-parameters", type=float, default=None,
                   help="stage3_max_live_parameters (default 1e9)")
    k.add_argument("--max-reuse-distance", type=float, default=None,
                   help="stage3_max_reuse_distance (default 1e9)")
    k.add_argument("--param-persistence-threshold", type=float, default=None,
                   help="stage3_param_persistence_threshold (default 1e5)")
    k.add_argument("--reduce-bucket-size", type=float, default=None, help="reduce_bucket_size (default 5e8)")
    # aio (DeepSpeed defaults: block_size 1 MiB, queue_depth 8, intra_op_parallelism 1)
    k.add_argument("--aio-block-size", type=int, default=None)
    k.add_argument("--aio-queue-depth", type=int, default=None)
    k.add_argument("--aio-threads", type=int, default=None, help="aio.intra_op_parallelism")
    return p.parse_args()


# What this anchor needed (filled in from the tuning runs; None = DeepSpeed's default).
NEEDED: dict[str, float | int | None] = {
    # Keep no parameter permanently in host memory: DeepSpeed's default (1e9 elements) pulls every
    # parameter of a <= 1e9-element model "permanently to CPU", so nothing would page from NVMe.
    "max_in_cpu": 0,
    # >= the largest parameter (the 32000 x d embedding / head: 57,344,000 elements at 1B), else
    # zero.Init fails with "More elements N than buffer size B".
    "buffer_size": 6e7,
    "buffer_count": None,  # DeepSpeed's 5 (2 was enough at 1e8 once max_reuse_distance is 0)
    # Release every parameter after use: with the default (1e9 elements, more than the model) all
    # parameters reused in backward stay gathered and hold their swap buffer, and the forward of
    # step 1 fails with "Not enough buffers 0 for swapping 1" unless buffer_count covers the model.
    "max_reuse_distance": 0,
    # The optimizer swapper allocates buffer_count (4) fp32 buffers of the largest sub-group; with
    # the default 1e9 that is 4 x 4 B x ~1e9 = 16 GB of host memory at 1B.
    "sub_group_size": 5e7,
    "opt_buffer_count": None,
    "max_live_parameters": None,
    "prefetch_bucket_size": None,
    "param_persistence_threshold": None,
    # Not needed to run; a memory knob: the default bucket (5e8 elements) takes the whole model's
    # bf16 gradients in one go, and backward's peak RSS grows with it (1e8 model: 3.03 -> 2.67 GiB).
    "reduce_bucket_size": 5e7,
    "aio_block_size": None,
    "aio_queue_depth": None,
    "aio_threads": None,
}


def _knob(args: argparse.Namespace, name: str):
    value = getattr(args, name)
    if value is None and not args.deepspeed_defaults:
        value = NEEDED[name]
    return None if value is None else int(value)


def build_config(args: argparse.Namespace, path: str) -> dict:
    offload_param = {"device": "nvme", "nvme_path": path, "pin_memory": False}
    for key, name in (("buffer_count", "buffer_count"), ("buffer_size", "buffer_size"),
                      ("max_in_cpu", "max_in_cpu")):
        if (v := _knob(args, name)) is not None:
            offload_param[key] = v
    offload_optimizer = {"device": "nvme", "nvme_path": path, "pin_memory": False}
    if (v := _knob(args, "opt_buffer_count")) is not None:
        offload_optimizer["buffer_count"] = v
    if args.pipeline:
        offload_optimizer["pipeline_read"] = offload_optimizer["pipeline_write"] = True
    zero = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
            "offload_param": offload_param, "offload_optimizer": offload_optimizer}
    for key, name in (("sub_group_size", "sub_group_size"),
                      ("stage3_prefetch_bucket_size", "prefetch_bucket_size"),
                      ("stage3_max_live_parameters", "max_live_parameters"),
                      ("stage3_max_reuse_distance", "max_reuse_distance"),
                      ("stage3_param_persistence_threshold", "param_persistence_threshold"),
                      ("reduce_bucket_size", "reduce_bucket_size")):
        if (v := _knob(args, name)) is not None:
            zero[key] = v
    aio = {}
    for key, name in (("block_size", "aio_block_size"), ("queue_depth", "aio_queue_depth"),
                      ("intra_op_parallelism", "aio_threads")):
        if (v := _knob(args, name)) is not None:
            aio[key] = v
    config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if aio:
        config["aio"] = aio
    return config


def main() -> int:
    args = _parse()
    gpt = _load_gpt()
    cfg = gpt.gpt_for_params(args.params)
    path = os.path.abspath(args.dir)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, exist_ok=True)
    config = build_config(args, path)
    record: dict = {
        "what": "DeepSpeed ZeRO-3, offload_param + offload_optimizer on NVMe, zero.Init(remote_device=nvme)",
        "argv": sys.argv, "params_requested": args.params,
        "model": {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_head": cfg.n_head,
                  "vocab_size": cfg.vocab_size, "block_size": cfg.block_size,
                  "tie_weights": cfg.tie_weights, "num_params": cfg.num_params},
        "batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps, "dtype": "bf16",
        "swap_dir": path, "config": config, "notes": args.note,
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "ok": False,
    }
    try:
        import deepspeed
        import torch

        record["deepspeed"] = deepspeed.__version__
        record["torch"] = torch.__version__
        torch.manual_seed(0)
        peaks = _Peaks()
        record["peak_rss_import_bytes"] = peaks.phase()
        deepspeed.init_distributed(dist_backend="gloo")
        t0 = time.perf_counter()
        with deepspeed.zero.Init(config_dict_or_path=config, remote_device="nvme", pin_memory=False,
                                 dtype=torch.bfloat16):
            model = gpt.GPT(cfg)
        t1 = time.perf_counter()
        record["rss_after_construct_bytes"] = _status("VmRSS")
        record["peak_rss_construct_bytes"] = peaks.phase()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        t2 = time.perf_counter()
        record["construct_s"] = t1 - t0
        record["initialize_s"] = t2 - t1
        record["init_s"] = t2 - t0
        record["rss_after_init_bytes"] = _status("VmRSS")
        record["peak_rss_initialize_bytes"] = peaks.phase()
        record["peak_rss_through_init_bytes"] = peaks.overall
        record["swap_after_init"] = _dir_bytes(path)
        print(f"init {t2 - t0:.1f} s (construct {t1 - t0:.1f}, initialize {t2 - t1:.1f}); "
              f"peak RSS {peaks.overall / 2**30:.2f} GiB", file=sys.stderr, flush=True)
        steps = []
        for i in range(args.steps):
            x, y = gpt.synthetic_batch(cfg, args.batch_size, args.seq_len, seed=i)
            io0 = _proc_io()
            s0 = time.perf_counter()
            loss = engine(x, y)
            s1 = time.perf_counter()
            pf = peaks.phase()
            engine.backward(loss)
            s2 = time.perf_counter()
            pb = peaks.phase()
            engine.step()
            s3 = time.perf_counter()
            io1 = _proc_io()
            po = peaks.phase()
            steps.append({"step_s": s3 - s0, "forward_s": s1 - s0, "backward_s": s2 - s1, "optimizer_s": s3 - s2,
                          "loss": loss.item(),
                          "disk_read_bytes": io1["read_bytes"] - io0["read_bytes"],
                          "disk_write_bytes": io1["write_bytes"] - io0["write_bytes"],
                          "rchar": io1["rchar"] - io0["rchar"], "wchar": io1["wchar"] - io0["wchar"],
                          "rss_bytes": _status("VmRSS"), "peak_rss_forward_bytes": pf,
                          "peak_rss_backward_bytes": pb, "peak_rss_optimizer_bytes": po})
            print(f"step {i}: {s3 - s0:.1f} s loss {loss.item():.4f} read "
                  f"{steps[-1]['disk_read_bytes'] / 1e9:.2f} GB write {steps[-1]['disk_write_bytes'] / 1e9:.2f} GB",
                  file=sys.stderr, flush=True)
        record["steps_detail"] = steps
        record["step_times_s"] = [s["step_s"] for s in steps]
        record["median_step_s"] = statistics.median(record["step_times_s"])
        record["median_disk_read_bytes_per_step"] = statistics.median(s["disk_read_bytes"] for s in steps)
        record["median_disk_write_bytes_per_step"] = statistics.median(s["disk_write_bytes"] for s in steps)
        record["swap_after_steps"] = _dir_bytes(path)
        record["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - the failure is the record
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()[-6000:]
        try:
            record["swap_at_failure"] = _dir_bytes(path)
        except OSError:
            pass
    finally:
        try:
            record["peak_rss_bytes"] = max(peaks.overall, _status("VmHWM"))
            record["peak_rss_per_phase_exact"] = peaks.can_reset
        except NameError:  # failed before the first phase
            record["peak_rss_bytes"] = _status("VmHWM")
        shutil.rmtree(path, ignore_errors=True)
        record["swap_removed"] = not os.path.exists(path)
    line = json.dumps(record)
    print(line, flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
