#!/usr/bin/env bash
# AddressSanitizer check of the framework-free core (docs/HARDENING.md, "ASan").
#
# 1. Copies the working tree (tracked files plus untracked, non-ignored ones: uncommitted
#    edits included) to a scratch directory, so the in-place build in the repository (and
#    its compiled extensions) is never touched.
# 2. Builds only the pybind11 core module there with FBN_GRAD_TF_BUILD=core
#    FBN_GRAD_TF_ASAN=1 (setup.py adds -fsanitize=address -fno-omit-frame-pointer -O1).
# 3. Runs the core fuzz of tests/test_hardening_fuzz.py (NumPy path, TensorFlow never
#    imported) against that module with libasan preloaded into Python.
#
# Any ASan report aborts the process (halt_on_error) and makes this script fail.
#
# Environment:
#   FBN_ASAN_DIR       scratch directory (default /tmp/fbn_asan; recreated)
#   FBN_ASAN_EXAMPLES  hypothesis examples (default 2000)
#   FBN_ASAN_SEED      hypothesis seed (default 0)
#   FBN_ASAN_CUDA      FBN_GRAD_TF_CUDA for the build (default 0: CPU kernels only; ASan and
#                      the static CUDA runtime do not mix, and nvcc adds minutes)
#   PYTHON             interpreter (default: the repository's .venv)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${FBN_ASAN_DIR:-/tmp/fbn_asan}
EXAMPLES=${FBN_ASAN_EXAMPLES:-2000}
SEED=${FBN_ASAN_SEED:-0}
PY=${PYTHON:-$REPO/.venv/bin/python}
case "$WORK" in /|"$REPO"|"$REPO"/*) echo "refusing FBN_ASAN_DIR=$WORK" >&2; exit 2;; esac

echo "[asan] copying the working tree of $REPO to $WORK"
rm -rf "$WORK"
mkdir -p "$WORK"
(cd "$REPO" && git ls-files -z --cached --others --exclude-standard \
   | while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done \
   | tar --null -T - -cf -) | tar -xf - -C "$WORK"

echo "[asan] building the core module with AddressSanitizer (FBN_GRAD_TF_BUILD=core)"
(cd "$WORK" && FBN_GRAD_TF_BUILD=core FBN_GRAD_TF_ASAN=1 FBN_GRAD_TF_CUDA=${FBN_ASAN_CUDA:-0} \
   "$PY" setup.py -q build_ext --inplace > "$WORK/asan_build.log" 2>&1) || {
  tail -40 "$WORK/asan_build.log"; echo "[asan] build FAILED" >&2; exit 1; }
SO=$(ls "$WORK"/python/fbn_grad_tf/_core*.so)
if ! readelf -d "$SO" | grep -q "libasan"; then
  echo "[asan] $SO is not linked against libasan" >&2; exit 1
fi

LIBASAN=$(gcc -print-file-name=libasan.so)
[ -f "$LIBASAN" ] || { echo "[asan] libasan not found ($LIBASAN)" >&2; exit 1; }
echo "[asan] running $EXAMPLES core fuzz examples under $LIBASAN"
cd "$WORK"
# libstdc++ is preloaded too: Python does not link it, and ASan's __cxa_throw interceptor
# must resolve the real function at start-up, or the first C++ exception (every ValueError
# of the pybind11 module) dies in "CHECK failed: ... real___cxa_throw != 0".
LIBSTDCXX=$(gcc -print-file-name=libstdc++.so)
export LD_PRELOAD="$LIBASAN $LIBSTDCXX"
# detect_leaks=0: CPython itself "leaks" at exit. Everything else at its default (reads and
# writes out of bounds of heap and stack, use after free, ...), stopping at the first report.
ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1"
ASAN_OPTIONS+=":detect_stack_use_after_return=1:strict_string_checks=1"
export ASAN_OPTIONS+=":check_initialization_order=1"
export PYTHONPATH="$WORK/python:$WORK/tests"
export FBN_FUZZ_SEED="$SEED" FBN_ASAN_WORK="$WORK"
set +e
"$PY" - "$EXAMPLES" "$SEED" <<'EOF' > "$WORK/asan_run.log" 2>&1
import sys, time
sys.modules["tensorflow"] = None  # the core only: never load TF under ASan
import fbn_grad_tf
from fbn_grad_tf import _build_info, core
import os
assert core._core.__file__.startswith(os.environ["FBN_ASAN_WORK"]), core._core.__file__
print("[asan] module:", core._core.__file__, "| WITH_ASAN =", _build_info.WITH_ASAN,
      "| ISA paths:", [i for i in core.CPU_ISAS if core.cpu_supports(i)])
assert _build_info.WITH_ASAN, "not the ASan build"
import test_hardening_fuzz as fz
t0 = time.time()
stats = fz.run_core_fuzz({"examples": int(sys.argv[1]), "seed": int(sys.argv[2]),
                          "big_every": 20})
print("[asan] core fuzz finished in %.0fs: %s" % (time.time() - t0, stats))
EOF
rc=$?
grep -v "^@@fbn-subproc" "$WORK/asan_run.log" | tail -40
set -e
if grep -q "ERROR: AddressSanitizer" "$WORK/asan_run.log"; then
  echo "[asan] example being run:"; grep "^@@fbn-subproc NOTE" "$WORK/asan_run.log" | tail -1
  echo "[asan] FAILED: AddressSanitizer report above (log: $WORK/asan_run.log)"; exit 1
fi
if [ "$rc" -ne 0 ]; then
  echo "[asan] example being run:"; grep "^@@fbn-subproc NOTE" "$WORK/asan_run.log" | tail -1
  echo "[asan] FAILED: exit status $rc (log: $WORK/asan_run.log)"; exit "$rc"
fi
echo "[asan] OK: no AddressSanitizer report"
