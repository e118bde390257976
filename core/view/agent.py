"""One agent as the view serves it: its manifest computed from the files as
they are now, its edits, its journal and its status (the rules are in ``host``).

:class:`AgentHost` is what a :class:`LiveAgent` needs of the view it is part
of (``tree.Tree`` and so ``host.LiveHost`` provide it).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from .. import metrics
from ..capsule import format as fmt
from ..capsule.spec import parse_spec
from ..errors import CapsuleError, FormatError, NotFoundError
from ..hashing import hash_file
from ..journal.events import Attachment, Event, MemoryEdit, ModelSwitch
from ..journal.record import Record
from ..journal.file import Journal, parse_draft_lines
from ..journal.recovery import journal_ring_path
from ..store.layout import RECOVERY_DIR
from ..journal.tip import journal_tip_path
from ..store.agent import AgentHandle
from ..store.host_store import HostStore
from .edit import Edit, resize
from .errors import NotPermitted
from .journal_tail import JournalTail, open_appender
from .nodes import EDITABLE, AgentState, Attr, Kind, Node, build_tree, stat_ident
from .scratch import SCRATCH_DIRS, ScratchArea

log = logging.getLogger(__name__)

#: Working memory up to this size goes inline into its memory_edit event;
#: larger memory is stored as a blob and the event names it.
INLINE_MEMORY_LIMIT = 64 * 1024
MOVE_UNAVAILABLE = "moving agents is not available on this mount (.control/move is reserved)"


def counted(records: list[Record]) -> list[Record]:
    """``records``, appended through the view, counted in the metrics."""
    for rec in records:
        metrics.EVENTS_APPENDED.inc(rec.kind)
    return records


def check_attachments(listed: Callable[[], Mapping[str, int]], events: Sequence[Event]) -> None:
    """FormatError unless every attachment event names a blob in ``listed()``
    (sha256 -> size: the agent's manifest, read only if there is one) and
    gives its size."""
    blobs: Mapping[str, int] | None = None
    for ev in events:
        if type(ev) is not Attachment:
            continue
        blobs = listed() if blobs is None else blobs
        size = blobs.get(ev.blob)
        if size is None:
            raise FormatError(f"attachment {ev.blob}: this agent has no such blob; write the file to "
                              f"{fmt.BLOBS_DIR}/<its sha256> first")
        if size != ev.size:
            raise FormatError(f"attachment {ev.blob}: size {ev.size} but the blob has {size} bytes")


class AgentHost(Protocol):
    """What a :class:`LiveAgent` uses of the view it belongs to."""

    @property
    def store(self) -> HostStore: ...

    @property
    def scratch(self) -> ScratchArea: ...

    @property
    def host_id(self) -> str: ...

    @property
    def failsafe(self) -> str | None: ...

    @property
    def last_error(self) -> str | None: ...

    @property
    def mover(self) -> object | None: ...

    @property
    def status_sections(self) -> Mapping[str, Callable[[str], object]]: ...

    @property
    def now_ns(self) -> Callable[[], int]: ...

    @property
    def new_event_id(self) -> Callable[[], str]: ...

    def state(self, agent_id: str) -> AgentState: ...

    def changed(self, agent_id: str, rel: str) -> None: ...

    def check_writable(self, agent_id: str) -> None: ...

    def check_lease(self) -> None: ...


class LiveAgent:
    def __init__(self, host: AgentHost, agent_id: str) -> None:
        self.host = host
        self.agent_id = agent_id
        self.handle = AgentHandle(host.store, agent_id)
        self.tail = JournalTail(self.handle.path(fmt.JOURNAL),
                                tip_path=journal_tip_path(host.store.root, agent_id))
        self.edits: dict[str, Edit] = {}
        #: Editable files unlinked, by the thread that unlinked each (its id and
        #: start time, see ``LiveHost.unlinked_by``): the
        #: name is gone for that thread only, until it creates the file anew.
        self.unlinked: dict[str, tuple[int, int | None]] = {}
        self._digests: dict[str, tuple[tuple[int, int, int, int], fmt.FileEntry]] = {}
        self._stored: tuple[tuple[int, int, int, int], fmt.Manifest] | None = None
        self._tree: tuple[object, dict[str, dict[str, Node]]] | None = None
        self._manifest_cache: tuple[object, bytes] | None = None
        self._blobs: tuple[fmt.Manifest, dict[str, int]] | None = None
        self._appender: Journal | None = None
        #: Set when the view drops this agent (moved away, removed, gone from
        #: the store): handles still open on it never write again, even once
        #: an agent of the same id is back (a new incarnation, a new object).
        self.gone = False
        self.move_progress: dict[str, object] | None = None
        # Directories show one fixed time: their entries change only when the
        # capsule's shape does, and a moving directory time makes `tar` of an
        # idle agent fail with "file changed as we read it".
        self.dir_mtime_ns = os.stat(self.handle.dir).st_mtime_ns

    # -- reading -------------------------------------------------------------
    def stored_manifest(self) -> fmt.Manifest:
        """The manifest as the store last wrote it (blobs, holder, name)."""
        path = os.path.join(self.handle.dir, fmt.MANIFEST)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise NotFoundError(f"agent {self.agent_id} is not held here") from None
        if self._stored is None or self._stored[0] != stat_ident(st):
            self._stored = (stat_ident(st), self.handle.manifest())
        return self._stored[1]

    def blobs(self) -> dict[str, int]:
        """sha256 -> size of the agent's blobs (from the stored manifest)."""
        stored = self.stored_manifest()
        if self._blobs is None or self._blobs[0] is not stored:
            self._blobs = (stored, stored.blobs())
        return self._blobs[1]

    def tree(self) -> dict[str, dict[str, Node]]:
        stored = self.stored_manifest()
        files = self.handle.local_files()
        key = (self._stored[0] if self._stored else None, tuple(files))
        if self._tree is None or self._tree[0] != key:
            aid = self.agent_id
            blobs = [fmt.blob_path(sha) for sha in stored.blobs()]

            def make(rel: str) -> Node:
                return Node(Kind.BLOB if fmt.blob_name(rel) is not None else Kind.FILE, aid, rel)

            tree = build_tree(files + blobs, [fmt.BLOBS_DIR], make, lambda d: Node(Kind.DIR, aid, d))
            tree[""][fmt.MANIFEST] = Node(Kind.MANIFEST, aid, fmt.MANIFEST)
            self._tree = (key, tree)
        return self._tree[1]

    def entry(self, rel: str) -> fmt.FileEntry:
        """Digest and size of a non-blob file as served now."""
        if rel == fmt.JOURNAL:
            self.tail.refresh()
            return fmt.FileEntry(sha256=self.tail.sha256(), size=self.tail.size)
        edit = self.edits.get(rel)
        if edit is not None and edit.dirty:
            return fmt.FileEntry(sha256=hashlib.sha256(edit.data).hexdigest(), size=len(edit.data))
        path = self.handle.path(rel)
        for _attempt in range(3):
            st = os.stat(path)
            cached = self._digests.get(rel)
            if cached is not None and cached[0] == stat_ident(st):
                return cached[1]
            sha, size = hash_file(path)
            if stat_ident(os.stat(path)) == stat_ident(st):  # unchanged while hashing
                e = fmt.FileEntry(sha256=sha, size=size)
                self._digests[rel] = (stat_ident(st), e)
                return e
        raise OSError(errno.EAGAIN, f"{path} keeps changing while being hashed")

    def manifest(self) -> fmt.Manifest:
        stored = self.stored_manifest()
        files = stored.blob_entries()
        for rel in self.handle.local_files():
            files[rel] = self.entry(rel)
        return stored.with_files(files)

    def _manifest_key(self) -> tuple[object, int] | None:
        """What the served manifest depends on, and the newest file mtime;
        None while an edit is in progress (then nothing is cached)."""
        if any(e.dirty for e in self.edits.values()):
            return None
        self.stored_manifest()
        idents = []
        mtime = self._stored[0][2] if self._stored else 0  # manifest.json's mtime
        for rel in self.handle.local_files():
            st = os.stat(self.handle.path(rel))
            idents.append((rel, stat_ident(st)))
            mtime = max(mtime, st.st_mtime_ns)
        self.tail.refresh()
        return (self._stored[0] if self._stored else None, tuple(idents), self.tail.size), mtime

    def manifest_bytes(self) -> bytes:
        """The manifest as served; rebuilt only when a file changed."""
        return self.manifest_attr()[0]

    def manifest_attr(self) -> tuple[bytes, int]:
        """(manifest bytes as served, newest mtime of the files it covers)."""
        keyed = self._manifest_key()
        if keyed is not None and self._manifest_cache is not None and self._manifest_cache[0] == keyed[0]:
            return self._manifest_cache[1], keyed[1]
        data = self.manifest().to_bytes()
        mtime = keyed[1] if keyed is not None else self.host.now_ns()
        if keyed is not None:
            self._manifest_cache = (keyed[0], data)
        return data, mtime

    def file_attr(self, rel: str) -> Attr:
        st = os.stat(self.handle.path(rel))
        if rel == fmt.JOURNAL:
            self.tail.refresh()
            return Attr(False, 0o644, self.tail.size, st.st_mtime_ns, atime_ns=st.st_atime_ns, ctime_ns=st.st_ctime_ns)
        if rel not in EDITABLE:
            return Attr(False, 0o444, st.st_size, st.st_mtime_ns)
        edit = self.edits.get(rel)
        size = len(edit.data) if edit is not None else st.st_size
        return Attr(False, 0o644, size, st.st_mtime_ns, atime_ns=st.st_atime_ns, ctime_ns=st.st_ctime_ns)

    def dir_attr(self, rel: str) -> Attr:
        """A directory of the capsule: one fixed time (its entries change only
        when the capsule's shape does), or, where editors keep scratch files,
        the time a scratch name in it last came or went, if later."""
        mtime = self.dir_mtime_ns
        if rel in SCRATCH_DIRS:
            mtime = max(mtime, self.host.scratch.dir_mtime_ns(self.agent_id, rel))
        return Attr(True, 0o755, 0, mtime)

    def set_times(self, rel: str, atime_ns: int | None, mtime_ns: int | None) -> None:
        """``touch -d``, ``cp -p``, ``rsync -a`` on a mutable file (working
        memory, the spec, the journal): the times are the stored file's, until
        its content changes (a commit replaces it, an append moves its mtime),
        as on a disk. Set while an edit is pending, they are set again once it
        is committed, unless it is written to meanwhile."""
        self.check_writable()
        path = self.handle.path(rel)
        st = os.stat(path)
        times = (st.st_atime_ns if atime_ns is None else atime_ns, st.st_mtime_ns if mtime_ns is None else mtime_ns)
        edit = self.edits.get(rel)
        if edit is not None and edit.dirty:
            edit.times = times
        os.utime(path, ns=times)
        self.host.changed(self.agent_id, rel)

    def model(self) -> tuple[str, str] | None:
        self.tail.refresh()
        return self.tail.model

    def model_bytes(self) -> bytes:
        m = self.model()
        return f"{m[0]}:{m[1]}\n".encode() if m else b""

    def status(self) -> dict[str, object]:
        stored = self.stored_manifest()
        model = self.model()
        state = self.host.state(self.agent_id)
        return {
            "agent_id": self.agent_id,
            "name": stored.name,
            "state": state.value,
            "writable": self.host.failsafe is None and state is AgentState.ACTIVE,
            "mount": "read-only (failsafe)" if self.host.failsafe is not None else "read-write",
            "holder": stored.holder.host,
            "epoch": stored.holder.epoch,
            "provider": model[0] if model else None,
            "model": model[1] if model else None,
            "events": self.tail.events,
            "last_error": self.host.last_error,
            "move": self.move_progress or ({"available": True, "phase": "idle"} if self.host.mover is not None
                                           else {"available": False, "detail": MOVE_UNAVAILABLE}),
        } | {key: section(self.agent_id) for key, section in self.host.status_sections.items()}

    def status_bytes(self) -> bytes:
        return (json.dumps(self.status(), indent=2, sort_keys=True) + "\n").encode()

    # -- writing -------------------------------------------------------------
    def journal(self) -> Journal:
        if self._appender is not None and self._appender.broken is not None:
            # A write or fdatasync failed (that append got EIO): reopen, which
            # makes the ring's bytes durable in the journal again first; if
            # the disk still fails, this append fails the same way.
            log.warning("agent %s: reopening its journal after an earlier failure (%s)",
                        self.agent_id, self._appender.broken)
            self._appender.close()
            self._appender = None
        if self._appender is None:
            h = self.host
            self._appender = open_appender(self.handle.path(fmt.JOURNAL), machine=h.host_id,
                                           new_id=h.new_event_id, now_ns=h.now_ns,
                                           recovery_dir=os.path.join(h.store.root, RECOVERY_DIR, self.agent_id),
                                           ring_path=journal_ring_path(h.store.root, self.agent_id),
                                           tip_path=journal_tip_path(h.store.root, self.agent_id))
        return self._appender

    def append(self, events: Sequence[Event]) -> list[Record]:
        self.check_writable()
        self.check_blobs(events)
        try:
            records = self.journal().append_many(events)
        finally:
            self.host.changed(self.agent_id, fmt.JOURNAL)
        return counted(records)

    def check_blobs(self, events: Sequence[Event]) -> None:
        """FormatError unless every attachment among ``events`` names a blob
        this agent lists, with its size (``uploads.check_attachments``)."""
        check_attachments(self.blobs, events)

    def append_lines(self, data: bytes) -> list[Record]:
        """Validate whole JSON lines of event drafts, then append them all, or none."""
        return self.append(parse_draft_lines(data, "journal"))

    def switch_model(self, provider: str, model: str) -> Record:
        """Switch to ``provider:model`` (as ``handles.parse_model_line`` reads one)."""
        return self.append([ModelSwitch(provider=provider, model=model)])[0]

    def begin_edit(self, rel: str) -> Edit:
        self.check_writable()
        edit = self.edits.get(rel)
        if edit is None:
            edit = self.edits[rel] = Edit(bytearray(self.handle.read(rel)))
        edit.writers += 1
        return edit

    def end_edit(self, rel: str, edit: Edit) -> None:
        """A writer's last close: the last writer of ``edit`` commits what is
        uncommitted; refused, the bytes are dropped (the close that could
        report it, flush, already did)."""
        edit.writers -= 1
        if edit.writers or edit.detached:
            return
        try:
            if edit.dirty:
                self.commit_edit(rel)
        except CapsuleError as exc:
            log.warning("%s of agent %s: edit not saved at close: %s", rel, self.agent_id, exc)
        finally:
            del self.edits[rel]
            if edit.dirty:  # dropped: the kernel's size of the file was the edit's
                self.host.changed(self.agent_id, rel)

    def commit_edit(self, rel: str) -> None:
        """Save the edit of ``rel``; refused, it stays as its writers left it."""
        edit = self.edits[rel]
        self.save(rel, bytes(edit.data))
        edit.dirty = edit.written = edit.fresh = False
        if edit.times is not None:  # set after the last write, before this commit
            os.utime(self.handle.path(rel), ns=edit.times)
            edit.times = None

    def detach_edit(self, rel: str) -> None:
        """``rel`` was replaced: its open writers keep writing to the old file."""
        edit = self.edits.pop(rel, None)
        if edit is not None:
            edit.detached = True

    def truncate(self, rel: str, size: int) -> None:
        self.check_writable()
        edit = self.edits.get(rel)
        if edit is not None:
            resize(edit.data, size, rel)
            edit.dirty = True
            return
        buf = bytearray(self.handle.read(rel))
        resize(buf, size, rel)
        self.save(rel, bytes(buf))

    def check_edit(self, rel: str, data: bytes) -> str | None:
        """Raise the error that saving ``data`` as ``rel`` would raise, before
        it changes anything; return the working memory's text."""
        self.check_writable()
        if rel == fmt.SPEC:
            parse_spec(data)
            return None
        if rel == fmt.VECTOR_INDEX:  # derived data, checked as its readers check it (they rebuild what is stale)
            from ..semantic.vectors import parse_index

            parse_index(data)
            return None
        if rel != fmt.WORKING_MEMORY:
            raise NotPermitted(f"{rel} is not editable")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FormatError(f"working memory must be UTF-8 text: {exc}") from None

    def save(self, rel: str, data: bytes) -> None:
        """Commit a new version of an editable file (validated first)."""
        text = self.check_edit(rel, data)
        self.unlinked.pop(rel, None)  # a new version: there for everyone again
        if text is None:  # the spec, the semantic index: no event
            self.handle.write_files({rel: data})
            self.host.changed(self.agent_id, rel)
            metrics.EDITS.inc(os.path.basename(rel))
            log.info("agent %s: %s updated (%d bytes)", self.agent_id, rel, len(data))
            return
        if data == self.handle.read(rel):
            return  # nothing changed: no event
        store = self.host.store
        with store.writing():
            if len(data) <= INLINE_MEMORY_LIMIT:
                self.append([MemoryEdit(text=text)])
                self.handle.write_files({rel: data})
            else:
                sha = store.put_blob(data)
                self.handle.list_blobs([sha])  # before the journal names it (gc)
                self.append([MemoryEdit(blob=sha)])
                self.handle.write_files({rel: data}, add_blobs=[sha])
        self.host.changed(self.agent_id, rel)
        metrics.EDITS.inc(os.path.basename(rel))
        log.info("agent %s: working memory edited (%d bytes)", self.agent_id, len(data))

    def check_writable(self) -> None:
        if self.gone:
            raise NotFoundError(f"agent {self.agent_id} left this view after this file was opened "
                                f"(removed or moved away); nothing is written through it")
        self.host.check_writable(self.agent_id)

    def close(self) -> None:
        self.gone = True
        if self._appender is not None:
            self._appender.close()
            self._appender = None
