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

See :mod:`capsulefs.core.view.host` for the view that makes them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..capsule import format as fmt
from .blobcheck import BlobCheck
from ..errors import CapsuleError, FormatError, NotFoundError
from ..journal.file import parse_draft_lines
from .errors import NotPermitted, NotSupported, TooLarge
from ..render import PROVIDER_ALIASES, PROVIDERS

if TYPE_CHECKING:
    from .host import LiveAgent

log = logging.getLogger(__name__)

#: Longest journal line a handle takes (it holds an incomplete one while waiting for its newline).
MAX_PARTIAL_LINE = 16 << 20
_TOO_LONG = f"a journal line is longer than {MAX_PARTIAL_LINE >> 20} MiB: nothing of it is appended"
#: Largest working_memory.md or spec.json a write or truncate may make: the
#: file being edited is held in the daemon's memory until it is committed.
MAX_EDIT_SIZE = 64 << 20
MOVE_UNAVAILABLE = "moving agents is not available on this mount (.control/move is reserved)"
REMOVE_UNAVAILABLE = "removing agents through this mount is not available (.control/remove is reserved)"
#: Longest line accepted by ``.control/model``, ``.control/move``, ``.control/abandon`` and ``.control/remove``.
MAX_CONTROL_LINE = 1024


class Mover(Protocol):
    """Who carries out ``.control/move`` and ``.control/abandon`` (the daemon).

    ``move`` returns once the agent moved and raises a domain error (see
    ``view.errors``: MoveBusy, PeerUnreachable, MoveRefused...) if the move
    rolled back or was refused; ``abandon`` ends an in-doubt move."""

    async def move(self, agent_id: str, target: str) -> None: ...

    async def abandon(self, agent_id: str, why: str) -> None: ...


class Remover(Protocol):
    """Who carries out ``.control/remove`` (the daemon).

    ``remove`` returns once the agent is gone from this host (its process
    stopped, its files and the areas beside them removed) and raises a
    domain error if it was refused: MoveBusy while a move of it is under
    way, ReadOnly in failsafe, NotFoundError if it is gone already."""

    async def remove(self, agent_id: str) -> None: ...


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
        self.check = check
        self.sha256 = check.sha256

    def read(self, offset: int, size: int) -> bytes:
        data = os.pread(self.fd, size, offset)
        self.check.served(offset, data)
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
            self.agent.journal().append_many(events)
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


@dataclass(slots=True)
class Edit:
    """An editable file being written: its bytes as writers see them.

    ``dirty``: changed since the last commit; ``written``: by a write (not
    only a truncate). ``detached``: the file was replaced (renamed over)
    while open; like writers of an unlinked inode, its writers go on
    writing bytes that nobody will see and nothing commits. ``fresh``: a
    file created anew after an unlink, not committed yet; it takes the
    capsule's mode at its commit, so mode changes until then are accepted
    (``install`` copies under mode 0600, ``mv`` sets the source's mode).
    ``failed``: a write to it failed (too large, read-only...); the bytes
    are not what any writer meant, so the edit is detached and poisoned:
    its writes, truncates and fsyncs fail with that error, nothing of it is
    committed, and the file stays as it was (the next open starts anew);
    a close fails too if bytes written before the failure were dropped
    (``dropped``)."""

    data: bytearray
    dirty: bool = False
    written: bool = False
    writers: int = 0
    detached: bool = False
    fresh: bool = False
    failed: CapsuleError | None = None
    dropped: bool = False
    times: tuple[int, int] | None = None  # (atime, mtime) set after the last write: applied at its commit


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


class ModelHandle(Handle):
    """.control/model: reads ``provider:model``; a write switches the model."""

    direct_io = True

    def __init__(self, agent: "LiveAgent", writable: bool) -> None:
        self.agent = agent
        self.writable = writable
        self.data = agent.model_bytes()

    def read(self, offset: int, size: int) -> bytes:
        return self.data[offset: offset + size]

    def write(self, offset: int, data: bytes) -> int:
        # One short line, whole: a long write comes in pieces, none of which may switch the model.
        self.agent.switch_model(*parse_model_line(bytes(data)))
        return len(data)

    def truncate(self, size: int) -> None:
        pass  # `echo x > model` truncates first; the write that follows is what counts


class MoveHandle(Handle):
    """.control/move (a peer's name or host id: move the agent there) and
    .control/abandon (a reason: end an in-doubt move here). A write blocks
    until the mover is done; its outcome is the write's error."""

    direct_io = True

    def __init__(self, agent: "LiveAgent", what: str, mover: Mover | None) -> None:
        self.agent = agent
        self.what = what  # "move" or "abandon"
        self.mover = mover

    def read(self, offset: int, size: int) -> bytes:
        return b""

    def write(self, offset: int, data: bytes) -> int:
        raise NotSupported(MOVE_UNAVAILABLE)

    async def write_async(self, offset: int, data: bytes) -> int:
        if self.mover is None:
            raise NotSupported(MOVE_UNAVAILABLE)
        line = control_line(bytes(data), f".control/{self.what}")
        if self.what == "move":
            await self.mover.move(self.agent.agent_id, line)
        else:
            await self.mover.abandon(self.agent.agent_id, line)
        return len(data)

    def truncate(self, size: int) -> None:
        pass  # `echo x > move` truncates first; the write that follows is what counts


