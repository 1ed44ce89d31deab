#!/usr/bin/env bash
# Compatibility check: fbn_grad_tf installed as a user installs it and tested (the `compat`
# tests of tests/test_compat.py and tests/test_portability.py) with every TensorFlow of the Keras 3 era, each with two Keras 3
# versions: the one current when that TensorFlow was released, and the newest that installs
# with it.
#
#   bash scripts/compat_check.sh                  # TF 2.16 2.17 2.18 2.19 2.20 2.21
#   bash scripts/compat_check.sh 2.16 2.21        # some TF versions (both Keras versions)
#   bash scripts/compat_check.sh 2.16:3.3.3       # one TF version with one Keras version
#   bash scripts/compat_check.sh --worktree 2.16  # the working tree instead of HEAD
#
# Source: a clean copy of HEAD (`git archive`), or with --worktree the working tree's files
# that git tracks or does not ignore; never the repository's own build/ or .venv.
# Per TF version X.Y (its newest patch release X.Y.Z on the package index): one wheel, built
# with `pip wheel --no-build-isolation` against tensorflow-cpu==X.Y.Z, CPU kernels only
# (FBN_GRAD_TF_CUDA=0), in $FBN_COMPAT_DIR/build/tf-X.Y (a copy of the source updated file by
# file, so that setup.py's object cache recompiles only what changed since the last run). The
# op library depends on TF only: both Keras versions of that TF install the same wheel.
# Per pair: a venv $FBN_COMPAT_DIR/venvs/tf-X.Y-keras-A.B.C (kept between runs) with
# tensorflow-cpu==X.Y.Z, keras==A.B.C, pytest and tf-keras==X.Y.* (--no-deps: it would pull
# the full tensorflow wheel; left out where there is no such release); the wheel installed;
# then `python -m pytest -m compat` on the copy's tests, from a directory outside the copy
# (so the installed package is the one imported).
#
# Output: a line per pair (TF, Keras, tf_keras, passed/failed/skipped, seconds), the logs
# and this run's results ($FBN_COMPAT_DIR/run/: logs/, results.json, results.md), and this
# run's rows merged into docs/results/compat.md (one row per TF version and Keras role;
# --no-doc: not). Exits 1 if any pair failed, 2 on a usage or setup error.
#
# Environment: FBN_COMPAT_DIR (default ~/.cache/fbn_grad_tf_compat; venvs ~1.5 GB each),
# FBN_COMPAT_PYTHON (the Python of the venvs, default python3), FBN_COMPAT_TESTS (pytest
# paths relative to the source, default tests/test_compat.py tests/test_portability.py).
set -uo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${FBN_COMPAT_DIR:-$HOME/.cache/fbn_grad_tf_compat}
PY=${FBN_COMPAT_PYTHON:-python3}
read -r -a TESTS <<< "${FBN_COMPAT_TESTS:-tests/test_compat.py tests/test_portability.py}"
DEFAULT_TF="2.16 2.17 2.18 2.19 2.20 2.21"
SOURCE=head
WRITE_DOC=1
REQUESTS=()

# The Keras 3 release current when each TensorFlow X.Y.0 came out (the newest patch of that
# Keras minor): TF 2.16 (Mar 2024) 3.3.3; 2.17 (Jul 2024) 3.4.1; 2.18 (Oct 2024) 3.6.0;
# 2.19 (Mar 2025) 3.9.2; 2.20 (Aug 2025) 3.11.3; 2.21 (Mar 2026) 3.13.2.
keras_at_release() {
  case $1 in
    2.16) echo 3.3.3 ;; 2.17) echo 3.4.1 ;; 2.18) echo 3.6.0 ;;
    2.19) echo 3.9.2 ;; 2.20) echo 3.11.3 ;; 2.21) echo 3.13.2 ;;
    *) echo "" ;;
  esac
}

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }

for a in "$@"; do
  case $a in
    --worktree) SOURCE=worktree ;;
    --no-doc) WRITE_DOC=0 ;;
    -h|--help) usage; exit 0 ;;
    [0-9]*.[0-9]*) REQUESTS+=("$a") ;;
    *) echo "compat_check: unknown argument $a (see --help)" >&2; exit 2 ;;
  esac
