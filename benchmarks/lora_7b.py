"""Issue #16, scenario 2: LoRA on a 7B Llama with the frozen bf16 base on NVMe, side by side with
plain PyTorch + peft holding the whole bf16 model in RAM.

Reproduce (about 15 minutes here; 13.5 GB base checkpoint + 13.5 GB of swap under --dir):

    .venv/bin/python benchmarks/lora_7b.py                 # Llama-2-7B's shape, 4 steps
    .venv/bin/python benchmarks/lora_7b.py --shape tiny    # the same flow in seconds
    .venv/bin/python benchmarks/lora_7b.py --shape 7b-8l --host-budget 2GiB --dir ./infinity-data/lora7b8l
                                                           # 8 of 7B's layers, streamed: ~4 min

1. Once: a sharded safetensors checkpoint of the shape with random bf16 weights (``--dir/base``,
   one file per decoder layer, HF's index), and the adapters' initial values
   (``--dir/adapter_init.safetensors``), so that both runs start from the same weights.
2. plain, in its own process: ``LlamaForCausalLM.from_pretrained(base, dtype=bf16)``, LoRA r 16 on
   q/k/v/o with peft, the initial adapters copied in, ``torch.optim.AdamW`` over the adapters,
   clipping 1.0, batch 1 x 128.
3. ours, in its own process: the model built under ``infinity.init`` (LoRA included), the base
   loaded into NVMe-homed shards (``load_base_weights``), the same adapters, the engine's AdamW,
   the same batches.
Each child reports its peak RSS (VmHWM, whole process), its step times and losses; ours also its
NVMe bytes per step and a raw direct-I/O probe of the swap directory just before and after its
steps. Printed: the median step of each, the ratio ours / plain, the largest loss difference, the
peak RSS of ours against 25% of RAM, and ours against the roofline max(plain step, NVMe bytes /
probed bandwidth) (the disk's speed drifts 2x between hours here: the roofline says whether a slow
run was the disk's or ours); written to benchmarks/results/lora7b-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import psutil
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))

from finetune_lora import SHAPES, batches  # noqa: E402 (the example's shapes and data)

from infinity.bench.report import peak_rss_bytes  # noqa: E402 (VmHWM of this process)

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _lora(rank: int):
    from peft import LoraConfig
    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS)


def make_inputs(shape: str, out_dir: str, rank: int) -> tuple[str, str]:
    """The base checkpoint and the adapters' initial values (made once; reused when present)."""
    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from infinity.io import write_safetensors

    base = os.path.join(out_dir, "base")
    adapters = os.path.join(out_dir, "adapter_init.safetensors")
    index = os.path.join(base, "model.safetensors.index.json")
    config = LlamaConfig(**SHAPES[shape])
    if not os.path.exists(index):
        os.makedirs(base, exist_ok=True)
        config.save_pretrained(base)
        with torch.device("meta"):
            meta = LlamaForCausalLM(config)
        files: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for name, p in meta.named_parameters():  # one file per decoder layer, one for the ends
            parts = name.split(".")
            stem = f"layer{int(parts[2]):03d}" if parts[1] == "layers" else "ends"
            files.setdefault(f"model-{stem}.safetensors", []).append((name, p))
        g = torch.Generator().manual_seed(1)
        weight_map = {}
        for i, (fname, params) in enumerate(sorted(files.items())):
            tensors = []
            for name, p in params:
                values = (torch.ones(p.shape) if p.dim() == 1
                          else torch.randn(p.shape, generator=g).mul_(0.02))
                tensors.append((name, values.to(torch.bfloat16)))
                weight_map[name] = fname
            write_safetensors(os.path.join(base, fname), tensors)
            print(f"  base checkpoint: {i + 1}/{len(files)} files", end="\r", flush=True)
        with open(index, "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
        print()
    if not os.path.exists(adapters):
        with torch.device("meta"):
            meta = get_peft_model(LlamaForCausalLM(config), _lora(rank))
        g = torch.Generator().manual_seed(2)
        tensors = []
        for name, p in meta.named_parameters():
            if p.requires_grad:  # lora_A: small random values; lora_B: zeros, as peft starts
                values = (torch.zeros(p.shape) if ".lora_B." in name
                          else torch.randn(p.shape, generator=g).mul_(0.01))
                tensors.append((name, values))
        write_safetensors(adapters, tensors)
    return base, adapters


def _reset_peak_rss() -> None:
    """Start a new VmHWM from the current RSS (Linux), to split set-up's peak from the steps'."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _train(step_fn, args: argparse.Namespace, vocab_size: int) -> dict:
    losses, times = [], []
    for tokens in batches(vocab_size, args.batch_size, args.seq_len, args.steps):
        t0 = time.perf_counter()
        losses.append(step_fn(tokens))
        times.append(time.perf_counter() - t0)
        print(f"  step {len(times)}: loss {losses[-1]:.4f}, {times[-1]:.1f} s", file=sys.stderr,
              flush=True)
    return {"losses": losses, "step_s": times}


def run_plain(args: argparse.Namespace, base: str, adapters: str) -> dict:
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    from infinity.io import SafetensorsCheckpoint, iter_tensors

    t0 = time.perf_counter()
    model = get_peft_model(LlamaForCausalLM.from_pretrained(base, dtype=torch.bfloat16),
                           _lora(args.rank))
    # from_pretrained may leave the weights as views of the mmapped safetensors files: the page
    # cache then decides whether a step reads them from RAM or from the disk (measured here: plain
    # steps of 10 s or 23 s, minutes apart). The reference holds the whole model in RAM: copy
    # every tensor into the process's own memory.
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.data = t.data.clone()
    named = dict(model.named_parameters())
    ckpt = SafetensorsCheckpoint(adapters)
    with torch.no_grad():
        for name, values in iter_tensors(ckpt):
            named[name].copy_(values)
    ckpt.close()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    setup_s = time.perf_counter() - t0

    def step(tokens):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    out = _train(step, args, model.config.vocab_size)
    return out | {"setup_s": setup_s, "peak_rss_bytes": peak_rss_bytes()}


def run_ours(args: argparse.Namespace, base: str, adapters: str) -> dict:
    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    import infinity
    from infinity.bench.roofline import nvme_moved_bytes, probe_disk
    from infinity.integrations.peft import load_base_weights

    config = {"zero": {"stage": 3, "unit_class_names": ["LlamaDecoderLayer"]},
              "precision": {"dtype": "bf16"},
              "optimizer": {"type": "adamw", "lr": args.lr, "weight_decay": 0.0},
              "offload_param": {"device": "nvme", "nvme_path": os.path.join(args.dir, "swap")},
              "gradient_clipping": 1.0}
    if args.host_budget:
        from infinity.cli._consolidate import parse_bytes
        config["memory"] = {"host_budget_bytes": parse_bytes(args.host_budget)}
    t0 = time.perf_counter()
    with infinity.init(config):
        model = get_peft_model(LlamaForCausalLM(LlamaConfig.from_pretrained(base)),
                               _lora(args.rank))
    engine = infinity.initialize(model)
    load_base_weights(engine, base)
    engine.load_weights(adapters, strict=False)  # the same initial adapters as the plain run
    setup_s = time.perf_counter() - t0

    moved: list[tuple[int, int]] = []  # NVMe (read, written) per step
    last = [engine.stats()["bytes_moved"]]  # one sample per step, diffed with the one before

    def step(tokens):
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        value = loss.item()
        now = engine.stats()["bytes_moved"]
        moved.append(nvme_moved_bytes(last[0], now))
        last[0] = now
        return value

    # The disk's raw bandwidth on the swap directory, probed just before the steps and once the
    # engine is closed (a shared virtual disk drifts by 2x between hours, and within a run: the
    # roofline needs this run's figure). Peak RSS: set-up's and the steps' apart.
    swap = config["offload_param"]["nvme_path"]
    setup_peak = peak_rss_bytes()
    disk_before = probe_disk(swap)
    _reset_peak_rss()  # the probe's buffer is freed: the steps' peak starts here
    out = _train(step, args, model.config.vocab_size)
    steps_peak = peak_rss_bytes()
    stats = engine.stats()
    budgets = {"host_budget_bytes": engine.offload.host_budget_bytes,
               "device_budget_bytes": engine.offload.device_budget_bytes,
               "prefetch_overlap": engine.offload.overlap,
               "tier_peak_bytes": {t: stats["bytes"][t]["peak"] for t in ("DEVICE", "HOST")},
               "prefetch_hit_rate": stats["prefetch"]["hit_rate"],
               "prefetch": stats["prefetch"],
               "stall_s": stats["stall_s"]}
    engine.close()
    disk_after = probe_disk(swap)  # after close: no prefetch or write-back of ours in flight
    probes = [{"read_bytes_per_s": d.read_bytes_per_s, "write_bytes_per_s": d.write_bytes_per_s,
               "direct": d.direct} for d in (disk_before, disk_after)]
    return out | {"setup_s": setup_s, "peak_rss_bytes": max(setup_peak, steps_peak),
                  "setup_peak_rss_bytes": setup_peak, "steps_peak_rss_bytes": steps_peak,
                  "nvme_read_per_step_bytes": sum(r for r, _ in moved) / len(moved),
                  "nvme_moved_by_step": [{"read_bytes": r, "write_bytes": w} for r, w in moved],
                  "disk_probes": probes, **budgets}


def _child(which: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", which, "--shape", args.shape,
           "--steps", str(args.steps), "--dir", args.dir, "--rank", str(args.rank),
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
           "--lr", str(args.lr)]
    cmd += ["--host-budget", args.host_budget] if args.host_budget else []
    print(f"{which}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{which} run failed (exit {out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _roofline(plain: dict, ours: dict, median: dict[str, float]) -> dict:
    """Ours against max(compute, disk): compute is the plain run's median step (the same model,
    batches and optimizer with every weight in RAM), disk the median steady step's NVMe bytes at
    the mean of the two raw probes of the swap directory taken around ours' steps."""
    from infinity.bench.roofline import DiskBandwidth, roofline

    steps = ours["nvme_moved_by_step"]
    steady = steps[1:] or steps  # the first step also reads what set-up left cold
    probes = ours["disk_probes"]
    disk = DiskBandwidth(
        read_bytes_per_s=statistics.mean(p["read_bytes_per_s"] for p in probes),
        write_bytes_per_s=statistics.mean(p["write_bytes_per_s"] for p in probes),
        direct=all(p["direct"] for p in probes))
    return roofline(cpu_s=median["plain"],
                    read_bytes=statistics.median(s["read_bytes"] for s in steady),
                    write_bytes=statistics.median(s["write_bytes"] for s in steady),
                    disk=disk, step_s=median["ours"]) | {
        "read_bytes_per_s": disk.read_bytes_per_s, "write_bytes_per_s": disk.write_bytes_per_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the first is warm-up)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--dir", default="./infinity-data/lora7b")
    parser.add_argument("--host-budget", default=None,
                        help="ours: memory.host_budget_bytes (e.g. 2GiB with --shape 7b-8l, so that "
                             "the base streams from NVMe as at 7B); default: the engine's 'auto'")
    parser.add_argument("--results-dir", default=os.path.join(HERE, "results"))
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--child", choices=("plain", "ours"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dir = os.path.abspath(args.dir)
    torch.manual_seed(0)
    if args.child:
        base, adapters = make_inputs(args.shape, args.dir, args.rank)
        result = (run_plain if args.child == "plain" else run_ours)(args, base, adapters)
        print(json.dumps(result))
        return
    t0 = time.perf_counter()
    make_inputs(args.shape, args.dir, args.rank)
    print(f"inputs ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    plain, ours = _child("plain", args), _child("ours", args)
    ram = psutil.virtual_memory().total
    median = {k: statistics.median(r["step_s"][1:] or r["step_s"]) for k, r in
              (("plain", plain), ("ours", ours))}
    record = {
        "name": "lora7b", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join([os.path.relpath(__file__, ROOT)] + sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "ram_bytes": ram, "python": platform.python_version(),
                    "torch": torch.__version__},
        "shape": args.shape, "batch": [args.batch_size, args.seq_len], "steps": args.steps,
        "plain": plain, "ours": ours,
        "median_step_s": median, "x_plain": median["ours"] / median["plain"],
        "max_loss_diff": max(abs(a - b) for a, b in zip(plain["losses"], ours["losses"])),
        "ours_peak_rss_over_ram": ours["peak_rss_bytes"] / ram,
        "roofline": _roofline(plain, ours, median),
    }
    print(f"plain: median step {median['plain']:.2f} s, peak RSS "
          f"{plain['peak_rss_bytes'] / 2**30:.2f} GiB, losses {plain['losses']}")
    print(f"ours:  median step {median['ours']:.2f} s, peak RSS "
          f"{ours['peak_rss_bytes'] / 2**30:.2f} GiB "
          f"({record['ours_peak_rss_over_ram']:.1%} of RAM; "
          f"set-up {ours['setup_peak_rss_bytes'] / 2**30:.2f}, steps "
          f"{ours['steps_peak_rss_bytes'] / 2**30:.2f}), "
          f"NVMe read per step {ours['nvme_read_per_step_bytes'] / 1e9:.2f} GB, losses {ours['losses']}")
    r = record["roofline"]
    print(f"ours / plain: {record['x_plain']:.3f}; largest loss difference "
          f"{record['max_loss_diff']:.2e}")
    print(f"roofline: max(compute {r['cpu_s']:.2f} s, disk {r['disk_s']:.2f} s at "
          f"{r['read_bytes_per_s'] / 1e9:.2f} GB/s read) = {r['roofline_s']:.2f} s; "
          f"ours / roofline {r['x_roofline']:.3f}")
    if not args.no_save:
        os.makedirs(args.results_dir, exist_ok=True)
        path = os.path.join(args.results_dir, f"lora7b-{time.strftime('%Y%m%d-%H%M%S')}.json")
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
        print(f"record: {path}")


if __name__ == "__main__":
    main()
