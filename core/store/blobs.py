"""Blobs stored once per host: ``objects/<2hex>/<64hex>``, named by the sha256 of their bytes.

Rules:
  * A blob is stored once per host however many agents use it; the agents'
    manifests list it as ``artifacts/blobs/<sha256>``. A blob file is never
    changed in place (mode 0444): a put of bytes the store has is deduplicated.
  * Every put is atomic: the bytes are written to a temp file in objects/,
    fsynced, hashed, renamed into place and the directory fsynced.
  * Blobs are re-hashed when read for export, verify or move
    (:meth:`BlobStore.iter_blob`); a corrupt blob raises CorruptBlobError with
    its path, is never handed out as good, and is moved to
    ``objects/.corrupt/`` so that a put of its good bytes repairs the store.
  * Writers that add a blob and then a reference to it hold the shared lock
    (``gc.lock``) across both steps (:meth:`BlobStore.writing`); gc
    (:meth:`capsulefs.core.store.host_store.HostStore.gc`) holds the exclusive
    lock, so it never sees a blob whose reference is still being written.
  * ``on_blob`` (given at construction) is told the name of every blob this
    object placed in objects/ once it is durable there (a blob the store had
    already is not told again). It is called in the thread that stored it,
    so it must be quick and thread-safe (the daemon's blob tier uploader
    queues the name). Blobs other processes store are not told: the
    uploader finds them when it reconciles at its start.
  * A blob's access time is its last read, kept coarsely by its readers
    (:meth:`BlobStore.touch_blob`, once a day at most): ``gc --tier-cache``
    evicts the coldest first (:mod:`capsulefs.core.store.cache`).
"""

from __future__ import annotations

import fcntl
import io
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import BinaryIO

from .. import metrics
from ..capsule import format as fmt
from ..errors import CorruptBlobError, NotFoundError
from ..fsutil import TMP_PREFIX, fsync_dir, makedirs_durable
from ..hashing import CHUNK, hash_file
from ..linuxfs import fsync_each, path_identity
from .cache import TOUCH_EVERY
from .layout import GC_LOCK, OBJECTS_DIR

log = logging.getLogger(__name__)

#: Where blobs found damaged are kept, under objects/ (see ``quarantine_blob``).
QUARANTINE_DIR = ".corrupt"


