"""Moving agents between hosts from the command line: move, move --abandon, move --resume, peer-serve.

While a mount daemon serves the state directory (its runtime file
``STATE/mount/daemon.json`` names a live process and mount), ``move``,
``move --abandon`` and ``move --learn`` go through it: they write
``.control/move`` (or ``.control/abandon``, ``.control/learn``) of the agent
in its mount and draw the progress from ``.control/status``, so one state
directory never has two move drivers.
Without a daemon they run the move driver in this process, on the host
store alone, holding the state directory as a daemon does for its life
(``daemon.holding_state``): no daemon can start and run the agent meanwhile,
and no second command can change the same holder records. So do
``--resume``, ``--learn``, ``--force-hold`` and ``peer-serve``; while a
daemon serves, ``--force-hold`` is refused (unmount first), since the
daemon may be changing that record.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
import threading
from functools import partial

import trio

from capsulefs.cli.common import state_dir
from capsulefs.core.errors import CapsuleError
from capsulefs.core.store.holder import HolderRecord, HolderState
from capsulefs.core.store.learning import force_hold
from capsulefs.core.store.story import story
from capsulefs.core.fleet import config as fleet_config
from capsulefs.daemon.daemon import find_daemon, holding_state
from capsulefs.move.doubt import abandon_move, learn_holder
from capsulefs.move.outcome import MoveControl
from capsulefs.move.source import move_agent, resume_moves
from capsulefs.move.host import MoveHost
from capsulefs.move.target import serve_moves
from capsulefs.peer.book import DEFAULT_PORT, Peer, parse_address

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("move", help="move an agent to a peer (fenced two-phase commit over TLS)")
    p.add_argument("agent", help="agent name or id")
    p.add_argument("peer", nargs="?", help="peer name or host id (see 'capsulefs peer ls')")
    p.add_argument("--abandon", action="store_true",
                   help="end an in-doubt move here by resuming the agent; RISK: if the target did "
                        "activate it, two hosts run it")
    p.add_argument("--force-hold", action="store_true",
                   help="hold an agent whose holder record is lost or missing here, at the epoch its files "
                        "say; RISK: if a peer holds a newer epoch, two hosts run it")
    p.add_argument("--learn", action="store_true",
                   help="for an agent in doubt here (holder record lost, imported): ask every peer who holds it; "
                        "held here if none does; if one does, what this host has is kept under recovery/ "
                        "and the agent retired here (through the daemon if one runs)")
    p.add_argument("--why", default="", help="with --abandon or --force-hold: the reason, logged")
    p.add_argument("--resume", action="store_true", help="finish moves a crash interrupted (no AGENT needed: use -)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds one call may take (default 120)")
    p.set_defaults(func=cmd_move)

    p = sub.add_parser("peer-serve", help="answer peers' moves in the foreground (without a mount daemon)")
    p.add_argument("--listen", default=f"0.0.0.0:{DEFAULT_PORT}", help=f"HOST:PORT (default 0.0.0.0:{DEFAULT_PORT})")
    p.set_defaults(func=cmd_peer_serve)


class _Bar:
    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()

    def __call__(self, phase: str, done: int, total: int, nbytes: int) -> None:
        line = f"{phase}: {done}/{total} pieces, {nbytes / 2**20:.1f} MiB sent"
        if self.tty:
            print(f"\r\033[K{line}", end="", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def _target(state: str, host: MoveHost, name: str) -> Peer:
    """The peer named: a live host of the directory in the fleet mode (the
    state dir's fleet.json; the daemon checks it again), else a pinned peer."""
    from capsulefs.core.fleet import config

    fleet = config.load(state)
    if fleet is None:
        return host.peers.find(name)
    from capsulefs.fleet.etcd import open_etcd  # (httpx: only in the fleet mode)
    from capsulefs.fleet.peers import DirectoryPeers

    directory, layout = fleet.directory, fleet.layout

    async def find() -> Peer:
        async with open_etcd(directory) as etcd:
            return await DirectoryPeers(etcd, layout, me=host.me).find(name)

    return trio.run(find)


def _through_daemon(args: argparse.Namespace, host: MoveHost, mountpoint: str) -> int:
    """Move or abandon by writing the agent's control files in the daemon's mount."""
    agent = host.store.find(args.agent)
    control = os.path.join(mountpoint, agent.manifest().name, ".control")
    if args.abandon:
        try:
            with open(os.path.join(control, "abandon"), "w") as f:
                f.write(args.why.strip().replace("\n", " ") + "\n")
        except OSError as exc:
            print(f"capsulefs: error: abandon: {exc.strerror} (see the daemon's log)", file=sys.stderr)
            return 1
        print(f"{agent.agent_id}: the daemon abandons the move and resumes the agent. If the target "
              f"activated it, two hosts now run it: check the target.")
        return 0
    if not args.peer:
        raise CapsuleError("move: name the peer to move to (see 'capsulefs peer ls')")
    peer = _target(state_dir(args), host, args.peer)
    running = _read_move_status(control) or {}
    if running.get("phase") not in (None, "idle") and running.get("outcome") is None:
        # The kernel serialises writes to one file: ours would wait behind the running move's.
        print(f"capsulefs: error: {agent.agent_id} is already moving to {running.get('target')} "
              f"({running.get('phase')}) [EBUSY]; see {control}/status", file=sys.stderr)
        return 1
    outcome: list[OSError | None] = []

    def write() -> None:
        try:
            with open(os.path.join(control, "move"), "w") as f:
                f.write(peer.name + "\n")
            outcome.append(None)
        except OSError as exc:
            outcome.append(exc)

    writer = threading.Thread(target=write, name="control-move", daemon=True)
    writer.start()
    bar = _Bar()
    last = None
    while writer.is_alive():
        writer.join(timeout=0.2)
        move = _read_move_status(control)
        if move and move.get("outcome") is None and move.get("phase") not in (None, "idle"):
            line = (move["phase"], move.get("blobs_sent", 0), move.get("blobs_total", 0), move.get("bytes_sent", 0))
            if line != last:
                bar(*line)  # type: ignore[arg-type]
                last = line
    bar.done()
    failure = outcome[0] if outcome else OSError(errno.EIO, "the write got no answer")
    if failure is None:
        print(f"{agent.agent_id}: moved to {peer.name} (through the daemon serving {mountpoint})")
        return 0
    move = _read_move_status(control) or {}
    why = move.get("detail") or "see the daemon's log"
    code = errno.errorcode.get(failure.errno or 0, "?")
    print(f"{agent.agent_id}: not moved: {failure.strerror or failure} [{code}]: {why}", file=sys.stderr)
    return 1


def _learn_through_daemon(args: argparse.Namespace, host: MoveHost, mountpoint: str) -> int:
    """``--learn`` beside a daemon: write the agent's ``.control/learn``; the
    daemon asks the peers, and keeps, retires or resumes the agent."""
    agent = host.store.find(args.agent)
    name = agent.manifest().name
    try:
        with open(os.path.join(mountpoint, name, ".control", "learn"), "w") as f:
            f.write("learn\n")
    except OSError as exc:
        if exc.errno != errno.EHOSTUNREACH:
            print(f"capsulefs: error: learn: {exc.strerror} [{errno.errorcode.get(exc.errno or 0, '?')}] "
                  f"(see the daemon's log)", file=sys.stderr)
            return 1
    rec = host.holders.get(agent.agent_id)
    if rec is None:
        raise CapsuleError(f"learn: agent {name} has no holder record here")
    return _said_learned(name, rec)


def _read_move_status(control: str) -> dict | None:
    try:
        with open(os.path.join(control, "status")) as f:
            move = json.load(f).get("move")
    except (OSError, ValueError):
        return None
    return move if isinstance(move, dict) else None


def cmd_move(args: argparse.Namespace) -> int:
    for flag, given in (("--abandon", args.abandon), ("--force-hold", args.force_hold)):
        if given and not args.why.strip():
            raise CapsuleError(f"{flag} needs --why REASON: it is logged with the risk it takes")
    state = state_dir(args)
    host = MoveHost.open(state)
    daemon = find_daemon(state)
    if daemon is not None:
        if args.resume:
            print(f"the daemon serving {daemon['mountpoint']} (pid {daemon['pid']}) resumes interrupted moves itself")
            return 0
        if args.learn:
            return _learn_through_daemon(args, host, str(daemon["mountpoint"]))
        for flag, given, why in (("--force-hold", args.force_hold, "the daemon may be changing the agent's record"),):
            if given:
                raise CapsuleError(f"{flag} runs without a daemon ({why}): "
                                   f"unmount first ('capsulefs umount {daemon['mountpoint']}')")
        return _through_daemon(args, host, str(daemon["mountpoint"]))
    if (args.resume or not (args.learn or args.force_hold or args.abandon)) and fleet_config.load(state) is not None:
        # (without the daemon's directory calls and lease the move would be one the directory never sees)
        raise CapsuleError("in the fleet mode a move goes through the mount's daemon, which holds the host's lease "
                           "and asks the directory: mount first ('capsulefs mount MNT')")
    if args.resume:
        doing = "resuming interrupted moves"
    else:
        verb = ("learning who holds" if args.learn else "forcing the hold of" if args.force_hold
                else "abandoning the move of" if args.abandon else "moving")
        doing = f"{verb} {args.agent} without a daemon"
    with holding_state(state, doing=doing):
        return _offline(args, host)


def _offline(args: argparse.Namespace, host: MoveHost) -> int:
    """``cmd_move`` without a daemon; the caller holds the state directory."""
    if args.resume:
        results = trio.run(partial(resume_moves, host, call_timeout=args.timeout))
        for r in results:
            print(f"{r.agent_id}: {r.state.value} ({r.reason})")
        return 0
    agent_id = host.store.find(args.agent).agent_id
    if args.learn:
        host.holders.reconcile([agent_id])  # files here without a record: in doubt
        name = host.store.agent(agent_id).name
        rec = trio.run(partial(learn_holder, host, agent_id, call_timeout=args.timeout))
        return _said_learned(name, rec)
    if args.force_hold:
        rec = host.holders.get(agent_id) or HolderRecord(agent_id=agent_id, state=HolderState.UNKNOWN, epoch=0)
        # UNKNOWN, or HELD and in doubt until a peer answers (docs/move.md, "Checking before running")
        if rec.state not in (HolderState.UNKNOWN, HolderState.HELD):
            raise CapsuleError(f"agent {agent_id} is {rec.state.value} here, not in doubt: nothing to force")
        epoch = host.store.agent(agent_id).manifest().holder.epoch
        host.holders.put(force_hold(rec, local_epoch=epoch, why=args.why))
        log.warning("agent %s: held at epoch %d by operator force (%s); if a peer holds a newer epoch, two "
                    "hosts run it until that peer is asked", agent_id, epoch, args.why)
        print(f"{agent_id}: held here at epoch {epoch} (forced). If a peer holds a newer epoch, two hosts run it.")
        return 0
    if args.abandon:
        rec = abandon_move(host.holders, agent_id, me=host.me, why=args.why)
        log.warning("agent %s: move abandoned by the operator (%s)", agent_id, args.why)
        print(f"{agent_id}: held here again at epoch {rec.held_epoch}. If the target activated it, "
              f"two hosts now run it: check the target before starting the agent.")
        return 0
    if not args.peer:
        raise CapsuleError("move: name the peer to move to (see 'capsulefs peer ls')")
    peer = host.peers.find(args.peer)
    bar = _Bar()
    result = trio.run(partial(move_agent, host, agent_id, peer, call_timeout=args.timeout,
                              control=MoveControl(on_progress=bar)))
    bar.done()
    if result.moved:
        print(f"{agent_id}: moved to {peer.name} at epoch {result.epoch} "
              f"({result.contents_sent} pieces, {result.bytes_sent / 2**20:.1f} MiB on the link)")
        return 0
    print(f"{agent_id}: not moved: {result.state.value} ({result.cause.value}: {result.cause.meaning}): {result.reason}",
          file=sys.stderr)
    return 1


def _said_learned(name: str, rec: HolderRecord) -> int:
    """What ``--learn`` found, in the agent's one story (``story.story``)."""
    if rec.state is HolderState.HELD:
        print(f"{name}: every peer answered and none holds it: {story(rec, name).line()}")
    elif rec.state is HolderState.RETIRED:
        print(f"{name}: {story(rec, name).line()}")
    else:
        print(f"{name}: not every peer answered (see the log); try again later: {story(rec, name).line()}")
        return 1
    return 0


def cmd_peer_serve(args: argparse.Namespace) -> int:
    listen_host, port = parse_address(args.listen, listen=True)
    # Serving moves changes holder records and installs agents: like a
    # daemon, it holds the state directory for its life.
    with holding_state(state_dir(args), doing=f"serving moves on {args.listen}"):
        return _peer_serve(MoveHost.open(state_dir(args)), listen_host, port)


def _peer_serve(host: MoveHost, listen_host: str, port: int) -> int:

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            serving = await nursery.start(partial(serve_moves, host, listen_host=listen_host, port=port))
            print(f"serving moves on {listen_host}:{serving.port} as {host.me}", flush=True)

    try:
        trio.run(main)
    except KeyboardInterrupt:
        return 130
    return 0
