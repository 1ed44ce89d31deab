#!/usr/bin/env bash
# The AddressSanitizer-only check of the core (the original check; docs/HARDENING.md): now
# scripts/sanitize_check.sh with FBN_SANITIZE=address. The old variables still work:
#   FBN_ASAN_DIR (default /tmp/fbn_asan), FBN_ASAN_EXAMPLES (default 2000), FBN_ASAN_SEED,
#   FBN_ASAN_CUDA. CI runs scripts/sanitize_check.sh (ASan + UBSan).
set -euo pipefail
export FBN_SANITIZE=address
export FBN_SAN_DIR=${FBN_ASAN_DIR:-/tmp/fbn_asan}
export FBN_SAN_EXAMPLES=${FBN_ASAN_EXAMPLES:-2000}
export FBN_SAN_SEED=${FBN_ASAN_SEED:-0}
export FBN_SAN_CUDA=${FBN_ASAN_CUDA:-0}
exec bash "$(dirname "$0")/sanitize_check.sh"