class RemoveHandle(Handle):
    """.control/remove: the agent's id, exactly, removes the agent from this
    host. Anything else (its name, ``yes``, an empty line) is refused with
    FormatError and removes nothing, so a stray write cannot delete an agent.
    A write blocks until the remover is done; its outcome is the write's error."""

    direct_io = True

    def __init__(self, agent: "LiveAgent", remover: Remover | None) -> None:
        self.agent = agent
        self.remover = remover

    def read(self, offset: int, size: int) -> bytes:
        return b""

    def write(self, offset: int, data: bytes) -> int:
        raise NotSupported(REMOVE_UNAVAILABLE)

    async def write_async(self, offset: int, data: bytes) -> int:
        if self.remover is None:
            raise NotSupported(REMOVE_UNAVAILABLE)
        check_removal(bytes(data), self.agent.agent_id)
        await self.remover.remove(self.agent.agent_id)
        return len(data)

    def truncate(self, size: int) -> None:
        pass  # `echo ID > remove` truncates first; the write that follows is what counts


def control_line(data: bytes, what: str, *, example: str = "laptop", strip: bool = True) -> str:
    """The one line of text a control file write may carry, or FormatError:
    UTF-8 without control characters (C0, DEL, C1), one trailing newline
    allowed (as ``echo`` writes). ``strip``: spaces around it and a CRLF
    line end are dropped (a peer's name, a model); else they are part of
    the text."""
    if len(data) > MAX_CONTROL_LINE:
        raise FormatError(f"{what}: write one line of at most {MAX_CONTROL_LINE} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError(f"{what}: not UTF-8 text") from None
    text = text[:-1] if text.endswith("\n") else text
    if strip and text.endswith("\r"):  # (a CRLF line end)
        text = text[:-1]
    if not text.strip(" ") or any(ord(c) < 32 or 0x7F <= ord(c) < 0xA0 for c in text):  # (another newline is one)
        raise FormatError(f"{what}: write exactly one non-empty line (e.g. `echo {example} > {what}`)")
    return text.strip(" ") if strip else text


def parse_model_line(data: bytes) -> tuple[str, str]:
    """What a write to ``.control/model`` switches to: (provider id, model), or
    FormatError. The provider must be one the renderers know, or a short
    name for one (``render.PROVIDER_ALIASES``): the agent could never answer
    for another."""
    line = control_line(data, ".control/model", example="anthropic:claude-sonnet-4-5")
    provider, sep, model = line.partition(":")
    provider, model = provider.strip(" "), model.strip(" ")
    if not sep or not provider or not model:
        raise FormatError(f"model {line[:80]!r} is not provider:model (e.g. anthropic:claude-sonnet-4-5)")
    provider = PROVIDER_ALIASES.get(provider, provider)
    if provider not in PROVIDERS:
        known = ", ".join(sorted(PROVIDERS)) + "; " + ", ".join(f"{a} means {p}" for a, p in
                                                              sorted(PROVIDER_ALIASES.items()))
        raise FormatError(f"unknown provider {provider[:80]!r} in .control/model; known: {known}")
    return provider, model


def check_removal(data: bytes, agent_id: str) -> None:
    """FormatError unless a write to ``.control/remove`` is exactly ``agent_id``
    (with at most the newline ``echo`` adds): a stray write removes nothing."""
    token = control_line(data, ".control/remove", example="AGENT_ID", strip=False)
    if token != agent_id:
        raise FormatError(f".control/remove: {token[:64]!r} is not this agent's id; write exactly its id, "
                          f"nothing around it (\"agent_id\" in .control/status) to remove it")


def check_edit_size(rel: str, size: int, now: int = 0) -> None:
    """TooLarge if ``rel`` would grow from ``now`` bytes to ``size``, beyond MAX_EDIT_SIZE."""
    if size > max(now, MAX_EDIT_SIZE):
        raise TooLarge(f"{rel} may not grow beyond {MAX_EDIT_SIZE >> 20} MiB")


def resize(buf: bytearray, size: int, rel: str) -> None:
    """Cut or zero-extend ``buf`` (the edit of ``rel``) to ``size`` bytes, like ftruncate."""
    check_edit_size(rel, size, len(buf))
    if size < len(buf):
        del buf[size:]
    else:
        buf.extend(b"\0" * (size - len(buf)))
