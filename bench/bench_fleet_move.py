"""A move between two real daemons on one blob tier, against the same move without it.

Two ``capsulefs mount`` processes on loopback (``--no-run``), both in the
fleet mode on one local etcd (the tests' fixture, tests/fleet_kit.py); an
agent whose workspace lists ``--mib`` MiB of blobs (``--blobs`` of them),
made in the source's store before its daemon starts. Side by side, round by
round, each with a fresh pair of hosts:

  * tier: both mounts name one real SeaweedFS (``weed mini``) with
    ``--blobs``; the source's uploader has put every blob before the move
    (the bench waits for its record), so the target fetches them from the
    tier, in the warm-up before the freeze (capsulefs/move/warm.py), and the
    peer link carries the manifest, the capsule's small files and what the
    tier lacks (nothing here);
  * baseline: the same mounts without ``--blobs``: every blob goes over the
    peer link.

Reported per mode: the bytes the source sent on the peer link (its
``capsulefs_move_bytes_total{direction="sent"}``, framing included) against
the bound manifest + journal + 64 KiB; the bytes the target fetched from the
tier; freeze-to-activate (the sum of the source's phase times from
``freezing`` to ``activate``, ``capsulefs_move_phase_seconds``) against the
200 ms target, and the offer's share of it (where the target's fetch from
the tier runs); with the load average.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

import common  # noqa: F401  (puts the repository on sys.path)

sys.path.insert(0, str(common.REPO / "tests"))
sys.path.insert(0, str(common.REPO / "tests" / "daemons"))

from capsulefs.core.capsule import format as fmt  # noqa: E402
from capsulefs.core.store.holder import HolderBook, new_held  # noqa: E402
from capsulefs.core.store.host_store import HostStore  # noqa: E402
from capsulefs.fleet.uploader import RECORD_DIR  # noqa: E402
from fleet_kit import EtcdServer, WeedServer, running_etcd, running_weed  # noqa: E402
from prom_kit import parse, value  # noqa: E402
from test_move_daemons import Host, wait_for, write_move  # noqa: E402

PHASES = ("freezing", "offer", "transferring", "verify", "prepare", "activate")  # from the freeze to activate
BOUND_EXTRA = 64 * 1024


def make_agent(h: Host, mib: int, nblobs: int) -> tuple[str, int]:
    """An agent held by ``h`` listing ``nblobs`` random blobs of ``mib`` MiB in all; its id and the bytes."""
    store = HostStore.open(h.state)
    size = (mib << 20) // nblobs
    with store.writing():
        shas = [store.put_blob(os.urandom(size)) for _ in range(nblobs)]
    agent = store.create_agent("carrier", host_id=h.host_id, agent_id=secrets.token_hex(16))
    agent.write_files({fmt.SNAPSHOT: fmt.snapshot_bytes({f"data/{i:05d}": s for i, s in enumerate(shas)})},
                      add_blobs=set(shas))
    HolderBook(h.state / "holders").put(new_held(agent.agent_id, 1))
    return agent.agent_id, size * nblobs


def small_files(h: Host, agent_id: str) -> tuple[int, int]:
    """The capsule's manifest.json and journal sizes on ``h``."""
    base = h.state / "agents" / agent_id
    return (base / fmt.MANIFEST).stat().st_size, (base / fmt.JOURNAL).stat().st_size


def recorded(h: Host) -> int:
    d = h.state / RECORD_DIR
    return sum(len(p.read_text().split()) for p in d.iterdir()) if d.exists() else 0


def metrics(h: Host) -> dict:
    return parse((h.mnt / ".control" / "metrics").read_bytes())


def phase_sum(before: dict, after: dict) -> dict[str, float]:
    return {p: value(after, "capsulefs_move_phase_seconds_sum", phase=p)
            - value(before, "capsulefs_move_phase_seconds_sum", phase=p) for p in PHASES + ("warming",)}


