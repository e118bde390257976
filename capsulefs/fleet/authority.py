"""The directory as the holder authority, over etcd: the move's calls at its point of no return.

Rules:
  * The records, Txns and their judgement are
    :mod:`capsulefs.core.fleet.directory`'s (``JUDGE_TABLE``); this module
    sends them and reads the answers. It writes an agent's key only in a
    claim, a commit, a fence or a takeover, never otherwise.
  * A commit whose answer is lost (:class:`DirectoryUnavailable` once sent)
    is settled by the fence: read the key; if it names the target, the
    commit applied; else rewrite it as it is if unchanged, so a commit still
    on its way can never apply after. :meth:`DirectoryAuthority.commit`
    settles for up to ``settle_within`` seconds; past that it raises
    :class:`CommitInDoubt` and the caller asks :meth:`settle` later (the
    move machine's status question). Only a judgement ever says NEVER.
  * A read lets this host run an agent only if its lease was alive before
    the read was sent and still is when the answer came
    (:class:`LeaseView`, the host's :class:`~capsulefs.fleet.keeper.HostLeaseKeeper`).

Theory of operation: the source calls :meth:`begin` after the freeze (the
read its commit compares against), :meth:`commit` as its ``activate`` and
:meth:`settle` as its ``status``; the target calls :meth:`confirm` before it
activates (and any holder before it runs an agent again after a new lease,
:meth:`confirm_batch`: 128 agents a round trip),
and :meth:`gate` when a prepared move sat idle or it restarted.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import trio

from capsulefs.core.fleet import directory as fd
from capsulefs.core.fleet.errors import DirectoryError, DirectoryUnavailable
from capsulefs.core.fleet.etcd import Compare, KeyValue, Op, Range, RangeResult, TxnResult
from capsulefs.core.move import Outcome

log = logging.getLogger(__name__)

__all__ = ["CommitInDoubt", "DirectoryAuthority", "DirectoryClient", "LeaseView", "NotTheHolder", "Ticket", "Verdict"]

SETTLE_WITHIN = 5.0  # seconds commit() tries to settle a lost answer before it reports the move in doubt
SETTLE_PAUSE = 0.2  # seconds between its tries
#: Agents read in one Txn by confirm_batch: etcd's default limit of operations per Txn (--max-txn-ops).
CONFIRM_BATCH = 128


class DirectoryClient(Protocol):
    """What the authority needs of etcd (:class:`capsulefs.fleet.etcd.EtcdClient` has it)."""

    async def get(self, key: bytes) -> KeyValue | None: ...

    async def txn(self, compare: Sequence[Compare], success: Sequence[Op] = (),
                  failure: Sequence[Op] = ()) -> TxnResult: ...


class LeaseView(Protocol):
    """Whether this host's lease lets it act now (the lease keeper)."""

    def may_run(self) -> bool: ...


class NotTheHolder(DirectoryError):
    """The directory does not name this host at the epoch it holds: no move, no run."""


class CommitInDoubt(DirectoryUnavailable):
    """A commit was sent and nobody can say yet whether it applied: ask :meth:`DirectoryAuthority.settle`."""

    def __init__(self, ticket: Ticket, why: str) -> None:
        super().__init__(f"agent {ticket.agent_id}: the commit to {ticket.move.target} at epoch "
                         f"{ticket.move.epoch} is in doubt: {why}")
        self.ticket = ticket


@dataclass(frozen=True, slots=True)
class Ticket:
    """A move the directory was asked about: what the source read before its offer."""

    agent_id: str
    move: fd.Move
    #: The agent's key as read by begin(): the commit compares its mod_revision.
    #: None for a move rebuilt from its record after a restart (ticket()): only settle() may use it.
    seen: KeyValue | None


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: Outcome  # ACTIVE: the target holds the agent; NEVER: no commit of this move can apply
    why: str


