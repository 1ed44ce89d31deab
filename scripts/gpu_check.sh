#!/usr/bin/env bash
# GPU check for a machine with CUDA + PyTorch and no TensorFlow (see docs/GPU.md):
#   1. builds the TF-free pybind11 module fbn_grad_tf._core with CUDA, in place
#      (FBN_GRAD_TF_BUILD=core-cuda python setup.py build_ext --inplace);
#   2. runs scripts/gpu_check.py (numerics vs CPU kernel and float64 reference, determinism,
#      benchmark vs PyTorch's cuDNN batch-norm backward) with PYTHONPATH=python.
# Extra arguments go to gpu_check.py (e.g. --skip-bench). Whole run bounded to ~6 minutes
# (GPU_CHECK_BUDGET_S, default 350 s). Exit status: the build's or gpu_check.py's.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET_S:-350}"
BUILD_TIMEOUT="${GPU_CHECK_BUILD_TIMEOUT_S:-220}"
T0=$SECONDS
say() { echo "[gpu_check.sh +$((SECONDS - T0))s] $*"; }

say "python: $($PY -c 'import sys; print(sys.executable, sys.version.split()[0])')"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
  --format=csv,noheader 2>/dev/null | sed 's/^/  gpu: /'
NVCC="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
[ -x "$NVCC" ] || NVCC=$(command -v nvcc || true)
if [ -z "$NVCC" ] && [ "${GPU_CHECK_SKIP_BUILD:-0}" != 1 ]; then
  say "ERROR: nvcc not found (set CUDA_HOME)"; exit 2
fi
[ -n "$NVCC" ] && say "nvcc: $("$NVCC" --version | tail -n 2 | head -n 1)"

# pybind11: use the installed one, else a local wheel from .whl/ (no network needed).
if ! $PY -c "import pybind11" 2>/dev/null; then
  WHL=$(ls "$ROOT"/.whl/pybind11-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$WHL" ]; then say "ERROR: pybind11 missing and no .whl/pybind11-*.whl"; exit 2; fi
  say "installing $WHL into /tmp/fbn_site"
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/fbn_site "$WHL" || exit 2
  export PYTHONPATH="/tmp/fbn_site${PYTHONPATH:+:$PYTHONPATH}"
fi

if [ "${GPU_CHECK_SKIP_BUILD:-0}" = 1 ]; then
  # A module built elsewhere for this Python (e.g. `FBN_GRAD_TF_BUILD=core-cuda python3.12
  # setup.py build_ext --inplace` on a machine with nvcc; cudart is linked statically).
  ls -l python/fbn_grad_tf/_core*.so 2>/dev/null | sed 's/^/  /'
  say "GPU_CHECK_SKIP_BUILD=1: using the module already in python/fbn_grad_tf"
else
say "building fbn_grad_tf._core (FBN_GRAD_TF_BUILD=core-cuda, timeout ${BUILD_TIMEOUT}s)"
LOG=$(mktemp /tmp/fbn_build.XXXXXX.log)
FBN_GRAD_TF_BUILD=core-cuda CUDA_HOME="$(dirname "$(dirname "$NVCC")")" \
  timeout "$BUILD_TIMEOUT" $PY setup.py build_ext --inplace >"$LOG" 2>&1
RC=$?
if [ $RC -ne 0 ]; then
  tail -n 60 "$LOG"
  say "ERROR: build failed (rc=$RC; 124 = timeout); full log: $LOG"
  exit 2
fi
grep -E "nvcc|error|warning" "$LOG" | tail -n 20 | cut -c1-300
ls -l python/fbn_grad_tf/_core*.so 2>/dev/null | sed 's/^/  /'
say "build done"
fi

LEFT=$((BUDGET - (SECONDS - T0)))
[ $LEFT -lt 60 ] && LEFT=60
say "running scripts/gpu_check.py $* (timeout ${LEFT}s)"
PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
  timeout "$LEFT" $PY scripts/gpu_check.py "$@"
RC=$?
[ $RC -eq 124 ] && echo "GPU_CHECK SUMMARY: FAIL (timed out after ${LEFT}s)"
say "done rc=$RC"
exit $RC
