"""Uploads: new blobs an agent writes into its ``artifacts/blobs/`` through the mount.

Rules:
  * A file created in ``AGENT/artifacts/blobs/`` is named by the sha256 of
    the bytes it is to hold (64 lowercase hex digits; any other name is a
    FormatError). Its bytes go to a private file of the daemon under
    ``<work>/uploads/`` (0600), never into ``objects/``; the name is neither
    listed nor found by a lookup until the blob is stored.
  * At close (flush) the bytes must hash to the name, or the close fails
    (FormatError) and nothing is stored; the private file goes at the last
    close. Bytes that match are placed in the host store (not rewritten if it
    has them) and listed in the agent's manifest, both under the store's
    shared lock, so gc sees the blob either not yet placed or listed. Listed,
    gc keeps it like any blob of the agent, whether or not an event names it
    yet; a crash before the listing leaves at worst an unlisted blob, which
    gc collects: that close never returned.
  * The bytes are verified even when the store has the blob already:
    naming another agent's blob gives no access to it.
  * An upload holds at most :data:`MAX_UPLOAD` bytes (the largest attachment
    any provider takes; a write or truncate beyond is TooLarge), and an
    agent has at most :data:`MAX_OPEN_UPLOADS` open at once (FilesBusy).
  * An ``attachment`` event appended through the mount must name a blob the
    agent's manifest lists, with its size (``agent.check_attachments``): one
    stored through ``artifacts/blobs/`` or held already.

Theory of operation: writes are hashed as they arrive while they come in
order (``cp``, ``cat >``), so the close costs a few fsyncs; after a write out
of order the close reads the file back to hash it.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import secrets
import shutil

from ..capsule import format as fmt
from ..errors import FilesBusy, FormatError
from ..fsutil import makedirs_durable
from ..hashing import CHUNK
from .errors import NotPermitted, TooLarge
from .agent import LiveAgent
from .handles import Handle
from ..render import MAX_ATTACHMENT

log = logging.getLogger(__name__)

#: Largest blob an agent may upload through the mount.
MAX_UPLOAD = MAX_ATTACHMENT
#: Uploads one agent may have open at once.
MAX_OPEN_UPLOADS = 16
#: The uploads' directory under the mount's work directory.
SUBDIR = "uploads"


def check_upload_name(name: str) -> str:
    """The sha256 a new file's name in ``artifacts/blobs/`` must be."""
    if not fmt.is_sha256(name):
        raise FormatError(f"{fmt.BLOBS_DIR}/{name[:80]!r}: a blob is named by the sha256 of its bytes "
                          f"(64 lowercase hex digits, e.g. `sha256sum FILE | cut -c1-64`)")
    return name