done
[ ${#REQUESTS[@]} -gt 0 ] || read -r -a REQUESTS <<< "$DEFAULT_TF"

T_START=$SECONDS
say() { echo "[compat $(date +%H:%M:%S)] $*"; }
die() { echo "[compat] ERROR: $*" >&2; exit 2; }
# pip, minus the "WARNING: Location '...' is ignored" lines of this machine's pip
# configuration; keeps pip's exit status.
pipq() {
  "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }
  return "${PIPESTATUS[0]}"
}
# The versions of a package on the index, newest first ("pip index versions").
index_versions() {
  pipq "$PY" -m pip index versions "$1" | sed -n 's/^Available versions: //p' | tr -d ' ' | tr ',' '\n'
}
newest_matching() { grep -E "$1" | sort -V | tail -n 1; }

command -v "$PY" > /dev/null || die "no $PY (set FBN_COMPAT_PYTHON)"
mkdir -p "$CACHE/venvs" "$CACHE/build" || die "cannot create $CACHE"
exec 9> "$CACHE/.lock"
flock -n 9 || die "another compat_check.sh is running with $CACHE (FBN_COMPAT_DIR)"
RUN=$CACHE/run
rm -rf "$RUN"
mkdir -p "$RUN/logs" "$RUN/junit" "$RUN/wheels" "$RUN/cwd"
LOGS=$RUN/logs
: > "$RUN/results.jsonl"

# ---- versions ------------------------------------------------------------------------------
say "looking up the releases of tensorflow-cpu, keras and tf-keras"
TF_ALL=$(index_versions tensorflow-cpu)
KERAS_ALL=$(index_versions keras)
TFK_ALL=$(index_versions tf-keras)
[ -n "$TF_ALL" ] && [ -n "$KERAS_ALL" ] || die "pip index versions found no tensorflow-cpu/keras releases"
KERAS_NEWEST=$(newest_matching '^3\.[0-9]+\.[0-9]+$' <<< "$KERAS_ALL")

PAIRS=()  # "tf_minor tf_full keras tf_keras role"
for req in "${REQUESTS[@]}"; do
  minor=${req%%:*}
  [[ $minor =~ ^[0-9]+\.[0-9]+$ ]] || die "bad TF version $minor (want X.Y or X.Y:KERAS)"
  tf_full=$(newest_matching "^${minor//./\\.}\.[0-9]+$" <<< "$TF_ALL")
  [ -n "$tf_full" ] || die "no tensorflow-cpu $minor.* on the index"
  tfk=$(newest_matching "^${minor//./\\.}\.[0-9]+$" <<< "$TFK_ALL")
  at_release=$(keras_at_release "$minor")
  if [[ $req == *:* ]]; then
    k=${req#*:}
    role=other
    [ "$k" = "$at_release" ] && role="at release"
    [ "$k" = "$KERAS_NEWEST" ] && role=newest
    PAIRS+=("$minor|$tf_full|$k|${tfk:--}|$role")
  else
    [ -n "$at_release" ] || die "no Keras-at-release entry for TF $minor (keras_at_release in $0); name one: $minor:KERAS"
    PAIRS+=("$minor|$tf_full|$at_release|${tfk:--}|at release")
    [ "$KERAS_NEWEST" = "$at_release" ] || PAIRS+=("$minor|$tf_full|newest|${tfk:--}|newest")
  fi
done
say "plan: ${#PAIRS[@]} pair(s); newest Keras 3 on the index: $KERAS_NEWEST"
for p in "${PAIRS[@]}"; do
  IFS='|' read -r minor tf_full k tfk role <<< "$p"
  echo "    tensorflow-cpu $tf_full  keras ${k/newest/newest that installs (from $KERAS_NEWEST down)}  tf-keras $tfk"
done

# ---- source --------------------------------------------------------------------------------
SNAP=$RUN/src
mkdir -p "$SNAP"
COMMIT=$(git -C "$REPO" rev-parse --short HEAD) || die "$REPO is not a git repository"
if [ "$SOURCE" = head ]; then
  say "source: HEAD ($COMMIT) via git archive -> $SNAP"
  git -C "$REPO" archive --format=tar HEAD | tar -x -C "$SNAP" || die "git archive failed"
else
  COMMIT="$COMMIT+worktree"
  say "source: the working tree (tracked and unignored files) -> $SNAP"
  (cd "$REPO" && git ls-files -z --cached --others --exclude-standard \
     | "$PY" -c 'import os,sys; sys.stdout.write("".join(p + "\0" for p in sys.stdin.read().split("\0") if p and os.path.isfile(p)))' \
     | tar --null -T - -cf -) | tar -x -C "$SNAP" || die "copying the working tree failed"
fi

MACHINE="$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | sed 's/.*: //; s/(R)//g; s/ Processor$//'), $(nproc) CPUs, $(uname -sm), Python $("$PY" -c 'import platform; print(platform.python_version())')"

# Makes dst a copy of src, file by file: a file is rewritten only when its content differs
# (so unchanged sources keep their timestamps for setup.py's object cache); files not in src
# are removed, except the build outputs (build/, *.egg-info).
sync_tree() {
  "$PY" - "$1" "$2" <<'EOF'
import filecmp, os, shutil, sys
src, dst = sys.argv[1:]
keep = lambda rel: rel.split(os.sep)[0] == "build" or ".egg-info" in rel
wanted = set()
for root, _, files in os.walk(src):
    for f in files:
        rel = os.path.relpath(os.path.join(root, f), src)
        wanted.add(rel)
        s, d = os.path.join(src, rel), os.path.join(dst, rel)
        if not (os.path.isfile(d) and filecmp.cmp(s, d, shallow=False)):
            os.makedirs(os.path.dirname(d), exist_ok=True)
            shutil.copyfile(s, d)
            shutil.copymode(s, d)
for root, _, files in os.walk(dst):
    for f in files:
        rel = os.path.relpath(os.path.join(root, f), dst)
        if rel not in wanted and not keep(rel):
            os.remove(os.path.join(dst, rel))
EOF
}

# ---- venvs, builds, tests ------------------------------------------------------------------
# Creates (or reuses) the venv of a pair; prints the Keras version installed. Keras "newest":
# the newest Keras 3 on the index, else the newest pip resolves next to this TensorFlow.
setup_venv() {
  local venv=$1 tf_full=$2 keras=$3 tfk=$4 log=$5 spec
  spec="tensorflow-cpu==$tf_full keras==$keras tf-keras==$tfk pytest pybind11>=2.12 setuptools>=64 wheel"
  if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.fbn-compat-spec" 2>/dev/null)" = "$spec" ]; then
    echo "venv $venv reused" >> "$log"
    return 0
  fi
  rm -rf "$venv"
  "$PY" -m venv "$venv" >> "$log" 2>&1 || return 1
  pipq "$venv/bin/python" -m pip install -q "tensorflow-cpu==$tf_full" "keras==$keras" pytest \
    "pybind11>=2.12" "setuptools>=64" wheel >> "$log" || return 1
  if [ "$tfk" != "-" ]; then
    pipq "$venv/bin/python" -m pip install -q --no-deps "tf-keras==$tfk" >> "$log" || return 1
  fi
  echo "$spec" > "$venv/.fbn-compat-spec"
}

# "keras newest": the newest Keras 3 that pip installs next to tensorflow-cpu==$1.
resolve_newest_keras() {
  local tf_full=$1 log=$2 report=$RUN/resolve-$1.json
  if pipq "$PY" -m pip install -q --dry-run --ignore-installed --report "$report" \
       "tensorflow-cpu==$tf_full" "keras==$KERAS_NEWEST" >> "$log"; then
    echo "$KERAS_NEWEST"
    return 0
  fi
  echo "keras $KERAS_NEWEST does not install with tensorflow-cpu $tf_full; asking pip for the newest that does" >> "$log"
  pipq "$PY" -m pip install -q --dry-run --ignore-installed --report "$report" \
    "tensorflow-cpu==$tf_full" "keras>=3,<4" >> "$log" || return 1
  "$PY" -c 'import json,sys; print([p["metadata"]["version"] for p in json.load(open(sys.argv[1]))["install"] if p["metadata"]["name"].lower() == "keras"][0])' "$report"
}

declare -A WHEEL BUILD_FAILED
record() {  # status tf tf_keras keras role passed failed skipped test_s total_s notes
  "$PY" - "$RUN/results.jsonl" "$@" "$(date +%Y-%m-%d)" "$MACHINE" "$COMMIT" <<'EOF'
import json, sys
keys = ["status", "tf", "tf_keras", "keras", "role", "passed", "failed", "skipped",
        "test_seconds", "total_seconds", "notes", "date", "machine", "commit"]
row = dict(zip(keys, sys.argv[2:]))
for k in ("passed", "failed", "skipped", "test_seconds", "total_seconds"):
    row[k] = int(row[k]) if row[k] not in ("", "-") else None
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(row) + "\n")
EOF
}

i=0
for p in "${PAIRS[@]}"; do
  i=$((i + 1))
  IFS='|' read -r minor tf_full keras tfk role <<< "$p"
  t0=$SECONDS
  tag="tf-$tf_full-keras-$keras"
  plog=$LOGS/$tag.log
  : > "$plog"
  if [ "$keras" = newest ]; then
    say "($i/${#PAIRS[@]}) TF $tf_full: which Keras 3 is the newest that installs"
    if ! keras=$(resolve_newest_keras "$tf_full" "$plog"); then
      say "($i/${#PAIRS[@]}) TF $tf_full: no Keras 3 installs with it (log: $plog)"
      record "install failed" "$tf_full" "$tfk" "?" "$role" - - - - $((SECONDS - t0)) "pip finds no Keras 3 for it"
      continue
    fi
    tag="tf-$tf_full-keras-$keras"
    mv "$plog" "$LOGS/$tag.log"
    plog=$LOGS/$tag.log
  fi
  name="TF $tf_full + Keras $keras ($role)"
  venv=$CACHE/venvs/tf-$minor-keras-$keras
  say "($i/${#PAIRS[@]}) $name: venv $venv"
  if ! setup_venv "$venv" "$tf_full" "$keras" "$tfk" "$plog"; then
    why=$(grep -E "ERROR|error:" "$plog" | tail -n 1 | cut -c1-160)
    say "($i/${#PAIRS[@]}) $name: INSTALL FAILED: $why (log: $plog)"
    record "install failed" "$tf_full" "$tfk" "$keras" "$role" - - - - $((SECONDS - t0)) "install failed: $why"
    continue
  fi
  if [ -z "${WHEEL[$minor]:-}" ] && [ -z "${BUILD_FAILED[$minor]:-}" ]; then
    bdir=$CACHE/build/tf-$minor
    blog=$LOGS/build-tf-$tf_full.log
    say "($i/${#PAIRS[@]}) building the wheel against TF $tf_full (CPU kernels; log: $blog)"
    tb=$SECONDS
    mkdir -p "$bdir/src" "$RUN/wheels/tf-$minor"
    sync_tree "$SNAP" "$bdir/src"
    rm -rf "$bdir"/src/build/lib* "$bdir"/src/build/bdist* "$bdir"/src/build/temp*
    if (cd "$bdir/src" && env -u FBN_GRAD_TF_SANITIZE -u FBN_GRAD_TF_ASAN -u FBN_GRAD_TF_LIBRARY \
          FBN_GRAD_TF_CUDA=0 FBN_GRAD_TF_BUILD=all \
          "$venv/bin/python" -m pip wheel --no-build-isolation --no-deps -w "$RUN/wheels/tf-$minor" . \
          > "$blog" 2>&1); then
      WHEEL[$minor]=$(ls "$RUN/wheels/tf-$minor"/fbn_grad_tf-*.whl | head -n 1)
      say "($i/${#PAIRS[@]}) built $(basename "${WHEEL[$minor]}") in $((SECONDS - tb)) s"
    else
      BUILD_FAILED[$minor]=$(grep -E "error" "$blog" | head -n 1 | cut -c1-160)
      say "($i/${#PAIRS[@]}) BUILD FAILED against TF $tf_full: ${BUILD_FAILED[$minor]} (log: $blog)"
    fi
  fi
  if [ -n "${BUILD_FAILED[$minor]:-}" ]; then
    record "build failed" "$tf_full" "$tfk" "$keras" "$role" - - - - $((SECONDS - t0)) "build failed: ${BUILD_FAILED[$minor]}"
    continue
  fi
  if ! pipq "$venv/bin/python" -m pip install -q --no-deps --force-reinstall "${WHEEL[$minor]}" >> "$plog"; then
    say "($i/${#PAIRS[@]}) $name: installing the wheel failed (log: $plog)"
    record "install failed" "$tf_full" "$tfk" "$keras" "$role" - - - - $((SECONDS - t0)) "the wheel did not install"
    continue
  fi
  tfk_installed=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("tf-keras"))' 2>/dev/null || echo -)
  say "($i/${#PAIRS[@]}) $name: pytest -m compat (log: $plog)"
  cwd=$RUN/cwd/$tag
  mkdir -p "$cwd"
  junit=$RUN/junit/$tag.xml
  tt=$SECONDS
  paths=()
  for t in "${TESTS[@]}"; do paths+=("$SNAP/$t"); done
  (cd "$cwd" && env -u PYTHONPATH -u FBN_GRAD_TF_LIBRARY TF_CPP_MIN_LOG_LEVEL=2 \
     "$venv/bin/python" -m pytest -m compat -p no:cacheprovider --rootdir "$SNAP" -q -rfEs \
     --junitxml "$junit" "${paths[@]}" >> "$plog" 2>&1)
  rc=$?
  test_s=$((SECONDS - tt))
  # passed failed skipped status notes, from the JUnit report
  read -r passed failed skipped status notes < <("$PY" - "$junit" "$rc" <<'EOF'
import os, sys
import xml.etree.ElementTree as ET
path, rc = sys.argv[1], int(sys.argv[2])
if not os.path.isfile(path):
    print("- - - failed pytest ran no test (rc %d)" % rc)
    raise SystemExit
root = ET.parse(path).getroot()
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
failed = n["failures"] + n["errors"]
bad = [c.get("name") for s in suites for c in s.iter("testcase")
       if c.find("failure") is not None or c.find("error") is not None]
status = "ok" if rc == 0 and failed == 0 and n["tests"] > 0 else "failed"
notes = ", ".join(bad[:4]) + (" (+%d more)" % (len(bad) - 4) if len(bad) > 4 else "")
if status == "failed" and not notes:
    notes = "pytest exit status %d" % rc
print(n["tests"] - failed - n["skipped"], failed, n["skipped"], status, notes or "-")
EOF
)
  line=$(printf 'TF %-7s Keras %-7s tf_keras %-7s %3s passed %3s failed %3s skipped  tests %4d s  (pair %4d s)' \
         "$tf_full" "$keras" "$tfk_installed" "$passed" "$failed" "$skipped" "$test_s" $((SECONDS - t0)))
  if [ "$status" = ok ]; then
    say "($i/${#PAIRS[@]}) $line"
  else
    say "($i/${#PAIRS[@]}) $line  FAILED: $notes"
    grep -E "^(FAILED|ERROR) " "$plog" | head -n 8 | sed 's/^/        /'
  fi
  [ "$notes" = "-" ] && notes=""
  record "$status" "$tf_full" "$tfk_installed" "$keras" "$role" "$passed" "$failed" "$skipped" \
    "$test_s" $((SECONDS - t0)) "$notes"
