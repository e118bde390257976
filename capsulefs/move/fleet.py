"""What a move needs of the fleet's directory (``mount --directory``): the
holder authority that answers the source's point of no return instead of
the target. docs/fleet.md, "A move through the directory".

Rules:
  * The moves take a :class:`Fleet` in their constructor, None in
    peer-to-peer mode (the moves then run exactly as without a fleet).
  * The source reads the agent's key after the freeze (``begin``); its
    ``activate`` is the directory's commit Txn and its ``status`` the
    settle (a read, then the fence); after a verdict "active" it nudges the
    target (the target's ``activate`` call), which activates only once it
    reads that the directory names it at the new epoch (``confirm``).
  * A prepared target asks ``gate`` before it ever refuses (idle, restarted,
    asked for status, asked by a peer to fence the agent): named -> activate;
    else refuse only once no commit of the move can apply.
  * After its commit was sent, a source whose move rolled back runs the
    agent again only once the directory names it (``confirm``, under a
    live lease): the entry may have moved on meanwhile.

Theory of operation: :class:`SourceCalls` makes one move's calls for the
source's driver and turns each answer into the event its machine is fed;
:func:`named`, :func:`gate` and :func:`gate_before_fence` are the target's questions. The real objects are capsulefs/fleet/authority.py's
``DirectoryAuthority`` and capsulefs/fleet/keeper.py's ``HostLeaseKeeper``,
built by the composition root; the simulation (capsulefs/testing/fleet_sim.py)
drives the same machines through the same calls.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import trio

from capsulefs.core import move as mv
from capsulefs.core.fleet.errors import DirectoryError
from capsulefs.core.move import Outcome
from capsulefs.core.store.holder import HolderRecord, HolderState
from capsulefs.peer.book import Peer
from capsulefs.peer.errors import CallFailed, PeerUnreachable
from capsulefs.peer.finder import PeerFinder, PeerLookupFailed

if TYPE_CHECKING:  # (the fleet's modules load only in the fleet mode)
    from capsulefs.fleet.authority import Ticket, Verdict

log = logging.getLogger(__name__)

__all__ = ["Fleet", "LeaseWait", "MoveDirectory", "SourceCalls", "find_target", "gate", "gate_before_fence", "named"]


class MoveDirectory(Protocol):
    """The directory's calls a move makes (``DirectoryAuthority``)."""

    async def begin(self, agent_id: str, held_epoch: int, target: str, epoch: int) -> Ticket: ...

    async def commit(self, ticket: Ticket) -> Verdict: ...

    async def settle(self, ticket: Ticket) -> Verdict: ...

    def ticket(self, agent_id: str, held_epoch: int, target: str, epoch: int) -> Ticket: ...

    async def confirm(self, agent_id: str, epoch: int) -> bool: ...

    async def gate(self, agent_id: str, epoch: int, source: str) -> Outcome: ...

    async def claim(self, agent_id: str, epoch: int) -> bool: ...


