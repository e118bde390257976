"""Crash recovery of a journal, and where the host store keeps what it needs:
the write-ahead ring replayed into its journal, bytes cut from a journal
saved aside, a journal replaced without losing its ring's records.

Rules:
  * Before a journal with a ring is read or appended to after a crash, the
    ring is replayed into it; a journal that disagrees with its ring is
    refused (RingMismatch), never repaired by guessing.
  * Bytes cut from a journal (a torn tail, or zeros a crash left unwritten)
    are first saved durably as ``<journal name>.torn-<n>`` in a recovery
    directory outside the capsule. They are never kept, never dropped
    silently.
  * Rings and recovery files live in the host's state directory, outside
    every capsule: ``<state>/journal-wal/<agent_id>`` and
    ``<state>/recovery/<agent_id>/``.

Theory of operation (the ring's chain is described in
:mod:`capsulefs.core.journal.ring`):
  Recovery (:func:`replay_ring`, under the journal's flock) reads the chain
  and compares it with the journal from the chain's first offset: missing
  bytes (lost by a crash, or a line cut short) are appended, the journal
  fdatasynced and the ring reset; zero bytes where the ring has data (a
  grown file whose data never reached the disk) are saved as a torn tail
  and replaced. Anything else is a disagreement: both files are left alone,
  an error names them, and appending is refused. Whole lines past the
  chain's end were never acknowledged and stay; a torn tail past it goes to
  the recovery directory as always, and so does a crash's garbage (NUL
  bytes, see :func:`unacknowledged_from`), when a writer opens the journal:
  readers (the store's open, log, verify, exports) only put back what the
  ring vouches for, and :func:`read_journal_locked` shows them the journal
  without that garbage. The host store replays every agent's ring when it
  opens, before anything reads a journal file.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import FormatError
from ..fsutil import TMP_PREFIX, fdatasync, fsync_dir, makedirs_durable
from .ring import Ring
from .ring import remove as remove_ring
from ..store.layout import RECOVERY_DIR

log = logging.getLogger(__name__)

#: Name of a recovery file for a torn tail: ``<journal name>.torn-<n>``.
TORN_SUFFIX = ".torn-"


class RingMismatch(FormatError):
    """A journal disagrees with its write-ahead ring: neither is touched and
    nothing is appended until someone looks (the message names both files)."""


#: Where torn tails of the host store's agents go: ``<state>/recovery/<agent_id>/``,
#: outside the agent's capsule directory, so the capsule still verifies.
#: Where the host store keeps each agent's write-ahead ring:
#: ``<state>/journal-wal/<agent_id>`` (outside the capsule, like recovery/).
WAL_DIR = "journal-wal"


def journal_ring_path(store_root: str, agent_id: str) -> str:
    """The write-ahead ring of an agent of the host store."""
    return os.path.join(store_root, WAL_DIR, agent_id)


def agent_recovery_dir(store_root: str, agent_id: str) -> str:
    return os.path.join(store_root, RECOVERY_DIR, agent_id)


def save_torn(recovery_dir: str, journal_path: str, tail: bytes) -> str:
    """Save bytes cut from a journal as ``<name>.torn-<n>`` (durably); return the path."""
    makedirs_durable(recovery_dir)
    name = os.path.basename(journal_path) + TORN_SUFFIX
    tmp = os.path.join(recovery_dir, TMP_PREFIX + os.urandom(8).hex())
    try:
        with open(tmp, "xb") as f:
            f.write(tail)
            f.flush()
            os.fsync(f.fileno())
        while True:  # journals side by side may share the directory: never over a tail saved meanwhile
            taken = [int(n[len(name):]) for n in os.listdir(recovery_dir)
                     if n.startswith(name) and n[len(name):].isdigit()]
            dest = os.path.join(recovery_dir, f"{name}{max(taken, default=0) + 1}")
            try:
                os.link(tmp, dest)
                break
            except FileExistsError:
                continue
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
    fsync_dir(recovery_dir)
    return dest


def _holds(fd: int, size: int, start: int, data: bytes) -> bool:
    """Whether the journal open on ``fd`` (``size`` bytes) holds ``data`` at ``start``."""
    return size >= start + len(data) and os.pread(fd, len(data), start) == data


def _persist(fd: int, path: str, start: int, data: bytes, ring: Ring) -> None:
    """Write ``data`` (which the journal holds at ``start`` already) over
    itself, fdatasync the journal and reset the ring: the bytes the ring
    vouches for are then durable in the journal itself, even if an earlier
    write-back of them failed. (Linux reports a failed write-back once and
    may keep the pages cached but clean: the journal reads right, and a
    later fdatasync returns 0 without writing them. Writing them again
    dirties them.) Through a second descriptor: ``fd`` appends whatever
    offset pwrite is given."""
    wfd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        mine, held = os.fstat(wfd), os.fstat(fd)
        if (mine.st_ino, mine.st_dev) != (held.st_ino, held.st_dev):
            return  # replaced meanwhile (by a writer outside the rules): leave the ring to the next reader
        view = memoryview(data)
        at = start
        while view:
            n = os.pwrite(wfd, view, at)
            view, at = view[n:], at + n
        fdatasync(wfd)
    finally:
        os.close(wfd)
    ring.reset(synced=(start + len(data), held.st_ino))
    log.debug("journal %s: the %d bytes its ring vouched for were written again and synced", path, len(data))


def unacknowledged_from(data: bytes, bound: int) -> int | None:
    """Where the unacknowledged garbage a crash can leave starts in a
    journal's bytes ``data``: the start of the first line holding a NUL
    byte at or past ``bound``, or None. ``bound`` is a line boundary past
    which the ring knows nothing was made durable but through the journal's
    own fdatasync (see :func:`garbage_bound`).

    Why such a line, and everything after it, was never acknowledged: no
    canonical line holds a NUL byte (JSON escapes every control character),
    so it is pages a crash left unwritten (zeros) in an append that was not
    yet durable (a multi-page write can have a later page written and an
    earlier one not). Every acknowledged byte is durable through the ring
    (before ``bound``: a replay puts it back) or through an fdatasync of
    the journal, and that fdatasync also wrote every byte before it, so no
    acknowledged line comes after pages a crash left unwritten. NULs before
    ``bound`` are in bytes the journal had synced: damage, not a crash's
    leftovers, and they are never cut (opening refuses, naming the line)."""
    k = data.find(b"\0", bound)
    if k < 0:
        return None
    return max(bound, data.rfind(b"\n", 0, k) + 1)


def garbage_bound(ring: Ring, ino: int) -> int | None:
    """The journal offset (of inode ``ino``) from which the ring knows of no
    acknowledged byte it does not vouch for itself: its chain's end, or,
    with no chain, how far the journal was synced by itself
    (:meth:`Ring.synced_to`). None if the ring cannot tell."""
    vouched = ring.vouched()  # headers only: a longer reading than the checked chain only cuts less
    if vouched is not None and vouched[1] == ino:
        return vouched[0] + len(vouched[2])
    return ring.synced_to(ino)


def _cut_unacknowledged_garbage(fd: int, path: str, end: int, recovery_dir: str) -> None:
    """Cut what follows ``end`` (see :func:`unacknowledged_from`) from its
    first line holding a NUL byte on, saving it like a torn tail. For a
    writer's open only: a reader leaves it (and does not show it).

    A crash in the middle of a multi-page append can leave one of its pages
    unwritten (zeros) and a later one written: a "line" of NULs and the end
    of a real one. Left there, it made the journal unreadable at every open."""
    size = os.fstat(fd).st_size
    if size <= end:
        return
    tail = os.pread(fd, size - end, end)
    k = unacknowledged_from(tail, 0)
    if k is None:
        return
    cut = end + k
    dest = save_torn(recovery_dir, path, tail[cut - end:])
    os.ftruncate(fd, cut)
    fdatasync(fd)
    log.warning("journal %s: %d bytes from offset %d, past its last acknowledged append and holding pages a crash "
                "left unwritten (NUL bytes), were never acknowledged; moved them to %s", path, size - cut, cut, dest)


def _all_held(fd: int, path: str, start: int, data: bytes, ring: Ring, recovery_dir: str, persist: bool) -> None:
    """The journal holds every byte the ring vouches for (``data`` at
    ``start``). A writer (``persist``) cuts unacknowledged garbage past
    them and makes them durable in the journal itself; a reader leaves the
    file as it is."""
    if persist:
        _cut_unacknowledged_garbage(fd, path, start + len(data), recovery_dir)
        _persist(fd, path, start, data, ring)


def _no_chain(fd: int, path: str, ring: Ring, recovery_dir: str, persist: bool) -> int:
    """The ring holds no valid chain: nothing to replay. A writer still cuts
    the garbage a crash left past where the journal was synced, if the ring
    says where that is (see :meth:`Ring.synced_to`)."""
    if persist:
        bound = ring.synced_to(os.fstat(fd).st_ino)
        if bound is not None:
            _cut_unacknowledged_garbage(fd, path, bound, recovery_dir)
    return 0


def replay_ring(fd: int, path: str, ring_path: str, recovery_dir: str, *, persist: bool = False) -> int:
    """Bring the journal open on ``fd`` up to date with its ring after a
    crash; return how many bytes were restored. Caller holds the flock.

    The ring's chain vouches for journal bytes [start, end) of one inode.
    If the journal holds them all, nothing is done (they may still be only
    in the page cache: the ring is kept), unless ``persist`` (a writer
    opening the journal): they are then written again and synced, and the
    ring reset (see :func:`_persist`). If the journal holds a prefix of
    them (a crash lost the rest, or cut a line), the rest is appended, the
    journal fdatasynced and the ring reset. Zero bytes where the ring has
    data (a crash can leave a grown file unwritten) are cut, saved to
    ``recovery_dir`` like a torn tail, and the ring's data written instead.
    Anything else (other bytes, another inode whose file does not hold the
    data, a file shorter than ``start``) raises RingMismatch and changes
    nothing: an acknowledged event is never guessed away.
    """
    ring = Ring.open(ring_path, create=False)
    if ring is None:
        return 0
    try:
        # The common case, checked first without a digest: the journal (same
        # inode) already holds every byte that even the longest reading of
        # the ring's headers vouches for. The checked chain is a prefix of
        # that reading, so the full path below would find nothing to do too.
        vouched = ring.vouched()
        if vouched is None:
            return _no_chain(fd, path, ring, recovery_dir, persist)
        start, ino, data = vouched
        st = os.fstat(fd)
        if st.st_ino == ino and _holds(fd, st.st_size, start, data):
            _all_held(fd, path, start, data, ring, recovery_dir, persist)
            return 0
        entries = ring.scan()
        if not entries:
            return _no_chain(fd, path, ring, recovery_dir, persist)
        start, ino = entries[0].offset, entries[0].ino
        want = b"".join(e.data for e in entries)
        end = start + len(want)
        st = os.fstat(fd)
        size = st.st_size
        have = os.pread(fd, min(size, end) - start, start) if size > start else b""

        def refuse(why: str) -> RingMismatch:
            msg = (f"journal {path} disagrees with its write-ahead ring {ring_path}: {why}. The ring vouches "
                   f"for acknowledged journal bytes {start}..{end} of inode {ino}; both files are left as they "
                   "are and nothing is appended until they are reconciled by hand")
            log.error("%s", msg)
            return RingMismatch(msg)

        if st.st_ino != ino:
            if size >= end and have == want:
                log.info("journal %s: its ring %s belongs to an earlier file that held the same bytes; reset it",
                         path, ring_path)
                ring.reset()
                return 0
            raise refuse(f"the ring was written for inode {ino}, the journal is inode {st.st_ino}")
        if size < start:
            raise refuse(f"the journal has {size} bytes, fewer than the {start} it had made durable")
        if want.startswith(have):
            if size >= end:  # every acknowledged byte is in the journal (maybe only cached: keep the ring)
                _all_held(fd, path, start, want, ring, recovery_dir, persist)
                return 0
            cut = -1
            missing = want[len(have):]
        else:
            k = next(i for i, (x, y) in enumerate(zip(have, want)) if x != y)
            # From the first difference on, every byte the ring vouches for is
            # either the ring's byte or zero: pages a crash left unwritten,
            # possibly with later pages that did reach the disk. Anything else
            # is a disagreement. What the file holds past the ring's end was
            # never acknowledged: it goes to the recovery file with the rest.
            import numpy as np  # (here only: readers of a journal load no numpy)

            got = np.frombuffer(have, np.uint8, offset=k)
            ours = np.frombuffer(want, np.uint8, count=len(have), offset=0)[k:]
            if not bool(np.all((got == ours) | (got == 0))):
                differs = k + int(np.argmax((got != ours) & (got != 0)))
                raise refuse(f"they differ at journal byte {start + differs}")
            cut = start + k
            rest = os.pread(fd, size - cut, cut)
            dest = save_torn(recovery_dir, path, rest)
            log.warning("journal %s: %d bytes from offset %d, with pages a crash left unwritten (zeros), moved to %s",
                        path, len(rest), cut, dest)
            os.ftruncate(fd, cut)
            missing = want[k:]
        view = memoryview(missing)
        while view:
            view = view[os.write(fd, view):]
        fdatasync(fd)
        ring.reset(synced=(end, ino))
        log.warning("journal %s: restored %d bytes of acknowledged events from its write-ahead ring %s "
                    "(a crash had kept them from reaching the journal file)", path, len(missing), ring_path)
        return len(missing)
    finally:
        ring.close()


def _open_locked(path: str, *, shared: bool = False) -> int:
    """A descriptor of the journal at ``path`` with its flock held (shared:
    read-only, for a reader), following a rename over it while waiting."""
    while True:
        fd = os.open(path, (os.O_RDONLY if shared else os.O_RDWR | os.O_APPEND) | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            on_disk = os.stat(path)
            held = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        if (on_disk.st_ino, on_disk.st_dev) == (held.st_ino, held.st_dev):
            return fd
        os.close(fd)


def recover_journal(path: str, ring_path: str, recovery_dir: str) -> int:
    """Replay a journal's ring if it has one (see :func:`replay_ring`), under
    the journal's flock; return the bytes restored. For readers of the raw
    file (export, move, the mount) and for the store at open."""
    if not os.path.exists(ring_path):
        return 0
    try:
        fd = _open_locked(path)
    except FileNotFoundError:
        return 0
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        check_ring_read_only(path, ring_path, exc)
        return 0
    try:
        return replay_ring(fd, path, ring_path, recovery_dir)
    finally:
        os.close(fd)


def check_ring_read_only(path: str, ring_path: str, why: OSError) -> None:
    """For a reader that may not write the store (mounted read-only, another
    user's): nothing can be replayed, so make sure nothing needs to be. The
    journal must hold every byte its ring vouches for (checked chain), else
    RingMismatch says so instead of serving a journal short of acknowledged
    events. A ring this user may not read is logged and the journal read as
    it is (its owner's next open replays it)."""
    try:
        ring_fd = os.open(ring_path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except PermissionError as exc:
        log.warning("journal %s: its write-ahead ring cannot be read here (%s); the journal is read as it is",
                    path, exc)
        return
    ring = Ring(ring_path, ring_fd)
    try:
        vouched = ring.vouched()
        if vouched is None:
            return
        try:
            fd = _open_locked(path, shared=True)
        except FileNotFoundError:
            return
        try:
            size = os.fstat(fd).st_size
            if _holds(fd, size, vouched[0], vouched[2]):
                return
            entries = ring.scan()
            if not entries or _holds(fd, size, entries[0].offset, b"".join(e.data for e in entries)):
                return
        finally:
            os.close(fd)
    finally:
        ring.close()
    raise RingMismatch(f"journal {path} lacks acknowledged events that its write-ahead ring {ring_path} holds (a "
                       f"crash kept them from the journal file), and they cannot be replayed here: "
                       f"{why.strerror}. Open the store once where it is writable (any capsulefs command) to replay them")


@contextmanager
def holding_journal(path: str) -> Iterator[int | None]:
    """Hold the journal's flock (if there is a journal at ``path``: its
    descriptor, else None) while the caller removes it, the directory it is
    in, or renames a file over it: an appender that kept the flock since
    its last append (a lease, see journal_lease) checks nothing until it
    lets go, so nobody may pull the file from under it without the lock.
    The next append then finds the file gone, or follows the new one."""
    try:
        fd = _open_locked(path)
    except FileNotFoundError:
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def read_journal_locked(path: str, ring_path: str | None = None) -> bytes:
    """The journal's bytes, read under a shared flock: no append (appenders
    hold it exclusively) is half way through, and none that started before
    the read is left out. A rename over the file while waiting is followed.
    A move's snapshot relies on it (see ``archive.snapshot_files``).

    With ``ring_path`` (the journal's ring), what a reader sees: without the
    garbage a crash left past the ring's knowledge (see
    :func:`unacknowledged_from`), which stays in the file for a writer's
    open to move aside. (A torn tail is the caller's to leave out.)"""
    fd = _open_locked(path, shared=True)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        data = b"".join(chunks)
        if ring_path is not None and b"\0" in data:
            try:
                ring: Ring | None = Ring(ring_path, os.open(ring_path, os.O_RDONLY | os.O_CLOEXEC))
            except (FileNotFoundError, PermissionError):
                ring = None  # nothing known: the whole file, as it is
            if ring is not None:
                try:
                    bound = garbage_bound(ring, os.fstat(fd).st_ino)
                finally:
                    ring.close()
                if bound is not None and (cut := unacknowledged_from(data, bound)) is not None:
                    data = data[:cut]
        return data
    finally:
        os.close(fd)


@contextmanager
def replacing_journal(path: str, ring_path: str, recovery_dir: str) -> Iterator[None]:
    """Hold the journal's flock while the caller renames a new file over it.

    First the ring is replayed into the old file, the old file is made
    durable by itself and the ring reset: the ring's records can then never
    be replayed into the new file, and appenders that were waiting for the
    lock follow the new file (see ``Journal._follow_replacement``).
    """
    with holding_journal(path) as fd:
        if fd is not None and os.path.exists(ring_path):
            replay_ring(fd, path, ring_path, recovery_dir)
            fdatasync(fd)
            ring = Ring.open(ring_path, create=False)
            if ring is not None:
                try:
                    ring.reset()
                finally:
                    ring.close()
        yield


def forget_ring(ring_path: str) -> None:
    """Remove a ring whose journal is gone or not yet there (an agent removed
    from the store, or about to be installed)."""
    if remove_ring(ring_path):
        log.info("removed write-ahead ring %s", ring_path)