done

# ---- summary -------------------------------------------------------------------------------
DOC=""
[ "$WRITE_DOC" = 1 ] && DOC=$REPO/docs/results/compat.md
"$PY" - "$RUN" "$DOC" "$((SECONDS - T_START))" "$SOURCE" <<'EOF'
import json, os, re, sys

run, doc, wall, source = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
rows = [json.loads(line) for line in open(os.path.join(run, "results.jsonl"))]
ROLE_ORDER = {"at release": 0, "newest": 1, "other": 2}
COLS = ["TF", "Keras", "tf_keras", "passed", "failed", "skipped", "time", "date", "machine",
        "commit", "notes"]


def vkey(v):
    return tuple(int(p) if p.isdigit() else 0 for p in re.split(r"[.+]", v))


def cells(r):
    result = r["status"] if r["status"] != "ok" else ""
    notes = "; ".join(x for x in (result, r["notes"]) if x)
    num = lambda v: "-" if v is None else str(v)
    return [r["tf"], "%s (%s)" % (r["keras"], r["role"]), r["tf_keras"], num(r["passed"]),
            num(r["failed"]), num(r["skipped"]),
            "-" if r["test_seconds"] is None else "%d s" % r["test_seconds"], r["date"],
            r["machine"], r["commit"], notes.replace("|", "/")]


