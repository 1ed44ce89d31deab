#!/usr/bin/env bash
# Creates .venv (if missing), installs the pinned TensorFlow and the build/test tools, and
# builds fbn_grad_tf in place (editable install). Safe and quick to re-run:
#   * the requirements are installed only when requirements.txt (or the Python) changed
#     since the last successful install of this venv;
#   * the package is rebuilt only when a build input changed (setup.py, pyproject.toml,
#     csrc/, the build switches), and then setup.py recompiles only the objects whose
#     sources changed (object cache in build/fbn-obj/, one per configuration).
# Stamps live in .venv/ and are written only after success.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
T0=$SECONDS

# pip, minus the "WARNING: Location '...' is ignored" lines that this machine's pip
# configuration prints for every package; pip's own errors and exit status are kept.
pip_quiet() {
  python -m pip "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }
}

# sha256 of the named files (content and path) plus extra text.
digest() {
  local extra=$1
  shift
  { printf '%s\n' "$extra"; find "$@" -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum; } \
    | sha256sum | cut -d' ' -f1
}

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
. .venv/bin/activate

REQ_STAMP=.venv/.fbn-requirements.sha256
req_hash=$(digest "$(python -c 'import sys; print(sys.version)')" requirements.txt requirements-nodeps.txt)
if [ "$(cat "$REQ_STAMP" 2>/dev/null)" = "$req_hash" ]; then
  echo "[setup] requirements unchanged since the last install: skipped"
else
  echo "[setup] installing tensorflow-cpu==2.21.0, pybind11, numpy, pytest, hypothesis, tf-keras"
  # requirements-nodeps.txt: packages whose declared `tensorflow` dependency would pull the
  # full tensorflow wheel over tensorflow-cpu (see the file).
  if ! pip_quiet install -q --upgrade pip setuptools wheel || ! pip_quiet install -q -r requirements.txt \
      || ! pip_quiet install -q --no-deps -r requirements-nodeps.txt; then
    echo "[setup] ERROR: installing the requirements failed (pip's error above)" >&2
    exit 1
  fi
  echo "$req_hash" > "$REQ_STAMP"
fi

BUILD_STAMP=.venv/.fbn-build.sha256
switches="BUILD=${FBN_GRAD_TF_BUILD:-all} CUDA=${FBN_GRAD_TF_CUDA:-auto} ASAN=${FBN_GRAD_TF_ASAN:-0} SANITIZE=${FBN_GRAD_TF_SANITIZE:-} CUDA_HOME=${CUDA_HOME:-} nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true) $req_hash"
build_hash=$(digest "$switches" setup.py pyproject.toml MANIFEST.in csrc)
built_libs=$(find python/fbn_grad_tf -maxdepth 1 \( -name '_core*.so' -o -name '_fbn_grad_ops*.so' \) | wc -l)
if [ "$(cat "$BUILD_STAMP" 2>/dev/null)" = "$build_hash" ] && [ "$built_libs" -ge 2 ]; then
  echo "[setup] build inputs unchanged since the last build: skipped"
else
  echo "[setup] building fbn_grad_tf (CPU kernels; CUDA kernels too when nvcc is found, FBN_GRAD_TF_CUDA=${FBN_GRAD_TF_CUDA:-auto})"
  rm -f "$BUILD_STAMP"
  if ! pip_quiet install -q --no-build-isolation --no-deps -e .; then
    echo "[setup] ERROR: building fbn_grad_tf failed (compiler output above)" >&2
    exit 1
  fi
  echo "$build_hash" > "$BUILD_STAMP"
fi
TF_CPP_MIN_LOG_LEVEL=2 python -c "import fbn_grad_tf, fbn_grad_tf.core as c; print('[setup] ready: TF', fbn_grad_tf.build_info.TF_VERSION, '| CUDA kernels compiled:', fbn_grad_tf.build_info.WITH_CUDA, '| CPU path:', c.default_isa())" 2>&1 \
  | { grep -v -e '^I0000 ' -e '^WARNING: All log messages before absl' || true; }
echo "[setup] done in $((SECONDS - T0)) s"
