"""An agent in doubt on this host: the operator's way out of a move no driver
finishes (:func:`abandon_move`), and learning from every peer who holds an
agent whose holder record was lost (:func:`learn_holder`).

Rules:
  * Abandon runs the source machine's own restart and abandon steps: the
    agent is held here again at its old epoch; if the target did activate
    it, two hosts run it, and the log says so.
  * Learning fences the agent at every peer first; only every peer's answer
    is evidence (core/store/learning.py decides). A host that learns it gave
    the agent up keeps a whole copy of what it had (recovery/) before it
    removes anything: nothing acknowledged is deleted.
"""

from __future__ import annotations

import logging
import os

import trio

from capsulefs.core import move as mv
from capsulefs.core.errors import CapsuleError
from capsulefs.core.store.holder import HolderBook, HolderRecord, HolderState
from capsulefs.core.store.kept import keep_copy
from capsulefs.core.store.learning import learn_from_peers
from capsulefs.core.move.wire import result_to_answer
from capsulefs.move.host import MoveHost
from capsulefs.move.source import Connector
from capsulefs.peer.client import open_peer
from capsulefs.peer.errors import PeerError

log = logging.getLogger(__name__)

__all__ = ["abandon_move", "learn_holder"]


def abandon_move(holders: HolderBook, agent_id: str, *, me: str, why: str) -> HolderRecord:
    """The operator's way out of an in-doubt move when no driver runs: hold the
    agent here again at its old epoch. If the target did activate it, two
    hosts now run the agent; the log says so."""
    record = holders.get(agent_id)
    if record is None or record.state not in (HolderState.FROZEN, HolderState.COMMITTING):
        state = "absent" if record is None else record.state.value
        raise mv.MoveError(f"agent {agent_id} has no move in progress here (its record is {state})")
    machine = mv.SourceMachine(record, me=me)
    commands = machine.handle(mv.Restarted())
    if machine.state is mv.SourceState.IN_DOUBT:
        commands = machine.handle(mv.OperatorAbandon(why=why))
    for c in commands:
        if isinstance(c, mv.Persist):
            holders.put(c.record)
    return machine.record


async def learn_holder(host: MoveHost, agent_id: str, *, connect: Connector = open_peer,
                       call_timeout: float = 30.0) -> HolderRecord:
    """Leave UNKNOWN by asking every peer to fence the agent and report.

    Returns the new record: HELD, RETIRED, or still UNKNOWN if a peer could
    not be asked (try again later, or force it as an operator).
    """
    async with host.lock(agent_id):
        record = host.holders.get(agent_id)
        if record is None or record.state is not HolderState.UNKNOWN:
            raise mv.MoveError(f"agent {agent_id} is not in doubt here")
        try:
            local_epoch = host.store.agent(agent_id).manifest().holder.epoch
        except CapsuleError as exc:
            raise mv.MoveError(f"agent {agent_id}: cannot read its files here: {exc}") from exc
        views = {}
        peers = host.peers.peers()
        for peer in peers:
            try:
                async with connect(host.identity, peer) as conn:
                    with trio.fail_after(call_timeout):
                        result, _ = await conn.call(mv.Call.FENCE.value, {"agent_id": agent_id})
                answer = result_to_answer(mv.Call.FENCE, agent_id, 1, result)
                assert isinstance(answer, mv.FenceReply)
                views[peer.host_id] = answer.view
            except (PeerError, CapsuleError, trio.TooSlowError) as exc:
                log.warning("agent %s: could not fence %s: %s", agent_id, peer.name, exc)
        new = learn_from_peers(record, local_epoch=local_epoch, views=views, peers=[p.host_id for p in peers])
        if new.state is HolderState.RETIRED:
            # Nothing acknowledged is deleted: what this host has (it may have
            # taken writes the holder lacks) is kept first, as a capsule; if
            # it cannot be kept, the record stays in doubt and nothing goes.
            kept = await trio.to_thread.run_sync(keep_copy, host.store.agent(agent_id))
            new = new.with_(kept=os.path.relpath(kept, host.store.root))
            log.warning("agent %s: %s holds it; this host gives it up, and what it had is kept in %s",
                        agent_id, new.peer, kept)
        if new is not record:
            host.holders.put(new)
            if new.state is HolderState.RETIRED:
                await host.hooks.retire(agent_id)
                await trio.to_thread.run_sync(host.store.remove_agent, agent_id)
            elif new.state is HolderState.HELD:
                await host.hooks.resume(agent_id)
        return new
