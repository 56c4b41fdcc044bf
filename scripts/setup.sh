#!/usr/bin/env bash
# Create ./.venv with torch (the local CPU build, pinned: an unpinned torch pulls a multi-GB CUDA
# build) and this package installed editable. Idempotent; `--dev` also installs the test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q torch==2.13.0
fi
extra=""
if [ "${1:-}" = "--dev" ]; then
    extra="[dev]"
fi
.venv/bin/python -m pip install -q -e ".${extra}" 2>&1 | grep -v "is ignored: it is neither" || true
.venv/bin/python -c "import infinity, torch; print(f'infinity ready (torch {torch.__version__})')"
