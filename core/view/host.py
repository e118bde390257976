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
  * A listed blob evicted from the store (``gc --tier-cache``: the blob
    tier holds it) fails its open with :class:`BlobEvicted`; the adapter
    fetches it back through the ``tier_cache`` and opens it again.
  * An edit of an editable file is buffered (one :class:`Edit` per file,
    shared by every descriptor writing it, like an inode's pages) and
    committed when a writer flushes (close) or fsyncs, or when a scratch
    file is renamed over the file. A committed working-memory edit is one
    ``memory_edit`` journal event followed by the file itself; a spec edit
    must pass ``spec.validate_spec`` or it is refused and the old spec kept.
  * A failed write poisons its edit (``edit.Edit.failed``): nothing
    of it is committed. Times given to a mutable file are kept on the
    stored file until its content changes (:meth:`LiveAgent.set_times`);
    other capsule files refuse them, as they refuse a mode.
  * Hidden directories, absent from listings but reachable by name:
    ``.control/`` (status, model, move, abandon, remove) and ``.snapshots/``
    (see snapshots).
  * Writes fail with ReadOnly while the agent is frozen (a move is under
    way) or once the view went read-only after an internal error
    (:meth:`LiveHost.enter_failsafe`, never undone while mounted), and
    while the view's write guard refuses them (the fleet mode's lease:
    ``control.WriteGuard``, asked before every write is acknowledged). A
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

import os

from ..capsule import format as fmt
from ..errors import CorruptBlobError, NotFoundError
from .changes import Changes
from .control import ModelHandle, MoveHandle, RemoveHandle
from .errors import AccessDenied, BlobEvicted, IsADirectory, NotPermitted, ReadOnly
from .handles import BlobHandle, BytesHandle, EditHandle, FileHandle, Handle, JournalHandle, ScratchHandle, truncate_new
from .nodes import EDITABLE, Kind, Node


class LiveHost(Changes):
    """Every agent of one host store, as the mount shows them (see the module's rules)."""

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
                        truncate_new(handle)  # libfuse's atomic O_TRUNC: no separate truncate comes
                    return handle
                if write:
                    raise NotPermitted(f"{node.rel} is read-only")
                return FileHandle(a.handle.path(node.rel))
            case Kind.BLOB:
                sha = fmt.blob_name(node.rel) or ""
                if write:  # the same bytes again: verified, and stored only if the store lacks them
                    return self._upload(node.agent, sha, exclusive=False)[1]
                sizes = self.agent(node.agent).blobs()
                if sha not in sizes:
                    raise NotFoundError(f"{node.rel}: not stored (yet)")
                return self._blob_handle(sha, sizes[sha])
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
            case Kind.HOST_CONTROL_FILE:
                if write:
                    raise NotPermitted(f".control/{node.rel} is read-only")
                return BytesHandle(self.metrics_bytes(), direct_io=True)
            case Kind.SNAP_FILE:
                if write:
                    raise ReadOnly("snapshots are read-only")
                self._snap(node.agent, node.snap)
                listed = fmt.blob_name(node.rel)
                if listed is not None:
                    return self._blob_handle(listed, self._snap(node.agent, node.snap).manifest.blobs().get(listed, 0))
                return FileHandle(self.snapshots.file_path(node.agent, node.snap, node.rel), keep_cache=True)
        raise IsADirectory("is a directory")

    def _blob_handle(self, sha: str, size: int) -> "BlobHandle":
        path = self.store.blob_file(sha)
        if self.tier_cache is not None:
            self.store.touch_blob(sha)  # (its last read, coarsely: gc --tier-cache keeps the hot ones)
        try:
            return BlobHandle(self.blobs.get(sha, path))
        except FileNotFoundError:
            if self.tier_cache is not None and self.tier_cache.evicted(sha):
                raise BlobEvicted(sha, size) from None  # (the adapter fetches it back and opens again)
            # A blob the capsule lists: quarantined after it was found damaged? Lost?
            raise CorruptBlobError(path, why=self.store.why_missing(sha)) from None
