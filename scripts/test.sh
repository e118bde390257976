#!/usr/bin/env bash
# Run the whole test suite (sets everything up first). Fails if a test left a
# FUSE mount behind.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
rc=0
.venv/bin/python -m pytest -q -p no:cacheprovider "$@" || rc=$?
if grep -q ' fuse' /proc/mounts; then
    echo "test.sh: FUSE mounts left behind:" >&2
    grep ' fuse' /proc/mounts >&2
    rc=1
fi
exit $rc
