"""capsulefs verify of a ~1 GiB capsule in 1,000 blobs vs sha256sum of the same files.

Both run as whole processes, alternately, on a warm page cache. Target:
verify's throughput >= 0.9x sha256sum's.
"""

from __future__ import annotations

import argparse
import tarfile
import tempfile
from pathlib import Path

from common import capsulefs_cmd, extract_all, pairs, random_blobs, run

from capsulefs.core.capsule import archive
from capsulefs.core.capsule import format as fmt
from capsulefs.core.store.host_store import HostStore


def build(tmp: Path, n: int, size: int) -> Path:
    store = HostStore.open(tmp / "state")
    agent = store.create_agent("bench", host_id="BENCH", agent_id="b" * 32)
    snap = {}
    with store.writing():
        for i, blob in enumerate(random_blobs(n, size)):
            snap[f"f{i:04}"] = store.put_blob(blob)
        agent.write_files({fmt.SNAPSHOT: fmt.snapshot_bytes(snap)}, add_blobs=set(snap.values()))
    tar = tmp / "cap.tar"
    archive.export_agent(agent, str(tar), mtime=0)
    out = tmp / "cap"
    with tarfile.open(tar) as tf:
        extract_all(tf, out)
    tar.unlink()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blobs", type=int, default=1000)
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round: does it run (CI), not a figure")
    args = ap.parse_args()
    if args.smoke:
        args.blobs, args.size, args.rounds = 5, 4096, 1
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        cap = build(Path(tmp), args.blobs, args.size)
        files = sorted(str(p) for p in cap.rglob("*") if p.is_file() and p.name != fmt.MANIFEST)
        total = sum(Path(f).stat().st_size for f in files)
        res = pairs(
            lambda: run(capsulefs_cmd() + ["verify", str(cap)]),
            lambda: run(["sha256sum", *files]),
            rounds=args.rounds,
            warmup=0 if args.smoke else 1,
        )
    mib = total / (1 << 20)
    print(f"capsule: {args.blobs} blobs, {mib:.0f} MiB")
    print(f"capsulefs verify: {mib / res['candidate_s']:.0f} MiB/s (median {res['candidate_s']:.2f} s)")
    print(f"sha256sum:        {mib / res['baseline_s']:.0f} MiB/s (median {res['baseline_s']:.2f} s)")
    print(f"throughput ratio verify/sha256sum: {res['speed_ratio']:.2f}x (target >= 0.9x); "
          f"per pair: {', '.join(f'{r:.2f}' for r in res['ratios'])}")


if __name__ == "__main__":
    main()
