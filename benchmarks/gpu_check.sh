#!/usr/bin/env bash
# GPU check of the CUDA path: the engine's GPU tests and a short step benchmark.
#
#   benchmarks/gpu_check.sh                # from the repository root or anywhere
#   PYTHON=/path/to/python benchmarks/gpu_check.sh
#
# What it runs, in order, and prints as it goes:
#   1. picks a Python that can import torch (PYTHON, .venv/bin/python, python3.12, python3, python);
#      no pip install is attempted (the GPU machine may be offline): without torch it says so, exit 2;
#   2. prints torch/CUDA versions and the GPU; without CUDA it says so, exit 3;
#   3. the GPU tests (tests/gpu, marker gpu) with pytest, or, where pytest is missing, the same
#      checks through `python -m tests.gpu.test_engine_cuda`;
#   4. a short step benchmark on the GPU: plain PyTorch vs the engine at stage 3 (no offload, CPU
#      offload of the optimizer), GPT 'small' preset, median step time after warm-up and peak CUDA
#      memory, as ratios to plain PyTorch in the same process.
# Exit status: 0 when the tests passed (the benchmark never fails the script), 1 on a test failure.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
REPO=$(pwd)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

pick_python() {
  local candidates=()
  [ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
  candidates+=("$REPO/.venv/bin/python" python3.12 python3 python)
  for py in "${candidates[@]}"; do
    if command -v "$py" >/dev/null 2>&1 && "$py" -c "import torch" >/dev/null 2>&1; then
      echo "$py"
      return 0
    fi
  done
  return 1
}

PY=$(pick_python) || {
  echo "gpu_check: no Python here can import torch (tried \$PYTHON, .venv/bin/python, python3.12,"
  echo "gpu_check: python3, python). Install torch with CUDA for one of them; nothing was run."
  exit 2
}
echo "== gpu_check: python: $PY ($("$PY" --version 2>&1))"
"$PY" - <<'EOF' || exit 3
import sys, torch
print(f"== torch {torch.__version__}, CUDA build {torch.version.cuda}, "
      f"available: {torch.cuda.is_available()}")
if not torch.cuda.is_available():
    print("gpu_check: CUDA is not available to this torch: the GPU tests would all be skipped; "
          "nothing was run")
    sys.exit(3)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"== GPU {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB")
EOF

status=0
if "$PY" -c "import pytest" >/dev/null 2>&1; then
  echo "== running: $PY -m pytest tests/gpu -m gpu -q"
  "$PY" -m pytest tests/gpu -m gpu -q -p no:cacheprovider || status=1
else
  echo "== pytest is not importable: running the same checks with $PY -m tests.gpu.test_engine_cuda"
  "$PY" -m tests.gpu.test_engine_cuda || status=1
fi

echo "== step benchmark (GPT 'small', stage 3; medians of 10 steps after 3 warm-up steps)"
"$PY" - <<'EOF' || echo "gpu_check: the benchmark failed (see above); the tests' status stands"
import statistics, time, torch
import infinity
from infinity.models.gpt import GPT, PRESETS, synthetic_batch

cfg = PRESETS["small"]
dev = torch.device("cuda", 0)
x, y = synthetic_batch(cfg, 8, 256, seed=0, device=dev)

def measure(step):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), torch.cuda.max_memory_allocated()

def plain():
    torch.manual_seed(0)
    model = GPT(cfg).to(dev, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    def step():
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step

def ours(offload):
    torch.manual_seed(0)
    config = {"zero": {"stage": 3, "unit_class_names": ["Block"]}, "precision": {"dtype": "bf16"},
              "optimizer": {"lr": 1e-4}, "offload_optimizer": {"device": offload}}
    engine = infinity.initialize(GPT(cfg), config)
    def step():
        engine.backward(engine(x, y))
        engine.step()
    return step

rows = [("plain PyTorch (bf16, fused AdamW)", plain)]
rows += [(f"infinity stage 3, optimizer offload={o}", lambda o=o: ours(o)) for o in ("none", "cpu")]
base = None
for name, make in rows:
    try:
        t, peak = measure(make())
    except Exception as e:
        print(f"   {name:45s} failed: {type(e).__name__}: {e}")
        continue
    base = base or t
    print(f"   {name:45s} {t * 1e3:8.2f} ms/step ({t / base:5.2f}x)  peak {peak / 2**20:8.1f} MiB")
EOF
if [ $status -eq 0 ]; then echo "== gpu_check: tests PASSED"; else echo "== gpu_check: tests FAILED"; fi
exit $status
