"""Holder records: what this host knows about who holds each agent.

Rules:
  * One record per agent per host, ``<dir>/<agent_id>.json``, format
    ``holder/1``. It is written with :func:`capsulefs.core.fsutil.atomic_write`
    (temp file, fsync, rename, fsync dir) and carries a sha256 of its own
    body, so a torn or bit-rotted record is detected, never trusted.
  * A record is written *before* any reply or action that depends on it.
    The move protocol (:mod:`capsulefs.core.move`) says when.
  * ``epoch`` is the highest epoch this host has seen for the agent in any
    role: held, offered, refused or handed over. It only grows. An offer is
    accepted only for an epoch greater than it (the fence).
  * ``activated`` lists every epoch this host itself activated, so a late
    question "did epoch N activate here?" always has an exact answer.
  * Only a record in state HELD lets the host run the agent.
  * REMOVED was once a REFUSED record told apart by its note text
    (:data:`REMOVED_NOTE`); such a record is read as REMOVED.
  * A record that is missing while the agent's files are present, or that is
    corrupt, becomes UNKNOWN: the host does not run the agent until it has
    learned from every peer that nobody holds a newer epoch
    (:func:`.learning.learn_from_peers`), or an operator forces it
    (:func:`.learning.force_hold`). What a record means for a person: :mod:`.story`.

States, by role:
  ======== ============ ======================================================
  state    role         meaning
  ======== ============ ======================================================
  HELD     holder       holds ``held_epoch``; may run the agent
  FROZEN   source       holds ``held_epoch``, frozen, moving to ``peer`` at
                        ``epoch``; no activate was sent: may roll back alone
  COMMITTING source     as FROZEN, but activate may have been sent: in doubt
                        until ``peer`` answers for ``epoch``
  RETIRED  source       handed the agent to ``peer`` at ``epoch``
  OFFERED  target       accepted an offer of ``epoch`` from ``peer``; staging
  VERIFIED target       every digest of that offer checked
  PREPARED target       staging built; activates on ``activate(epoch)``
  REFUSED  target       decided, durably, that ``epoch`` never activates here
  REMOVED  any          an operator removed the agent here (``rm``): as
                        REFUSED, nothing at ``epoch`` or below activates here
  UNKNOWN  any          record lost or corrupt: do not run, learn or be forced
  ======== ============ ======================================================
"""

from __future__ import annotations

import enum
import errno
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from typing import Any

from ..errors import FilesBusy, FormatError
from ..capsule.format import check_agent_id, check_host_id, check_int, load_json_object
from ..fsutil import atomic_write, makedirs_durable

log = logging.getLogger(__name__)

#: Seconds between two tries of a files lock held by someone else (see HolderBook.files_lock).
LOCK_POLL = 0.01
#: Longest a reconcile waits for the files lock of an agent found without a record.
RECONCILE_WAIT = 10.0

__all__ = [
    "HOLDER_FORMAT",
    "MOVING",
    "HolderBook",
    "HolderRecord",
    "HolderState",
]

HOLDER_FORMAT = "holder/1"


class HolderState(enum.Enum):
    HELD = "held"
    FROZEN = "frozen"
    COMMITTING = "committing"
    RETIRED = "retired"
    OFFERED = "offered"
    VERIFIED = "verified"
    PREPARED = "prepared"
    REFUSED = "refused"
    REMOVED = "removed"
    UNKNOWN = "unknown"


#: States in which this host holds the agent (at ``held_epoch``).
HOLDING = frozenset({HolderState.HELD, HolderState.FROZEN, HolderState.COMMITTING})
#: Target states of a move that has not activated yet.
PENDING = frozenset({HolderState.OFFERED, HolderState.VERIFIED, HolderState.PREPARED})
_NEEDS_PEER = PENDING | {HolderState.FROZEN, HolderState.COMMITTING, HolderState.RETIRED}
#: States in which a move of the agent is under way here, as its source
#: (FROZEN; COMMITTING: in doubt) or its target (PENDING). Removing the
#: agent then could lose it on both hosts.
MOVING = frozenset({HolderState.FROZEN, HolderState.COMMITTING}) | PENDING


