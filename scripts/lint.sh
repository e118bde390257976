#!/usr/bin/env bash
# ruff and mypy, as pyproject.toml configures them (scripts/test.sh runs this
# before pytest). Needs the venv scripts/setup.sh makes.
#
# mypy cannot follow pyproject's package-dir (core/ is capsulefs.core, mount/
# is capsulefs.mount; an editable install maps them with an import hook), so
# it checks a tree of symlinks in the shape of the installed package.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

.venv/bin/ruff check --quiet .

tree=$(mktemp -d /tmp/capsulefs-mypy.XXXXXX)
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/capsulefs"
for entry in capsulefs/*; do
    ln -s "$repo/$entry" "$tree/capsulefs/"
done
ln -s "$repo/core" "$tree/capsulefs/core"
ln -s "$repo/mount" "$tree/capsulefs/mount"
# Paths in mypy's messages are the tree's (capsulefs/core/...): said as the repository's.
(cd "$tree" && "$repo/.venv/bin/mypy" --config-file "$repo/pyproject.toml" \
    --cache-dir "$repo/.mypy_cache" -p capsulefs) \
    | sed -e 's|^capsulefs/core/|core/|' -e 's|^capsulefs/mount/|mount/|'
