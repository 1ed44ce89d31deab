#!/usr/bin/env bash
# The main job of README.md: set up from scratch if needed, then run the demo (trains a small
# batch-norm CNN in tf.function with our op vs Keras/TF, checks against TF's op, prints a
# benchmark table). Extra arguments go to the demo (e.g. --plot demo.png).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
exec python -m fbn_grad_tf.demo "$@"
