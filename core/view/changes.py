"""Changing the view's tree (``LiveHost``'s third part): mkdir (a new agent,
a snapshot), create, unlink, rename, truncate, and refused mode, owner and
time changes. What may change is in ``host``'s rules; everything else is
refused with the error a file system would give.
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager, nullcontext

from ..capsule import format as fmt
from ..capsule.archive import FILES_WAIT
from ..errors import ExistsError, NotFoundError
from ..fsutil import thread_start
from ..store.holder import agent_files_lock
from ..store.layout import HOLDERS_DIR
from .attributes import Attributes
from .edit import check_edit_size
from .errors import IsADirectory, NotADirectory, NotEmpty, NotPermitted, ReadOnly
from .handles import EditHandle, Handle, ScratchHandle, truncate_new
from .nodes import EDITABLE, Kind, Node
from .uploads import check_upload_name

log = logging.getLogger(__name__)


class Changes(Attributes):
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
            self.check_lease()
            fmt.check_agent_name(name)
            agent = self.store.create_agent(name, host_id=self.host_id, agent_id=self.new_agent_id())
            log.info("created agent %s (%s)", name, agent.agent_id)
            if self.new_agents is not None:
                self.new_agents.created(agent.agent_id, agent.manifest().holder.epoch)
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
                truncate_new(handle)
            return existing, handle
        if existing is not None or self.scratch.exists(parent.agent, parent.rel, name):
            raise ExistsError(f"{parent.rel}/{name} exists")
        self.check_writable(parent.agent)
        fd = self.scratch.create(parent.agent, parent.rel, name, mode, flags)
        return Node(Kind.SCRATCH, parent.agent, f"{parent.rel}/{name}"), ScratchHandle(fd)

    def _recreate(self, node: Node, flags: int) -> Handle:
        """Thread that unlinked ``node`` (an editable file) creates it anew:
        a new, empty file, whose first commit replaces the capsule's. Writers
        still open on the old one write to it, which nothing commits."""
        agent = self.agent(node.agent)
        agent.check_writable()
        agent.detach_edit(node.rel)
        handle = EditHandle(agent, node.rel, True, append=bool(flags & os.O_APPEND))
        truncate_new(handle)
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

    def _upload(self, agent_id: str, name: str, *, exclusive: bool) -> tuple[Node, Handle]:
        """A new blob written through ``artifacts/blobs/<sha256>`` (``uploads``)."""
        sha = check_upload_name(name)
        agent = self.agent(agent_id)
        agent.check_writable()
        if exclusive and sha in agent.blobs():
            raise ExistsError(f"{fmt.blob_path(sha)} exists")
        return Node(Kind.BLOB, agent_id, fmt.blob_path(sha)), self.uploads.open(agent, sha)
