#!/usr/bin/env bash
# Run the whole test suite (scripts/test.sh; arguments go to pytest) with
# CPU-bound processes beside it, as on a busy CI machine: two busy loops by
# default (CAPSULEFS_LOAD_PROCS=N for another number). They are started and
# stopped here, by their process ids, also when the run fails or is
# interrupted. Its exit status is the suite's.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh  # (before the load: its own speed is not the point)

n=${CAPSULEFS_LOAD_PROCS:-2}
pids=()
stop_load() {
    local pid
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    pids=()
}
trap stop_load EXIT
trap 'exit 130' INT TERM

for _ in $(seq "$n"); do
    .venv/bin/python -c 'while 1: pass' &
    pids+=("$!")
done
echo "test-under-load: $n busy loop(s) beside the suite (pids ${pids[*]})"

start=$(date +%s)
rc=0
bash scripts/test.sh "$@" || rc=$?
elapsed=$(( $(date +%s) - start ))
echo "test-under-load: exit $rc after ${elapsed} s with $n busy loop(s); load average $(cut -d' ' -f1-3 /proc/loadavg)"
exit $rc