def need_epoch(value: object, what: str) -> int:
    return check_int(value, what)


@dataclass(frozen=True, slots=True, kw_only=True)
class HolderRecord:
    agent_id: str  # 32 lowercase hex: the agent this record is about
    state: HolderState  # see the table in the module docstring
    epoch: int  # highest epoch seen for the agent here, in any role (the fence)
    held_epoch: int | None = None  # epoch this host holds at; set iff state is HELD/FROZEN/COMMITTING
    peer: str | None = None  # host id at the other end of the pending (or last) move
    activated: tuple[int, ...] = ()  # epochs this host activated, ascending
    note: str = ""  # why the record is in its state, for people (e.g. a refusal reason)
    kept: str | None = None  # a copy of what this host had, kept when it gave the agent up (core.store.kept):
    #                          its path under the state directory, e.g. recovery/<agent_id>/kept-e1-...
    # An operator forced this hold (``move --force-hold --why``): the daemon
    # runs the agent without a peer's word that nobody holds a higher epoch
    # (docs/move.md, "Checking before running"). Only on a HELD record;
    # written only when true, so records from before it read the same.
    forced: bool = False

    def __post_init__(self) -> None:
        check_agent_id(self.agent_id)
        if not isinstance(self.state, HolderState):
            raise FormatError(f"holder state {self.state!r} is not a HolderState")
        need_epoch(self.epoch, "holder epoch")
        if (self.held_epoch is not None) != (self.state in HOLDING):
            raise FormatError(f"holder record in state {self.state.value} must "
                              f"{'' if self.state in HOLDING else 'not '}have a held_epoch")
        if self.held_epoch is not None:
            need_epoch(self.held_epoch, "held epoch")
            if self.held_epoch > self.epoch:
                raise FormatError(f"held epoch {self.held_epoch} is above the highest epoch seen {self.epoch}")
            if self.state in (HolderState.FROZEN, HolderState.COMMITTING) and self.held_epoch >= self.epoch:
                raise FormatError(f"a move from epoch {self.held_epoch} must be to a higher epoch, not {self.epoch}")
        if self.peer is not None:
            check_host_id(self.peer)
        if self.state in _NEEDS_PEER and self.peer is None:
            raise FormatError(f"holder record in state {self.state.value} must name its peer")
        if list(self.activated) != sorted(set(self.activated)):
            raise FormatError(f"activated epochs {self.activated!r} must be ascending and distinct")
        for e in self.activated:
            need_epoch(e, "activated epoch")
            if e > self.epoch:
                raise FormatError(f"activated epoch {e} is above the highest epoch seen {self.epoch}")
        if not isinstance(self.note, str):
            raise FormatError("holder note must be a string")
        if self.kept is not None and (not isinstance(self.kept, str) or not self.kept.startswith("recovery/")
                                      or ".." in self.kept.split("/") or len(self.kept) > 512
                                      or any(ord(c) < 32 or c == "\x7f" for c in self.kept)):
            raise FormatError(f"holder kept copy {self.kept!r} is not a path under recovery/")
        if not isinstance(self.forced, bool):
            raise FormatError("holder 'forced' must be true or false")
        if self.forced and self.state is not HolderState.HELD:
            raise FormatError(f"holder record in state {self.state.value} cannot be forced (only held)")

    # -- questions ---------------------------------------------------------
    @property
    def runnable(self) -> bool:
        """May this host run the agent now?"""
        return self.state is HolderState.HELD

    @property
    def holding(self) -> bool:
        return self.state in HOLDING

    @property
    def removed_here(self) -> bool:
        """An operator removed the agent from this host (see :func:`removed`)."""
        return self.state is HolderState.REMOVED

    @property
    def pending(self) -> bool:
        return self.state in PENDING

    @property
    def moving(self) -> bool:
        """Is a move of the agent under way here (either side, in doubt included)?"""
        return self.state in MOVING

    def describe_move(self) -> str:
        """The move under way, in words (for a refusal): state, side, peer, epoch."""
        side = "moving in from" if self.pending else "moving to"
        doubt = " (in doubt: the target may have activated it)" if self.state is HolderState.COMMITTING else ""
        return f"{self.state.value}, {side} {self.peer} at epoch {self.epoch}{doubt}"

    def with_(self, **changes: Any) -> "HolderRecord":
        if changes.get("state", self.state) is not HolderState.HELD:
            changes.setdefault("forced", False)  # (a forced hold ends with the hold)
        return replace(self, **changes)

    # -- serialisation -----------------------------------------------------
    def body(self) -> dict[str, Any]:
        body = {
            "format": HOLDER_FORMAT,
            "agent_id": self.agent_id,
            "state": self.state.value,
            "epoch": self.epoch,
            "held_epoch": self.held_epoch,
            "peer": self.peer,
            "activated": list(self.activated),
            "note": self.note,
        }
        if self.kept is not None:  # (absent otherwise: records without one read as before)
            body["kept"] = self.kept
        if self.forced:  # (likewise)
            body["forced"] = True
        return body

    def to_bytes(self) -> bytes:
        body = self.body()
        check = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        return (json.dumps({**body, "check": check}, sort_keys=True, indent=1) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "HolderRecord":
        doc = load_json_object(data, "holder record")
        check = doc.pop("check", None)
        if hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest() != check:
            raise FormatError("holder record does not match its check digest")
        if doc.get("format") != HOLDER_FORMAT:
            raise FormatError(f"holder record format {doc.get('format')!r} is not {HOLDER_FORMAT!r}")
        try:
            state = HolderState(doc["state"])
            if state is HolderState.REFUSED and doc.get("note") == REMOVED_NOTE:
                state = HolderState.REMOVED  # (written before REMOVED was a state of its own)
            return cls(
                agent_id=doc["agent_id"],
                state=state,
                epoch=doc["epoch"],
                held_epoch=doc["held_epoch"],
                peer=doc["peer"],
                activated=tuple(doc["activated"]),
                note=doc["note"],
                kept=doc.get("kept"),
                forced=doc.get("forced", False),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"holder record field missing or wrong: {exc}") from None


def new_held(agent_id: str, epoch: int) -> HolderRecord:
    """The record of an agent created or imported here, held at ``epoch``."""
    return HolderRecord(agent_id=agent_id, state=HolderState.HELD, epoch=epoch, held_epoch=epoch, activated=(epoch,))


#: The note of a record whose agent an operator removed from this host; before
#: REMOVED was a state, a REFUSED record with this note said "removed here".
REMOVED_NOTE = "removed from this host by an operator"


def removed(record: HolderRecord, kept: str | None = None) -> HolderRecord:
    """The record of an agent removed from this host: no longer held here
    (peers learn that this host does not hold it), its highest epoch kept as
    the fence against stale offers, and its activation history kept.
    REMOVED says this, and as REFUSED, that nothing at ``epoch`` or below
    activates here."""
    return HolderRecord(agent_id=record.agent_id, state=HolderState.REMOVED, epoch=record.epoch,
                        activated=record.activated, note=REMOVED_NOTE, kept=kept)


def unknown(agent_id: str, note: str, epoch: int = 0) -> HolderRecord:
    return HolderRecord(agent_id=agent_id, state=HolderState.UNKNOWN, epoch=epoch, note=note)


class HolderBook:
    """The holder records of one host, one file per agent in ``directory``.

    Not thread safe: callers serialise access per agent (the daemon does so
    with one lock per agent).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = os.fspath(directory)
        makedirs_durable(self.directory, 0o700)

    def _path(self, agent_id: str) -> str:
        return os.path.join(self.directory, check_agent_id(agent_id) + ".json")

    def get(self, agent_id: str) -> HolderRecord | None:
        """The record, None if there is none, UNKNOWN if it is corrupt."""
        try:
            with open(self._path(agent_id), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        try:
            record = HolderRecord.from_bytes(data)
        except FormatError as exc:
            return unknown(agent_id, f"holder record corrupt: {exc}")
        if record.agent_id != agent_id:
            return unknown(agent_id, f"holder record names agent {record.agent_id}")
        return record

    def put(self, record: HolderRecord) -> None:
        """Write ``record`` durably; return only once it is on disk."""
        atomic_write(self._path(record.agent_id), record.to_bytes(), mode=0o600)

    def agent_ids(self) -> list[str]:
        return sorted(n[:-5] for n in os.listdir(self.directory) if n.endswith(".json") and not n.startswith("."))

    def files_lock(self, agent_id: str, *, shared: bool, wait: float | None = None,
                   clock: Callable[[], float] = time.monotonic) -> AbstractContextManager[None]:
        """Hold the agent's files lock (see :func:`agent_files_lock`)."""
        return agent_files_lock(self.directory, agent_id, shared=shared, wait=wait, clock=clock)

    def reconcile(self, present: Iterable[str], *, wait: float = RECONCILE_WAIT) -> list[HolderRecord]:
        """Mark agents whose files are ``present`` here but who have no
        readable record as UNKNOWN (durably); return those records.

        An agent without a record is looked at again under its files lock:
        ``capsulefs new`` and ``import`` hold it from installing the files
        to writing the record. One held longer than ``wait`` seconds (a
        suspended import) is left alone, with a log line, for next time."""
        out = []
        for agent_id in present:
            rec = self.get(agent_id)
            if rec is None:
                try:
                    with self.files_lock(agent_id, shared=True, wait=wait):
                        rec = self.get(agent_id)
                        if rec is None:
                            rec = unknown(agent_id, "holder record lost")
                            self.put(rec)
                except FilesBusy:
                    log.warning("agent %s has files here but no holder record, and its files lock is held "
                                "(an import under way?); left alone for now", agent_id)
                    continue
            if rec.state is HolderState.UNKNOWN:
                out.append(rec)
        return out


@contextmanager
def agent_files_lock(directory: str, agent_id: str, *, shared: bool, wait: float | None = None,
                     clock: Callable[[], float] = time.monotonic) -> Iterator[None]:
    """Hold an agent's files lock (an flock on ``<agent_id>.lock`` beside its
    holder record in ``directory``), across processes. A writer that changes
    the agent's files from outside the daemon (`capsulefs append`: journal,
    projections, manifest) holds it exclusively and checks the record under
    it; a reader of the agent's files as a whole (archive.snapshot_files:
    snapshots, export, merge, a move once FROZEN is durable) holds it shared.
    So an append is whole in what a reader sees, or not in it at all, and a
    move never leaves one behind on the source.

    ``wait``: give up after that many seconds (FilesBusy), for a holder that
    must not hang behind a writer that stopped (a suspended append).

    A reader of a store it may not write (mounted read-only, or another
    user's) reads without the lock, as before there was one: nobody can be
    appending to a read-only store, and the other user's case is logged."""
    path = os.path.join(directory, check_agent_id(agent_id) + ".lock")
    try:
        if shared:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # (flock does not care how a file is open)
            except FileNotFoundError:
                makedirs_durable(directory, 0o700)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if not shared or exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        if exc.errno != errno.EROFS:
            log.warning("agent %s: reading its files without their lock (%s): an append by its owner may "
                        "show half", agent_id, exc)
        fd = -1
    if fd < 0:
        yield
        return
    try:
        mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        if wait is None:
            fcntl.flock(fd, mode)
        else:
            deadline = clock() + wait
            while True:
                try:
                    fcntl.flock(fd, mode | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if clock() >= deadline:
                        raise FilesBusy(f"agent {agent_id}: a writer outside the daemon (capsulefs append) has held "
                                        f"its files for over {wait:.0f} s") from None
                    time.sleep(LOCK_POLL)
        yield
    finally:
        os.close(fd)