def one_move(root: Path, etcd: EtcdServer, weed: WeedServer, mode: str, mib: int, nblobs: int) -> dict:
    root.mkdir()
    a, b = Host.init_all(root, "a", "b")
    flags: tuple[str, ...] = ("--directory", etcd.spec, "--directory-prefix", f"/bench-{secrets.token_hex(4)}/")
    if mode == "tier":
        bucket = "bench-" + secrets.token_hex(4)
        import trio

        from capsulefs.core.fleet.s3_wire import parse_tier_url
        from capsulefs.core.fleet.sigv4 import Credentials
        from capsulefs.fleet.s3 import open_s3

        async def create() -> None:
            async with open_s3(parse_tier_url(weed.tier_url(bucket)), Credentials(weed.access_key,
                                                                                  weed.secret_key)) as s3:
                await s3.create_bucket()

        trio.run(create)
        flags += ("--blobs", weed.tier_url(bucket, "fleet"))
    a.extra = b.extra = flags
    agent_id, total = make_agent(a, mib, nblobs)
    try:
        t0 = time.monotonic()
        a.start()
        b.start()
        if mode == "tier":
            wait_for(lambda: recorded(a) >= nblobs, "the source's blobs in the tier", timeout=3600)
        upload_s = time.monotonic() - t0
        wait_for(lambda: a.status("carrier")["state"] == "active", "the agent active on A")
        wait_for(lambda: b.host_id in a.cli("fleet", "hosts").stdout, "B in the directory (the target is found there)")
        manifest, journal = small_files(a, agent_id)
        before_a, before_b = metrics(a), metrics(b)
        t1 = time.monotonic()
        rc = write_move(a.mnt, "carrier", f"{b.host_id}\n")
        wall = time.monotonic() - t1
        assert rc == 0, f"the move failed: {os.strerror(rc)}\n{a.log.read_text()[-3000:]}"
        after_a, after_b = metrics(a), metrics(b)
    finally:
        a.stop()
        b.stop()
    phases = phase_sum(before_a, after_a)
    return {
        "mode": mode, "blob_bytes": total, "upload_s": upload_s, "wall_s": wall,
        "sent": value(after_a, "capsulefs_move_bytes_total", direction="sent")
        - value(before_a, "capsulefs_move_bytes_total", direction="sent"),
        "fetched": value(after_b, "capsulefs_tier_bytes_total", direction="fetched")
        - value(before_b, "capsulefs_tier_bytes_total", direction="fetched"),
        "bound": manifest + journal + BOUND_EXTRA, "manifest": manifest, "journal": journal,
        "freeze_to_activate_s": sum(phases[p] for p in PHASES), "phases": phases,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024, help="MiB of blobs the agent lists (default 1024)")
    ap.add_argument("--blobs", type=int, default=256, help="how many blobs (default 256: 4 MiB each)")
    ap.add_argument("--rounds", type=int, default=1, help="pairs of moves, tier and baseline (default 1)")
    ap.add_argument("--dir", help="where the hosts' state goes (default: a temporary directory)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: check that the bench runs")
    args = ap.parse_args()
    if args.smoke:
        args.mib, args.blobs, args.rounds = 4, 8, 1
    root = Path(tempfile.mkdtemp(prefix="bench-fleet-move-", dir=args.dir))
    results = []
    try:
        with running_etcd() as etcd, running_weed() as weed:
            os.environ["AWS_ACCESS_KEY_ID"] = weed.access_key  # (the daemons inherit them)
            os.environ["AWS_SECRET_ACCESS_KEY"] = weed.secret_key
            for r in range(args.rounds):
                for mode in ("tier", "baseline"):
                    res = one_move(root / f"{mode}-{r}", etcd, weed, mode, args.mib, args.blobs)
                    results.append(res)
                    shutil.rmtree(root / f"{mode}-{r}", ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"a move of an agent listing {args.mib} MiB in {args.blobs} blobs between two daemons "
          f"(load average {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f} {os.getloadavg()[2]:.1f})")
    print(f"{'mode':9} {'link bytes':>12} {'bound':>9} {'within':>6} {'tier fetched':>13} "
          f"{'freeze->activate':>16} {'offer':>8} {'warm-up':>9} {'move wall':>9} {'upload':>8}")
    for res in results:
        print(f"{res['mode']:9} {res['sent']:12,.0f} {res['bound']:9,} {str(res['sent'] <= res['bound']):>6} "
              f"{res['fetched']:13,.0f} {res['freeze_to_activate_s'] * 1000:13,.0f} ms "
              f"{res['phases']['offer'] * 1000:5,.0f} ms {res['phases']['warming']:8.2f}s "
              f"{res['wall_s']:8.2f}s {res['upload_s']:7.1f}s")
    for res in results:
        print(f"  {res['mode']:9} phases (ms): " + ", ".join(f"{p} {res['phases'][p] * 1000:,.0f}" for p in PHASES))
    print("(bound: manifest + journal + 64 KiB; freeze->activate: the source's phases freezing..activate, "
          "target 200 ms; warm-up: before the freeze, the target fetches from the tier what the agent's manifest "
          "lists; offer: the target fetches what is still missing)")


if __name__ == "__main__":
    main()
