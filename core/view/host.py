"""The live view: every agent a host holds, as the file tree a mount shows.

Rules:
  * The root holds one directory per agent, named by the agent's name;
    making a directory there creates an agent. Each agent directory is
    exactly a capsule (``format``): its ``manifest.json`` is computed from
    the files as they are served right now, so a copy of an idle agent
    verifies. Blobs are served from the host store and never change.
  * Writable: ``memory/working_memory.md`` and ``environment/spec.json``
    (any editor: in place, a scratch file renamed over them, or unlink and
    create anew, which hides the name from the unlinking thread only), and
    ``memory/timeline_events.jsonl`` (append only, whole JSON lines). A new
    file in ``artifacts/blobs/`` named by the sha256 of its bytes adds a
    blob (``uploads``). All else is read-only; the capsule's shape
    never changes through the mount otherwise.
  * An edit of an editable file is buffered (one :class:`Edit` per file,
    shared by every descriptor writing it, like an inode's pages) and
    committed when a writer flushes (close) or fsyncs, or when a scratch
    file is renamed over the file. A committed working-memory edit is one
    ``memory_edit`` journal event followed by the file itself; a spec edit
    must pass ``spec.validate_spec`` or it is refused and the old spec kept.
  * A failed write poisons its edit (``handles.Edit.failed``): nothing
    of it is committed. Times given to a mutable file are kept on the
    stored file until its content changes (:meth:`LiveAgent.set_times`);
    other capsule files refuse them, as they refuse a mode.
  * Hidden directories, absent from listings but reachable by name:
    ``.control/`` (status, model, move, abandon, remove) and ``.snapshots/``
    (see snapshots).
  * Writes fail with ReadOnly while the agent is frozen (a move is under
    way) or once the view went read-only after an internal error
    (:meth:`LiveHost.enter_failsafe`, never undone while mounted). A
    retired agent is not shown at all; nor is a removed one (REMOVED, whose
    open handles then write nothing) until its id is in the store again.

Theory of operation: the adapter (``capsulefs.mount``) turns inodes into
:class:`Node` keys and file handles into :class:`Handle` objects, and calls
this module for everything else. Digests are cached per file by its stat
identity; the journal is followed incrementally (``journal_tail.JournalTail``)
so a manifest costs a few ``stat`` calls however long the journal grows.

Concurrency: everything here is synchronous and is called from one thread
(the adapter's event loop); a method never yields half-way, so state shared
between requests (edits, caches) is consistent between calls. Blob reads
may run in worker threads: only :class:`BlobHandle` and ``blobcheck`` are
thread-safe.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from enum import Enum

from ..capsule import format as fmt
from ..capsule.archive import FILES_WAIT
from .blobcheck import BlobChecks
from ..errors import CapsuleError, CorruptBlobError, ExistsError, FormatError, NotFoundError, StoreError
from ..journal.events import Event, MemoryEdit, ModelSwitch, Record
from ..fsutil import thread_start
from ..hashing import hash_file
from ..store.holder import HOLDERS_DIR, agent_files_lock
from .errors import AccessDenied, IsADirectory, NoAttribute, NotADirectory, NotEmpty, NotPermitted, ReadOnly
from ..journal.file import Journal, parse_draft_lines
from ..journal.recovery import RECOVERY_DIR, journal_ring_path
from ..journal.tip import journal_tip_path
from .handles import (
    MOVE_UNAVAILABLE,
    BlobHandle,
    Mover,
    BytesHandle,
    Edit,
    EditHandle,
    FileHandle,
    Handle,
    JournalHandle,
    ModelHandle,
    MoveHandle,
    RemoveHandle,
    Remover,
    ScratchHandle,
    check_edit_size,
    resize,
)
from .journal_tail import JournalTail, open_appender
from .scratch import SCRATCH_DIRS, ScratchArea
from .uploads import UploadArea, check_attachments, check_upload_name
from .snapshots import Snapshots
from ..capsule.spec import parse_spec
from ..store.host_store import AgentHandle, HostStore

log = logging.getLogger(__name__)

CONTROL = ".control"
SNAPSHOTS = ".snapshots"
CONTROL_FILES = ("abandon", "model", "move", "remove", "status")
EDITABLE = frozenset({fmt.WORKING_MEMORY, fmt.SPEC})
#: Working memory up to this size goes inline into its memory_edit event;
#: larger memory is stored as a blob and the event names it.
INLINE_MEMORY_LIMIT = 64 * 1024
XATTR_SHA256 = "user.capsule.sha256"
XATTR_AGENT_ID = "user.capsule.agent_id"
XATTR_EPOCH = "user.capsule.epoch"


class Kind(Enum):
    ROOT = "root"  # the mount's root: one directory per agent
    AGENT = "agent"  # an agent directory (the capsule's top)
    DIR = "dir"  # a directory inside a capsule (rel)
    FILE = "file"  # a non-blob capsule file (rel), on disk in the agent dir
    BLOB = "blob"  # artifacts/blobs/<sha256>, served from the store
    MANIFEST = "manifest"  # manifest.json, computed
    SCRATCH = "scratch"  # an editor's temp file (rel = "<dir>/<name>")
    CONTROL = "control"  # .control/
    CONTROL_FILE = "control_file"  # .control/<rel>
    SNAPSHOTS = "snapshots"  # .snapshots/
    SNAPSHOT = "snapshot"  # .snapshots/<snap>/ (a capsule's top)
    SNAP_DIR = "snap_dir"  # a directory inside a snapshot (rel)
    SNAP_FILE = "snap_file"  # a file inside a snapshot (rel), blobs included


DIR_KINDS = frozenset({Kind.ROOT, Kind.AGENT, Kind.DIR, Kind.CONTROL, Kind.SNAPSHOTS, Kind.SNAPSHOT, Kind.SNAP_DIR})


@dataclass(frozen=True, slots=True)
class Node:
    """What an inode stands for. Hashable: the adapter's inode table key."""

    kind: Kind
    agent: str = ""  # agent_id ("" for the root)
    rel: str = ""  # capsule-relative path, or the control file's name
    snap: str = ""  # snapshot name, for the SNAP* kinds

    @property
    def is_dir(self) -> bool:
        return self.kind in DIR_KINDS


