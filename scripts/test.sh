#!/usr/bin/env bash
# The test command of README.md (and of .ci/run): set up from scratch if needed, then run
# the whole fast suite. Extra arguments go to pytest (e.g. -m slow, -k name).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
echo "[test] running pytest"
# pytest exits 5 when it collects no test: that counts as a failure here too.
exec python -m pytest -ra -q -p no:cacheprovider "$@"
