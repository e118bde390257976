"""Commands for running agents: secrets in the host keychain, the reference agent."""

from __future__ import annotations

import argparse
import sys

from capsulefs import keychain
from capsulefs.cli import UsageError
from capsulefs.cli.common import state_dir


def cmd_secret_set(args: argparse.Namespace) -> int:
    if sys.stdin.isatty():
        import getpass

        value = getpass.getpass(f"value of {args.name}: ")
    else:
        value = sys.stdin.read().rstrip("\n")
    if not value:
        raise UsageError(f"refusing to store an empty value for {args.name}")
    keychain.store_secret(state_dir(args), args.name, value)
    print(f"stored secret {args.name}")
    return 0


def cmd_secret_ls(args: argparse.Namespace) -> int:
    names = keychain.secret_names(state_dir(args))
    if names is None:
        print("the system keyring is in use; it cannot list its entries", file=sys.stderr)
        return 0
    for n in names:
        print(n)
    return 0


def cmd_secret_rm(args: argparse.Namespace) -> int:
    keychain.delete_secret(state_dir(args), args.name)
    print(f"removed secret {args.name}")
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    from capsulefs import agent

    return agent.main(args)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("agent", help="run the reference agent loop (the default entrypoint of an agent's spec)")
    p.set_defaults(func=cmd_agent)

    p = sub.add_parser("secret", help="manage the secrets agents' specs name (values never enter a capsule)")
    ssub = p.add_subparsers(dest="secret_command", metavar="ACTION", required=True)
    s = ssub.add_parser("set", help="store a secret; the value is read from stdin, never from the command line")
    s.add_argument("name")
    s.set_defaults(func=cmd_secret_set)
    s = ssub.add_parser("ls", help="list stored secret names")
    s.set_defaults(func=cmd_secret_ls)
    s = ssub.add_parser("rm", help="delete a secret")
    s.add_argument("name")
    s.set_defaults(func=cmd_secret_rm)