class LeaseWait(Protocol):
    """The host's lease, as a move waits for it (``HostLeaseKeeper``)."""

    def may_run(self) -> bool: ...

    async def wait_alive(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Fleet:
    """The moves' view of the fleet: its directory and this host's lease."""

    directory: MoveDirectory
    lease: LeaseWait


class SourceCalls:
    """One move's calls to the directory, for the source's driver
    (capsulefs/move/source.py): each returns the event its machine is fed."""

    def __init__(self, fleet: Fleet, *, committing: bool) -> None:
        self.fleet = fleet
        self.ticket: Ticket | None = None  # the directory's read after the freeze (begin)
        self.commit_sent = committing  # the directory's entry may name the target
        self.cause: mv.Cause | None = None  # why the directory (or a refused offer) ended the move

    async def begin(self, c: mv.Send, held_epoch: int) -> object | None:
        """After the freeze, before the offer: the read the commit compares
        against. None if the directory names this host; else the failure the
        machine rolls back on."""
        from capsulefs.fleet.authority import NotTheHolder  # (the fleet's modules: in the fleet mode only)

        try:
            self.ticket = await self.fleet.directory.begin(c.agent_id, held_epoch, c.target, c.epoch)
            return None
        except NotTheHolder as exc:
            self.cause, why = mv.Cause.NOT_HOLDER, str(exc)
        except DirectoryError as exc:
            self.cause, why = mv.Cause.UNREACHABLE, f"the directory did not answer: {exc}"
        log.warning("move of %s: %s; rolling back", c.agent_id, why)
        return mv.IoFailure(reason=why)

    async def commit(self, c: mv.Send) -> object:
        """The point of no return: the directory's commit Txn (a lost answer is settled by the fence)."""
        self.commit_sent = True
        if self.ticket is None:  # (not reached: activate follows begin; asking status is always safe)
            return mv.IoFailure(reason="the directory's read of the move is missing")
        try:
            verdict = await self.fleet.directory.commit(self.ticket)
        except DirectoryError as exc:  # in doubt (CommitInDoubt), or an answer that says nothing
            log.warning("move of %s: the commit to %s is in doubt: %s", c.agent_id, c.target, exc)
            return mv.IoFailure(reason=f"the directory: {exc}")
        return mv.ActivateReply(agent_id=c.agent_id, epoch=c.epoch, outcome=verdict.outcome)

    async def settle(self, c: mv.Send, held_epoch: int) -> object:
        """The status question, asked of the directory: did the commit apply? (read, else fence)"""
        ticket = self.ticket or self.fleet.directory.ticket(c.agent_id, held_epoch, c.target, c.epoch)
        try:
            verdict = await self.fleet.directory.settle(ticket)
        except DirectoryError as exc:
            log.warning("move of %s: the directory did not settle the commit yet: %s", c.agent_id, exc)
            return mv.IoFailure(reason=f"the directory: {exc}")
        log.info("move of %s to %s at epoch %d settled: %s (%s)", c.agent_id, c.target, c.epoch,
                 verdict.outcome.value, verdict.why)
        return mv.StatusReply(agent_id=c.agent_id, epoch=c.epoch, outcome=verdict.outcome)

    async def may_resume(self, agent_id: str, held_epoch: int, retry_pause: float) -> bool:
        """A rollback after the commit was sent: may the agent run here again?
        Only once the directory, read under a live lease, names this host at
        the epoch it holds (the entry may have moved on: a takeover)."""
        while True:
            await self.fleet.lease.wait_alive()
            try:
                if await self.fleet.directory.confirm(agent_id, held_epoch):
                    return True
            except DirectoryError as exc:
                log.warning("agent %s: asking the directory before it runs again: %s", agent_id, exc)
                await trio.sleep(retry_pause)
                continue
            if self.fleet.lease.may_run():
                log.warning("agent %s: the move rolled back, but the directory does not name this host at "
                            "epoch %d: it stays frozen here", agent_id, held_epoch)
                return False
            # (the lease ended during the read: ask again under the next)


async def find_target(finder: PeerFinder, host_id: str) -> Peer:
    """A move resumed after a restart: where its target is now, from its live
    host record in the directory (the client pins the host id the record
    names, the one the move's record keeps). PeerUnreachable if the
    directory cannot be read or has no live host of that id (a lost nudge:
    the target's own gate asks the directory)."""
    try:
        found = await finder.by_id(host_id)
    except PeerLookupFailed as exc:
        raise PeerUnreachable(f"host {host_id} could not be looked up: {exc}") from None
    if found is None:
        raise PeerUnreachable(f"host {host_id} is not a live host in the directory")
    return found


async def named(fleet: Fleet, agent_id: str, epoch: int) -> bool:
    """A target: does the directory, read under this host's live lease, name it at ``epoch``?"""
    try:
        return await fleet.directory.confirm(agent_id, epoch)
    except DirectoryError as exc:
        log.warning("agent %s: the directory did not say whether epoch %d is this host's: %s", agent_id, epoch, exc)
        return False


async def gate(fleet: Fleet, agent_id: str, epoch: int, source: str) -> Outcome | None:
    """A prepared target asks the directory's gate: ACTIVE (activate), NEVER
    (refuse: no commit of the move can apply), None (no answer yet: wait)."""
    try:
        outcome = await fleet.directory.gate(agent_id, epoch, source)
    except DirectoryError as exc:
        log.info("agent %s: the prepared move at epoch %d waits for the directory: %s", agent_id, epoch, exc)
        return None
    log.info("agent %s: the directory's gate for the move prepared at epoch %d: %s", agent_id, epoch, outcome.value)
    return outcome


async def gate_before_fence(rec: HolderRecord | None, gated: Callable[[HolderRecord], Awaitable[Outcome | None]],
                            asker: str) -> None:
    """A target asked by a peer to fence the agent (it learns who holds it),
    under the agent's lock: a move prepared here is decided by the
    directory's gate (``gated``: activated, or refused), never by the peer's
    word; no answer yet -> CallFailed (the peer asks again; the move stays
    prepared). A move not yet prepared is left to the fence, which refuses
    it: no commit can name this host before its prepare was answered."""
    if rec is None or rec.state is not HolderState.PREPARED:
        return
    if await gated(rec) is None:
        raise CallFailed("unavailable", f"agent {rec.agent_id}: a move to this host is prepared and the "
                                        f"directory has not decided it yet; {asker} may ask again")
