#!/usr/bin/env bash
# Set everything up, then run the main job end to end on this machine:
# create a demo agent, give it memory and a workspace, export it signed,
# verify the export, and import it into a second host store.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
work=$(mktemp -d -t capsulefs-demo.XXXXXX)
trap 'rm -rf "$work"' EXIT
cfs() { .venv/bin/capsulefs "$@"; }
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

say "a new agent on host A"
cfs --state "$work/hostA" new demo
cfs --state "$work/hostA" ls

say "sign and export it, then verify the tar offline"
cfs keygen -o "$work/signing.key"
cfs --state "$work/hostA" export demo -o "$work/demo.tar.zst" --sign "$work/signing.key"
cfs verify "$work/demo.tar.zst" --pubkey "$work/signing.key.pub"
tar --zstd -tvf "$work/demo.tar.zst"

say "import it on host B"
cfs --state "$work/hostB" import "$work/demo.tar.zst"
cfs --state "$work/hostB" ls

say "a tampered copy does not verify"
mkdir "$work/unpacked"
tar --zstd -xf "$work/demo.tar.zst" -C "$work/unpacked"
echo "injected" >> "$work/unpacked/memory/working_memory.md"
if cfs verify "$work/unpacked"; then echo "BUG: tampering went unnoticed" >&2; exit 1; fi
echo "demo finished: every step above worked"
