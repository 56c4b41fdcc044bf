"""DeepSpeed ZeRO-3 reference for ``infinity bench step`` (run by DeepSpeed's own interpreter).

Loads the very same GPT file (infinity/models/gpt.py, plain PyTorch) by path, so it needs nothing
of infinity installed. Prints one JSON line like infinity/bench/_step_worker.py.
"""

import importlib.util
import json
import os
import resource
import shutil
import statistics
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "RANK": "0",
                   "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_SIZE": "1"}.items():
    os.environ.setdefault(key, value)

import deepspeed  # noqa: E402
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
spec_ = importlib.util.spec_from_file_location("gpt", os.path.join(HERE, "..", "infinity", "models", "gpt.py"))
gpt = importlib.util.module_from_spec(spec_)
sys.modules["gpt"] = gpt  # dataclasses look their module up here
spec_.loader.exec_module(gpt)


def _peak_rss_bytes() -> int:
    """VmHWM, as infinity/bench/_step_worker.py measures it (ru_maxrss inherits the parent's)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    spec = json.loads(sys.argv[1])
    torch.manual_seed(0)
    cfg = gpt.PRESETS[spec["model"]]
    model = gpt.GPT(cfg)
    zero = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True}
    path = os.path.abspath(spec["dir"] + "-ds")
    if spec["mode"] == "ds-stage3-cpu":
        zero["offload_param"] = {"device": "cpu"}
        zero["offload_optimizer"] = {"device": "cpu"}
    elif spec["mode"] == "ds-stage3-nvme":
        os.makedirs(path, exist_ok=True)
        zero["offload_param"] = {"device": "nvme", "nvme_path": path}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": path}
    config = {
        "train_micro_batch_size_per_gpu": spec["batch_size"],
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": spec["dtype"] == "bf16"},
        "steps_per_print": 10**9,
    }
    deepspeed.init_distributed(dist_backend="gloo")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    times, loss = [], float("nan")
    for i in range(spec["warmup"] + spec["steps"]):
        x, y = gpt.synthetic_batch(cfg, spec["batch_size"], spec["seq_len"], seed=i)
        t0 = time.perf_counter()
        out = engine(x, y)
        engine.backward(out)
        engine.step()
        loss = out.item()
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
    print(json.dumps({"mode": spec["mode"], "step_s": statistics.median(times), "step_times_s": times,
                      "peak_rss_bytes": _peak_rss_bytes(),
                      "final_loss": loss, "deepspeed": deepspeed.__version__}))
    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
