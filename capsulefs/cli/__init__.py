"""The ``capsulefs`` command line.

Each command group lives in its own module under ``capsulefs.cli`` and
exposes ``register(subparsers)``, which adds its subcommands and sets
``func`` on each. ``main`` maps every domain error to one line on stderr and
a non-zero exit; nothing a user can cause prints a traceback.

A command's run imports only its own module (:data:`COMMANDS` says which),
and each module imports what its commands need inside them: ``capsulefs
log`` loads no numpy, trio, pyfuse3 or cryptography. Help, and anything
not in the table, builds the whole parser.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from capsulefs import __version__
from capsulefs.core.errors import CapsuleError

if TYPE_CHECKING:
    from typing import Any

# Modules that register subcommands, in the order --help lists them.
COMMAND_MODULES = (
    "capsulefs.cli.capsule_cmds",
    "capsulefs.cli.journal_cmds",
    "capsulefs.cli.index_cmds",
    "capsulefs.cli.mount_cmds",
    "capsulefs.cli.status_cmds",
    "capsulefs.cli.run_cmds",
    "capsulefs.cli.render_cmds",
    "capsulefs.cli.peer_cmds",
    "capsulefs.cli.move_cmds",
    "capsulefs.cli.fleet_cmds",
    "capsulefs.cli.mcp_cmds",
)
#: Which module registers each command (a test keeps it equal to what they register).
COMMANDS = {
    **dict.fromkeys(("new", "ls", "rm", "verify", "export", "import", "keygen", "gc"), "capsulefs.cli.capsule_cmds"),
    **dict.fromkeys(("log", "append", "merge"), "capsulefs.cli.journal_cmds"),
    **dict.fromkeys(("search", "reindex"), "capsulefs.cli.index_cmds"),
    **dict.fromkeys(("mount", "umount"), "capsulefs.cli.mount_cmds"),
    **dict.fromkeys(("status", "logs"), "capsulefs.cli.status_cmds"),
    **dict.fromkeys(("agent", "secret"), "capsulefs.cli.run_cmds"),
    "render": "capsulefs.cli.render_cmds",
    **dict.fromkeys(("init", "id", "peer"), "capsulefs.cli.peer_cmds"),
    **dict.fromkeys(("move", "peer-serve"), "capsulefs.cli.move_cmds"),
    "fleet": "capsulefs.cli.fleet_cmds",
    "mcp": "capsulefs.cli.mcp_cmds",
}


class UsageError(Exception):
    """A command was called wrongly; the message says how."""


def _columns() -> int:
    """``shutil.get_terminal_size().columns``, without importing shutil
    (and with it bz2, lzma and zlib): argparse's help formatter imports it
    for each argument it adds, when it is not given a width."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


class _Formatter(argparse.HelpFormatter):
    """argparse's help formatter, as wide as the terminal (less 2, as argparse's own)."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: int | None = None) -> None:
        super().__init__(prog, indent_increment, max_help_position, _columns() - 2 if width is None else width)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose help formatter is :class:`_Formatter` unless
    told otherwise (its subcommands' parsers are of this class too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)


def _command(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names (its first word that is no global option
    or option value), or None (none, or help asked before it)."""
    args = iter(argv)
    for arg in args:
        if arg == "--state":
            next(args, None)
        elif arg in ("-h", "--help", "--version") or arg == "--":
            return None
        elif not arg.startswith("-"):
            return arg
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``command`` (one of :data:`COMMANDS`), only its
    module's subcommands are registered (and imported)."""
    parser = _Parser(
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
    only = COMMANDS.get(command or "")
    for name in COMMAND_MODULES:
        if only is None or name == only:
            importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    parser = build_parser(_command(argv))
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
