"""The ``capsulefs`` command line.

Each command group lives in its own module under ``capsulefs.cli`` and
exposes ``register(subparsers)``, which adds its subcommands and sets
``func`` on each. ``main`` maps every domain error to one line on stderr and
a non-zero exit; nothing a user can cause prints a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from capsulefs import __version__
from capsulefs.core.errors import CapsuleError

# Modules that register subcommands, in the order --help lists them.
COMMAND_MODULES = (
    "capsulefs.cli.capsule_cmds",
    "capsulefs.cli.journal_cmds",
    "capsulefs.cli.index_cmds",
    "capsulefs.cli.mount_cmds",
    "capsulefs.cli.run_cmds",
    "capsulefs.cli.render_cmds",
    "capsulefs.cli.peer_cmds",
    "capsulefs.cli.move_cmds",
    "capsulefs.cli.fleet_cmds",
)


class UsageError(Exception):
    """A command was called wrongly; the message says how."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="capsulefs",
        description="Mount every agent this host holds as a live capsule directory; "
        "verify, export, import, sign, merge, render and move agents.",
    )
    parser.add_argument("--version", action="version", version=f"capsulefs {__version__}")
    parser.add_argument(
        "--state",
        metavar="DIR",
        help="host state directory (default: /var/lib/capsulefs as root, else ~/.local/share/capsulefs)",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="capsulefs: %(levelname)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except (CapsuleError, UsageError) as exc:
        print(f"capsulefs: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("capsulefs: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        print(f"capsulefs: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1
    return int(rc or 0)
