"""Dedup: 10 agents sharing 90% of their blobs, disk used by the host store vs
one copy of the unique content (and vs 10 plain capsule copies, for scale).

Disk use is counted in allocated blocks (st_blocks), metadata files included.
Target: the store uses <= 1.15x the unique content.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from common import random_blobs

from capsulefs.core.capsule import format as fmt
from capsulefs.core.store.host_store import HostStore


def disk_use(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--agents", type=int, default=10)
    ap.add_argument("--blobs", type=int, default=100, help="blobs per agent")
    ap.add_argument("--size", type=int, default=256 << 10)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round: does it run (CI), not a figure")
    args = ap.parse_args()
    if args.smoke:
        args.agents, args.blobs, args.size = 2, 10, 4096
    n_shared = args.blobs * 9 // 10
    n_own = args.blobs - n_shared
    shared = random_blobs(n_shared, args.size, seed=1)
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        store = HostStore.open(Path(tmp) / "state")
        unique = [*shared]
        for a in range(args.agents):
            own = random_blobs(n_own, args.size, seed=100 + a)
            unique += own
            agent = store.create_agent(f"agent{a}", host_id="BENCH", agent_id=f"{a:032x}")
            snap = {}
            with store.writing():
                for i, blob in enumerate(shared + own):
                    snap[f"f{i}"] = store.put_blob(blob)
                agent.write_files({fmt.SNAPSHOT: fmt.snapshot_bytes(snap)}, add_blobs=set(snap.values()))
        unique_bytes = sum(len(b) for b in unique)
        used = disk_use(Path(store.root))
        naive = args.agents * args.blobs * args.size
    print(f"{args.agents} agents x {args.blobs} blobs of {args.size} bytes, {n_shared} shared by all")
    print(f"unique content:      {unique_bytes / 2**20:8.1f} MiB")
    print(f"host store on disk:  {used / 2**20:8.1f} MiB")
    print(f"{args.agents} plain copies:     {naive / 2**20:8.1f} MiB")
    print(f"store / unique content: {used / unique_bytes:.3f}x (target <= 1.15x); "
          f"store / plain copies: {used / naive:.3f}x")


if __name__ == "__main__":
    main()