def key(c):  # (TF minor, Keras role[, Keras version for "other"])
    tf_minor = ".".join(c[0].split(".")[:2])
    m = re.match(r"(\S+) \((.*)\)$", c[1])
    ver, role = (m.group(1), m.group(2)) if m else (c[1], "other")
    return (tf_minor, role, ver if role == "other" else "")


def sort_key(c):
    k = key(c)
    return (vkey(k[0]), ROLE_ORDER.get(k[1], 3), vkey(k[2] or "0"))


def table(cell_rows):
    out = ["| " + " | ".join(COLS) + " |", "|" + "---|" * len(COLS)]
    out += ["| " + " | ".join(c) + " |" for c in sorted(cell_rows, key=sort_key)]
    return "\n".join(out) + "\n"


new = [cells(r) for r in rows]
failed = [r for r in rows if r["status"] != "ok"]
with open(os.path.join(run, "results.json"), "w") as f:
    json.dump(rows, f, indent=1)
with open(os.path.join(run, "results.md"), "w") as f:
    f.write(table(new))
print("\n" + table(new))
print("%d pair(s), %d failed; %d s in all; logs in %s/logs" % (len(rows), len(failed), wall,
                                                               run))

if doc:
    old = []
    if os.path.isfile(doc):
        for line in open(doc):
            if line.startswith("| ") and not line.startswith("| TF |"):
                c = [x.strip() for x in line.strip().strip("|").split("|")]
                if len(c) == len(COLS):
                    old.append(c)
    merged = {key(c): c for c in old}
    merged.update({key(c): c for c in new})
    os.makedirs(os.path.dirname(doc), exist_ok=True)
    with open(doc, "w") as f:
        f.write(
            "# Compatibility: TensorFlow x Keras 3\n\n"
            "fbn_grad_tf built from source against each TensorFlow of the Keras 3 era "
            "(`tensorflow-cpu`, the newest patch release of each, CPU kernels) and tested "
            "with two Keras 3 versions per TensorFlow: the one current when that "
            "TensorFlow was released (*at release*) and the newest that installs with it "
            "(*newest*); tf_keras is the release numbered like the TensorFlow. The tests "
            "are the `compat` subset of [tests/test_compat.py](../../tests/test_compat.py) "
            "and [tests/test_portability.py](../../tests/test_portability.py): "
            "our backward and forward ops against TensorFlow's per dtype and format, "
            "`convert` + `fit` + `model.export` of MobileNetV2 served without fbn_grad_tf, "
            "`override()` on Keras 3 and tf_keras models, `revert` round trips, TFLite of a "
            "reverted model, weight files and checkpoints between NASNetMobile or "
            "MobileNetV2 and its conversion, and `.keras` files of converted models.\n\n"
            "Written by `bash scripts/compat_check.sh [TF versions]` (each run replaces "
            "the rows of the pairs it ran). *time*: the pytest run; *commit*: the source "
            "tested (`+worktree`: uncommitted files included).\n\n")
        f.write(table(list(merged.values())))
    print("rows merged into %s" % doc)

    # README's compat block: one row per TF version, from the merged table.
    readme = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(doc))), "README.md")
    begin, end = "<!-- BEGIN GENERATED: compat -->", "<!-- END GENERATED: compat -->"
    text = open(readme).read() if os.path.isfile(readme) else ""
    if begin in text and end in text:
        by_tf = {}
        for c in sorted(merged.values(), key=sort_key):
            by_tf.setdefault(c[0], []).append(c)
        lines = [begin, "<!-- made by scripts/compat_check.sh from docs/results/compat.md: "
                 "rerun it instead of editing -->",
                 "Machine: %s. Every pair: [docs/results/compat.md](docs/results/compat.md)."
                 % "; ".join(sorted({c[8] for c in merged.values()})), "",
                 "| TensorFlow | Keras 3 (at release, newest) | tf_keras | compat tests passed "
                 "| date |", "|---|---|---|---|---|"]
        for tf_v, cs in by_tf.items():
            ok = all(c[4] == "0" and not c[10] for c in cs)
            lines.append("| %s | %s | %s | %s%s | %s |" % (
                tf_v, ", ".join(c[1].split(" ")[0] for c in cs), cs[0][2],
                " / ".join(c[3] for c in cs), "" if ok else " (failures: see the table)",
                max(c[7] for c in cs)))
        lines.append(end)
        i, j = text.index(begin), text.index(end) + len(end)
        with open(readme, "w") as f:
            f.write(text[:i] + "\n".join(lines) + text[j:])
        print("README.md's compat block rewritten")
EOF
[ -s "$RUN/results.jsonl" ] || exit 2
if grep -q '"status": "ok"' "$RUN/results.jsonl" && ! grep -qv '"status": "ok"' "$RUN/results.jsonl"; then
  exit 0
fi
exit 1
