#!/usr/bin/env bash
# Creates .venv (if missing), installs the pinned TensorFlow and the build/test tools, and
# builds fbn_grad_tf in place (editable install). Safe to re-run: it only rebuilds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
. .venv/bin/activate
echo "[setup] installing tensorflow-cpu==2.21.0, pybind11, numpy, pytest, hypothesis"
python -m pip install -q --upgrade pip setuptools wheel
python -m pip install -q -r requirements.txt
echo "[setup] building fbn_grad_tf (CPU kernels; CUDA kernels too when nvcc is found, FBN_GRAD_TF_CUDA=${FBN_GRAD_TF_CUDA:-auto})"
python -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v "^WARNING: Location" || true
python -c "import fbn_grad_tf, fbn_grad_tf.core as c; print('[setup] built: TF', fbn_grad_tf.build_info.TF_VERSION, '| CUDA kernels compiled:', fbn_grad_tf.build_info.WITH_CUDA, '| CPU path:', c.default_isa())" 2>&1 | grep "^\[setup\]"
