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
#   4. every test in tests/gpu (pytest, with faulthandler_timeout=60 so that a hang prints where it
#      was; pytest-timeout's per-test limit where it is installed, and said to be off where not;
#      without pytest the tests are reported as not run: they import pytest, so there is nothing
#      to fall back to);
#   5. `infinity bench step` on the GPU: GPT 350m preset, bf16, 8 x 1024 tokens a step, 2 timed
#      steps after 1 warm-up: plain PyTorch against ours at stage 3 without offload, with CPU
#      offload and with NVMe offload, as ratios (x_plain), tokens/s and model TFLOP/s; then which
#      modes finished. Sized to the time left (GPU_CHECK_PLAN_ONLY=1 prints the plan and exits;
#      tests/unit/test_gpu_check_script.py checks it fits): the NVMe mode writes the 5.6 GB state
#      once and moves about that much a step, ~23 GB at 1 GB/s inside its share.
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
PICK_MAX_S=20    # picking the Python and printing the GPU (seconds, typically)
BUILD_MAX_S=60   # the C++ CPU Adam build
TESTS_MAX_S=180  # tests/gpu
BENCH_MODEL=350m BENCH_BATCH=8 BENCH_SEQ=1024 BENCH_STEPS=2 BENCH_WARMUP=1
BENCH_MODES=plain,stage3,stage3-cpu,stage3-nvme
N_MODES=$(echo "$BENCH_MODES" | tr ',' '\n' | wc -l)
BENCH_MIN_S=$(( TOTAL_S - PICK_MAX_S - BUILD_MAX_S - TESTS_MAX_S - 10 ))
if [ -n "${GPU_CHECK_PLAN_ONLY:-}" ]; then
  echo "plan: total_s=$TOTAL_S pick_max_s=$PICK_MAX_S build_max_s=$BUILD_MAX_S" \
       "tests_max_s=$TESTS_MAX_S bench_min_s=$BENCH_MIN_S" \
       "mode_min_s=$(( (BENCH_MIN_S - 20) / N_MODES )) model=$BENCH_MODEL batch=$BENCH_BATCH" \
       "seq_len=$BENCH_SEQ steps=$BENCH_STEPS warmup=$BENCH_WARMUP modes=$BENCH_MODES"
  exit 0
fi

left_s() { echo $(( TOTAL_S - ($(date +%s) - START) )); }

pick_python() {
  # Prints the first candidate whose torch sees CUDA; says on stderr why each other was skipped.
  # Returns 2 when no candidate imports torch, 3 when some do but none sees CUDA.
  local candidates=() seen_torch=0 py rc
  [ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
  candidates+=(python3 python3.12 python "$REPO/.venv/bin/python")
  for py in "${candidates[@]}"; do
    command -v "$py" >/dev/null 2>&1 || continue
    timeout 30 "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)' \
      >/dev/null 2>&1
    rc=$?
    case $rc in
      0) echo "$py"; return 0 ;;
      3) seen_torch=1; echo "gpu_check: skipping $py: its torch sees no CUDA" >&2 ;;
      124) echo "gpu_check: skipping $py: importing torch took over 30 s" >&2 ;;
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
timeout "$BUILD_MAX_S" "$PY" -m infinity.optim._cpu_adam_ext native \
  || echo "gpu_check: the C++ CPU Adam did not build (error above): the optimizer falls back to torch"
timeout 60 "$PY" -c "from infinity.optim import cpu_adam; print('== CPU Adam backend:', cpu_adam.backend())"

status=0
if "$PY" -c "import pytest" >/dev/null 2>&1; then
  budget=$(( $(left_s) - BENCH_MIN_S ))  # the benchmark below keeps its share
  [ $budget -gt $TESTS_MAX_S ] && budget=$TESTS_MAX_S
  per_test=()
  if "$PY" -c "import pytest_timeout" >/dev/null 2>&1; then
    per_test=(--timeout=120)
  else
    echo "gpu_check: pytest-timeout is not installed: the per-test timeout is off (a hang prints" \
         "its stack after 60 s; the whole run stops at ${budget} s)"
  fi
  echo "== running: $PY -m pytest tests/gpu (limit ${budget} s)"
  timeout "$budget" "$PY" -m pytest tests/gpu -q -rs -p no:cacheprovider \
    -o faulthandler_timeout=60 ${per_test[@]+"${per_test[@]}"}
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
mode_s=$(( (bench_s - 20) / N_MODES ))
echo "== step benchmark on the GPU (GPT $BENCH_MODEL, bf16, $BENCH_BATCH x $BENCH_SEQ," \
     "$BENCH_STEPS steps after $BENCH_WARMUP; limit ${bench_s} s, ${mode_s} s a mode)"
SWAP_DIR=$(mktemp -d "${TMPDIR:-/tmp}/infinity-gpu-check-XXXXXX")
timeout "$bench_s" "$PY" -m infinity bench step --model "$BENCH_MODEL" --dtype bf16 \
  --batch-size "$BENCH_BATCH" --seq-len "$BENCH_SEQ" --steps "$BENCH_STEPS" \
  --warmup "$BENCH_WARMUP" --modes "$BENCH_MODES" --dir "$SWAP_DIR/swap" \
  --results-dir "$SWAP_DIR/results" --mode-timeout-s "$mode_s" \
  || echo "gpu_check: the benchmark failed or ran out of time (see above); the tests' status stands"
# Which modes finished (a mode over its share is stopped and reported by the bench).
timeout 30 "$PY" - "$SWAP_DIR/results" "$BENCH_MODES" <<'EOF'
import glob, json, os, sys
files = sorted(glob.glob(os.path.join(sys.argv[1], "step-*.json")))
rows = json.load(open(files[-1]))["rows"] if files else []
ran = [r["mode"] for r in rows if r.get("step_s") is not None]
print(f"== bench modes that ran: {', '.join(ran) or 'none'}; did not: "
      f"{', '.join(m for m in sys.argv[2].split(',') if m not in ran) or 'none'}")
EOF
mkdir -p benchmarks/results && cp "$SWAP_DIR"/results/step-*.json benchmarks/results/ 2>/dev/null
rm -rf "$SWAP_DIR"

echo "== gpu_check: $(( $(date +%s) - START )) s"
if [ $status -eq 0 ]; then echo "== gpu_check: tests PASSED"; else echo "== gpu_check: tests FAILED"; fi
exit $status