class BlobStore:
    """A state directory's objects/ and the lock that holds gc off. Safe to share between processes."""

    def __init__(self, root: str, *, on_blob: Callable[[str], None] | None = None) -> None:
        self.root = os.path.abspath(root)
        self.objects_dir = os.path.join(self.root, OBJECTS_DIR)
        self._lock_path = os.path.join(self.root, GC_LOCK)
        self._tlock = threading.local()
        self._on_blob = on_blob

    # -- locking -----------------------------------------------------------
    @contextmanager
    def _flock(self, mode: int) -> Iterator[None]:
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            os.close(fd)

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Hold off gc while adding blobs and the references to them. Re-entrant."""
        depth = getattr(self._tlock, "depth", 0)
        if depth:
            self._tlock.depth = depth + 1
            try:
                yield
            finally:
                self._tlock.depth -= 1
            return
        with self._flock(fcntl.LOCK_SH):
            self._tlock.depth = 1
            try:
                yield
            finally:
                self._tlock.depth = 0

    # -- blobs ---------------------------------------------------------------
    def blob_file(self, sha256: str) -> str:
        fmt.check_sha256(sha256, "blob name")
        return os.path.join(self.objects_dir, sha256[:2], sha256)

    def has_blob(self, sha256: str) -> bool:
        return os.path.exists(self.blob_file(sha256))

    def touch_blob(self, sha256: str, *, now_ns: int | None = None) -> None:
        """A reader is about to read this blob: mark it as read now, coarsely.
        Its object's access time is the store's record of its last read
        (``gc --tier-cache`` evicts the coldest first): set explicitly, so
        that it holds under ``noatime`` too, and at most once a day
        (``cache.TOUCH_EVERY``; ``relatime`` updates it as often, ``strictatime``
        more: either only keeps it fresher). Missing blob, or a store this
        user may not change: nothing."""
        import time

        path = self.blob_file(sha256)
        now = time.time_ns() if now_ns is None else now_ns
        try:
            st = os.stat(path)
            if now - st.st_atime_ns >= TOUCH_EVERY * 1_000_000_000:
                os.utime(path, ns=(now, st.st_mtime_ns))
        except OSError as exc:
            log.debug("blob %s: its read time not kept: %s", sha256, exc)

    def blob_size(self, sha256: str) -> int:
        try:
            return os.stat(self.blob_file(sha256)).st_size
        except FileNotFoundError:
            raise NotFoundError(f"blob {sha256} is not in the store") from None

    def put_blob_stream(self, f: BinaryIO, expect: str | None = None) -> tuple[str, int]:
        """Store everything left in ``f`` as a blob; return (sha256, size).

        With ``expect``, refuse bytes that do not hash to it (nothing lands).
        """
        import hashlib  # (where it hashes: hashlib loads OpenSSL, which a reader of the store need not)

        os.makedirs(self.objects_dir, exist_ok=True)
        tmp = os.path.join(self.objects_dir, TMP_PREFIX + os.urandom(8).hex())
        h = hashlib.sha256()
        size = 0
        with self.writing():
            try:
                with open(tmp, "wb") as out:
                    while chunk := f.read(CHUNK):
                        h.update(chunk)
                        out.write(chunk)
                        size += len(chunk)
                    out.flush()
                    os.fsync(out.fileno())
                sha = h.hexdigest()
                if expect is not None and sha != expect:
                    raise CorruptBlobError(f"incoming blob {expect}", sha)
                self._place(tmp, sha)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        return sha, size

    def put_blob(self, data: bytes, expect: str | None = None) -> str:
        return self.put_blob_stream(io.BytesIO(data), expect)[0]

    def adopt_blob_file(self, path: str, sha256: str) -> None:
        """Move an already written, fsynced and hashed file into objects/."""
        with self.writing():
            self._place(path, sha256)

    def adopt_blob_files(self, items: Iterable[tuple[str, str]], *,
                         sync_dirs: Callable[[Iterable[str]], None] | None = None) -> None:
        """Move many already written, fsynced and hashed files, given as
        (path, sha256), into objects/, making each directory durable once at
        the end rather than once per blob (the move service adopts a
        thousand at a time): with ``sync_dirs`` given the directories
        touched (the move service's syncs its whole file system at once),
        else an fsync of each, several at a time so that the file system
        can commit them together."""
        items = list(items)
        touched: set[str] = set()
        placed: list[str] = []
        with self.writing():
            self.make_blob_dirs(sha for _, sha in items)
            for path, sha in items:
                dest = self.blob_file(sha)
                if self._holds_copy(dest, path):
                    os.unlink(path)
                    continue
                os.chmod(path, 0o444)
                os.replace(path, dest)
                touched.add(os.path.dirname(dest))
                placed.append(sha)
            if touched:
                if sync_dirs is not None:
                    sync_dirs(sorted(touched))
                else:
                    fsync_each(touched, fsync_dir)
        if self._on_blob is not None:
            for sha in placed:
                self._on_blob(sha)

    def make_blob_dirs(self, shas: Iterable[str]) -> None:
        """Create the directories (``objects/xx``) that these blobs will be
        placed in, before the blobs come: making a directory costs the file
        system far more than a rename into one that exists (measured on ext4
        here: 0.5 ms per mkdir against 20 us per rename), so the move service
        makes them while the blobs are still arriving. Durable: objects/ is
        fsynced when it changed. Names that are not digests are skipped."""
        made = False
        for prefix in sorted({sha[:2] for sha in shas if fmt.is_sha256(sha)}):
            try:
                os.mkdir(os.path.join(self.objects_dir, prefix))
            except FileExistsError:
                continue
            made = True
        if made:
            fsync_dir(self.objects_dir)

    def _place(self, tmp: str, sha: str) -> None:
        dest = self.blob_file(sha)
        if self._holds_copy(dest, tmp):
            os.unlink(tmp)  # deduplicated: the store has these bytes already
            return
        self.make_blob_dirs((sha,))
        os.chmod(tmp, 0o444)
        os.replace(tmp, dest)
        fsync_dir(os.path.dirname(dest))
        if self._on_blob is not None:
            self._on_blob(sha)

    def _holds_copy(self, dest: str, new: str) -> bool:
        """Whether the object ``dest`` is there to deduplicate the new, hashed
        file ``new`` against. One of another size is damaged (a blob's size
        follows from its name): it is quarantined, and the new bytes take
        its place. (One of the right size is trusted, as reading it is the
        cost dedup saves: a rotten one is found when read, and quarantined.)
        Caller holds the store's shared lock."""
        try:
            size = os.stat(dest).st_size
        except FileNotFoundError:
            return False
        good = os.stat(new).st_size
        if size == good:
            return True
        self._quarantine(dest, f"{size} bytes where the good copy has {good}")
        return False

    def quarantine_blob(self, sha256: str, why: str, *, ino: int | None = None) -> None:
        """Move a blob found damaged out of ``objects/`` (to ``objects/.corrupt/``,
        kept for a person): the next put of its good bytes (an import of an
        export that has it, a move, a workspace commit) then places them
        instead of deduplicating against the damaged copy, which nothing
        could repair before. With ``ino`` (the file that was read), only if
        the name still holds that file: a good copy placed meanwhile stays.
        A store this user may not change keeps the blob (logged)."""
        path = self.blob_file(sha256)
        try:
            with self.writing():
                if ino is not None and path_identity(path)[0] != ino:
                    return  # replaced meanwhile (by a put of the good bytes)
                self._quarantine(path, why)
        except FileNotFoundError:
            return  # quarantined (or collected) meanwhile
        except OSError as exc:
            log.error("blob %s is damaged (%s) and could not be quarantined: %s", path, why, exc)

    def _quarantine(self, path: str, why: str) -> None:
        pen = os.path.join(self.objects_dir, QUARANTINE_DIR)
        makedirs_durable(pen, 0o700)
        dest = os.path.join(pen, f"{os.path.basename(path)}.{os.urandom(4).hex()}")
        try:
            os.rename(path, dest)
        except FileNotFoundError:
            return  # quarantined (or collected) meanwhile
        fsync_dir(os.path.dirname(path))
        fsync_dir(pen)
        metrics.BLOB_QUARANTINES.inc()
        log.error("blob %s is damaged (%s): moved to %s; putting its bytes again (importing an export that has "
                  "them, or moving an agent that has them here) repairs the store", path, why, dest)

    def iter_blob(self, sha256: str, chunk: int = CHUNK) -> Iterator[bytes]:
        """Yield a blob's bytes, re-hashing them; raise CorruptBlobError at the end
        if they do not match (callers that stream must discard what they got),
        after quarantining the blob (see :meth:`quarantine_blob`)."""
        import hashlib

        path = self.blob_file(sha256)
        h = hashlib.sha256()
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise self._missing(sha256) from None
        with f:
            ino = os.fstat(f.fileno()).st_ino
            while data := f.read(chunk):
                h.update(data)
                yield data
        if h.hexdigest() != sha256:
            self.quarantine_blob(sha256, f"its bytes hash to {h.hexdigest()}", ino=ino)
            raise CorruptBlobError(path, h.hexdigest())

    def read_blob(self, sha256: str) -> bytes:
        return b"".join(self.iter_blob(sha256))

    def why_missing(self, sha256: str) -> str:
        """Why a blob is not in objects/, and how to repair that if it was quarantined."""
        why = "not in the store"
        pen = os.path.join(self.objects_dir, QUARANTINE_DIR)
        if os.path.isdir(pen) and any(n.startswith(sha256 + ".") for n in os.listdir(pen)):
            why += (f": a damaged copy was quarantined in {pen}; putting its bytes again (importing an export "
                    f"that has them, or a move) repairs the store")
        return why

    def _missing(self, sha256: str) -> NotFoundError:
        return NotFoundError(f"blob {sha256} ({self.blob_file(sha256)}) is {self.why_missing(sha256)}")

    def verify_blob(self, sha256: str) -> None:
        try:
            ino = path_identity(self.blob_file(sha256))[0]  # (before: a copy placed later is not the one hashed)
            actual, _ = hash_file(self.blob_file(sha256))
        except FileNotFoundError:
            raise self._missing(sha256) from None
        if actual != sha256:
            self.quarantine_blob(sha256, f"its bytes hash to {actual}", ino=ino)
            raise CorruptBlobError(self.blob_file(sha256), actual)

    def all_blobs(self) -> Iterator[str]:
        for sub in os.listdir(self.objects_dir):
            d = os.path.join(self.objects_dir, sub)
            if len(sub) == 2 and os.path.isdir(d):
                for name in os.listdir(d):
                    if fmt.is_sha256(name):
                        yield name
