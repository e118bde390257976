#!/usr/bin/env bash
# The long fuzz pass (issue 25): every target of tests/fuzz (tests/fuzz/targets_*.py)
# for SECONDS in all (default 600, shared equally), then inputs/s, distinct
# exceptions that are not CapsuleError, leftovers in staging/, peak RSS and the
# load average. Extra arguments go to the harness, e.g. --only archive, --save DIR.
# Exit 1 if anything was found. CI runs a short pass instead (tests/fuzz/test_fuzz.py).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-600}
shift || true
[ -x .venv/bin/python ] || bash scripts/setup.sh
cd tests
exec ../.venv/bin/python -m fuzz.harness --seconds "$seconds" "$@"
