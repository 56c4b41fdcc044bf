#!/usr/bin/env bash
# GPU check of the CUDA path: the GPU tests and the step benchmark on the GPU (issue #14).
#
#   bash benchmarks/gpu_check.sh                # from a bare copy of the repository, offline
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh
#
# Installs nothing (the GPU machine has no network): it needs a Python whose torch sees CUDA and
# that has pytest (transformers, peft and safetensors for the tests that use them), and g++ for
# the C++ CPU Adam. In order, each phase bounded by `timeout`, the whole in under 8 minutes:
#   1. picks the first Python whose torch sees a GPU among $PYTHON, python3, python3.12, python,
#      .venv/bin/python (a CPU-only torch, such as a CPU .venv, is skipped and said so); none: exit 3
#      ("no CUDA"), or exit 2 when none imports torch;
#   2. prints torch/CUDA versions and the GPU;
#   3. builds the C++ CPU Adam with the local compiler and prints which backend runs;
#   4. every test in tests/gpu (pytest; without pytest the tests are reported as not run: they
#      import pytest, so there is nothing to fall back to);
#   5. `infinity bench step` on the GPU: GPT 1b preset, bf16, 8 x 1024 tokens a step (a few hundred
#      ms of compute on an H100/H200): plain PyTorch against ours at stage 3 without offload, with
#      CPU offload and with NVMe offload, as ratios (x_plain), tokens/s and model TFLOP/s.
#      Targets on a GPU: no offload <= 1.05x plain, CPU offload <= 1.3x, NVMe <= 1.5x.
# Exit status: 0 when the GPU tests passed (the benchmark never fails the script), 1 when a test
# failed, timed out or could not run, 2 without torch, 3 without CUDA.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
REPO=$(pwd)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PIP_NO_INDEX=1  # belt and braces: nothing below installs, and pip could not reach an index
START=$(date +%s)
TOTAL_S=${GPU_CHECK_TOTAL_S:-470}  # the 8-minute bound, with room to print the summary

left_s() { echo $(( TOTAL_S - ($(date +%s) - START) )); }

pick_python() {
  # Prints the first candidate whose torch sees CUDA; says on stderr why each other was skipped.
  # Returns 2 when no candidate imports torch, 3 when some do but none sees CUDA.
  local candidates=() seen_torch=0 py rc
  [ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
  candidates+=(python3 python3.12 python "$REPO/.venv/bin/python")
  for py in "${candidates[@]}"; do
    command -v "$py" >/dev/null 2>&1 || continue
    timeout 60 "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)' \
      >/dev/null 2>&1
    rc=$?
    case $rc in
      0) echo "$py"; return 0 ;;
      3) seen_torch=1; echo "gpu_check: skipping $py: its torch sees no CUDA" >&2 ;;
      124) echo "gpu_check: skipping $py: importing torch took over 60 s" >&2 ;;
      *) echo "gpu_check: skipping $py: it cannot import torch" >&2 ;;
    esac
  done
  [ $seen_torch -eq 1 ] && return 3
  return 2
}

PY=$(pick_python)
picked=$?
if [ $picked -eq 3 ]; then
  echo "gpu_check: no CUDA: no Python here has a torch that sees a GPU (tried \$PYTHON, python3,"
  echo "gpu_check: python3.12, python, .venv/bin/python); nothing was run or installed"
  exit 3
elif [ $picked -ne 0 ]; then
  echo "gpu_check: no Python here can import torch (tried \$PYTHON, python3, python3.12, python,"
  echo "gpu_check: .venv/bin/python); install torch with CUDA for one of them; nothing was run"
  exit 2
fi
echo "== gpu_check: python: $PY ($("$PY" --version 2>&1))"
timeout 60 "$PY" - <<'EOF'
import torch
print(f"== torch {torch.__version__}, CUDA {torch.version.cuda}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"== GPU {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB")
EOF

echo "== building the C++ CPU Adam with the local toolchain (${CXX:-g++})"
timeout 120 "$PY" -m infinity.optim._cpu_adam_ext native \
  || echo "gpu_check: the C++ CPU Adam did not build (error above): the optimizer falls back to torch"
timeout 60 "$PY" -c "from infinity.optim import cpu_adam; print('== CPU Adam backend:', cpu_adam.backend())"

status=0
if "$PY" -c "import pytest" >/dev/null 2>&1; then
  budget=$(( $(left_s) - 250 ))  # what the benchmark below needs
  [ $budget -gt 240 ] && budget=240
  echo "== running: $PY -m pytest tests/gpu (limit ${budget} s)"
  timeout "$budget" "$PY" -m pytest tests/gpu -q -rs -p no:cacheprovider
  rc=$?
  if [ $rc -eq 124 ]; then
    echo "gpu_check: the GPU tests ran over ${budget} s and were stopped"; status=1
  elif [ $rc -ne 0 ]; then
    status=1
  fi
else
  echo "gpu_check: pytest is not importable by $PY: the GPU tests (which import pytest) were not run"
  status=1
fi

bench_s=$(( $(left_s) - 10 ))
mode_s=$(( (bench_s - 20) / 4 ))
echo "== step benchmark on the GPU (GPT 1b, bf16, 8 x 1024; limit ${bench_s} s, ${mode_s} s a mode)"
SWAP_DIR=$(mktemp -d "${TMPDIR:-/tmp}/infinity-gpu-check-XXXXXX")
timeout "$bench_s" "$PY" -m infinity bench step --model 1b --dtype bf16 --batch-size 8 \
  --seq-len 1024 --steps 3 --warmup 1 --modes plain,stage3,stage3-cpu,stage3-nvme \
  --dir "$SWAP_DIR" --mode-timeout-s "$mode_s" \
  || echo "gpu_check: the benchmark failed or ran out of time (see above); the tests' status stands"
rm -rf "$SWAP_DIR"

echo "== gpu_check: $(( $(date +%s) - START )) s"
if [ $status -eq 0 ]; then echo "== gpu_check: tests PASSED"; else echo "== gpu_check: tests FAILED"; fi
exit $status