ROOT = Node(Kind.ROOT)


@dataclass(frozen=True, slots=True)
class Attr:
    is_dir: bool
    perm: int  # permission bits
    size: int
    mtime_ns: int
    immutable: bool = False  # never changes: the kernel may cache it long
    uid: int | None = None  # None: the mounting user
    gid: int | None = None
    atime_ns: int | None = None  # None: mtime_ns
    ctime_ns: int | None = None  # None: mtime_ns


class AgentState(Enum):
    ACTIVE = "active"
    FROZEN = "frozen"  # a move is under way: every write fails with ReadOnly
    RETIRED = "retired"  # moved away (or being removed): not shown
    REMOVED = "removed"  # removed from the store (capsulefs rm): not shown until its id is back (an import)


def _tree(files: Sequence[str], extra_dirs: Sequence[str], make: Callable[[str], Node],
          make_dir: Callable[[str], Node]) -> dict[str, dict[str, Node]]:
    """Directory -> {name: node} for a capsule's files."""
    dirs: dict[str, dict[str, Node]] = {"": {}}

    def ensure(d: str) -> None:
        if d in dirs:
            return
        parent, _, name = d.rpartition("/")
        ensure(parent)
        dirs[parent][name] = make_dir(d)
        dirs[d] = {}

    for d in extra_dirs:
        ensure(d)
    for rel in files:
        parent, _, name = rel.rpartition("/")
        ensure(parent)
        dirs[parent][name] = make(rel)
    return dirs


