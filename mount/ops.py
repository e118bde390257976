"""The pyfuse3 ``Operations`` of a capsulefs mount: thin, as in S3QL's fs.py.

Rules:
  * Each operation logs (via :func:`capsulefs.mount.errors.fuse_op`),
    checks its guards, calls :mod:`capsulefs.core.view.host`, and turns the
    answer into pyfuse3 types. No digests, JSON or capsule rules here.
  * Names arrive as bytes and are decoded with ``surrogateescape`` so any
    name round-trips.
  * Cache policy (timeouts below): content that never changes (blobs,
    snapshots) is cached long, with ``keep_cache``; names and directories
    inside a capsule for a minute; the root's entries for a second, since
    agents appear and vanish outside the kernel's sight (CLI, moves);
    mutable files for a second, and a change made through the mount drops
    the kernel's attributes of the file, the manifest and the status at once;
    so does each open of a file read through the page cache (the read would
    be cut at a size the kernel took before a change beside the mount).

Concurrency: the handlers never await between reading and updating shared
state, so each runs atomically with respect to the others on the trio loop.
An open of a blob evicted from the store (``gc --tier-cache``) awaits its
fetch from the blob tier (``LiveHost.tier_cache``) and opens again; the
tier down or its bytes wrong fail that open with EIO (BlobUnavailable),
never the mount. Blob checks run in worker threads, started in the daemon's nursery
(``Operations.nursery``); they touch only their ``BlobCheck`` (thread-safe).
A durable journal append (fdatasync) runs inline: the kernel holds the
inode lock across a write to one file anyway, so a worker thread would buy
no group commit and only add latency.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from collections.abc import Callable
from typing import Protocol

import pyfuse3
import trio

from capsulefs.core.capsule import format as fmt
from capsulefs.core.view.blobcheck import BlobCheck, Verdict
from capsulefs.core.errors import CorruptBlobError, NotFoundError
from capsulefs.core.view.nodes import Attr, Kind, Node, parent_dir
from capsulefs.core.view.host import LiveHost
from capsulefs.core.view.handles import Handle
from capsulefs.core.view.errors import BlobEvicted, NotPermitted, NotSupported

from .errors import fuse_op
from .inodes import InodeTable

log = logging.getLogger(__name__)

#: Timeouts (seconds). Content that never changes (blobs, snapshots) is cached
#: long. Names inside a capsule never change behind the kernel's back (only
#: through this mount, which the kernel sees), nor do the attributes of its
#: directories. The root's entries (agents) change outside the kernel's
#: sight (CLI, moves), and so do the sizes of mutable files (the agent
#: runtime appends to the journal directly): those are checked each time.
IMMUTABLE_TIMEOUT = 3600.0
CAPSULE_TIMEOUT = 60.0
ROOT_TIMEOUT = 1.0
#: Mutable files: a change made through the mount invalidates the kernel's
#: copy at once (:meth:`Operations._changed`); one made beside the mount
#: (the agent runtime appending to the journal in the store) shows within
#: this many seconds.
MUTABLE_ATTR_TIMEOUT = 1.0
BLKSIZE = 128 * 1024
#: Opens of a blob evicted from the store (``gc --tier-cache``), each after
#: fetching it back from the blob tier: more than one only if a gc evicted it
#: again between the fetch and the open.
EVICTED_OPENS = 3


class Kernel(Protocol):
    """Cache invalidation notices to the kernel (a fake in tests)."""

    def invalidate_inode(self, ino: int) -> None: ...

    def invalidate_entry(self, parent_ino: int, name: bytes) -> None: ...

    def invalidate_attr(self, ino: int) -> None: ...


class FuseKernel:
    def invalidate_inode(self, ino: int) -> None:
        # Never from the request handler itself: the kernel holds the pages
        # of a read in progress, and would wait for it forever. A thread
        # waits until the handler has replied.
        threading.Thread(target=self._invalidate_inode, args=(ino,), daemon=True,
                         name=f"invalidate-{ino}").start()

    @staticmethod
    def _invalidate_inode(ino: int) -> None:
        try:
            pyfuse3.invalidate_inode(ino)
        except OSError as exc:  # ENOENT: the kernel did not have it
            log.debug("invalidate_inode(%d): %s", ino, exc)

    def invalidate_entry(self, parent_ino: int, name: bytes) -> None:
        pyfuse3.invalidate_entry_async(parent_ino, name, ignore_enoent=True)

    def invalidate_attr(self, ino: int) -> None:
        # Attributes only: the kernel takes no page or inode lock for this,
        # so it is safe inside a request handler, even one on that inode.
        try:
            pyfuse3.invalidate_inode(ino, attr_only=True)
        except OSError as exc:
            log.debug("invalidate_inode(%d, attr_only): %s", ino, exc)


def _name(raw: bytes) -> str:
    return os.fsdecode(raw)


class Operations(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(
        self,
        live: LiveHost,
        *,
        kernel: Kernel | None = None,
        readdir_reply: Callable[..., bool] = pyfuse3.readdir_reply,
        uid: int | None = None,
        gid: int | None = None,
    ) -> None:
        super().__init__()
        self.live = live
        self.kernel: Kernel = kernel or FuseKernel()
        self.inodes = InodeTable()
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        self._readdir_reply = readdir_reply
        self._handles: dict[int, Handle] = {}
        self._dirs: dict[int, list[tuple[str, Node]]] = {}
        self._next_fh = 1
        #: The daemon's nursery, for background blob checks (None: check inline).
        self.nursery: trio.Nursery | None = None
        self._verifying: dict[str, trio.Event] = {}
        #: Attributes of the mount's root that the daemon serves about itself
        #: (``user.capsulefs.pid``: who to ask to stop, see ``capsulefs umount``).
        self.root_xattrs: dict[str, bytes] = {}
        live.on_change = self._changed

    # -- helpers -------------------------------------------------------------
    def _fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    def _entry(self, ino: int, a: Attr, node: Node) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = ino
        e.generation = 0
        if a.immutable:
            e.entry_timeout = e.attr_timeout = IMMUTABLE_TIMEOUT
        elif node.kind is Kind.ROOT:
            e.entry_timeout = e.attr_timeout = ROOT_TIMEOUT
        elif node.kind is Kind.AGENT:
            e.entry_timeout, e.attr_timeout = ROOT_TIMEOUT, CAPSULE_TIMEOUT
        elif a.is_dir:
            e.entry_timeout = e.attr_timeout = CAPSULE_TIMEOUT
        else:
            e.entry_timeout, e.attr_timeout = CAPSULE_TIMEOUT, MUTABLE_ATTR_TIMEOUT
        e.st_mode = (stat.S_IFDIR if a.is_dir else stat.S_IFREG) | a.perm
        e.st_nlink = 2 if a.is_dir else 1
        e.st_uid = self.uid if a.uid is None else a.uid
        e.st_gid = self.gid if a.gid is None else a.gid
        e.st_rdev = 0
        e.st_size = a.size
        e.st_blksize = BLKSIZE
        e.st_blocks = (a.size + 511) // 512
        e.st_mtime_ns = a.mtime_ns
        e.st_atime_ns = a.mtime_ns if a.atime_ns is None else a.atime_ns
        e.st_ctime_ns = a.mtime_ns if a.ctime_ns is None else a.ctime_ns
        return e

    def _handle(self, fh: int) -> Handle:
        try:
            return self._handles[fh]
        except KeyError:
            raise pyfuse3.FUSEError(errno.EBADF) from None

    def _open_info(self, handle: Handle) -> pyfuse3.FileInfo:
        fh = self._fh()
        self._handles[fh] = handle
        return pyfuse3.FileInfo(fh=fh, direct_io=handle.direct_io, keep_cache=handle.keep_cache)

    def _changed(self, agent_id: str, rel: str) -> None:
        """A file changed through the mount: drop the kernel's attributes of it,
        of the manifest and of the control files, if the kernel has them."""
        blob = fmt.blob_name(rel) is not None
        nodes = [Node(Kind.BLOB if blob else Kind.FILE, agent_id, rel), Node(Kind.MANIFEST, agent_id, fmt.MANIFEST)]
        nodes += [Node(Kind.CONTROL_FILE, agent_id, n) for n in ("status", "model")]
        if rel == fmt.WORKING_MEMORY:
            nodes.append(Node(Kind.FILE, agent_id, fmt.JOURNAL))  # its memory_edit event
        for node in nodes:
            for ino in self.inodes.all_of(node):
                self.kernel.invalidate_attr(ino)
        if blob:  # an upload stored or dropped: the kernel's entry of its name goes too
            for ino in self.inodes.all_of(Node(Kind.DIR, agent_id, fmt.BLOBS_DIR)):
                self.kernel.invalidate_entry(ino, os.fsencode(rel.rpartition("/")[2]))

    def owner_changed(self, agent_id: str) -> None:
        """The agent was given a uid of its own (sandbox isolation): drop the
        kernel's attributes of every inode of it, which name the old owner."""
        for ino in self.inodes.find(lambda node: node.agent == agent_id):
            self.kernel.invalidate_attr(ino)

    # -- names -----------------------------------------------------------------
    @fuse_op
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        node = self.live.lookup(self.inodes.node(parent_inode), _name(name), ctx.pid)
        attr = self.live.attr(node)
        return self._entry(self.inodes.ref(node), attr, node)

    def forget(self, inode_list: list[tuple[int, int]]) -> None:  # type: ignore[override]
        for ino, n in inode_list:
            self.inodes.forget(ino, n)

    @fuse_op
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        node = self.inodes.node(inode)
        return self._entry(inode, self.live.attr(node), node)

    @fuse_op
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        node = self.inodes.node(inode)
        if fields.update_size:
            if fh is not None and fh in self._handles:
                self._handles[fh].truncate(attr.st_size)
            else:
                self.live.truncate(node, attr.st_size)
        if fields.update_mode or fields.update_uid or fields.update_gid:
            self.live.chmod_chown(
                node,
                attr.st_mode if fields.update_mode else None,
                attr.st_uid if fields.update_uid else None,
                attr.st_gid if fields.update_gid else None,
            )
        if fields.update_atime or fields.update_mtime:
            self.live.utimens(node, attr.st_atime_ns if fields.update_atime else None,
                              attr.st_mtime_ns if fields.update_mtime else None)
        return self._entry(inode, self.live.attr(node), node)

    # -- directories -------------------------------------------------------------
    @fuse_op
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        node = self.inodes.node(inode)
        entries = self.live.listdir(node)
        fh = self._fh()
        self._dirs[fh] = [*self._dots(inode, node), *entries]
        return fh

    def _dots(self, inode: int, node: Node) -> list[tuple[str, Node]]:
        """``.`` and ``..``: listed first, as a directory of any file system
        lists them. The parent's inode is one the kernel knows (it holds the
        path to this directory); at the root ``..`` is the root itself."""
        dots = [(".", node)]
        parent = parent_dir(node)
        if self.inodes.peek(parent) is not None:
            dots.append(("..", parent))
        return dots

    @fuse_op
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        entries = self._dirs.get(fh, [])
        for i in range(start_id, len(entries)):
            name, node = entries[i]
            try:
                attr = self.live.attr(node)
            except (NotFoundError, FileNotFoundError):
                continue  # gone since opendir: skip it, as a real directory would
            dot = name in (".", "..")  # the kernel takes no reference for these (readdirplus)
            ino = self.inodes.peek(node) if dot else self.inodes.ref(node)
            if ino is None:
                continue
            if not self._readdir_reply(token, os.fsencode(name), self._entry(ino, attr, node), i + 1):
                if not dot:
                    self.inodes.forget(ino, 1)
                return

    @fuse_op
    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    @fuse_op
    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        parent = self.inodes.node(parent_inode)
        lock = self.live.mkdir_lock(parent)
        await trio.to_thread.run_sync(lock.__enter__)  # (a snapshot waits for a `capsulefs append` here)
        try:
            node = self.live.mkdir(parent, _name(name))
        finally:
            lock.__exit__(None, None, None)
        attr = self.live.attr(node)
        return self._entry(self.inodes.ref(node), attr, node)

    @fuse_op
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self.live.rmdir(self.inodes.node(parent_inode), _name(name))

    @fuse_op
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self.live.unlink(self.inodes.node(parent_inode), _name(name), ctx.pid)

    @fuse_op
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes,
                     flags: int, ctx: pyfuse3.RequestContext) -> None:
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise NotSupported("rename with RENAME_EXCHANGE is not supported")
        src, now = self.live.rename(
            self.inodes.node(parent_inode_old), _name(name_old),
            self.inodes.node(parent_inode_new), _name(name_new),
            noreplace=bool(flags & pyfuse3.RENAME_NOREPLACE),
        )
        self.inodes.move(src, now)

    @fuse_op
    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        raise NotPermitted("a capsule holds only files and directories: no symbolic links")

    @fuse_op
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        raise NotPermitted("a capsule holds only files and directories: no hard links")

    @fuse_op
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        raise NotPermitted("a capsule holds only files and directories")

    # -- files ---------------------------------------------------------------------
    @fuse_op
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        node = self.inodes.node(inode)
        for attempt in range(1, EVICTED_OPENS + 1):
            try:
                handle = self.live.open(node, flags, ctx.uid)
                break
            except BlobEvicted as exc:
                if self.live.tier_cache is None or attempt == EVICTED_OPENS:
                    raise  # (EIO)
                # The kernel's request waits for the fetch (bounded by the tier's timeout); other requests go on.
                await self.live.tier_cache.ensure_local({exc.sha256: exc.size})
        if handle.check is not None:
            self._verify_in_background(handle.check)
        if not handle.keep_cache and not handle.direct_io:
            # Read through the page cache, which the kernel cuts at its idea of
            # the size: a file changed beside the mount would read cut at the
            # size it had when last asked (up to MUTABLE_ATTR_TIMEOUT ago).
            self.kernel.invalidate_attr(inode)
        return self._open_info(handle)

    def _verify_in_background(self, check: BlobCheck) -> None:
        """Hash a blob not yet judged in a worker thread while its reads are
        served; the read that reaches its end waits for the verdict."""
        if check.verdict is not Verdict.UNKNOWN or self.nursery is None or check.sha256 in self._verifying:
            return
        done = self._verifying[check.sha256] = trio.Event()
        check.background = True
        self.nursery.start_soon(self._verify, check, done)

    async def _verify(self, check: BlobCheck, done: trio.Event) -> None:
        try:
            await trio.to_thread.run_sync(check.full_check)
        except CorruptBlobError:
            pass  # logged by the check; its readers get EIO
        except OSError as exc:
            log.warning("verifying blob %s: %s (its last read will verify it again)", check.path, exc)
        finally:
            check.background = False
            del self._verifying[check.sha256]
            done.set()

    @fuse_op
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        node, handle = self.live.create(self.inodes.node(parent_inode), _name(name), mode & ~ctx.umask, flags,
                                        ctx.pid)
        try:
            attr = self.live.attr(node)
        except BaseException:
            handle.release()
            raise
        info = self._open_info(handle)
        return info, self._entry(self.inodes.ref(node), attr, node)

    @fuse_op
    async def read(self, fh: int, off: int, size: int) -> bytes:
        handle = self._handle(fh)
        if handle.check is not None and off + size >= handle.check.size:
            done = self._verifying.get(handle.check.sha256)
            if done is not None:
                await done.wait()  # never hand out a blob's end before its verdict
        try:
            return handle.read(off, size)
        except CorruptBlobError:
            self._drop_cached(handle)
            raise

    def _drop_cached(self, handle: Handle) -> None:
        # The kernel may hold pages of a blob found corrupt: drop them.
        sha = getattr(handle, "sha256", None)
        if sha is None:
            return
        for ino in self.inodes.find(lambda n: n.kind in (Kind.BLOB, Kind.SNAP_FILE) and n.rel.endswith(sha)):
            self.kernel.invalidate_inode(ino)

    @fuse_op
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        handle = self._handle(fh)
        n = await handle.write_async(off, buf)  # .control/move waits here, other requests go on
        handle.written()
        return n

    @fuse_op
    async def flush(self, fh: int) -> None:
        self._handle(fh).flush()

    @fuse_op
    async def fsync(self, fh: int, datasync: bool) -> None:
        self._handle(fh).fsync()

    @fuse_op
    async def release(self, fh: int) -> None:
        handle = self._handles.pop(fh, None)
        if handle is not None:
            handle.release()

    # -- extended attributes -------------------------------------------------------
    @fuse_op
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if inode == pyfuse3.ROOT_INODE and _name(name) in self.root_xattrs:
            return self.root_xattrs[_name(name)]
        return self.live.getxattr(self.inodes.node(inode), _name(name))

    @fuse_op
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        names = set(self.live.xattrs(self.inodes.node(inode)))
        if inode == pyfuse3.ROOT_INODE:
            names |= set(self.root_xattrs)
        return [os.fsencode(n) for n in sorted(names)]

    @fuse_op
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise NotSupported("extended attributes of a capsule are computed, not set")

    @fuse_op
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise NotSupported("extended attributes of a capsule are computed, not removed")

    # -- the file system ------------------------------------------------------------
    @fuse_op
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        st = os.statvfs(self.live.store.root)
        out = pyfuse3.StatvfsData()
        for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail"):
            setattr(out, name, getattr(st, name))
        out.f_namemax = 255
        return out

    def release_all(self) -> None:
        """Close every open handle (after the main loop ended)."""
        for fh in list(self._handles):
            try:
                self._handles.pop(fh).release()
            except Exception:  # noqa: BLE001 - shutting down; log and go on
                log.exception("closing file handle %d at unmount", fh)


__all__ = ["Operations", "FuseKernel", "Kernel"]
