"""Host identity and peers: init, id, peer add/ls/rm."""

from __future__ import annotations

import argparse

from capsulefs.cli.common import state_dir
from capsulefs.core.store.host_store import HostStore
from capsulefs.peer.identity import identity_path, load_identity, load_or_create_identity
from capsulefs.peer.book import Peer, PeerBook, PeerBookError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("init", help="make this host's state directory, key and certificate")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("id", help="print this host's id (the digest of its certificate)")
    p.set_defaults(func=cmd_id)

    peer = sub.add_parser("peer", help="manage the hosts this host moves agents to and from")
    psub = peer.add_subparsers(dest="peer_command", metavar="ACTION", required=True)
    p = psub.add_parser("add", help="pin a peer by name, address and host id")
    p.add_argument("name", help="a local name for the peer, e.g. laptop")
    p.add_argument("address", help="HOST:PORT of its daemon (port 7714 if left out)")
    p.add_argument("host_id", metavar="HOSTID", help="its id, as printed by 'capsulefs id' on it")
    p.set_defaults(func=cmd_peer_add)
    p = psub.add_parser("ls", help="list peers")
    p.set_defaults(func=cmd_peer_ls)
    p = psub.add_parser("rm", help="forget a peer (its links are refused from now on)")
    p.add_argument("name")
    p.set_defaults(func=cmd_peer_rm)


def cmd_init(args: argparse.Namespace) -> int:
    root = state_dir(args)
    existed = identity_path(root).exists()
    HostStore.open(root)
    ident = load_or_create_identity(root)
    verb = "already initialised" if existed else "initialised"
    print(f"{root}: {verb}; host id {ident.host_id}")
    return 0


def cmd_id(args: argparse.Namespace) -> int:
    print(load_identity(state_dir(args)).host_id)
    return 0


def cmd_peer_add(args: argparse.Namespace) -> int:
    book = PeerBook(state_dir(args))
    peer = Peer(name=args.name, address=args.address, host_id=args.host_id)
    if peer.host_id == load_or_create_identity(state_dir(args)).host_id:
        raise PeerBookError(f"{peer.host_id} is this host's own id")
    book.add(peer)
    print(f"added peer {peer.name} at {peer.address} ({peer.host_id})")
    return 0


def cmd_peer_ls(args: argparse.Namespace) -> int:
    for p in PeerBook(state_dir(args)).peers():
        print(f"{p.name}\t{p.address}\t{p.host_id}")
    return 0


def cmd_peer_rm(args: argparse.Namespace) -> int:
    p = PeerBook(state_dir(args)).remove(args.name)
    print(f"removed peer {p.name} ({p.host_id})")
    return 0

