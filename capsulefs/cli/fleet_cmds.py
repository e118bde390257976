"""The fleet mode's commands: check-blobs (the conformance check of a blob tier).

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

ACCESS_KEY = "AWS_ACCESS_KEY_ID"
SECRET_KEY = "AWS_SECRET_ACCESS_KEY"
SESSION_TOKEN = "AWS_SESSION_TOKEN"


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


def _credentials(args: argparse.Namespace) -> tuple[str, str, str | None]:
    access, secret = os.environ.get(ACCESS_KEY), os.environ.get(SECRET_KEY)
    if access and secret:
        return access, secret, os.environ.get(SESSION_TOKEN) or None
    from capsulefs.agents import keychain

    try:
        found = keychain.fetch(state_dir(args), [ACCESS_KEY, SECRET_KEY])
    except keychain.MissingSecret:
        raise UsageError(f"no credentials for the blob tier: set {ACCESS_KEY} and {SECRET_KEY} in the "
                         f"environment, or in the keychain with 'capsulefs secret set NAME'") from None
    return found[ACCESS_KEY], found[SECRET_KEY], None


def cmd_check_blobs(args: argparse.Namespace) -> int:
    import trio

    from capsulefs.core.fleet.s3_wire import parse_tier_url
    from capsulefs.core.fleet.sigv4 import Credentials
    from capsulefs.fleet.blobcheck import check_blob_tier
    from capsulefs.fleet.s3 import open_s3

    if args.writers < 2 or args.writers > 64:
        raise UsageError("--writers is 2 to 64")
    tier = parse_tier_url(args.url)
    access, secret, token = _credentials(args)
    try:
        creds = Credentials(access, secret, token)
    except ValueError as exc:
        raise UsageError(f"unusable blob tier credentials: {exc}") from None
    region = args.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"

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