class UploadArea:
    """The private files of the uploads in progress, and who has them open."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._open: dict[str, list[UploadHandle]] = {}  # agent id -> its open uploads
        # Nothing here was ever acknowledged: a crash (or a kill) left it.
        shutil.rmtree(root, ignore_errors=True)

    @classmethod
    def under(cls, work_dir: str) -> "UploadArea":
        return cls(os.path.join(work_dir, SUBDIR))

    def open(self, agent: LiveAgent, sha256: str) -> "UploadHandle":
        mine = self._open.setdefault(agent.agent_id, [])
        if len(mine) >= MAX_OPEN_UPLOADS:
            raise FilesBusy(f"{fmt.BLOBS_DIR}/: agent {agent.agent_id} has {len(mine)} uploads open; "
                            f"close one first")
        makedirs_durable(self.root, 0o700)
        path = os.path.join(self.root, f"{agent.agent_id}-{secrets.token_hex(8)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        handle = UploadHandle(agent, self, sha256, fd, path)
        mine.append(handle)
        return handle

    def closed(self, handle: "UploadHandle") -> None:
        mine = self._open.get(handle.agent.agent_id, [])
        if handle in mine:
            mine.remove(handle)
        if not mine:
            self._open.pop(handle.agent.agent_id, None)

    def pending_size(self, agent_id: str, sha256: str) -> int | None:
        """The size of an upload of ``sha256`` open for ``agent_id``, if one is."""
        sizes = [h.size for h in self._open.get(agent_id, ()) if h.sha256 == sha256 and not h.done]
        return max(sizes) if sizes else None


class UploadHandle(Handle):
    """A new blob being written: verified and stored at close (see the module rules)."""

    direct_io = True  # bytes not yet verified never sit in the page cache

    def __init__(self, agent: LiveAgent, area: UploadArea, sha256: str, fd: int, path: str) -> None:
        self.agent = agent
        self.area = area
        self.sha256 = sha256
        self.fd = fd
        self.path = path
        self.size = 0
        self._hash = hashlib.sha256()
        self._hashed = 0  # bytes 0.._hashed are in _hash, if in_order
        self._in_order = True
        self.done = False  # stored: the private file is the store's now (or gone)
        self._released = False

    @property
    def rel(self) -> str:
        return fmt.blob_path(self.sha256)

    def _check(self, end: int) -> None:
        self.agent.check_writable()
        if self.done:
            raise NotPermitted(f"{self.rel} is stored: blobs are read-only")
        if end > MAX_UPLOAD:
            raise TooLarge(f"{self.rel}: an uploaded blob may not exceed {MAX_UPLOAD} bytes "
                           f"(the largest attachment a provider takes)")

    def read(self, offset: int, size: int) -> bytes:
        if self.done:
            with open(self.agent.host.store.blob_file(self.sha256), "rb") as f:
                f.seek(offset)
                return f.read(size)
        return os.pread(self.fd, size, offset)

    def write(self, offset: int, data: bytes) -> int:
        if offset < 0:
            raise FormatError(f"{self.rel}: negative offset")
        self._check(offset + len(data))
        n = os.pwrite(self.fd, data, offset)
        if not n:
            return 0  # (a file grows only by bytes written)
        if self._in_order and offset == self._hashed:
            self._hash.update(memoryview(data)[:n])
            self._hashed += n
        else:
            self._in_order = False
        self.size = max(self.size, offset + n)
        return n

    def truncate(self, size: int) -> None:
        if size < 0:
            raise FormatError(f"{self.rel}: negative size")
        self._check(size)
        os.ftruncate(self.fd, size)
        if size == 0:
            self._hash, self._hashed, self._in_order = hashlib.sha256(), 0, True
        elif size != self._hashed:
            self._in_order = False
        self.size = size

    def _digest(self) -> str:
        if self._in_order and self._hashed == self.size:
            return self._hash.hexdigest()
        h = hashlib.sha256()
        offset = 0
        while chunk := os.pread(self.fd, CHUNK, offset):
            h.update(chunk)
            offset += len(chunk)
        return h.hexdigest()

    def flush(self) -> None:
        """Verify the bytes and store the blob (FormatError if they do not hash to the name)."""
        if self.done or self._released:
            return
        self.agent.check_writable()
        got = self._digest()
        if got != self.sha256:
            raise FormatError(f"{self.rel}: the {self.size} bytes written hash to {got}, not to the file's name; "
                              f"nothing is stored")
        store = self.agent.host.store
        os.fsync(self.fd)
        with store.writing():  # gc sees the blob not yet placed, or listed
            try:
                store.adopt_blob_file(self.path, self.sha256)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                with open(self.path, "rb") as f:  # (a work directory on another file system)
                    store.put_blob_stream(f, expect=self.sha256)
            self.agent.handle.list_blobs([self.sha256])
        os.close(self.fd)
        self.fd = -1
        self.done = True
        self.agent.host.changed(self.agent.agent_id, self.rel)
        log.info("agent %s: blob %s uploaded (%d bytes)", self.agent.agent_id, self.sha256, self.size)

    def fsync(self) -> None:
        if not self.done:
            os.fsync(self.fd)  # (stored, and durable, at close)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.area.closed(self)
        if self.done:
            return
        os.close(self.fd)
        self.fd = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        log.info("agent %s: upload of %s closed without being stored (%d bytes dropped)",
                 self.agent.agent_id, self.rel, self.size)
        self.agent.host.changed(self.agent.agent_id, self.rel)  # the kernel's size of it goes
