"""The fleet mode's commands: check-blobs (the conformance check of a blob tier),
ls and hosts (what the directory says), gc (of the blob tier).

httpx and the engine clients are imported inside the commands, so the rest
of the CLI does not pay for them.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from capsulefs.cli import UsageError
from capsulefs.cli.common import state_dir

if TYPE_CHECKING:
    from capsulefs.fleet.blobcheck import Report
    from capsulefs.core.fleet.directory import Layout
    from capsulefs.fleet.directory import AgentRow, HostRow

def register(sub: argparse._SubParsersAction) -> None:
    fleet = sub.add_parser("fleet", help="the fleet mode's engines: a directory on etcd, a blob tier on S3")
    fsub = fleet.add_subparsers(dest="fleet_command", metavar="ACTION", required=True)
    p = fsub.add_parser(
        "check-blobs",
        help="check that an S3 blob tier honours conditional writes (exit 1 naming each failed property)",
        description="Write a few small objects under PREFIX/capsulefs-check/ and check that the tier refuses a "
        "second If-None-Match write, lets exactly one of 8 racing writers win, refuses If-Match with a stale "
        "ETag and reads back what won; the objects are deleted afterwards. Credentials: AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) from the environment, else from the host keychain "
        "('capsulefs secret set AWS_ACCESS_KEY_ID').",
    )
    p.add_argument("url", metavar="URL", help="the tier: http[s]://HOST[:PORT]/BUCKET[/PREFIX] (path-style)")
    p.add_argument("--region", default=None,
                   help="the region to sign for (default: $AWS_REGION, $AWS_DEFAULT_REGION, else us-east-1)")
    p.add_argument("--writers", type=int, default=8, help="racing writers (default 8)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds one request may take (default 30)")
    p.set_defaults(func=cmd_check_blobs)
    p = fsub.add_parser(
        "gc", help="delete from the blob tier the blobs that no host's live set names (one gc at a time)",
        description="Delete from the fleet's blob tier every blob that no host's published live set names and "
        "that has been in the tier longer than the grace; each is marked first, the live sets read again, and "
        "deleted only if still unnamed. Refused, in one line, while another gc runs, or when a host that holds "
        "an agent in the directory has no live set (or a stale one). Credentials as check-blobs.")
    p.add_argument("--grace", default="24h", metavar="DURATION",
                   help="how long a blob must have been in the tier before it may go: 90s, 30m, 24h, 7d "
                   "(default 24h; longer than any move)")
    p.add_argument("--dry-run", action="store_true", help="say what would be deleted; delete nothing")
    p.add_argument("--directory", metavar="etcd://HOST:PORT[,...]",
                   help="the directory (etcd); default: the one 'mount --directory' saved in the state dir")
    p.add_argument("--prefix", default=None,
                   help="the fleet's key prefix in etcd (default: the saved one, else /capsulefs/)")
    p.add_argument("--blobs", metavar="URL", default=None,
                   help="the blob tier, http[s]://HOST[:PORT]/BUCKET[/PREFIX]; default: the saved one")
    p.add_argument("--state", metavar="DIR", default=argparse.SUPPRESS, help="host state directory")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds one request may take (default 30)")
    p.set_defaults(func=cmd_gc)
    for name, func, what in (
        ("ls", cmd_ls, "every agent in the directory: its holder, epoch, state, and whether the holder's lease lives"),
        ("hosts", cmd_hosts, "every host with a live lease: its address, lease time left and agents held"),
    ):
        p = fsub.add_parser(name, help=what, description=what + ". Exit 1 if a record in the directory "
                            "does not parse (it is listed, with the problem).")
        p.add_argument("--directory", metavar="etcd://HOST:PORT[,...]",
                       help="the directory (etcd); default: the one 'mount --directory' saved in the state dir")
        p.add_argument("--prefix", default=None,
                       help="the fleet's key prefix in etcd (default: the saved one, else /capsulefs/)")
        p.add_argument("--state", metavar="DIR", default=argparse.SUPPRESS, help="host state directory")
        p.add_argument("--json", action="store_true", help="one JSON object per line")
        p.add_argument("--timeout", type=float, default=10.0, help="seconds one request may take (default 10)")
        p.set_defaults(func=func)


def cmd_check_blobs(args: argparse.Namespace) -> int:
    import trio

    from capsulefs.core.fleet.s3_wire import parse_tier_url
    from capsulefs.fleet.blobcheck import check_blob_tier
    from capsulefs.fleet.credentials import tier_credentials, tier_region
    from capsulefs.fleet.s3 import open_s3

    if args.writers < 2 or args.writers > 64:
        raise UsageError("--writers is 2 to 64")
    tier = parse_tier_url(args.url)
    creds = tier_credentials(state_dir(args))
    region = args.region or tier_region()

    async def run() -> Report:
        async with open_s3(tier, creds, region=region, timeout=args.timeout,
                           connections=max(16, args.writers)) as s3:
            return await check_blob_tier(s3, writers=args.writers)

    report = trio.run(run)
    for line in report.lines():
        print(line)
    if report.ok:
        return 0
    sys.stdout.flush()
    print(f"capsulefs: error: the blob tier fails: {', '.join(report.failed)}", file=sys.stderr)
    return 1


def cmd_gc(args: argparse.Namespace) -> int:
    import trio

    from capsulefs.core.fleet import config
    from capsulefs.core.fleet.s3_wire import parse_tier_url
    from capsulefs.fleet.credentials import tier_credentials, tier_region
    from capsulefs.fleet.etcd import open_etcd
    from capsulefs.fleet.s3 import open_s3
    from capsulefs.fleet.tiergc import TierGcReport, run_tier_gc
    from capsulefs.testing import seams

    grace = parse_duration(args.grace, "--grace")
    layout = _layout(args)
    blobs = args.blobs
    if blobs is None:
        saved = config.load(state_dir(args))
        blobs = saved.blobs if saved is not None else None
        if blobs is None:
            raise UsageError(f"no --blobs given and no blob tier saved in {state_dir(args)} "
                             "(capsulefs mount --directory ... --blobs URL saves it)")
    tier = parse_tier_url(blobs)
    creds = tier_credentials(state_dir(args))
    pause = seams.gc_pause_seam(os.environ.get(seams.GC_PAUSE_ENV))

    async def run() -> TierGcReport:
        async with open_etcd(args.directory, timeout=args.timeout) as etcd, \
                open_s3(tier, creds, region=tier_region(), timeout=args.timeout) as s3:
            return await run_tier_gc(etcd, s3, layout, grace=grace, dry_run=args.dry_run, pause=pause)

    r = trio.run(run)
    print(f"tier gc {tier}: {r.listed} blob(s) in the tier, {r.named} named by the live sets of "
          f"{len(r.sets)} host(s), {r.young} unnamed but younger than the grace")
    if r.dry_run:
        print(f"dry run: {r.candidates} blob(s) would be deleted")
    else:
        print(f"deleted {r.deleted} blob(s), {r.freed} bytes; kept {r.kept} candidate(s) named again or marked "
              f"by another gc; removed {r.stale_marks} mark(s) of an earlier gc")
    return 0


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, what: str) -> float:
    """``90s``, ``30m``, ``24h``, ``7d`` or plain seconds; UsageError naming ``what`` otherwise."""
    t = text.strip()
    number, unit = (t[:-1], t[-1]) if t[-1:] in _UNITS else (t, "s")
    if not (number.isascii() and number.isdigit() and 0 < len(number) <= 9):
        raise UsageError(f"{what} {text[:40]!r} is not a duration such as 90s, 30m, 24h or 7d")
    return float(int(number) * _UNITS[unit])


def _layout(args: argparse.Namespace) -> Layout:
    """The fleet's layout; fills in ``args.directory`` from the saved configuration if not given."""
    from capsulefs.core.fleet import config
    from capsulefs.core.fleet.directory import Layout

    if args.directory is None:
        saved = config.load(state_dir(args))
        if saved is None:
            raise UsageError(f"no --directory given and none saved in {state_dir(args)} "
                             "(capsulefs mount --directory etcd://HOST:PORT saves it)")
        args.directory = saved.directory
        if args.prefix is None:
            args.prefix = saved.prefix
    try:
        return Layout((config.DEFAULT_PREFIX if args.prefix is None else args.prefix).encode("utf-8"))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _read(args: argparse.Namespace, hosts: bool) -> tuple[list[AgentRow], list[HostRow]]:
    import trio

    from capsulefs.fleet.directory import read_agents, read_hosts
    from capsulefs.fleet.etcd import open_etcd

    layout = _layout(args)

    async def run() -> tuple[list[AgentRow], list[HostRow]]:
        async with open_etcd(args.directory, timeout=args.timeout) as etcd:
            agents = await read_agents(etcd, layout)
            return agents, (await read_hosts(etcd, layout, agents=agents) if hosts else [])

    return trio.run(run)