class DirectoryAuthority:
    """One host's calls to the directory about who holds an agent."""

    def __init__(self, client: DirectoryClient, layout: fd.Layout, host_id: str, lease: LeaseView, *,
                 settle_within: float = SETTLE_WITHIN) -> None:
        self._client = client
        self._layout = layout
        self.host_id = host_id
        self._lease = lease
        self._settle_within = settle_within

    async def _txn(self, t: fd.DirTxn) -> TxnResult:
        return await self._client.txn(t.compare, t.success, t.failure)

    async def _read_alive(self, agent_id: str) -> KeyValue | None:
        """The agent's key, read while this host's lease was alive (else NotTheHolder)."""
        if not self._lease.may_run():
            raise NotTheHolder(f"agent {agent_id}: host {self.host_id} has no live lease")
        kv = await self._client.get(self._layout.agent(agent_id))
        if not self._lease.may_run():
            raise NotTheHolder(f"agent {agent_id}: host {self.host_id}'s lease ended during the read")
        return kv

    # -- a new agent, and a holder's check --------------------------------------------
    async def claim(self, agent_id: str, epoch: int) -> bool:
        """This host holds a new agent at ``epoch``, if the directory has no entry for it."""
        t = fd.claim_txn(self._layout, agent_id, fd.AgentEntry(host_id=self.host_id, epoch=epoch))
        return (await self._txn(t)).succeeded

    async def confirm(self, agent_id: str, epoch: int) -> bool:
        """May this host run the agent it holds at ``epoch``? Before it runs it
        (again: after a new lease, a rolled-back move, a restart) and before a
        target activates. Only a read that names it, made under its lease."""
        try:
            kv = await self._read_alive(agent_id)
        except NotTheHolder:
            return False
        return fd.may_run(kv, self.host_id, epoch)

    #: The most agents :meth:`confirm_batch` reads at once.
    batch = CONFIRM_BATCH

    async def confirm_batch(self, held: Mapping[str, int]) -> dict[str, bool | None]:
        """:meth:`confirm` for up to :attr:`batch` agents (id -> the epoch this
        host holds) in one round trip: one Txn of a Range of each agent's key,
        read at one revision, under a live lease (before it was sent and when
        its answer came; else NotTheHolder). For each agent: True if the
        directory names this host at its epoch, False if it names another
        holder or epoch (or the record does not parse), None if the agent
        has no entry (claim it, then confirm it)."""
        if len(held) > self.batch:
            raise ValueError(f"{len(held)} agents to confirm in one Txn, more than {self.batch}")
        ids = list(held)
        if not ids:
            return {}
        if not self._lease.may_run():
            raise NotTheHolder(f"{len(ids)} agent(s): host {self.host_id} has no live lease")
        result = await self._client.txn((), [Range(key=self._layout.agent(a)) for a in ids])
        if not self._lease.may_run():
            raise NotTheHolder(f"{len(ids)} agent(s): host {self.host_id}'s lease ended during the read")
        out: dict[str, bool | None] = {}
        for agent_id, answer in zip(ids, result.responses, strict=True):
            assert isinstance(answer, RangeResult)  # (the client checks each answer against its operation)
            kv = answer.kvs[0] if answer.kvs else None
            try:
                out[agent_id] = None if kv is None else fd.may_run(kv, self.host_id, held[agent_id])
            except DirectoryError as exc:
                log.warning("agent %s: its directory record does not parse: %s", agent_id, exc)
                out[agent_id] = False
        return out

    async def entry(self, agent_id: str) -> fd.AgentEntry | None:
        """The agent's entry as the directory has it now: a plain read, which
        lets nothing run (to say whom the directory names)."""
        kv = await self._client.get(self._layout.agent(agent_id))
        return None if kv is None else fd.decode_agent(kv.value)

    # -- the source --------------------------------------------------------------------
    async def begin(self, agent_id: str, held_epoch: int, target: str, epoch: int) -> Ticket:
        """Before the offer (the agent frozen): the read the commit will compare against."""
        kv = await self._read_alive(agent_id)
        if not fd.may_run(kv, self.host_id, held_epoch):
            named = "no entry" if kv is None else f"{fd.decode_agent(kv.value)}"
            raise NotTheHolder(f"agent {agent_id}: the directory does not name {self.host_id} at epoch "
                               f"{held_epoch} ({named[:200]})")
        assert kv is not None
        move = fd.Move(source=self.host_id, held_epoch=held_epoch, target=target, epoch=epoch)
        return Ticket(agent_id, move, kv)

    def ticket(self, agent_id: str, held_epoch: int, target: str, epoch: int) -> Ticket:
        """A move whose commit may have been sent, rebuilt from the source's
        record (COMMITTING) after a restart: for :meth:`settle` only."""
        move = fd.Move(source=self.host_id, held_epoch=held_epoch, target=target, epoch=epoch)
        return Ticket(agent_id, move, None)

    async def commit(self, ticket: Ticket) -> Verdict:
        """The point of no return: one Txn. If its answer is lost, settle it (the fence)."""
        if ticket.seen is None:
            raise DirectoryError(f"agent {ticket.agent_id}: a commit needs the read its move began with")
        t = fd.commit_txn(self._layout, ticket.agent_id, ticket.seen, ticket.move.target, ticket.move.epoch)
        try:
            result = await self._txn(t)
        except DirectoryUnavailable as exc:
            log.warning("agent %s: commit to %s at %d: %s; settling it", ticket.agent_id, ticket.move.target,
                        ticket.move.epoch, exc)
            return await self._settle_for(ticket, str(exc))
        outcome, why = fd.judge(t, "commit", ticket.move, result)
        log.info("agent %s: commit to %s at %d: %s (%s)", ticket.agent_id, ticket.move.target, ticket.move.epoch,
                 outcome.value, why)
        return Verdict(outcome, why)

    async def _settle_for(self, ticket: Ticket, why: str) -> Verdict:
        with trio.move_on_after(self._settle_within):
            while True:
                try:
                    return await self.settle(ticket)
                except DirectoryUnavailable as exc:
                    why = str(exc)
                await trio.sleep(SETTLE_PAUSE)
        raise CommitInDoubt(ticket, why)

    async def settle(self, ticket: Ticket) -> Verdict:
        """Did the commit apply? Read; if the key names the target, yes; else
        fence it (rewrite it as it is, if unchanged) and judge the fence.
        DirectoryUnavailable: no answer yet, ask again."""
        kv = await self._client.get(self._layout.agent(ticket.agent_id))
        if kv is None:
            return Verdict(Outcome.NEVER, "the agent has no entry")
        if fd.decode_agent(kv.value).names(ticket.move.target, ticket.move.epoch):
            return Verdict(Outcome.ACTIVE, "the entry names the target at the new epoch")
        t = fd.fence_txn(self._layout, ticket.agent_id, kv)
        outcome, why = fd.judge(t, "fence", ticket.move, await self._txn(t))
        log.info("agent %s: fence of the move to %s at %d: %s (%s)", ticket.agent_id, ticket.move.target,
                 ticket.move.epoch, outcome.value, why)
        return Verdict(outcome, why)

    # -- a prepared target ------------------------------------------------------------
    async def gate(self, agent_id: str, epoch: int, source: str) -> Outcome:
        """A prepared move that sat idle, or a target that restarted: ACTIVE if
        the directory names this host at ``epoch`` (read under its lease), else
        NEVER once no commit of the move can apply (the source's entry fenced).
        NotTheHolder if the entry names this host but the lease did not let the
        read count (ask again); DirectoryUnavailable: no answer."""
        for _ in range(8):  # each round lost a race with another writer of the key
            kv = await self._client.get(self._layout.agent(agent_id))
            entry = None if kv is None else fd.decode_agent(kv.value)
            if entry is not None and entry.names(self.host_id, epoch):
                if await self.confirm(agent_id, epoch):
                    return Outcome.ACTIVE
                # (never NEVER here: the entry names this host; only its lease, or a race, kept the read
                # from counting: ask again under a live lease)
                raise NotTheHolder(f"agent {agent_id}: the directory names {self.host_id} at epoch {epoch}, "
                                   f"but not in a read made under a live lease: ask again")
            if kv is None or entry is None or entry.host_id != source:
                return Outcome.NEVER  # the entry moved on: no commit of this move can apply
            if (await self._txn(fd.fence_txn(self._layout, agent_id, kv))).succeeded:
                return Outcome.NEVER
        raise DirectoryUnavailable(f"agent {agent_id}: the entry kept changing while the target asked about it")

    # -- a takeover ----------------------------------------------------------------
    async def takeover(self, agent_id: str, *, above: int = 0) -> int | None:
        """Take the agent of a host whose lease is gone, at an epoch above the
        entry's and ``above`` (what this host held of it); the new epoch, or
        None if its holder's key still lives (or someone else took it first)."""
        kv = await self._read_alive(agent_id)
        if kv is None:
            return None
        entry = fd.decode_agent(kv.value)
        if entry.state is not fd.EntryState.HELD or entry.host_id == self.host_id:
            return None
        if await self._client.get(self._layout.host(entry.host_id)) is not None:
            return None  # its holder's lease lives: only its own move can give the agent away
        epoch = max(entry.epoch, above) + 1
        result = await self._txn(fd.takeover_txn(self._layout, agent_id, kv, self.host_id, epoch))
        if not result.succeeded:
            return None
        log.warning("agent %s: taken over from %s (lease gone) at epoch %d", agent_id, entry.host_id, epoch)
        return epoch
