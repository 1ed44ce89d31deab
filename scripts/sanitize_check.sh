#!/usr/bin/env bash
# Sanitizer check of the framework-free core (docs/HARDENING.md, "Sanitizers"); run by CI
# (.ci/run) after the test suite.
#
# 1. Copies the working tree (tracked files plus untracked, non-ignored ones: uncommitted
#    edits included) to a scratch directory, so the in-place build in the repository (and
#    its compiled extensions) is never touched.
# 2. Builds only the pybind11 core module there, CPU kernels only, every ISA path, with
#    FBN_GRAD_TF_BUILD=core FBN_GRAD_TF_SANITIZE=address,undefined (setup.py adds
#    -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -O1).
# 3. Runs, in one Python process with the sanitizer runtimes preloaded (TensorFlow never
#    imported), through the NumPy binding on every CPU instruction-set path:
#    - the backward fuzz (tests/test_hardening_fuzz.py: run_core_fuzz), and
#    - the entry-point fuzz (tests/test_hardening_core_entry.py: run_core_entry_fuzz):
#      forward with every activation mode the core has, the fused ReLU's backward, the split
#      reduce/apply, malformed inputs, empty tensors, NaN/Inf, hostile epsilon/factor (and
#      the side input, through its hook, once the core has one).
#
# The first AddressSanitizer or UndefinedBehaviorSanitizer report stops the process and
# makes this script fail (exit status 1), as does any failing check of the fuzz.
#
# Environment:
#   FBN_SANITIZE           sanitizers (default address,undefined; address = the old ASan check)
#   FBN_SAN_DIR            scratch directory (default /tmp/fbn_sanitize; recreated)
#   FBN_SAN_EXAMPLES       backward fuzz examples (default 2000)
#   FBN_SAN_ENTRY_EXAMPLES entry-point fuzz examples (default 1500)
#   FBN_SAN_SEED           hypothesis seed (default 0)
#   FBN_SAN_CUDA           FBN_GRAD_TF_CUDA for the build (default 0: CPU kernels only; the
#                          sanitizers and the static CUDA runtime do not mix, nvcc adds minutes)
#   PYTHON                 interpreter (default: the repository's .venv)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
SAN=${FBN_SANITIZE:-address,undefined}
WORK=${FBN_SAN_DIR:-/tmp/fbn_sanitize}
EXAMPLES=${FBN_SAN_EXAMPLES:-2000}
ENTRY_EXAMPLES=${FBN_SAN_ENTRY_EXAMPLES:-1500}
SEED=${FBN_SAN_SEED:-0}
PY=${PYTHON:-$REPO/.venv/bin/python}
case "$WORK" in /|"$REPO"|"$REPO"/*) echo "refusing FBN_SAN_DIR=$WORK" >&2; exit 2;; esac
case ",$SAN," in *,address,*) ;; *) echo "[san] FBN_SANITIZE must include address" >&2; exit 2;; esac
UBSAN=0
case ",$SAN," in *,undefined,*) UBSAN=1;; esac
t_start=$(date +%s)

echo "[san] copying the working tree of $REPO to $WORK"
rm -rf "$WORK"
mkdir -p "$WORK"
(cd "$REPO" && git ls-files -z --cached --others --exclude-standard \
   | while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done \
   | tar --null -T - -cf -) | tar -xf - -C "$WORK"

echo "[san] building the core module with -fsanitize=$SAN (FBN_GRAD_TF_BUILD=core, CPU only)"
(cd "$WORK" && FBN_GRAD_TF_BUILD=core FBN_GRAD_TF_SANITIZE="$SAN" FBN_GRAD_TF_ASAN=0 \
   FBN_GRAD_TF_CUDA=${FBN_SAN_CUDA:-0} "$PY" setup.py -q build_ext --inplace \
   > "$WORK/san_build.log" 2>&1) || {
  tail -40 "$WORK/san_build.log"; echo "[san] build FAILED" >&2; exit 1; }
SO=$(ls "$WORK"/python/fbn_grad_tf/_core*.so)
for lib in libasan $([ "$UBSAN" = 1 ] && echo libubsan); do
  if ! readelf -d "$SO" | grep -q "$lib"; then
    echo "[san] $SO is not linked against $lib" >&2; exit 1
  fi
done
t_built=$(date +%s)
echo "[san] build: $((t_built - t_start)) s"

LIBASAN=$(gcc -print-file-name=libasan.so)
[ -f "$LIBASAN" ] || { echo "[san] libasan not found ($LIBASAN)" >&2; exit 1; }
PRELOAD="$LIBASAN"
if [ "$UBSAN" = 1 ]; then
  LIBUBSAN=$(gcc -print-file-name=libubsan.so)
  [ -f "$LIBUBSAN" ] || { echo "[san] libubsan not found ($LIBUBSAN)" >&2; exit 1; }
  PRELOAD+=" $LIBUBSAN"
fi
# libstdc++ is preloaded too: Python does not link it, and ASan's __cxa_throw interceptor
# must resolve the real function at start-up, or the first C++ exception (every ValueError
# of the pybind11 module) dies in "CHECK failed: ... real___cxa_throw != 0". libasan must
# come first; libubsan would be loaded with the module anyway (preloading it changes nothing
# but makes the set-up explicit).
PRELOAD+=" $(gcc -print-file-name=libstdc++.so)"
export LD_PRELOAD="$PRELOAD"
# detect_leaks=0: CPython itself "leaks" at exit. Everything else at its default (reads and
# writes out of bounds of heap and stack, use after free, ...), stopping at the first report.
ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1"
ASAN_OPTIONS+=":detect_stack_use_after_return=1:strict_string_checks=1"
export ASAN_OPTIONS+=":check_initialization_order=1"
# UBSan: the build has -fno-sanitize-recover=all (the first report ends the process); these
# add a stack trace and make the end an abort, as ASan's.
export UBSAN_OPTIONS="halt_on_error=1:abort_on_error=1:print_stacktrace=1:report_error_type=1"
export PYTHONPATH="$WORK/python:$WORK/tests"
export FBN_FUZZ_SEED="$SEED" FBN_SAN_WORK="$WORK" FBN_SAN_LIST="$SAN"
echo "[san] running $EXAMPLES backward + $ENTRY_EXAMPLES entry-point fuzz examples (LD_PRELOAD=$LD_PRELOAD)"
set +e
"$PY" - "$EXAMPLES" "$ENTRY_EXAMPLES" "$SEED" <<'EOF' > "$WORK/san_run.log" 2>&1
import os, sys, time
sys.modules["tensorflow"] = None  # the core only: never load TF under the sanitizers
import fbn_grad_tf
from fbn_grad_tf import _build_info, core
assert core._core.__file__.startswith(os.environ["FBN_SAN_WORK"]), core._core.__file__
want = sorted(os.environ["FBN_SAN_LIST"].split(","))
print("[san] module:", core._core.__file__, "| SANITIZE =", _build_info.SANITIZE,
      "| ISA paths:", [i for i in core.CPU_ISAS if core.cpu_supports(i)])
assert _build_info.WITH_ASAN and _build_info.SANITIZE == want, "not the sanitizer build"
import test_hardening_core_entry as entry
import test_hardening_fuzz as fz
n, n_entry, seed = (int(a) for a in sys.argv[1:4])
t0 = time.time()
stats = fz.run_core_fuzz({"examples": n, "seed": seed, "big_every": 20})
print("[san] backward fuzz finished in %.0fs: %s" % (time.time() - t0, stats), flush=True)
t0 = time.time()
stats = entry.run_core_entry_fuzz({"examples": n_entry, "seed": seed, "big_every": 40})
print("[san] entry-point fuzz finished in %.0fs: %s" % (time.time() - t0, stats), flush=True)
EOF
rc=$?
set -e
grep -v "^@@fbn-subproc" "$WORK/san_run.log" | tail -40
t_end=$(date +%s)
echo "[san] run: $((t_end - t_built)) s; total $((t_end - t_start)) s"
report=""
grep -q "ERROR: AddressSanitizer" "$WORK/san_run.log" && report="AddressSanitizer"
grep -q "runtime error:" "$WORK/san_run.log" && report="${report:+$report and }UndefinedBehaviorSanitizer"
if [ -n "$report" ] || [ "$rc" -ne 0 ]; then
  echo "[san] example being run:"; grep "^@@fbn-subproc NOTE" "$WORK/san_run.log" | tail -1 || true
  if [ -n "$report" ]; then
    echo "[san] FAILED: $report report above (log: $WORK/san_run.log)"
  else
    echo "[san] FAILED: exit status $rc (log: $WORK/san_run.log)"
  fi
  exit 1
fi
echo "[san] OK: no sanitizer report ($SAN), every fuzz check passed"
