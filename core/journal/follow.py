"""The journal file a :class:`~capsulefs.core.journal.file.Journal` holds,
and following it: locks, the lease, catching up with other writers, the
tip, a file renamed over the path, a torn tail. :class:`Follower` is the
first part of a Journal; :class:`~capsulefs.core.journal.append.Appender`
adds appending to it, and :class:`~capsulefs.core.journal.file.Journal`
reading and opening.

Rules:
  * A Journal belongs to the process that opened it: flock belongs to the
    open file description, which a forked child shares, so a child's use of
    an inherited Journal (appends, catching up) raises JournalForked; the
    child opens its own.
  * A file that does not end with a newline has a torn tail: bytes of an
    append that crashed before it was acknowledged. A writer's open (or
    catch-up) moves that tail into a recovery file outside the capsule and
    logs a warning. It is never kept, never dropped silently. A reader (no
    machine id) writes nothing: it reads the whole lines only, and stops
    before a line holding NUL bytes, leaving both for a writer's open.

Theory of operation (following the file):
  Appenders on one host are serialized by ``flock`` on the journal file
  itself (no lock file to leak into the capsule) plus a thread lock. Each
  :class:`Journal` keeps the chain state (per-machine tails, greatest clock,
  size of the whole lines) in memory. Under the lock it compares the file's
  size with the size it knows: if another process appended, it reads only
  the new bytes and absorbs them before stamping. So an append costs a
  statx of the path (the inode only: see ``linuxfs.path_identity``) and an
  lseek, one write and one fdatasync, whatever the journal's length.
  If another file was renamed over the journal's path (by someone holding
  the old file's flock), the Journal follows it: nothing is appended to an
  unlinked file. With a tip (:mod:`capsulefs.core.journal.tip`), a Journal
  that knows nothing yet (opening, or after a replacement) starts from the
  tip on disk when it matches the file, and writes a new one every
  ``TIP_EVERY`` bytes: opening costs the bytes after the tip, not the history.

  The lease (:mod:`capsulefs.core.journal.lease`): after a commit that
  succeeded the Journal keeps the flock, for ``IDLE`` seconds after its
  last append and ``MAX_HOLD`` at most, and its next append within that
  time asks the file only its size (a writer outside the rules is still
  seen): no flock, no statx, no read of the ring's header. Whoever appends,
  replays the ring, renames a file over the journal or removes it holds
  the flock, so none of them can have acted meanwhile. A thread per
  process gives idle leases back.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from typing import Self

from ..errors import FormatError, NotFoundError
from .chain import ChainState
from .events import line_hash
from .held import NO_TIP, JournalState
from .lease import keeper
from .recovery import replay_ring, save_torn
from .tip import TIP_EVERY, advance_tip, checked_tip, save_tip

log = logging.getLogger(__name__)

#: Catching up with at least this many bytes is done in bulk (vectorised).
BULK_CATCH_UP = 1 << 20
#: Catching up reads the file in pieces of this size (more for a longer line).
CATCH_UP_PIECE = 256 << 20


class Follower(JournalState):
    """The journal file held and followed (see the module's rules): the
    first part of a :class:`~capsulefs.core.journal.file.Journal`."""

    # -- lifecycle ---------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._leased and self._fd >= 0:
                # Closing the descriptor would not free the flock if a forked
                # child still holds the same open file.
                self._leased = False
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            if self._ring is not None:
                self._ring.close()
                self._ring = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._fd < 0

    # -- locking and catching up ------------------------------------------------
    def _locked(self) -> "_Locked":
        return _Locked(self)

    def _acquire(self) -> None:
        """Take both locks and catch up with the file (see :class:`_Locked`).
        Under a lease the flock is ours already and nothing changed since
        our last commit (see journal_lease): nothing to ask the file."""
        if self._fd < 0:
            raise ValueError(f"journal {self.path} is closed")
        self._lock.acquire()
        if self._leased:  # (close() ends the lease under the lock)
            # Still one system call: the size. Every writer that follows the
            # rules holds the flock, but one that does not (a tool appending
            # to the file by hand, a write torn by a crash outside the rules)
            # must still be seen before we write after it.
            try:
                unchanged = os.lseek(self._fd, 0, os.SEEK_END) == self._size
            except BaseException:
                self._lock.release()
                raise
            if unchanged:
                self._unchanged = True
                return
            self._leased = False  # the full checks below, with the flock we hold
        self._unchanged = False
        try:
            if self._fd < 0:  # closed while we waited for the lock
                raise ValueError(f"journal {self.path} is closed")
            if self._forked is not None:  # (a child forgot every lease: appends get here)
                raise self._forked
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                size = self._follow_replacement()
                if size != self._size:
                    self._catch_up(size)
            except BaseException:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                raise
        except BaseException:
            self._lock.release()
            raise

    def _release(self, *, lease: bool = False) -> None:
        """Give both locks back; with ``lease`` (a commit that succeeded),
        maybe keep the flock for the next append (see journal_lease)."""
        try:
            keep = False
            try:
                keep = lease and self._keep_lease()
            finally:
                if not keep:
                    self._leased = False
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._lock.release()

    def _keep_lease(self) -> bool:
        """After a commit that succeeded: whether to keep the flock (and
        until when). Only appends that follow each other closely take a
        lease: a lone append gives the flock back at once, as it always did."""
        now = keeper().clock()
        last, self._last_commit = self._last_commit, now
        if self._leased:
            if now < self._lease_start + self.lease_max:
                self._lease_end = min(now + self.lease_idle, self._lease_start + self.lease_max)
                return True
            # Held long enough: give others their chance, twice (now, and
            # after the next commit, which takes no lease).
            self._lease_pause = True
            return False
        if self._lease_pause:
            self._lease_pause = False
            return False
        if now - last > self.lease_idle:  # not in a run of appends
            return False
        try:
            keeper().hold(self, now + self.lease_idle)
        except Exception as exc:  # e.g. no thread can be started: no lease, the commit stands
            log.warning("journal %s: no lease (%s); giving the flock back after each append", self.path, exc)
            return False
        self._leased = True
        self._lease_start = now
        self._lease_end = now + self.lease_idle
        return True

    def _lease_over(self, now: float) -> float | None:
        """For the keeper: give the flock back if the lease is over. Never
        blocks on the journal's lock (an append in progress: look again)."""
        if not self._lock.acquire(blocking=False):
            return now + self.lease_idle
        try:
            if not self._leased:
                return None
            if now < self._lease_end:
                return self._lease_end
            self._leased = False
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            return None
        finally:
            self._lock.release()

    def _catch_up(self, size: int) -> None:
        """Absorb whatever other writers appended; move a torn tail aside.
        ``size`` is the file's current size. Caller holds both locks."""
        if size == self._size:
            return
        if size < self._size or not self._last_line_unchanged():
            # Only a torn tail (never part of _size) is ever cut; a shorter
            # file, or one whose last line we knew is gone, was rewritten
            # behind our back (same inode: a rename is followed before this):
            # start over, or an append would chain onto lines no longer there.
            if size < self._size:
                log.warning("journal %s shrank from %d to %d bytes; re-reading it", self.path, self._size, size)
            else:
                log.warning("journal %s was rewritten in place: its line ending at byte %d is no longer the one "
                            "this process read or wrote there; re-reading it", self.path, self._size)
            if self.ring_path is not None:
                # As opening does: acknowledged bytes the cut took are put
                # back from the ring, or appending is refused (RingMismatch),
                # before a restarted ring could overwrite their only copy.
                replay_ring(self._fd, self.path, self.ring_path, self.recovery_dir)
                size = os.lseek(self._fd, 0, os.SEEK_END)
            self._forget_state()
        if self._size == 0 and self.tip_path is not None:
            self._start_from_tip(size)
        self._read_new(size)
        if self._size >= self._tip_due:
            self._save_tip()

    def _forget_state(self) -> None:
        """Start over from an empty file (then from the tip on disk, if it
        matches the file). Caller holds both locks."""
        self._state = ChainState()
        self._size = 0
        self._tip = None
        self._tip_due = TIP_EVERY if self.tip_path is not None else NO_TIP

    def _start_from_tip(self, size: int) -> None:
        """Take the state from the tip on disk if it describes this file
        (see journal_tip): catching up then reads only the bytes after it.
        Caller holds both locks; ``_size`` is 0."""
        assert self.tip_path is not None
        tip = checked_tip(self._fd, self.tip_path, size)
        if tip is None:
            return
        self._state = tip.chain_state()
        self._size = tip.size
        self._tip = tip
        self._tip_due = tip.size + TIP_EVERY

    def _save_tip(self) -> None:
        """Write the tip of what this Journal knows (see journal_tip), the
        old one advanced over the bytes since. Never raises: a tip is an
        optimisation. Caller holds both locks."""
        assert self.tip_path is not None
        self._tip_due = self._size + TIP_EVERY
        try:
            tip = advance_tip(self._fd, self._tip, self._state, self._size)
            save_tip(self.tip_path, tip)
        except Exception as exc:
            quiet = isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
            (log.info if quiet else log.warning)("journal %s: could not write its tip %s: %s",
                                                 self.path, self.tip_path, exc)
            return
        self._tip = tip

    def _read_new(self, size: int) -> None:
        """Absorb the file's bytes from ``_size`` to ``size``. Caller holds both locks."""
        # In pieces: one read() returns at most 2 GiB - 4 KiB, and a short
        # read taken for the whole file made a torn tail of the line it
        # stopped in. A piece's partial last line is read again with the
        # next one; only what is left at the file's end is a torn tail.
        want = CATCH_UP_PIECE
        while self._size < size:
            data = os.pread(self._fd, min(size - self._size, want), self._size)
            end = data.rfind(b"\n") + 1
            if self._size + len(data) >= size:
                if end < len(data) and self.machine is not None:  # a reader leaves it (and does not read it)
                    self._move_torn_tail(self._size + end, data[end:])
                self._absorb(data, end)
                return
            if not data:  # pragma: no cover - the file shrank under the flock (a writer outside the rules)
                return
            if not end:  # a line longer than the piece: read it whole
                if len(data) < want:
                    raise FormatError(f"{self.path}: line {self._state.count + 1} is longer than {len(data)} bytes")
                want *= 2
                continue
            if not self._absorb(data, end):
                return

    def _last_line_unchanged(self) -> bool:
        """Whether the file still holds, right before ``_size``, the last line
        this Journal read or wrote: a cheap check (one short ``pread`` and a
        hash, only when catching up with a file that grew) that its prefix
        was not rewritten in place. An edit that leaves the last line as it
        was is not seen here (``verify`` reports it). Caller holds both locks."""
        last = self._state.last
        if last is None or self._size == 0:
            return True
        want = self._state.tails[last[1]].digest
        window = 4096
        while True:
            start = max(0, self._size - 1 - window)
            data = os.pread(self._fd, self._size - start, start)
            if len(data) != self._size - start or not data.endswith(b"\n"):
                return False
            nl = data.rfind(b"\n", 0, len(data) - 1)
            if nl >= 0 or start == 0:
                return line_hash(data[nl + 1 : -1]) == want
            window *= 4

    def _absorb(self, data: bytes, end: int) -> bool:
        """Absorb the whole lines ``data[:end]``, which start at ``_size``.
        False if a reader stopped before a line holding NUL bytes (see
        below): nothing after it is read. Caller holds both locks."""
        start = 0
        base_no = self._state.count
        state = self._state
        if end >= BULK_CATCH_UP and state.absorb_bulk(data[:end]):
            self._size += end
            return True
        while start < end:
            nl = data.index(b"\n", start)
            try:
                state.absorb(data[start:nl])
            except FormatError as exc:
                # Stop at the last good line: appending after a line we cannot
                # read would stamp a wrong chain. verify names the line too.
                self._size += start
                no = base_no + 1 + _count_lines(data, start)
                if self.machine is None and b"\0" in data[start:nl]:
                    # Pages a crash left unwritten in an append never
                    # acknowledged (or damage): a writer's open decides which
                    # and moves them aside. A reader writes nothing: it shows
                    # the lines before, as it leaves a torn tail unread.
                    log.warning("journal %s: line %d holds NUL bytes (pages a crash left unwritten, or damage); "
                                "reading stops before it, and the file is left to a writer's open", self.path, no)
                    return False
                raise FormatError(f"{self.path}: line {no}: {exc}") from None
            start = nl + 1
        self._size += end
        return True

    def _follow_replacement(self) -> int:
        """If another file was renamed over the journal's path (whoever does
        that holds the old file's flock while renaming), switch to it: an
        append to the old, unlinked file would be lost. Caller holds the
        thread lock and the flock of the current descriptor. Returns the
        size of the file now held.

        No stat of the journal here: asking for a file's timestamps makes
        its next write take a fine-grained one (Linux multigrain
        timestamps), which then gives the ring a new mtime on every write
        and its fdatasync an inode to write (see ``linuxfs.path_identity``)."""
        try:
            on_disk = self._identity()
        except FileNotFoundError:
            raise NotFoundError(f"journal {self.path} was removed; refusing to append to a deleted file") from None
        if self._id is None:
            held = os.fstat(self._fd)
            self._id = (held.st_ino, held.st_dev)
        if on_disk == self._id:
            return os.lseek(self._fd, 0, os.SEEK_END)
        log.info("journal %s was replaced; following the new file", self.path)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        old, self._fd = self._fd, fd
        os.close(old)  # releases the old file's flock
        self._forget_state()
        held = os.fstat(fd)
        self._id = (held.st_ino, held.st_dev)
        return held.st_size

    def _move_torn_tail(self, offset: int, tail: bytes) -> None:
        dest = save_torn(self.recovery_dir, self.path, tail)  # saved durably before the journal is cut
        os.ftruncate(self._fd, offset)
        os.fsync(self._fd)
        log.warning(
            "journal %s: torn tail of %d bytes at offset %d was never acknowledged; moved it to %s",
            self.path, len(tail), offset, dest,
        )

    def refresh(self) -> int:
        """Catch up with appends of other processes; return the size."""
        with self._locked():
            return self._size


class _Locked:
    """Both locks held, and the state caught up with the file."""

    __slots__ = ("_j",)

    def __init__(self, journal: Follower) -> None:
        self._j = journal

    def __enter__(self) -> None:
        self._j._acquire()

    def __exit__(self, *exc: object) -> None:
        self._j._release()


def _count_lines(data: bytes, end: int) -> int:
    return data.count(b"\n", 0, end)
