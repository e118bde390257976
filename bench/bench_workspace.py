"""Workspace scan (the freeze before a move): core.workspace.scan, which walks
by directory fd without recursion (walk.walk_tree), against the same work
done with the standard library's walks, on a normal workspace: 10,000 files
of 100 B to 8 KiB in 3-level directories (a source tree), page cache warm.

Baselines, each run alternately with the candidate in this script:
  * os.walk: list, lstat and sha256 each file by its path (what a plain
    script would do, following nothing);
  * os.fwalk: the scan as it was before (recursive, fd-based), kept here;
  * the walk alone: walk.walk_tree against os.walk + lstat, no hashing.
Target: the scan is not slower than either whole-scan baseline (ratio >= 0.95).
"""

from __future__ import annotations

import argparse
import os
import stat
import tempfile
from pathlib import Path

from common import pairs

from capsulefs.core.capsule import workspace
from capsulefs.core.walk import walk_tree
from capsulefs.core.hashing import hash_stream

OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def build(root: Path, files: int) -> None:
    seed = os.urandom(8192)
    for i in range(files):
        d = root / f"pkg{i % 10}" / f"mod{i // 10 % 10}" / f"sub{i // 100 % 10}"
        d.mkdir(parents=True, exist_ok=True)
        size = 100 + (i * 7919) % 8092
        (d / f"file{i}.py").write_bytes(i.to_bytes(4, "big") + seed[:size])


def hash_path(path: str) -> str:
    fd = os.open(path, OPEN)
    with os.fdopen(fd, "rb", buffering=0) as f:
        return hash_stream(f)[0]  # type: ignore[arg-type]


def walk_scan(root: str) -> dict[str, str]:
    """os.walk: every regular file by its path."""
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                out[os.path.relpath(path, root)] = hash_path(path)
    return out


def fwalk_scan(root: str) -> dict[str, str]:
    """The scan before (os.fwalk: recursive), its walk and hashing."""
    out = {}
    for top, dirs, files, top_fd in os.fwalk(root):
        for name in sorted(dirs + files):
            st = os.stat(name, dir_fd=top_fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                continue
            fd = os.open(name, OPEN, dir_fd=top_fd)
            with os.fdopen(fd, "rb", buffering=0) as f:
                out[os.path.relpath(os.path.join(top, name), root)] = hash_stream(f)[0]  # type: ignore[arg-type]
    return out


def walk_only(root: str) -> int:
    return sum(len(d.entries) for d in walk_tree(root))


def os_walk_only(root: str) -> int:
    n = 0
    for dirpath, dirs, names in os.walk(root):
        for name in dirs + names:
            os.lstat(os.path.join(dirpath, name))
            n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round: does it run (CI), not a figure")
    args = ap.parse_args()
    if args.smoke:
        args.files, args.rounds = 200, 1
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        ws = os.path.join(tmp, "workspace")
        build(Path(ws), args.files)
        snapshot = workspace.scan(ws, {}).changes
        assert len(snapshot) == args.files and walk_scan(ws) == fwalk_scan(ws) == snapshot
        scan = lambda: workspace.scan(ws, snapshot)  # noqa: E731 (a freeze that finds nothing new)
        print(f"workspace: {args.files} files in {sum(1 for _ in walk_tree(ws))} directories")
        for name, baseline in (("os.walk scan", lambda: walk_scan(ws)), ("os.fwalk scan (before)", lambda: fwalk_scan(ws))):
            r = pairs(scan, baseline, rounds=args.rounds)
            print(f"scan {r['candidate_s'] * 1e3:7.1f} ms, {name} {r['baseline_s'] * 1e3:7.1f} ms: "
                  f"{r['speed_ratio']:.2f}x its speed (target >= 0.95)")
        r = pairs(lambda: walk_only(ws), lambda: os_walk_only(ws), rounds=args.rounds)
        print(f"walk alone: walk_tree {r['candidate_s'] * 1e3:6.1f} ms, os.walk + lstat {r['baseline_s'] * 1e3:6.1f} ms: "
              f"{r['speed_ratio']:.2f}x its speed")


if __name__ == "__main__":
    main()
