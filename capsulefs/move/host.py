"""What the move driver and the move service share on one host.

Rules:
  * :class:`AgentHooks` is the seam to whoever runs agents (the mount
    daemon). The move code calls it; it never starts or stops agents itself.
    Every hook is idempotent: after a crash, recovery may call it again.
  * All move work on one agent, source or target side, holds that agent's
    lock (:meth:`MoveHost.lock`), so the holder record is read and written
    by one task at a time. Different agents move concurrently.
  * The wire form of every call name and answer is core/move/wire.py's,
    beside the move machines (docs/wire.md lists it).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import trio

from capsulefs.core.errors import ImportRefused
from capsulefs.core.store.holder import HolderBook, HolderRecord, HolderState, new_held, unknown
from capsulefs.core.store.layout import HOLDERS_DIR
from capsulefs.core.store.host_store import HostStore
from capsulefs.peer.identity import Identity, load_or_create_identity
from capsulefs.peer.book import PeerBook
from capsulefs.peer.finder import BookPeers, PeerFinder

__all__ = ["AgentHooks", "MoveHost", "NoHooks", "holders_dir", "new_agent_files", "record_imported",
           "record_new_agent", "refuse_stale_copy"]


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
    UNKNOWN: not run until the peers have been asked or an operator forces it.

    An agent this host let go (its record RETIRED, or REFUSED) whose copy
    names this host at a newer epoch than the record's is held at that epoch
    (the lifecycle still runs it only with evidence: docs/move.md); a copy
    at an epoch not above it is refused before it is installed
    (:func:`refuse_stale_copy`)."""
    book = HolderBook(holders_dir(state_dir))
    rec = book.get(agent_id)
    if rec is None or (rec.state in _LET_GO and epoch > rec.epoch):
        rec = new_held(agent_id, epoch)
        book.put(rec)
    elif rec.removed_here:
        rec = unknown(agent_id, "imported again after it was removed here", epoch=max(epoch, rec.epoch))
        book.put(rec)
    return rec


#: Records of an agent this host let go: handed to another host (RETIRED), or an incoming move refused.
_LET_GO = (HolderState.RETIRED, HolderState.REFUSED)


def refuse_stale_copy(state_dir: str | os.PathLike[str], agent_id: str, name: str, holder: str, epoch: int,
                      here: str) -> None:
    """Before an import installs an agent's files (under its files lock):
    ImportRefused, in one line, if this host let the agent go (its record
    RETIRED or REFUSED) and the copy names this host (``here``) at an epoch
    not above the record's: what this host had before it handed the agent
    on. Installed, it would never be shown nor run (its record says another
    host holds a newer epoch) and the next start would drop its files. A
    copy that names another host (an export from the holder) is imported
    as any other host's agent: in doubt (:func:`record_imported`)."""
    rec = HolderBook(holders_dir(state_dir)).get(agent_id)
    if rec is None or rec.state not in _LET_GO or holder != here or epoch > rec.epoch:
        return
    who = f"host {rec.peer}" if rec.peer else "another host"
    what = "handed it to" if rec.state is HolderState.RETIRED else "refused a move of it from"
    raise ImportRefused(f"agent {name} ({agent_id}): this host {what} {who} at epoch {rec.epoch}, and this copy "
                        f"is this host's own from epoch {epoch}: nothing imported (move it back from its holder, "
                        f"or import an export made there)")


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
    #: Who a move's target is and who may call this host's move service: the
    #: pinned peers (default), or the directory's live hosts in the fleet mode.
    finder: PeerFinder | None = None
    _locks: dict[str, trio.Lock] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.finder is None:
            self.finder = BookPeers(self.peers)

    @classmethod
    def open(cls, state_dir: str | os.PathLike[str], hooks: AgentHooks | None = None,
             finder: PeerFinder | None = None, *, store: HostStore | None = None) -> "MoveHost":
        """``store``: the daemon's own (its blob tier uploader is told of the blobs a move adopts)."""
        root = os.fspath(state_dir)
        store = store if store is not None else HostStore.open(root)
        return cls(
            store=store,
            holders=HolderBook(holders_dir(root)),
            identity=load_or_create_identity(root),
            peers=PeerBook(root),
            hooks=hooks if hooks is not None else NoHooks(),
            finder=finder,
        )

    @property
    def peer_finder(self) -> PeerFinder:
        assert self.finder is not None  # (set in __post_init__)
        return self.finder

    @property
    def me(self) -> str:
        return self.identity.host_id

    def lock(self, agent_id: str) -> trio.Lock:
        return self._locks.setdefault(agent_id, trio.Lock())
