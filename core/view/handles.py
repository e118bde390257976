"""Open files of the live view: what ``read``/``write``/``flush`` do per kind of file.

Rules:
  * A handle raises only domain errors; the adapter maps them to errno.
  * Blobs and snapshot files are served as they are stored (the page cache
    may keep them across opens); so are, for one open, the manifest and
    editable files read (the kernel drops their pages when the size or
    mtime changes). A file being edited, control files and the journal
    bypass the page cache (``direct_io``) so that what a reader gets is
    what the view says, never what a refused write left. The journal's
    readers too: after a direct write the kernel takes the file's size to
    be the offset plus the bytes written, but the stored line is longer
    (stamped), so a read through the page cache would end mid-line until
    the size is fetched again (pyfuse3 cannot ask for
    FUSE_DIRECT_IO_ALLOW_MMAP, which would also drop cached pages at each
    direct write). The kernel refuses a shared map of a direct I/O file
    (ENODEV); a private one works.

Control files' handles are in ``control``; see :mod:`capsulefs.core.view.host` for the view that makes them.
"""

from __future__ import annotations

import logging
import os

from ..capsule import format as fmt
from ..errors import CapsuleError, FormatError, NotFoundError
from ..journal.file import parse_draft_lines
from .agent import LiveAgent, counted
from .blobcheck import BlobCheck
from .edit import check_edit_size, resize
from .errors import NotPermitted, TooLarge

log = logging.getLogger(__name__)

#: Longest journal line a handle takes (it holds an incomplete one while waiting for its newline).
MAX_PARTIAL_LINE = 16 << 20
_TOO_LONG = f"a journal line is longer than {MAX_PARTIAL_LINE >> 20} MiB: nothing of it is appended"


class Handle:
    """An open file. The adapter calls these; each raises domain errors."""

    direct_io = False  # bypass the page cache (content may differ from what was written)
    keep_cache = False  # keep the page cache across opens (content never changes)
    check: BlobCheck | None = None  # a stored blob's verification, if this serves one
    def written(self) -> None:
        """Called by the adapter after a successful ``write``."""

    def read(self, offset: int, size: int) -> bytes:
        raise NotPermitted("this file is not open for reading")

    async def write_async(self, offset: int, data: bytes) -> int:
        """What the adapter calls: :meth:`write`, unless the handle must wait
        for something (a move) without holding up other requests."""
        return self.write(offset, data)

    def write(self, offset: int, data: bytes) -> int:
        raise NotPermitted("this file is read-only")

    def truncate(self, size: int) -> None:
        raise NotPermitted("this file cannot be truncated")

    def flush(self) -> None:
        pass

    def fsync(self) -> None:
        pass

    def release(self) -> None:
        pass


class BytesHandle(Handle):
    """Serves bytes fixed at open (manifest.json, .control/status)."""

    def __init__(self, data: bytes, *, direct_io: bool = False) -> None:
        self.data = data
        self.direct_io = direct_io

    def read(self, offset: int, size: int) -> bytes:
        return self.data[offset: offset + size]


class FileHandle(Handle):
    """A read-only file on disk."""

    def __init__(self, path: str, *, keep_cache: bool = False) -> None:
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFoundError(f"{path}: no such file") from None
        self.keep_cache = keep_cache

    def read(self, offset: int, size: int) -> bytes:
        return os.pread(self.fd, size, offset)

    def release(self) -> None:
        os.close(self.fd)


class BlobHandle(FileHandle):
    """A stored blob: cached by the kernel, never served as good if corrupt."""

    keep_cache = True

    def __init__(self, check: BlobCheck) -> None:
        check.check_open()
        super().__init__(check.path, keep_cache=True)
        self.check: BlobCheck = check
        self.sha256 = check.sha256

    def read(self, offset: int, size: int) -> bytes:
        data = os.pread(self.fd, size, offset)
        self.check.served(offset, data, self.fd)
        return data