def _ident(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


# -- one agent ------------------------------------------------------------------


class LiveAgent:
    def __init__(self, host: "LiveHost", agent_id: str) -> None:
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
        if self._stored is None or self._stored[0] != _ident(st):
            self._stored = (_ident(st), self.handle.manifest())
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

            tree = _tree(files + blobs, [fmt.BLOBS_DIR], make, lambda d: Node(Kind.DIR, aid, d))
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
            if cached is not None and cached[0] == _ident(st):
                return cached[1]
            sha, size = hash_file(path)
            if _ident(os.stat(path)) == _ident(st):  # unchanged while hashing
                e = fmt.FileEntry(sha256=sha, size=size)
                self._digests[rel] = (_ident(st), e)
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
            idents.append((rel, _ident(st)))
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
            return self.journal().append_many(events)
        finally:
            self.host.changed(self.agent_id, fmt.JOURNAL)

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
        if text is None:  # the spec
            self.handle.write_files({rel: data})
            self.host.changed(self.agent_id, rel)
            log.info("agent %s: spec updated (%d bytes)", self.agent_id, len(data))
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


# -- the host ------------------------------------------------------------------


@dataclass(slots=True)
class _SnapCache:
    manifest: fmt.Manifest
    tree: dict[str, dict[str, Node]] = field(default_factory=dict)


class LiveHost:
    """Every agent of one host store, as the mount shows them."""

    def __init__(
        self,
        store: HostStore,
        *,
        host_id: str,
        work_dir: str,
        new_agent_id: Callable[[], str],
        new_event_id: Callable[[], str],
        now_ns: Callable[[], int],
        owner_uid: int = 0,
    ) -> None:
        self.store = store
        self.host_id = fmt.check_host_id(host_id)
        self.new_agent_id = new_agent_id
        self.new_event_id = new_event_id
        self.now_ns = now_ns
        self.owner_uid = owner_uid  # the mounting user; with root, may write .control
        #: With sandbox isolation (agents run as uids of their own): the uid
        #: an agent's processes run as, or None before it has one. Set, the
        #: root is mode 0711, each agent's directory 0700, and the agent's
        #: directory, files and folders (not .control) are its uid's, so
        #: that its process, and no other agent's, can use them.
        self.agent_owner: Callable[[str], int | None] | None = None
        self.work_dir = work_dir
        self.scratch = ScratchArea.under(work_dir)
        self.uploads = UploadArea.under(work_dir)  # (leftovers of an earlier daemon removed)
        self.snapshots = Snapshots.under(work_dir)
        self.snapshots.sweep()
        self._drop_leftovers(set(store.agent_ids()))
        self.blobs = BlobChecks()
        self.failsafe: str | None = None  # why the view went read-only, if it did
        self.last_error: str | None = None
        self._agents: dict[str, LiveAgent] = {}
        self._states: dict[str, AgentState] = {}
        self._snaps: dict[tuple[str, str], _SnapCache] = {}
        self._names: tuple[object, dict[str, str]] | None = None
        #: Called with (agent_id, capsule path) after a change made through
        #: this view, so that the adapter can tell the kernel (attributes
        #: of that file, the manifest and the status change).
        self.on_change: Callable[[str, str], None] = lambda agent_id, rel: None
        #: Extra sections of ``.control/status`` from other components, by
        #: key (e.g. "run": the agent process's state from the supervisor).
        self.status_sections: dict[str, Callable[[str], object]] = {}
        #: Called with (agent_id, epoch) right after ``mkdir`` created an
        #: agent, so the daemon records that this host holds it (a holder
        #: record: without one the agent never runs and cannot move).
        self.on_new_agent: Callable[[str, int], None] = lambda agent_id, epoch: None
        #: Carries out writes to ``.control/move`` and ``.control/abandon``
        #: (the daemon's move wiring); None: they fail with EOPNOTSUPP.
        self.mover: Mover | None = None
        #: Carries out writes to ``.control/remove`` (the daemon); None: they
        #: fail with EOPNOTSUPP.
        self.remover: Remover | None = None

    # -- states (the daemon's API for the move driver) -----------------------
    def state(self, agent_id: str) -> AgentState:
        st = self._states.get(agent_id, AgentState.ACTIVE)
        if st is AgentState.REMOVED and os.path.isfile(os.path.join(self.store.agents_dir, agent_id, fmt.MANIFEST)):
            del self._states[agent_id]  # an agent of that id is in the store again (an import): a new one
            return AgentState.ACTIVE
        return st

    def set_state(self, agent_id: str, state: AgentState) -> None:
        fmt.check_agent_id(agent_id)
        if state is AgentState.ACTIVE:
            self._states.pop(agent_id, None)
        else:
            self._states[agent_id] = state
        log.info("agent %s is now %s", agent_id, state.value)

    def enter_failsafe(self, reason: str) -> None:
        self.last_error = reason
        if self.failsafe is None:
            self.failsafe = reason
            log.error("the mount is now read-only (failsafe) after an internal error: %s", reason)

    def changed(self, agent_id: str, rel: str) -> None:
        self.on_change(agent_id, rel)

    def check_writable(self, agent_id: str) -> None:
        if self.failsafe is not None:
            raise ReadOnly(f"the mount went read-only after an internal error: {self.failsafe}")
        if self.state(agent_id) is AgentState.REMOVED:
            raise NotFoundError(f"agent {agent_id} was removed from this host")
        if self.state(agent_id) is not AgentState.ACTIVE:
            raise ReadOnly(f"agent {agent_id} is {self.state(agent_id).value} (a move is under way); no writes")

    # -- agents ----------------------------------------------------------------
    def agent(self, agent_id: str) -> LiveAgent:
        a = self._agents.get(agent_id)
        if a is None:
            if self.state(agent_id) in (AgentState.RETIRED, AgentState.REMOVED):
                raise NotFoundError(f"agent {agent_id} was {self.state(agent_id).value} from this host")
            a = self._agents[agent_id] = LiveAgent(self, agent_id)
        return a

    def names(self, *, strict: bool = True) -> dict[str, str]:
        """name -> agent_id of every agent shown.

        A listing (``strict``) reads every agent's manifest and raises
        StoreError if one is unreadable: the root never silently shows fewer
        agents. A lookup (not strict) uses the last answer while the agents
        directory and the retired set are unchanged, and skips unreadable
        agents so that the others stay reachable.
        """
        key = (os.stat(self.store.agents_dir).st_mtime_ns, frozenset(self._states.items()))
        if not strict and self._names is not None and self._names[0] == key:
            return self._names[1]
        out = {}
        ids = set(self.store.agent_ids())
        for gone in set(self._agents) - ids:
            self._agents.pop(gone).close()
        broken: StoreError | None = None
        for aid in sorted(ids):
            if self.state(aid) is AgentState.RETIRED:
                continue
            try:
                out[self.agent(aid).stored_manifest().name] = aid
            except NotFoundError:
                continue  # removed meanwhile
            except StoreError as exc:
                broken = broken or exc
        if broken is not None and strict:
            raise broken
        self._names = (key, out) if broken is None else None
        return out

    # -- the tree ----------------------------------------------------------------
    def _snap(self, agent_id: str, name: str) -> _SnapCache:
        key = (agent_id, name)
        c = self._snaps.get(key)
        if c is None or not self.snapshots.exists(agent_id, name):
            if not self.snapshots.exists(agent_id, name):
                self._snaps.pop(key, None)
                raise NotFoundError(f"no snapshot {name!r}")
            m = self.snapshots.manifest(agent_id, name)
            files = sorted(m.files) + [fmt.MANIFEST]
            tree = _tree(files, [fmt.BLOBS_DIR], lambda r: Node(Kind.SNAP_FILE, agent_id, r, name),
                         lambda d: Node(Kind.SNAP_DIR, agent_id, d, name))
            c = self._snaps[key] = _SnapCache(m, tree)
        return c

    def _children(self, node: Node, *, strict: bool = True) -> dict[str, Node]:
        match node.kind:
            case Kind.ROOT:
                return {name: Node(Kind.AGENT, aid) for name, aid in self.names(strict=strict).items()}
            case Kind.AGENT:
                return self.agent(node.agent).tree()[""]
            case Kind.DIR:
                return self.agent(node.agent).tree().get(node.rel, {})
            case Kind.CONTROL:
                return {n: Node(Kind.CONTROL_FILE, node.agent, n) for n in CONTROL_FILES}
            case Kind.SNAPSHOTS:
                return {n: Node(Kind.SNAPSHOT, node.agent, "", n) for n in self.snapshots.names(node.agent)}
            case Kind.SNAPSHOT | Kind.SNAP_DIR:
                return self._snap(node.agent, node.snap).tree.get(node.rel, {})
        raise NotADirectory(f"{node.rel or node.kind.value} is not a directory")

    def listdir(self, node: Node) -> list[tuple[str, Node]]:
        """Entries of a directory, hidden directories and scratch files left out."""
        return sorted(self._children(node).items())

    def lookup(self, parent: Node, name: str, pid: int | None = None) -> Node:
        """The node ``name`` in ``parent`` names, as thread ``pid`` sees it
        (an editable file it unlinked is gone for it; None: for no one)."""
        if parent.kind is Kind.AGENT and name in (CONTROL, SNAPSHOTS):
            self.agent(parent.agent).stored_manifest()  # the agent still exists
            return Node(Kind.CONTROL if name == CONTROL else Kind.SNAPSHOTS, parent.agent)
        child = self._children(parent, strict=False).get(name)
        if child is not None:
            if pid is not None and child.kind is Kind.FILE and self.unlinked_by(child, pid):
                raise NotFoundError(f"{child.rel}: unlinked by this process, not created again yet")
            return child
        if parent.kind is Kind.DIR and self.scratch.exists(parent.agent, parent.rel, name):
            return Node(Kind.SCRATCH, parent.agent, f"{parent.rel}/{name}")
        raise NotFoundError(f"{name}: no such file or directory")

    def attr(self, node: Node) -> Attr:
        a = self._attr(node)
        if self.agent_owner is None:
            return a
        if node.kind is Kind.ROOT:
            return replace(a, perm=0o711)  # (agents pass through to their own; none lists the others)
        owner = self.agent_owner(node.agent)
        if node.kind is Kind.AGENT:
            a = replace(a, perm=0o700)
        if owner is None or node.kind in (Kind.CONTROL, Kind.CONTROL_FILE) or a.uid not in (None, self.owner_uid):
            return a
        return replace(a, uid=owner, gid=owner)

    def _attr(self, node: Node) -> Attr:
        match node.kind:
            case Kind.ROOT:
                return Attr(True, 0o755, 0, os.stat(self.store.agents_dir).st_mtime_ns)
            case Kind.AGENT | Kind.DIR | Kind.CONTROL | Kind.SNAPSHOTS:
                a = self.agent(node.agent)
                a.stored_manifest()
                if node.kind is Kind.DIR and node.rel not in a.tree():
                    raise NotFoundError(f"{node.rel}: no such directory")
                return a.dir_attr(node.rel) if node.kind is Kind.DIR else Attr(True, 0o755, 0, a.dir_mtime_ns)
            case Kind.FILE:
                return self.agent(node.agent).file_attr(node.rel)
            case Kind.BLOB:
                sha = fmt.blob_name(node.rel) or ""
                size = self.agent(node.agent).blobs().get(sha)
                if size is None and (pending := self.uploads.pending_size(node.agent, sha)) is not None:
                    return Attr(False, 0o644, pending, self.now_ns())  # being uploaded (uploads)
                if size is None:
                    raise NotFoundError(f"{node.rel}: no such blob in this agent")
                try:
                    mtime = os.stat(self.store.blob_file(sha)).st_mtime_ns
                except FileNotFoundError:  # quarantined (found damaged): listed still, and reading it is EIO
                    mtime = 0
                return Attr(False, 0o444, size, mtime, immutable=True)
            case Kind.MANIFEST:
                data, mtime = self.agent(node.agent).manifest_attr()
                return Attr(False, 0o444, len(data), mtime)
            case Kind.SCRATCH:
                d, _, n = node.rel.rpartition("/")
                st = self.scratch.stat(node.agent, d, n)
                return Attr(False, st.st_mode & 0o7777, st.st_size, st.st_mtime_ns, uid=st.st_uid, gid=st.st_gid,
                            atime_ns=st.st_atime_ns, ctime_ns=st.st_ctime_ns)
            case Kind.CONTROL_FILE:
                a = self.agent(node.agent)
                mtime = os.stat(a.handle.dir).st_mtime_ns
                if node.rel == "status":
                    return Attr(False, 0o444, len(a.status_bytes()), mtime)
                if node.rel == "model":
                    return Attr(False, 0o644, len(a.model_bytes()), mtime)
                return Attr(False, 0o644, 0, mtime)
            case Kind.SNAPSHOT | Kind.SNAP_DIR:
                self._snap(node.agent, node.snap)
                st = os.stat(self.snapshots.dir(node.agent, node.snap))
                # 0755 like the agent's own directories (writes are EROFS all
                # the same): `cp -a` keeps the mode, and a copy of 0555
                # directories cannot be copied into again or removed by its owner.
                return Attr(True, 0o755, 0, st.st_mtime_ns, immutable=True)
            case Kind.SNAP_FILE:
                c = self._snap(node.agent, node.snap)
                mtime = os.stat(self.snapshots.file_path(node.agent, node.snap, fmt.MANIFEST)).st_mtime_ns
                if node.rel == fmt.MANIFEST:
                    size = os.stat(self.snapshots.file_path(node.agent, node.snap, fmt.MANIFEST)).st_size
                else:
                    size = c.manifest.files[node.rel].size
                return Attr(False, 0o444, size, mtime, immutable=True)
        raise AssertionError(node)  # pragma: no cover

    def xattrs(self, node: Node) -> dict[str, bytes]:
        match node.kind:
            case Kind.AGENT:
                m = self.agent(node.agent).stored_manifest()
                return {XATTR_AGENT_ID: m.agent_id.encode(), XATTR_EPOCH: str(m.holder.epoch).encode()}
            case Kind.SNAPSHOT:
                m = self._snap(node.agent, node.snap).manifest
                return {XATTR_AGENT_ID: m.agent_id.encode(), XATTR_EPOCH: str(m.holder.epoch).encode()}
            case Kind.FILE:
                return {XATTR_SHA256: self.agent(node.agent).entry(node.rel).sha256.encode()}
            case Kind.BLOB:
                return {XATTR_SHA256: (fmt.blob_name(node.rel) or "").encode()}
            case Kind.MANIFEST:
                data = self.agent(node.agent).manifest_bytes()
                return {XATTR_SHA256: hashlib.sha256(data).hexdigest().encode()}
            case Kind.SNAP_FILE:
                c = self._snap(node.agent, node.snap)
                if node.rel == fmt.MANIFEST:
                    data = c.manifest.to_bytes()
                    with open(self.snapshots.file_path(node.agent, node.snap, fmt.MANIFEST), "rb") as f:
                        data = f.read()
                    return {XATTR_SHA256: hashlib.sha256(data).hexdigest().encode()}
                return {XATTR_SHA256: c.manifest.files[node.rel].sha256.encode()}
        return {}

    def getxattr(self, node: Node, name: str) -> bytes:
        value = self.xattrs(node).get(name)
        if value is None:
            raise NoAttribute(f"no attribute {name}")
        return value

    # -- changing the tree ---------------------------------------------------------
    def mkdir_lock(self, parent: Node) -> AbstractContextManager[None]:
        """What ``mkdir`` in ``parent`` must hold, for the caller to take off
        the event loop first: for a snapshot, the agent's files lock, shared
        (a `capsulefs append` holding it is let finish, for up to
        ``archive.FILES_WAIT`` seconds, then FilesBusy)."""
        if parent.kind is not Kind.SNAPSHOTS:
            return nullcontext()
        return agent_files_lock(os.path.join(self.store.root, HOLDERS_DIR), parent.agent, shared=True,
                                wait=FILES_WAIT)

    def mkdir(self, parent: Node, name: str) -> Node:
        if parent.kind is Kind.ROOT:
            if self.failsafe is not None:
                raise ReadOnly(f"the mount went read-only after an internal error: {self.failsafe}")
            fmt.check_agent_name(name)
            agent = self.store.create_agent(name, host_id=self.host_id, agent_id=self.new_agent_id())
            log.info("created agent %s (%s)", name, agent.agent_id)
            self.on_new_agent(agent.agent_id, agent.manifest().holder.epoch)
            return Node(Kind.AGENT, agent.agent_id)
        if parent.kind is Kind.SNAPSHOTS:
            if self.failsafe is not None:
                raise ReadOnly(f"the mount went read-only after an internal error: {self.failsafe}")
            a = self.agent(parent.agent)
            self.snapshots.create(a.handle, name)
            log.info("agent %s: snapshot %s made", parent.agent, name)
            return Node(Kind.SNAPSHOT, parent.agent, "", name)
        if parent.is_dir:
            raise NotPermitted("directories can only be made at the root (a new agent) or in .snapshots/")
        raise NotADirectory("not a directory")

    def rmdir(self, parent: Node, name: str) -> None:
        if parent.kind is Kind.SNAPSHOTS:
            if self.failsafe is not None:
                raise ReadOnly(f"the mount went read-only after an internal error: {self.failsafe}")
            self.snapshots.remove(parent.agent, name)
            self._snaps.pop((parent.agent, name), None)
            log.info("agent %s: snapshot %s removed", parent.agent, name)
            return
        child = self.lookup(parent, name)
        if not child.is_dir:
            raise NotADirectory(f"{name} is not a directory")
        if child.kind is Kind.AGENT:
            raise NotEmpty(f"{name} is an agent; remove agents with `capsulefs rm`")
        raise NotEmpty(f"{name} is part of a capsule and cannot be removed")

    def create(self, parent: Node, name: str, mode: int, flags: int, pid: int = 0) -> tuple[Node, Handle]:
        if parent.kind is not Kind.DIR:
            if parent.kind in (Kind.SNAPSHOT, Kind.SNAP_DIR):
                raise ReadOnly("snapshots are read-only")
            raise NotPermitted("files can only be created in memory/ and environment/ of an agent (editor scratch files)")
        if parent.rel == fmt.BLOBS_DIR:
            return self._upload(parent.agent, name, exclusive=bool(flags & os.O_EXCL))
        existing = self._children(parent).get(name)
        if existing is not None and existing.kind is Kind.FILE and \
                self.unlinked_by(existing, pid):
            return existing, self._recreate(existing, flags)
        if existing is not None and existing.kind is Kind.FILE and existing.rel in EDITABLE \
                and not flags & os.O_EXCL:
            # An editor that renamed the file away (as a backup) creates it
            # anew: the capsule kept it, so this opens it for writing.
            handle = EditHandle(self.agent(parent.agent), existing.rel, True, append=bool(flags & os.O_APPEND))
            if flags & os.O_TRUNC:
                _truncate_new(handle)
            return existing, handle
        if existing is not None or self.scratch.exists(parent.agent, parent.rel, name):
            raise ExistsError(f"{parent.rel}/{name} exists")
        self.check_writable(parent.agent)
        fd = self.scratch.create(parent.agent, parent.rel, name, mode, flags)
        return Node(Kind.SCRATCH, parent.agent, f"{parent.rel}/{name}"), ScratchHandle(fd)

    def unlinked_by(self, node: Node, pid: int) -> bool:
        """Whether thread ``pid`` unlinked editable file ``node`` and has not
        created it again. The thread is named by its id and its start time:
        once it is gone, a later thread given the same id is another one, and
        sees the file (the entry is dropped)."""
        agent = self.agent(node.agent)
        entry = agent.unlinked.get(node.rel)
        if entry is None or entry[0] != pid:
            return False
        if thread_start(pid) != entry[1]:
            del agent.unlinked[node.rel]
            return False
        return True

    def _recreate(self, node: Node, flags: int) -> Handle:
        """Thread that unlinked ``node`` (an editable file) creates it anew:
        a new, empty file, whose first commit replaces the capsule's. Writers
        still open on the old one write to it, which nothing commits."""
        agent = self.agent(node.agent)
        agent.check_writable()
        agent.detach_edit(node.rel)
        handle = EditHandle(agent, node.rel, True, append=bool(flags & os.O_APPEND))
        _truncate_new(handle)
        handle.edit.fresh = True
        del agent.unlinked[node.rel]
        return handle

    def unlink(self, parent: Node, name: str, pid: int) -> None:
        """Remove a scratch file. An editable file's unlink only makes room:
        the name is gone for thread ``pid`` until it creates the file anew
        (``mv`` from another file system, ``install``, ``cp
        --remove-destination`` unlink, then create with O_EXCL); everyone
        else still sees the capsule's file, which stays until then."""
        node = self.lookup(parent, name, pid)
        if node.is_dir:
            raise IsADirectory(f"{name} is a directory")
        if node.kind is Kind.FILE and node.rel in EDITABLE:
            if pid <= 0:  # a caller outside the mount's pid namespace: no thread to make room for
                raise NotPermitted(f"{node.rel} is part of the capsule and cannot be removed")
            self.check_writable(node.agent)
            self.agent(node.agent).unlinked[node.rel] = (pid, thread_start(pid))
            log.info("agent %s: %s unlinked by pid %d (kept until it is created anew)", node.agent, node.rel, pid)
            return
        if node.kind is not Kind.SCRATCH:
            if node.kind is Kind.SNAP_FILE:
                raise ReadOnly("snapshots are read-only")
            raise NotPermitted(f"{node.rel or name} is part of the capsule and cannot be removed")
        self.check_writable(node.agent)
        self.scratch.unlink(node.agent, parent.rel, name)

    def rename(self, p_old: Node, n_old: str, p_new: Node, n_new: str, *, noreplace: bool = False) -> tuple[Node, Node]:
        """Rename; return (node renamed, the node its inode stands for now)."""
        src = self.lookup(p_old, n_old)
        try:
            dst: Node | None = self.lookup(p_new, n_new)
        except NotFoundError:
            dst = None
        if dst is not None and noreplace:
            raise ExistsError(f"{n_new} exists")
        if src.kind in (Kind.SNAP_FILE, Kind.SNAP_DIR, Kind.SNAPSHOT) or p_new.kind in (Kind.SNAPSHOT, Kind.SNAP_DIR):
            raise ReadOnly("snapshots are read-only")
        if p_new.kind is not Kind.DIR or p_new.agent != src.agent or src.kind not in (Kind.SCRATCH, Kind.FILE):
            raise NotPermitted(f"{n_old} cannot be renamed to {n_new}: a capsule's files stay where they are")
        self.check_writable(src.agent)
        agent = self.agent(src.agent)
        if src.kind is Kind.SCRATCH:
            src_dir = p_old.rel
            if dst is None or dst.kind is Kind.SCRATCH:
                self.scratch.rename(src.agent, (src_dir, n_old), (p_new.rel, n_new))
                return src, Node(Kind.SCRATCH, src.agent, f"{p_new.rel}/{n_new}")
            if dst.kind is Kind.FILE and dst.rel in EDITABLE:
                st = os.stat(self.scratch.path(src.agent, src_dir, n_old))
                check_edit_size(dst.rel, st.st_size)
                agent.save(dst.rel, self.scratch.read(src.agent, src_dir, n_old))
                # The renamed file keeps its times, as on a disk (`rsync -a`
                # sets them on its temp file before renaming it over).
                os.utime(agent.handle.path(dst.rel), ns=(st.st_atime_ns, st.st_mtime_ns))
                agent.detach_edit(dst.rel)  # writers still open write to the file replaced, as on a disk
                self.scratch.unlink(src.agent, src_dir, n_old)
                return src, dst
            if dst.rel == fmt.JOURNAL:
                raise NotPermitted("the journal is append-only: it cannot be replaced")
            raise NotPermitted(f"{dst.rel} is read-only")
        # src is a capsule file: only an editable one may be "renamed" to a
        # scratch name, which copies it (editors make backups that way); the
        # capsule keeps the file.
        if src.rel not in EDITABLE or (dst is not None and dst.kind is not Kind.SCRATCH):
            what = "the journal is append-only" if src.rel == fmt.JOURNAL else f"{src.rel} stays in the capsule"
            raise NotPermitted(f"{n_old} cannot be renamed: {what}")
        self.scratch.write(src.agent, p_new.rel, n_new, agent.handle.read(src.rel))
        return src, Node(Kind.SCRATCH, src.agent, f"{p_new.rel}/{n_new}")

    def truncate(self, node: Node, size: int) -> None:
        """Truncate by path (no open file)."""
        match node.kind:
            case Kind.FILE if node.rel in EDITABLE:
                self.agent(node.agent).truncate(node.rel, size)
            case Kind.FILE if node.rel == fmt.JOURNAL:
                raise NotPermitted("the journal is append-only: it cannot be truncated")
            case Kind.SCRATCH:
                self.check_writable(node.agent)
                d, _, n = node.rel.rpartition("/")
                os.truncate(self.scratch.path(node.agent, d, n), size)
            case Kind.CONTROL_FILE if node.rel != "status":
                pass
            case Kind.SNAP_FILE | Kind.SNAP_DIR | Kind.SNAPSHOT:
                raise ReadOnly("snapshots are read-only")
            case _ if node.is_dir:
                raise IsADirectory("is a directory")
            case _:
                raise NotPermitted(f"{node.rel} is read-only")

    def chmod_chown(self, node: Node, mode: int | None, uid: int | None, gid: int | None) -> None:
        """Mode and owner changes: real on scratch files, refused elsewhere unless a no-op."""
        if node.kind is Kind.SCRATCH:
            self.check_writable(node.agent)
            d, _, n = node.rel.rpartition("/")
            p = self.scratch.path(node.agent, d, n)
            if mode is not None:
                os.chmod(p, mode & 0o7777)
            if uid is not None or gid is not None:
                os.chown(p, -1 if uid is None else uid, -1 if gid is None else gid)
            return
        a = self.attr(node)
        edit = self.agent(node.agent).edits.get(node.rel) if node.kind is Kind.FILE else None
        if edit is not None and edit.fresh:
            # Created anew after an unlink, not committed yet: `mv` and
            # `install` set the source's mode and owner; the commit gives it
            # the capsule's, as any save does.
            return
        if mode is not None and (mode & 0o7777) != a.perm:
            raise NotPermitted("the modes of capsule files are fixed")
        if (uid is not None and uid != (self.owner_uid if a.uid is None else a.uid)) or \
                (gid is not None and a.gid is not None and gid != a.gid):
            raise NotPermitted("the owner of capsule files is the mounting user, or the agent's own uid")

    def utimens(self, node: Node, atime_ns: int | None, mtime_ns: int | None) -> None:
        """Times are real on scratch files and on the capsule's mutable files
        (working memory, the spec, the journal: ``LiveAgent.set_times``);
        elsewhere they follow the capsule, and a change is refused as a mode
        change is, unless it changes nothing."""
        match node.kind:
            case Kind.SCRATCH:
                self.check_writable(node.agent)
                d, _, n = node.rel.rpartition("/")
                p = self.scratch.path(node.agent, d, n)
                st = os.stat(p)
                os.utime(p, ns=(st.st_atime_ns if atime_ns is None else atime_ns,
                                st.st_mtime_ns if mtime_ns is None else mtime_ns))
                return
            case Kind.FILE if node.rel in EDITABLE or node.rel == fmt.JOURNAL:
                self.agent(node.agent).set_times(node.rel, atime_ns, mtime_ns)
                return
            case Kind.SNAP_FILE | Kind.SNAP_DIR | Kind.SNAPSHOT:
                raise ReadOnly("snapshots are read-only")
        a = self.attr(node)
        if (mtime_ns is not None and mtime_ns != a.mtime_ns) or \
                (atime_ns is not None and atime_ns != (a.mtime_ns if a.atime_ns is None else a.atime_ns)):
            raise NotPermitted(f"the times of {node.rel or node.kind.value} follow the capsule; only working memory, "
                               "the spec, the journal and scratch files take times of their own")

    # -- opening -------------------------------------------------------------------
    def open(self, node: Node, flags: int, uid: int) -> Handle:
        write = (flags & os.O_ACCMODE) != os.O_RDONLY
        match node.kind:
            case Kind.FILE:
                a = self.agent(node.agent)
                if node.rel == fmt.JOURNAL:
                    if write:
                        if not flags & os.O_APPEND:
                            raise NotPermitted("the journal is append-only: open it with O_APPEND (>>)")
                        if flags & os.O_TRUNC:
                            raise NotPermitted("the journal is append-only: it cannot be truncated (O_TRUNC)")
                        self.check_writable(node.agent)
                    return JournalHandle(a, write)
                if node.rel in EDITABLE:
                    handle = EditHandle(a, node.rel, write, append=write and bool(flags & os.O_APPEND))
                    if write and flags & os.O_TRUNC:
                        _truncate_new(handle)  # libfuse's atomic O_TRUNC: no separate truncate comes
                    return handle
                if write:
                    raise NotPermitted(f"{node.rel} is read-only")
                return FileHandle(a.handle.path(node.rel))
            case Kind.BLOB:
                sha = fmt.blob_name(node.rel) or ""
                if write:  # the same bytes again: verified, and stored only if the store lacks them
                    return self._upload(node.agent, sha, exclusive=False)[1]
                if sha not in self.agent(node.agent).blobs():
                    raise NotFoundError(f"{node.rel}: not stored (yet)")
                return self._blob_handle(sha)
            case Kind.MANIFEST:
                if write:
                    raise NotPermitted("manifest.json is computed and read-only")
                return BytesHandle(self.agent(node.agent).manifest_bytes())
            case Kind.SCRATCH:
                if write:
                    self.check_writable(node.agent)
                d, _, n = node.rel.rpartition("/")
                return ScratchHandle(self.scratch.open(node.agent, d, n, flags))
            case Kind.CONTROL_FILE:
                a = self.agent(node.agent)
                if write and uid not in (0, self.owner_uid):
                    raise AccessDenied("only the mounting user and root may write control files")
                if node.rel == "status":
                    if write:
                        raise NotPermitted(".control/status is read-only")
                    return BytesHandle(a.status_bytes(), direct_io=True)
                if node.rel == "model":
                    if write:
                        self.check_writable(node.agent)
                    return ModelHandle(a, write)
                if node.rel == "remove":
                    return RemoveHandle(a, self.remover)
                return MoveHandle(a, node.rel, self.mover)
            case Kind.SNAP_FILE:
                if write:
                    raise ReadOnly("snapshots are read-only")
                self._snap(node.agent, node.snap)
                sha = fmt.blob_name(node.rel)
                if sha is not None:
                    return self._blob_handle(sha)
                return FileHandle(self.snapshots.file_path(node.agent, node.snap, node.rel), keep_cache=True)
        raise IsADirectory("is a directory")

    def _upload(self, agent_id: str, name: str, *, exclusive: bool) -> tuple[Node, Handle]:
        """A new blob written through ``artifacts/blobs/<sha256>`` (``uploads``)."""
        sha = check_upload_name(name)
        agent = self.agent(agent_id)
        agent.check_writable()
        if exclusive and sha in agent.blobs():
            raise ExistsError(f"{fmt.blob_path(sha)} exists")
        return Node(Kind.BLOB, agent_id, fmt.blob_path(sha)), self.uploads.open(agent, sha)

    def _blob_handle(self, sha: str) -> "BlobHandle":
        path = self.store.blob_file(sha)
        try:
            return BlobHandle(self.blobs.get(sha, path))
        except FileNotFoundError:  # a blob the capsule lists: quarantined after it was found damaged?
            raise CorruptBlobError(path, why=self.store.why_missing(sha)) from None

    def close(self) -> None:
        """Close every agent's open journal (at unmount)."""
        for a in self._agents.values():
            a.close()

    def _drop_leftovers(self, held: set[str]) -> None:
        """Remove the snapshots and scratch files of agents the store no longer
        has: a crash between the steps of a removal left them, and the blobs
        the snapshots list would never be freed."""
        for area in (self.snapshots, self.scratch):
            for agent_id in area.agent_ids():
                if agent_id not in held:
                    log.info("removing leftover %s of agent %s (no longer in the store)",
                             os.path.basename(area.root), agent_id)
                    area.remove_agent(agent_id)

    def _drop_open(self, agent_id: str) -> None:
        """Close what the view keeps open or cached of an agent gone from it
        (its journal, its snapshots' caches)."""
        if agent_id in self._agents:
            self._agents.pop(agent_id).close()
        for key in [k for k in self._snaps if k[0] == agent_id]:
            del self._snaps[key]

    # -- the daemon's API ------------------------------------------------------------
    def freeze(self, agent_id: str) -> None:
        self.agent(agent_id).stored_manifest()
        self.set_state(agent_id, AgentState.FROZEN)

    def resume(self, agent_id: str) -> None:
        self.agent(agent_id).stored_manifest()
        self.set_state(agent_id, AgentState.ACTIVE)

    def retire(self, agent_id: str) -> str | None:
        """Hide an agent (moved away); return the name it was shown under."""
        name = None
        a = self._agents.get(agent_id)
        try:
            name = (a or LiveAgent(self, agent_id)).stored_manifest().name
        except (NotFoundError, FileNotFoundError):
            pass  # already gone from the store
        self.set_state(agent_id, AgentState.RETIRED)
        self._drop_open(agent_id)
        # It runs elsewhere now: snapshots kept here would only pin its blobs.
        self.snapshots.remove_agent(agent_id)
        self.scratch.remove_agent(agent_id)
        return name

    def forget(self, agent_id: str) -> None:
        """The agent was removed from the store: drop what the view kept of it
        (open journal, snapshot caches) and mark it REMOVED, so that handles
        still open on it write nothing (ENOENT), until an agent of that id is
        in the store again (an import), which is shown as a new one."""
        self._drop_open(agent_id)
        self.set_state(agent_id, AgentState.REMOVED)

    def activate(self, agent_id: str) -> str:
        """Show an agent again (or for the first time, after a move in): active."""
        self.set_state(agent_id, AgentState.ACTIVE)
        return self.agent(agent_id).stored_manifest().name


def _truncate_new(handle: Handle) -> None:
    """O_TRUNC of a file just opened: the handle is closed again if refused."""
    try:
        handle.truncate(0)
    except BaseException:
        handle.release()
        raise