def _table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def _bad(problems: list[str]) -> int:
    if not problems:
        return 0
    sys.stdout.flush()
    print(f"capsulefs: error: {len(problems)} record(s) in the directory do not parse; the first: {problems[0]}",
          file=sys.stderr)
    return 1


def cmd_ls(args: argparse.Namespace) -> int:
    import json

    agents, _ = _read(args, hosts=False)
    if args.json:
        for a in agents:
            e = a.entry
            print(json.dumps({"agent_id": a.agent_id, "holder": e and e.host_id, "epoch": e and e.epoch,
                              "state": e.state.value if e else "unreadable", "holder_alive": a.holder_alive,
                              "problem": a.problem}))
    else:
        rows = [["AGENT", "HOLDER", "EPOCH", "STATE", "HOLDER'S LEASE"]]
        for a in agents:
            if a.entry is None:
                rows.append([a.agent_id, "-", "-", "unreadable", a.problem])
            else:
                rows.append([a.agent_id, a.entry.host_id, str(a.entry.epoch), a.entry.state.value,
                             "alive" if a.holder_alive else "gone"])
        _table(rows)
    return _bad([f"{a.agent_id}: {a.problem}" for a in agents if a.entry is None])


def cmd_hosts(args: argparse.Namespace) -> int:
    import json

    agents, hosts = _read(args, hosts=True)
    if args.json:
        for h in hosts:
            print(json.dumps({"host_id": h.host_id, "address": h.entry and h.entry.address, "lease_ttl": h.lease_ttl,
                              "agents": h.agents, "problem": h.problem}))
    else:
        rows = [["HOST", "ADDRESS", "LEASE LEFT", "AGENTS"]]
        for h in hosts:
            if h.entry is None:
                rows.append([h.host_id, "unreadable", h.problem, "-"])
            else:
                rows.append([h.host_id, h.entry.address, "gone" if h.lease_ttl is None else f"{h.lease_ttl}s",
                             str(h.agents)])
        _table(rows)
    return _bad([f"host {h.host_id}: {h.problem}" for h in hosts if h.entry is None]
                + [f"{a.agent_id}: {a.problem}" for a in agents if a.entry is None])
