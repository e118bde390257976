"""``capsulefs mcp AGENT``: serve one agent to MCP clients over stdio
(see :mod:`capsulefs.cli.mcp_server`, which needs the ``mcp`` extra)."""

from __future__ import annotations

import argparse

from capsulefs.cli import UsageError


def cmd_mcp(args: argparse.Namespace) -> int:
    try:
        from capsulefs.cli import mcp_server
    except ImportError as exc:
        raise UsageError(f"capsulefs mcp needs the mcp package: pip install 'capsulefs[mcp]' ({exc})") from None
    return mcp_server.serve(args)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("mcp", help="serve an agent to MCP clients (stdio): timeline, search, memory, files, status")
    p.add_argument("agent", help="agent name or id")
    p.set_defaults(func=cmd_mcp)
