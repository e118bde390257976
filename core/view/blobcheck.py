"""Serving blobs without ever serving a corrupt one as good.

Rules:
  * A read that reaches a blob's last byte is answered only once the whole
    blob is known to hash to its name. Reads before the end may be answered
    while the check is still running: a reader that gets the whole file has
    then always had it checked, and one whose blob is bad gets EIO before
    end of file, like a disk read error in the middle of a file.
  * A verdict holds while the object file keeps the same identity (inode,
    size, mtime, ctime); objects are written once, mode 0444, so a change
    of identity means someone replaced it (a repair) and it is judged anew.
  * A blob found bad fails every later open and read (CorruptBlobError),
    and the caller must drop any pages of it the kernel cached.

Theory of operation: most readers (cat, cp, tar, backup tools) read a file
front to back, so :class:`BlobCheck` hashes reads as they are served while
they arrive in order, and the read holding the last byte finishes the hash
for free. If reads arrive out of order, the hash stops advancing, and the
last read triggers one full re-read of the object (:meth:`BlobCheck.full_check`).
An adapter with threads to spare runs :meth:`BlobCheck.full_check` in the
background from the first open instead (``background``), serves the reads
meanwhile, and makes the read that reaches the end wait for the verdict.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from enum import Enum

from ..errors import CorruptBlobError
from ..hashing import hash_fd, hash_file

log = logging.getLogger(__name__)


class Verdict(Enum):
    UNKNOWN = "unknown"  # not (yet) fully hashed
    GOOD = "good"  # hashes to its name
    BAD = "bad"  # does not: never served again


def identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What must stay the same for a GOOD verdict to stay valid."""
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class BlobCheck:
    """Verification state of one stored blob, shared by all its readers.

    Thread-safe: the adapter may read from worker threads.
    """

    def __init__(self, sha256: str, path: str, st: os.stat_result) -> None:
        self.sha256 = sha256
        self.path = path
        self.size = st.st_size
        self.ident = identity(st)
        self.verdict = Verdict.UNKNOWN
        self._h = hashlib.sha256()
        self._pos = 0  # bytes hashed so far, in order
        self._lock = threading.Lock()
        #: A full check runs elsewhere (a worker thread): reads are not hashed
        #: as served, and the adapter holds back the read that reaches the end.
        self.background = False

    def check_open(self) -> None:
        if self.verdict is Verdict.BAD:
            raise CorruptBlobError(self.path)

    def served(self, offset: int, data: bytes, fd: int | None = None) -> None:
        """Account for ``data`` read at ``offset``; raise if it may not be served.

        Called after the bytes were read from the object (through ``fd``, the
        reader's open descriptor, if given) and before they are handed out.
        """
        with self._lock:
            if self.verdict is Verdict.GOOD:
                return
            if self.verdict is Verdict.BAD:
                raise CorruptBlobError(self.path)
            if not self.background and offset == self._pos and data:
                self._h.update(data)
                self._pos += len(data)
                if self._pos >= self.size:
                    self._decide(self._h.hexdigest())
                    return
            reaches_end = offset + len(data) >= self.size
        if reaches_end:
            self.full_check(fd)

    def full_check(self, fd: int | None = None) -> None:
        """Hash the whole object now (slow); raise CorruptBlobError if bad.

        With ``fd`` (a reader's descriptor of the object), the bytes that
        reader is served are hashed, wherever the object's name went: a
        reader of the store (a sandbox being built, an export) that finds
        the blob damaged moves it to quarantine while the mount's reader
        still has it open, and that reader must get EIO, not ENOENT."""
        if self.verdict is Verdict.GOOD:
            return
        if self.verdict is Verdict.BAD:
            raise CorruptBlobError(self.path)
        actual, _size = hash_file(self.path) if fd is None else hash_fd(fd)
        with self._lock:
            self._decide(actual)

    def _decide(self, actual: str) -> None:
        # Called with the lock held.
        if actual == self.sha256:
            self.verdict = Verdict.GOOD
            return
        self.verdict = Verdict.BAD
        log.error("corrupt blob %s: its bytes hash to %s; serving EIO for it", self.path, actual)
        raise CorruptBlobError(self.path, actual)


class BlobChecks:
    """One :class:`BlobCheck` per stored blob, renewed if the object changes."""

    def __init__(self) -> None:
        self._checks: dict[str, BlobCheck] = {}
        self._lock = threading.Lock()

    def get(self, sha256: str, path: str) -> BlobCheck:
        """The check of the blob stored at ``path``; FileNotFoundError if
        there is none (the caller knows why: see ``HostStore.why_missing``)."""
        st = os.stat(path)
        with self._lock:
            chk = self._checks.get(sha256)
            if chk is None or chk.ident != identity(st):
                chk = BlobCheck(sha256, path, st)
                self._checks[sha256] = chk
            return chk

    def is_bad(self, sha256: str) -> bool:
        chk = self._checks.get(sha256)
        return chk is not None and chk.verdict is Verdict.BAD
