#!/usr/bin/env bash
# Run the whole test suite (sets everything up first). Fails if a test left a
# mount (a FUSE mount of the daemon) behind under this run's own directory;
# mounts elsewhere, a user's sshfs or another test run's, are none of its business.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# ruff and mypy first (CAPSULEFS_LINT=0 skips them: tests/ops/test_scripts.py,
# which runs this script for its mount check only).
if [ "${CAPSULEFS_LINT:-1}" != 0 ]; then
    bash scripts/lint.sh
fi

# Every test directory and mount point of this run is under run_root
# (tests/conftest.py reads CAPSULEFS_TEST_ROOT), and so is pytest's basetemp.
run_root=$(mktemp -d /tmp/capsulefs-test.XXXXXX)
chmod 0711 "$run_root"
export CAPSULEFS_TEST_ROOT=$run_root

# The mount points under run_root, from the mount table (its octal escapes undone).
mounts_left() {
    local _dev mnt _rest
    while read -r _dev mnt _rest; do
        mnt=$(printf '%b' "$mnt")
        case "$mnt" in "$run_root"/*) printf '%s\n' "$mnt" ;; esac
    done </proc/self/mounts
}

rc=0
finish() {
    local left
    left=$(mounts_left)
    if [ -n "$left" ]; then
        echo "test.sh: mounts left behind under $run_root (kept):" >&2
        printf '%s\n' "$left" >&2
        rc=1
    else  # (never removed through a mount)
        rm -rf --one-file-system "$run_root"
    fi
    exit $rc
}
trap finish EXIT
trap 'rc=130; exit' INT TERM

# Every Python process of the run (pytest, whose rewritten test modules are cached
# too, and each capsulefs CLI, daemon and helper it starts) reads its compiled
# modules from __pycache__ (git-ignored) instead of compiling the package again:
# PYTHONDONTWRITEBYTECODE=1 in a caller's environment cost up to 0.25 s of CPU
# per process, and 7 s at collection.
unset PYTHONDONTWRITEBYTECODE
# Two worker processes (pytest-xdist; CAPSULEFS_TEST_WORKERS=N for another
# number, 0 for none), each given whole test files (--dist loadfile: a module's
# engines, an etcd or a weed, start once). Most of a test's time is a real
# process, a daemon or a disk it waits for, so on 2 cores two workers take
# about half the time of one; every test keeps its own directories, ports,
# namespaces and uids, so workers never share anything but the machine.
workers=${CAPSULEFS_TEST_WORKERS:-2}
dist=()
[ "$workers" = 0 ] || dist=(--dist loadfile)
.venv/bin/python -m pytest -q -p no:cacheprovider -n "$workers" "${dist[@]}" --basetemp "$run_root/basetemp" "$@" || rc=$?
