"""Checking before running, and while running: the daemon's side of
core/store/lifecycle.py.

Rules:
  * Peers tell each other what they hold in one ``holds`` message each way
    (docs/wire.md): the caller's claims in the call, the callee's in the
    reply, one claim per holder record. This host asks every pinned peer at
    start and every :data:`PERIOD` seconds, and answers every peer that asks;
    a message either way counts as that peer's answer for every agent here
    (an agent it does not claim, it has no record of).
  * After each message, every agent is settled (:meth:`Standings.settle`):
    the lifecycle's decision is carried out under the agent's move lock (an
    agent that is moving is the move's to settle). A peer that outranks this
    host's hold makes the record UNKNOWN (durably, before anything else) and
    the agent is frozen, which stops its process; an agent in doubt that got
    its evidence is resumed, which starts it.
  * Answers are kept for the daemon's life only: evidence is learned again
    at every start, since a restored state directory may be the one that is
    wrong.

Theory of operation: :class:`Standings` belongs to the daemon's move wiring
(capsulefs/move/mount_moves.py); the daemon's lifecycle owner
(capsulefs/daemon/agents.py) asks it for decisions when it shows, resumes
or runs an agent, and it answers ``holds`` calls in front of the move
service.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import trio

from capsulefs.core.errors import CapsuleError, FormatError
from capsulefs.core.store import lifecycle as lc
from capsulefs.core.store.holder import HolderRecord, HolderState
from capsulefs.core.view.nodes import AgentState
from capsulefs.move.host import MoveHost
from capsulefs.peer.book import Peer
from capsulefs.peer.client import open_peer
from capsulefs.peer.errors import CallFailed, PeerError
from capsulefs.peer.framing import Payload
from capsulefs.peer.server import PeerHandler
from capsulefs.core.move.wire import HOLDS_CALL

log = logging.getLogger(__name__)

__all__ = ["ASK_TIMEOUT", "PERIOD", "Standings"]

#: Seconds between two rounds of asking every peer (each round: one message per peer).
PERIOD = 2.0
#: Longest one ask (connect, handshake, call) may take.
ASK_TIMEOUT = 5.0


class AgentControl(Protocol):
    """What Standings needs of the daemon."""

    async def freeze(self, agent_id: str) -> None: ...

    async def resume(self, agent_id: str) -> None: ...

    def state(self, agent_id: str) -> AgentState: ...


class Standings:
    """Evidence per agent, the ``holds`` exchange, and the decisions carried out."""

    def __init__(self, host: MoveHost, agents: AgentControl, *, period: float = PERIOD,
                 ask_timeout: float = ASK_TIMEOUT, connect: Callable[..., Any] = open_peer) -> None:
        self.host = host
        self.agents = agents
        self.period = period
        self.ask_timeout = ask_timeout
        self.connect = connect
        #: agent -> peer host id -> its claim (None: it answered, and has no record of the agent)
        self._answers: dict[str, dict[str, lc.Claim | None]] = {}
        #: peer name -> what the last ask of it gave, for status
        self.asked: dict[str, str] = {}
        self._created: set[str] = set()  # agents this daemon created (mkdir)
        # The highest epoch each record had at start: a hold at a higher epoch
        # with a peer named was activated by a move during this daemon's life.
        self._start_epoch: dict[str, int] = {}
        for agent_id in host.holders.agent_ids():
            rec = host.holders.get(agent_id)
            if rec is not None:
                self._start_epoch[agent_id] = rec.epoch
        self._wake = trio.Event()

    # -- evidence and decisions ------------------------------------------------------
    def created(self, agent_id: str) -> None:
        """This daemon created the agent (and its record) just now."""
        self._created.add(agent_id)

    def _own(self, rec: HolderRecord) -> bool:
        if rec.agent_id in self._created:
            return True
        return (rec.peer is not None and rec.held_epoch is not None and rec.held_epoch in rec.activated
                and rec.held_epoch > self._start_epoch.get(rec.agent_id, 0))

    def evidence(self, rec: HolderRecord) -> lc.Evidence:
        try:
            holder = self.host.store.agent(rec.agent_id).manifest().holder
        except CapsuleError as exc:
            log.warning("agent %s: cannot read its manifest (%s): in doubt", rec.agent_id, exc)
            return lc.Evidence.NONE
        peers = frozenset(p.host_id for p in self.host.peers.peers())
        return lc.gather(rec, me=self.host.me, manifest_holder=holder.host, manifest_epoch=holder.epoch,
                         peers=peers, answers=self._answers.get(rec.agent_id, {}), own=self._own(rec))

    def decision(self, agent_id: str) -> lc.Decision:
        rec = self.host.holders.get(agent_id)
        evidence = self.evidence(rec) if rec is not None and rec.state is HolderState.HELD else lc.Evidence.NONE
        return lc.decide(rec, evidence)

    def detail(self, agent_id: str, name: str) -> str | None:
        """Why an agent in doubt is read-only, and what to do (for status)."""
        if self.decision(agent_id).standing is not lc.Standing.IN_DOUBT:
            return None
        try:
            holder = self.host.store.agent(agent_id).manifest().holder
        except CapsuleError:
            holder = None
        peers = self.host.peers.peers()
        if holder is not None and holder.host != self.host.me and self.host.peers.by_id(holder.host) is None:
            why = (f"its manifest names host {holder.host} as its holder, which is not a peer of this host and "
                   f"cannot be asked whether it still holds it")
        elif not peers:
            why = "its records do not agree with its manifest, and there is no peer to ask"
        else:
            asked = "; ".join(f"{p.name}: {self.asked.get(p.name, 'not asked yet')}" for p in peers)
            why = f"no peer has answered yet whether it holds a higher epoch ({asked})"
        return (f"in doubt: {why}. It is read-only and does not run until a peer answers, or until "
                f"'capsulefs move {name} --force-hold --why REASON' (the daemon stopped) runs it here, at the "
                f"risk of two hosts running it")

    # -- the holds exchange ----------------------------------------------------------
    def claims(self) -> list[lc.Claim]:
        out = []
        for agent_id in self.host.holders.agent_ids():
            rec = self.host.holders.get(agent_id)
            if rec is None or rec.state is HolderState.UNKNOWN:
                continue
            try:
                named = self.host.store.agent(agent_id).manifest().holder.host == self.host.me
            except CapsuleError:
                named = False  # (no files here, or unreadable ones)
            claim = lc.claim_of(rec, named=named)
            if claim.held is not None or claim.top > 0:
                out.append(claim)
        return out

    def learn(self, peer: Peer, theirs: dict[str, lc.Claim]) -> None:
        """A peer's full statement of what it holds: its answer for every agent here."""
        for agent_id in self.host.store.agent_ids():
            self._answers.setdefault(agent_id, {})[peer.host_id] = theirs.get(agent_id)

    async def answer(self, peer: Peer, args: dict[str, Any]) -> dict[str, Any]:
        """Serve a peer's ``holds`` call: learn its claims, answer with ours."""
        try:
            theirs = lc.claims_from_wire(args.get("claims"), f"holds from {peer.name}")
        except FormatError as exc:
            raise CallFailed("bad-request", str(exc)) from None
        self.learn(peer, theirs)
        self.asked[peer.name] = f"asked us at {time.strftime('%H:%M:%S')}"
        mine = lc.claims_to_wire(self.claims())
        await self.settle_all()
        return {"claims": mine}

    def around(self, service: PeerHandler) -> PeerHandler:
        """A peer handler that answers ``holds`` and passes every other call to ``service``."""

        async def handler(peer: Peer, call: str, args: dict[str, Any], payload: Payload) -> tuple[dict[str, Any], bytes]:
            if call == HOLDS_CALL:
                await payload.drain()
                return await self.answer(peer, args), b""
            return await service(peer, call, args, payload)

        return handler

    async def ask(self, peer: Peer) -> bool:
        """One ``holds`` exchange with ``peer``; False if it could not be asked."""
        try:
            with trio.fail_after(self.ask_timeout):
                async with self.connect(self.host.identity, peer, timeout=self.ask_timeout) as conn:
                    result, _ = await conn.call(HOLDS_CALL, {"claims": lc.claims_to_wire(self.claims())})
            theirs = lc.claims_from_wire(result.get("claims"), f"holds reply from {peer.name}")
        except (PeerError, FormatError, trio.TooSlowError, OSError) as exc:
            what = "no answer in time" if isinstance(exc, trio.TooSlowError) else str(exc)
            if self.asked.get(peer.name, "").startswith("answered") or peer.name not in self.asked:
                log.info("could not ask %s which agents it holds: %s", peer.name, what)
            self.asked[peer.name] = f"could not be asked: {what}"
            return False
        self.learn(peer, theirs)
        self.asked[peer.name] = f"answered at {time.strftime('%H:%M:%S')}"
        return True

    def wake(self) -> None:
        """Ask the peers now (an agent appeared)."""
        self._wake.set()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Ask every peer now and every period, settling every agent after each round."""
        task_status.started()
        while True:
            self._wake = trio.Event()
            async with trio.open_nursery() as nursery:
                for peer in self.host.peers.peers():
                    nursery.start_soon(self.ask, peer)
            await self.settle_all()
            with trio.move_on_after(self.period):
                await self._wake.wait()

    # -- carrying decisions out ---------------------------------------------------------
    async def settle_all(self) -> None:
        for agent_id in self.host.store.agent_ids():
            try:
                await self.settle(agent_id)
            except Exception:  # one agent's trouble must not stop the others being settled
                log.exception("agent %s: settling its standing failed", agent_id)

    async def settle(self, agent_id: str) -> None:
        """Carry out the lifecycle's decision for one agent, unless a move holds it."""
        lock = self.host.lock(agent_id)
        try:
            lock.acquire_nowait()
        except trio.WouldBlock:
            return  # a move (or a removal) has it: theirs to settle
        try:
            rec = self.host.holders.get(agent_id)
            if rec is None or rec.state is not HolderState.HELD:
                return
            decision = self.decision(agent_id)
            if decision.standing is lc.Standing.STALE:
                await self._stale(rec)
                return
            try:
                shown = self.agents.state(agent_id)
            except CapsuleError:
                return
            if decision.view is AgentState.FROZEN and shown is AgentState.ACTIVE:
                log.warning("agent %s: %s; read-only and not run until then", agent_id, decision.standing.value)
                await self.agents.freeze(agent_id)
            elif decision.view is AgentState.ACTIVE and shown is AgentState.FROZEN:
                log.info("agent %s: no peer holds a higher epoch (%s): running it",
                         agent_id, self.evidence(rec).value)
                await self.agents.resume(agent_id)
        finally:
            lock.release()

    async def _stale(self, rec: HolderRecord) -> None:
        """A peer holds a higher epoch: record UNKNOWN first, then stop the agent."""
        answers = self._answers.get(rec.agent_id, {})
        who = [(host, c) for host, c in answers.items() if c is not None]
        host, claim = max(who, key=lambda hc: max(hc[1].top, hc[1].held or 0))
        peer = self.host.peers.by_id(host)
        name = peer.name if peer is not None else host
        seen = max(claim.top, claim.held or 0, rec.epoch)
        note = (f"peer {name} holds a higher epoch than this host's {rec.held_epoch} (it claims held "
                f"{claim.held}, activated up to {claim.top})")
        # (the epochs activated here are kept: a source may still ask about one)
        self.host.holders.put(HolderRecord(agent_id=rec.agent_id, state=HolderState.UNKNOWN, epoch=seen,
                                           activated=rec.activated, note=note))
        log.warning("agent %s: peer %s holds a higher epoch than this host's %d (held %s, activated up to %d): "
                    "stopped and read-only here; 'capsulefs move --learn' settles it", rec.agent_id, name,
                    rec.held_epoch, claim.held, claim.top)
        try:
            shown = self.agents.state(rec.agent_id)
        except CapsuleError:
            return
        if shown is AgentState.ACTIVE:
            await self.agents.freeze(rec.agent_id)