class ScratchHandle(Handle):
    """An editor's scratch file: a plain file, passed through."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def read(self, offset: int, size: int) -> bytes:
        return os.pread(self.fd, size, offset)

    def write(self, offset: int, data: bytes) -> int:
        return os.pwrite(self.fd, data, offset)

    def truncate(self, size: int) -> None:
        os.ftruncate(self.fd, size)

    def fsync(self) -> None:
        os.fsync(self.fd)

    def release(self) -> None:
        os.close(self.fd)


class JournalHandle(Handle):
    """The journal: reads up to its last whole line; O_APPEND writes of lines.

    Each write appends, durably and all or none, the lines it completes; a
    bad line fails that write with FormatError and appends nothing of it,
    and the next write starts a new line (the refused write's bytes,
    complete or not, are forgotten). Bytes after the last newline wait in
    the handle for the rest of their line (the kernel splits large writes,
    and buffered writers such as Python's cut at their buffer size, not at
    newlines). ``close`` of a descriptor while a line is incomplete fails
    with FormatError but keeps the bytes: the kernel flushes at the close
    of every copy of the descriptor (a child closing an inherited one at
    exec), and the copy still open may finish the line. The last close
    (release) drops a line still incomplete, with a log line.

    A line longer than MAX_PARTIAL_LINE is never appended, nor any part of
    it: the write that makes it too long fails with TooLarge, and so does
    every later write through the handle until one carries the newline
    that ends it (that one fails too, and the next write starts a new
    line), and so does a close meanwhile. (The kernel cuts a large
    ``write()`` into requests answered one by one: the requests before the
    one that made the line too long were taken, so that ``write()`` returns
    a short count, as at a file size limit, and the caller's write of the
    rest fails.)
    """

    direct_io = True

    def __init__(self, agent: "LiveAgent", writable: bool) -> None:
        self.agent = agent
        self.agent_id = agent.agent_id
        self.writable = writable
        if writable:
            agent.journal()  # opened now, so that a broken journal fails the open
        self.partial = b""  # the start of a line whose newline has not come yet
        self.overlong = False  # in a line too long to append: refuse writes until its newline

    def read(self, offset: int, size: int) -> bytes:
        tail = self.agent.tail
        tail.refresh()
        n = max(0, min(size, tail.size - offset))
        if not n:
            return b""
        with open(tail.path, "rb") as f:
            f.seek(offset)
            return f.read(n)

    def write(self, offset: int, data: bytes) -> int:
        if not self.writable:
            raise NotPermitted("the journal is not open for writing")
        self.agent.check_writable()
        if self.overlong:
            self.overlong = b"\n" not in data
            raise TooLarge(_TOO_LONG + ("; writes fail until the newline that ends it" if self.overlong else
                                        "; it ended in this write, refused whole: the next write starts a new line"))
        buf, self.partial = self.partial + bytes(data), b""  # a refused write leaves no partial line
        end = buf.rfind(b"\n") + 1
        if len(buf) - end > MAX_PARTIAL_LINE:  # the line still open: refused until its newline
            self.overlong = True
            raise TooLarge(_TOO_LONG + "; writes fail until the newline that ends it")
        if end > MAX_PARTIAL_LINE and max(map(len, buf[:end].split(b"\n"))) > MAX_PARTIAL_LINE:
            raise TooLarge(_TOO_LONG + "; the write is refused whole")
        if end:
            events = parse_draft_lines(buf[:end], "journal")
            self.agent.check_blobs(events)  # an attachment names a blob this agent has
            counted(self.agent.journal().append_many(events))
        self.partial = buf[end:]
        return len(data)

    def written(self) -> None:
        self.agent.host.changed(self.agent_id, fmt.JOURNAL)

    def flush(self) -> None:
        if self.overlong:
            raise TooLarge(_TOO_LONG + "; the descriptor was closed before its newline")
        if self.partial:
            raise FormatError(f"the journal write ended without a newline: {len(self.partial)} bytes of an "
                              "incomplete line are not appended")

    def release(self) -> None:
        if self.overlong:
            log.warning("agent %s: journal closed in a line longer than %d MiB; dropped",
                        self.agent_id, MAX_PARTIAL_LINE >> 20)
            self.overlong = False
        if self.partial:
            log.warning("agent %s: journal closed with %d bytes of an incomplete line; dropped",
                        self.agent_id, len(self.partial))
            self.partial = b""

    def truncate(self, size: int) -> None:
        raise NotPermitted("the journal is append-only: it cannot be truncated")


class EditHandle(Handle):
    """working_memory.md or spec.json, open for reading or writing.

    Writers share one :class:`Edit` (readers see it too). ``close`` (flush)
    commits it once something was written, so a refused commit (a spec that
    does not validate, memory that is not UTF-8, a read-only mount) fails
    the close that asked, and the writer's bytes stay for another try. A
    truncate alone is only checked there, and committed at the last close:
    the kernel flushes at the close of every copy of a descriptor, and the
    shell's ``>`` opens with O_TRUNC, then closes its first copy before
    anything is written. The last close (release) commits what is still
    uncommitted or, refused, drops it with a log line. Writers share the
    bytes, as on a disk: one writer's refused bytes are what another's
    close commits (and is refused for) until someone writes them right.
    """

    def __init__(self, agent: "LiveAgent", rel: str, writable: bool, *, append: bool = False) -> None:
        self.agent = agent
        self.rel = rel
        self.writable = writable
        #: Opened with O_APPEND: every write goes at the end of the file as
        #: it is now, whatever offset the kernel sends (its idea of the size,
        #: stale after a change made beside the mount or an edit dropped).
        self.append = append
        if writable:
            self.direct_io = True  # a refused commit must not linger in the page cache
            self.edit = agent.begin_edit(rel)
            self.snapshot = b""
        else:
            self.snapshot = agent.handle.read(rel)

    def _current(self) -> bytes | bytearray:
        if self.writable:
            return self.edit.data
        edit = self.agent.edits.get(self.rel)
        return edit.data if edit is not None else self.snapshot

    def read(self, offset: int, size: int) -> bytes:
        return bytes(self._current()[offset: offset + size])

    def write(self, offset: int, data: bytes) -> int:
        if not self.writable:
            raise NotPermitted(f"{self.rel} is not open for writing")
        self._check_failed()
        buf = self.edit.data
        try:
            self.agent.check_writable()
            if self.append:
                offset = len(buf)
            check_edit_size(self.rel, offset + len(data), len(buf))
        except CapsuleError as exc:
            # (The kernel may have had earlier pieces of this write() taken:
            # what the edit holds now is no version anyone meant to save.)
            self._poison(exc)
            raise
        if offset > len(buf):
            buf.extend(b"\0" * (offset - len(buf)))
        buf[offset: offset + len(data)] = data
        self.edit.dirty = self.edit.written = True
        self.edit.times = None  # (a write moves the mtime, as on a disk)
        return len(data)

    def _poison(self, exc: CapsuleError) -> None:
        edit = self.edit
        if edit.failed is None:
            log.warning("agent %s: a write to %s failed (%s); the edit is dropped, the file keeps its saved version",
                        self.agent.agent_id, self.rel, exc)
        edit.failed = exc
        edit.dropped = edit.dropped or edit.dirty
        if self.agent.edits.get(self.rel) is edit:
            self.agent.detach_edit(self.rel)  # readers and the next writer see the file as saved
            if edit.dirty:
                self.agent.host.changed(self.agent.agent_id, self.rel)  # (the kernel's size was the edit's)

    def _check_failed(self) -> None:
        failed = self.edit.failed
        if failed is not None:
            raise type(failed)(f"{self.rel}: an earlier write through this file failed ({failed}); nothing of "
                               "this edit is saved: close it, and open the file again")

    def truncate(self, size: int) -> None:
        if not self.writable:
            raise NotPermitted(f"{self.rel} is not open for writing")
        self._check_failed()
        self.agent.check_writable()
        resize(self.edit.data, size, self.rel)
        self.edit.dirty = True

    def flush(self) -> None:
        if not self.writable or (self.edit.failed is not None and not self.edit.dropped):
            return  # (a write failed, but nothing written was lost: nothing to report)
        self._check_failed()
        if self.edit.detached:
            return
        if self.edit.written:
            self.agent.commit_edit(self.rel)
        elif self.edit.dirty:  # truncated only: committed at release, refused here if it will be
            self.agent.check_edit(self.rel, bytes(self.edit.data))

    def fsync(self) -> None:
        if self.writable:
            self._check_failed()
        self.flush()

    def release(self) -> None:
        if self.writable:
            self.agent.end_edit(self.rel, self.edit)


def truncate_new(handle: Handle) -> None:
    """O_TRUNC of a file just opened: the handle is closed again if refused."""
    try:
        handle.truncate(0)
    except BaseException:
        handle.release()
        raise
