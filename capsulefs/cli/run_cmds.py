"""Commands for running agents: secrets in the host keychain, the reference agent."""

from __future__ import annotations

import argparse
import sys

from capsulefs.agents import grants, keychain
from capsulefs.cli import UsageError
from capsulefs.cli.common import open_store, state_dir
from capsulefs.core.capsule.spec import ENV_NAME


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


def _agent_id(args: argparse.Namespace) -> tuple[str, str | None]:
    """(agent id, name) of ``args.agent``: an agent here by name or id, or
    the id of one not here yet (a grant may wait for a move)."""
    from capsulefs.core.capsule import format as fmt
    from capsulefs.core.errors import NotFoundError

    try:
        agent = open_store(args).find(args.agent)
    except NotFoundError:
        if fmt.is_agent_id(args.agent):
            return args.agent, None
        raise
    return agent.agent_id, agent.manifest().name


def _check_names(names: list[str]) -> list[str]:
    bad = [n for n in names if not ENV_NAME.fullmatch(n)]
    if bad:
        raise UsageError(f"not a secret name: {', '.join(map(repr, bad))} (letters, digits and _, as in the spec)")
    return names


def _shown(agent_id: str, name: str | None) -> str:
    return f"agent {name} ({agent_id})" if name else f"agent {agent_id} (not on this host yet)"


def cmd_secret_grant(args: argparse.Namespace) -> int:
    agent_id, name = _agent_id(args)
    now = grants.grant(state_dir(args), agent_id, _check_names(args.names))
    print(f"{_shown(agent_id, name)} may now be given: {', '.join(now)}")
    return 0


def cmd_secret_revoke(args: argparse.Namespace) -> int:
    agent_id, name = _agent_id(args)
    left = grants.revoke(state_dir(args), agent_id, _check_names(args.names) if args.names else None)
    print(f"{_shown(agent_id, name)} may now be given: {', '.join(left) or 'no secret'}")
    return 0


def cmd_secret_grants(args: argparse.Namespace) -> int:
    open_store(args)  # (the first look at an old state directory grants what its agents used)
    for agent_id, names in grants.all_grants(state_dir(args)).items():
        print(f"{agent_id}  {' '.join(names)}")
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    from capsulefs.agents.reference.loop import main

    return main(args)


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
    s = ssub.add_parser("grant", help="let an agent be given these secrets of this host (an agent moved or "
                                      "imported here gets none on its own; 'new --spec' grants what its spec asks)")
    s.add_argument("agent", help="agent name or id (an id for an agent not here yet)")
    s.add_argument("names", nargs="+", metavar="NAME")
    s.set_defaults(func=cmd_secret_grant)
    s = ssub.add_parser("revoke", help="take grants back (every grant of the agent if no NAME is given)")
    s.add_argument("agent", help="agent name or id")
    s.add_argument("names", nargs="*", metavar="NAME")
    s.set_defaults(func=cmd_secret_revoke)
    s = ssub.add_parser("grants", help="list every agent's grants (agent id, then secret names)")
    s.set_defaults(func=cmd_secret_grants)
