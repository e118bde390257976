"""What the move driver and the move service share on one host.

Rules:
  * :class:`AgentHooks` is the seam to whoever runs agents (the mount
    daemon). The move code calls it; it never starts or stops agents itself.
    Every hook is idempotent: after a crash, recovery may call it again.
  * All move work on one agent, source or target side, holds that agent's
    lock (:meth:`MoveHost.lock`), so the holder record is read and written
    by one task at a time. Different agents move concurrently.
  * The wire form of every answer is defined here once
    (:func:`answer_to_result`, :func:`result_to_answer`); docs/wire.md lists it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from capsulefs.core import move as mv
from capsulefs.core.errors import FormatError
from capsulefs.core.store.holder import HolderBook, HolderRecord, HolderState, new_held, unknown
from capsulefs.core.store.layout import HOLDERS_DIR
from capsulefs.core.store.learning import PeerView
from capsulefs.core.store.host_store import HostStore
from capsulefs.peer.identity import Identity, load_or_create_identity
from capsulefs.peer.book import PeerBook

__all__ = ["AgentHooks", "MoveHost", "NoHooks", "answer_to_result", "holders_dir", "new_agent_files",
           "record_imported", "record_new_agent", "result_to_answer"]


def holders_dir(state_dir: str | os.PathLike[str]) -> str:
    return os.path.join(os.fspath(state_dir), HOLDERS_DIR)


@contextmanager
def new_agent_files(state_dir: str | os.PathLike[str], agent_id: str) -> Iterator[None]:
    """Hold a new agent's files lock, exclusively, while its files are
    installed and :func:`record_new_agent` records it: a daemon starting
    meanwhile (``HolderBook.reconcile``) waits for both instead of finding
    files without a record and taking the agent for one whose record was lost."""
    with HolderBook(holders_dir(state_dir)).files_lock(agent_id, shared=False):
        yield


def record_new_agent(state_dir: str | os.PathLike[str], agent_id: str, epoch: int = 1) -> HolderRecord:
    """Record that this host holds an agent it just created or imported, and
    return the agent's record.

    ``capsulefs new`` and ``import`` must call this (with the epoch in the
    agent's manifest): an agent whose files are here without a holder record
    is taken for one whose record was lost, and is not run until peers or an
    operator settle it (see docs/move.md).

    An agent removed here earlier and imported again is not simply held
    again: meanwhile another host may have imported the same export and,
    having learned that this host no longer holds it, taken it. It becomes
    UNKNOWN: not run until the peers have been asked or an operator forces it."""
    book = HolderBook(holders_dir(state_dir))
    rec = book.get(agent_id)
    if rec is None:
        rec = new_held(agent_id, epoch)
        book.put(rec)
    elif rec.removed_here:
        rec = unknown(agent_id, "imported again after it was removed here", epoch=max(epoch, rec.epoch))
        book.put(rec)
    return rec


def record_imported(state_dir: str | os.PathLike[str], agent_id: str, holder_host: str, epoch: int) -> HolderRecord:
    """Record an agent just imported from an export that names another
    host as its holder: in doubt (UNKNOWN) until the peers have been asked
    or an operator forces it, so every place a user looks tells the same
    story from this record (``story.story``). A record that holds the
    agent or moves it is left alone."""
    book = HolderBook(holders_dir(state_dir))
    rec = book.get(agent_id)
    if rec is None or not (rec.holding or rec.moving):
        rec = unknown(agent_id, f"imported from an export that says host {holder_host} holds it at epoch {epoch}",
                      epoch=max(epoch, 0 if rec is None else rec.epoch))
        book.put(rec)
    return rec


class AgentHooks(Protocol):
    """How the move code asks the daemon to start and stop an agent."""

    async def freeze(self, agent_id: str) -> None:
        """Stop the agent and flush its files; no file of it changes until resume or retire."""

    async def resume(self, agent_id: str) -> None:
        """The move rolled back: run the agent again here."""

    async def retire(self, agent_id: str) -> None:
        """The agent is active elsewhere: stop showing it (its files are removed next)."""

    async def prepare(self, agent_id: str, staged_dir: str) -> None:
        """Target side, before activate: render and build what the agent needs in
        ``staged_dir`` (a capsule directory without blobs). Raise to refuse the move."""

    async def activate(self, agent_id: str) -> None:
        """Target side: the agent is installed and its record is HELD: show and run it."""


class NoHooks:
    """Hooks for a host that runs no agents (tests, the CLI without a daemon)."""

    async def freeze(self, agent_id: str) -> None:
        pass

    async def resume(self, agent_id: str) -> None:
        pass

    async def retire(self, agent_id: str) -> None:
        pass

    async def prepare(self, agent_id: str, staged_dir: str) -> None:
        pass

    async def activate(self, agent_id: str) -> None:
        pass


@dataclass
class MoveHost:
    store: HostStore
    holders: HolderBook
    identity: Identity
    peers: PeerBook
    hooks: AgentHooks = field(default_factory=NoHooks)
    _locks: dict[str, trio.Lock] = field(default_factory=dict)

    @classmethod
    def open(cls, state_dir: str | os.PathLike[str], hooks: AgentHooks | None = None) -> "MoveHost":
        root = os.fspath(state_dir)
        store = HostStore.open(root)
        return cls(
            store=store,
            holders=HolderBook(holders_dir(root)),
            identity=load_or_create_identity(root),
            peers=PeerBook(root),
            hooks=hooks if hooks is not None else NoHooks(),
        )

    @property
    def me(self) -> str:
        return self.identity.host_id

    def lock(self, agent_id: str) -> trio.Lock:
        return self._locks.setdefault(agent_id, trio.Lock())


# -- the wire form of answers -------------------------------------------------------------


def answer_to_result(answer: object) -> dict[str, Any]:
    match answer:
        case mv.OfferReply():
            return {"accepted": answer.accepted, "missing": list(answer.missing), "highest": answer.highest,
                    "held_there": answer.held_there, "reason": answer.reason}
        case mv.BlobReply():
            return {"sha": answer.sha, "ok": answer.ok, "reason": answer.reason}
        case mv.VerifyReply():
            return {"ok": answer.ok, "bad": list(answer.bad), "reason": answer.reason}
        case mv.PrepareReply():
            return {"ok": answer.ok, "reason": answer.reason}
        case mv.ActivateReply() | mv.StatusReply():
            return {"outcome": answer.outcome.value}
        case mv.AbortReply():
            return {}
        case mv.FenceReply():
            v = answer.view
            return {"host": v.host, "state": None if v.state is None else v.state.value, "epoch": v.epoch,
                    "held_epoch": v.held_epoch, "activated": list(v.activated)}
    raise TypeError(f"not an answer: {answer!r}")


def result_to_answer(call: mv.Call, agent_id: str, epoch: int, r: dict[str, Any]) -> object:
    """Parse a reply's result; raise FormatError if it is malformed."""
    try:
        match call:
            case mv.Call.OFFER:
                return mv.OfferReply(agent_id=agent_id, epoch=epoch, accepted=r["accepted"], missing=tuple(r["missing"]),
                                     highest=r["highest"], held_there=r["held_there"], reason=r["reason"])
            case mv.Call.BLOB:
                return mv.BlobReply(agent_id=agent_id, epoch=epoch, sha=r["sha"], ok=r["ok"], reason=r["reason"])
            case mv.Call.VERIFY:
                return mv.VerifyReply(agent_id=agent_id, epoch=epoch, ok=r["ok"], bad=tuple(r["bad"]), reason=r["reason"])
            case mv.Call.PREPARE:
                return mv.PrepareReply(agent_id=agent_id, epoch=epoch, ok=r["ok"], reason=r["reason"])
            case mv.Call.ACTIVATE:
                return mv.ActivateReply(agent_id=agent_id, epoch=epoch, outcome=mv.Outcome(r["outcome"]))
            case mv.Call.STATUS:
                return mv.StatusReply(agent_id=agent_id, epoch=epoch, outcome=mv.Outcome(r["outcome"]))
            case mv.Call.ABORT:
                return mv.AbortReply(agent_id=agent_id, epoch=epoch)
            case mv.Call.FENCE:
                view = PeerView(host=r["host"], state=None if r["state"] is None else HolderState(r["state"]),
                                epoch=r["epoch"], held_epoch=r["held_epoch"], activated=tuple(r["activated"]))
                return mv.FenceReply(agent_id=agent_id, view=view)
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"malformed {call.value} reply: {exc!r}") from None
    raise AssertionError(call)
