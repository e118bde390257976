"""Appending to the journal: group commit, and durability in the journal
itself or in its write-ahead ring. :class:`Appender` is the second part of
a :class:`~capsulefs.core.journal.file.Journal`, after
:class:`~capsulefs.core.journal.follow.Follower`.

Rules:
  * An append is acknowledged only once it is durable: after an fdatasync
    of the journal, or, for a journal with a write-ahead ring (every agent
    of the host store), once the ring record that holds the same bytes is
    durable (one O_DIRECT|O_DSYNC write, or pwrite + fdatasync). One ``write`` carries a whole group of lines
    (:meth:`Journal.append_many`), and threads sharing a Journal share
    commits: the others queue while one writes and syncs.
  * A ring never vouches for less than the journal lacks: before the ring
    starts over at its offset 0 (full, or another process appended), the
    journal itself is fdatasynced (a checkpoint). Before a journal with a
    ring is read or appended to after a crash, the ring is replayed into it
    (:mod:`capsulefs.core.journal.recovery`).

Theory of operation (the write-ahead ring):
  Growing a file makes its fdatasync write the inode (the new size) after
  the data: two dependent writes. A ring (:mod:`capsulefs.core.journal.ring`)
  is a file of fixed size written in place, whose fdatasync writes data
  only. With one, an append writes its lines to the journal (O_APPEND, not
  synced: readers see them at once), then one record (header, checksum, the
  same bytes, their journal offset and inode) after the previous record in
  the ring, makes it durable (one O_DIRECT|O_DSYNC write of the pages it
  covers where the file system allows, else pwrite + fdatasync of the
  ring) and acknowledges. The ring's records form
  one chain, contiguous in journal offsets from its first record, whose
  offset is where the journal was last synced by itself. A Journal
  continues its own chain only if the journal still ends where its chain
  does and the ring still starts with the chain's first header; otherwise
  (another process appended, or reset or restarted the ring) it
  checkpoints: fdatasync of the journal, then a new chain at offset 0. A
  full ring is a checkpoint too, so the journal is synced about once per
  ring size of events.
  Recovery after a crash is :mod:`capsulefs.core.journal.recovery`'s.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections.abc import Iterable

from ..fsutil import fdatasync
from .events import Event
from .record import Record
from .follow import Follower
from .recovery import replay_ring
from .ring import Ring

log = logging.getLogger(__name__)


class Appender(Follower):
    """Appends (see the module's rules): the second part of a
    :class:`~capsulefs.core.journal.file.Journal`."""

    # -- appending -------------------------------------------------------------
    def append(self, event: Event) -> Record:
        """Stamp ``event``, append it durably, and return its record."""
        if self.machine is None:
            raise ValueError(f"journal {self.path} was opened read-only (no machine id)")
        with self._queue_lock:  # (the condition's lock, without its Python-level wrapper)
            alone = not self._leading and not self._pending
            if alone:
                self._leading = True
        if not alone:  # others are writing or queued: join the group commit
            return self.append_many((event,))[0]
        # Nobody else is appending through this Journal: lead a group of one
        # without the queue's bookkeeping. Threads arriving meanwhile queue
        # as they would behind any leader.
        try:
            return self._commit_alone(event)
        finally:
            with self._queue_lock:
                self._leading = False
                if self._waiting:
                    self._cond.notify_all()

    def _commit_alone(self, event: Event) -> Record:
        """:meth:`_commit` of a group of one event, raising its error
        directly (no request to settle)."""
        if self._broken is not None:
            raise self._refusal()
        self._acquire()
        ok = False
        try:
            records = self._state.plan((event,), machine=self.machine, now=self._now,  # type: ignore[arg-type]
                                       new_id=self._new_id)
            data = records[0].line + b"\n"
            start = self._size
            if self.ring_path is None:
                self._write_synced(data, start)
            else:
                self._commit_with_ring(data)
            self._state.take(records)
            self._size = start + len(data)
            self.commits += 1
            self.leased_commits += self._unchanged
            ok = True
            if self._size >= self._tip_due:
                self._save_tip()
            return records[0]
        finally:
            self._release(lease=ok)

    def append_many(self, events: Iterable[Event]) -> list[Record]:
        """Append a group of events with one write and one fdatasync (all or none).

        Group commit: while one thread writes and syncs, others queue their
        events; the next of them to lead writes every queued group with one
        write and one fdatasync. Each caller returns once its own events are
        durable, or raises; a bad event fails only its own caller.
        """
        events = list(events)
        if self.machine is None:
            raise ValueError(f"journal {self.path} was opened read-only (no machine id)")
        if not events:
            return []
        req = Request(events)
        with self._cond:
            self._pending.append(req)
            while self._leading and not req.done:
                self._waiting += 1
                try:
                    self._cond.wait()
                finally:
                    self._waiting -= 1
            if not req.done:
                self._leading = True
                group, self._pending = self._pending, []
        if not req.done:
            try:
                self._commit(group)
            finally:
                with self._cond:
                    self._leading = False
                    if self._waiting:
                        self._cond.notify_all()
        return req.result()

    def _commit(self, group: list["Request"]) -> None:
        """Write the queued groups of events as one; settle every request."""
        assert self.machine is not None
        try:
            if self._broken is not None:
                raise self._refusal()
            self._acquire()
            ok = False
            try:
                if len(group) == 1:  # the common case: plan on the state itself (plan changes nothing)
                    req = group[0]
                    state = None
                    try:
                        records = self._state.plan(req.events, machine=self.machine, now=self._now,
                                                   new_id=self._new_id)
                    except Exception as exc:  # a bad event fails its own request only
                        req.settle(error=exc)
                        return
                    planned = [(req, records)]
                    data = records[0].line + b"\n" if len(records) == 1 else b"".join(r.line + b"\n" for r in records)
                else:
                    state = self._state.copy()
                    planned = []
                    for req in group:
                        try:
                            records = state.plan(req.events, machine=self.machine, now=self._now,
                                                 new_id=self._new_id)
                        except Exception as exc:  # a bad event fails its own request only
                            req.settle(error=exc)
                            continue
                        state.take(records)
                        planned.append((req, records))
                    if not planned:
                        return
                    lines = [r.line for _req, records in planned for r in records]
                    lines.append(b"")
                    data = b"\n".join(lines)
                end = self._size + len(data)
                if self.ring_path is None:
                    self._write_synced(data, self._size)
                else:
                    self._commit_with_ring(data)
                if state is None:
                    self._state.take(records)
                else:
                    self._state = state
                self._size = end
                self.commits += 1
                self.leased_commits += self._unchanged
                ok = True
                for req, records in planned:
                    req.settle(records=records)
                if self._size >= self._tip_due:
                    self._save_tip()
            finally:
                self._release(lease=ok)
        except BaseException as exc:
            for req in group:
                if not req.done:
                    req.settle(error=exc)
            if not isinstance(exc, Exception):
                raise

    def _sync(self) -> None:
        """fdatasync the journal itself; a failure breaks this Journal (see ``_broken``)."""
        try:
            fdatasync(self._fd)
        except OSError as exc:
            self._broken = f"fdatasync failed: {exc}"
            log.error("journal %s: fdatasync failed (%s); no more appends until it is reopened", self.path, exc)
            raise

    def _commit_with_ring(self, data: bytes) -> None:
        """Write ``data`` to the journal without syncing it, then make it
        durable as one record of the ring (an overwrite in place). Caller
        holds both locks and is caught up."""
        assert self.ring_path is not None
        start = self._size
        ring = self._ring
        if ring is None:
            try:
                ring = self._ring = Ring.open(self.ring_path, create=True)
            except OSError as exc:
                log.warning("journal %s: cannot open its write-ahead ring %s (%s); syncing the journal itself",
                            self.path, self.ring_path, exc)
        if ring is None or not ring.holds(len(data)):
            # No ring, or a group larger than the whole ring: the journal's
            # own fdatasync; the next record restarts the ring (its chain no
            # longer ends here), and a chain already there stays a prefix.
            if ring is not None:
                ring.forget()
            self._write_synced(data, start)
            self.checkpoints += 1
            return
        assert self._id is not None
        ino = self._id[0]
        restart = not ring.continues(start, ino, unchanged=self._unchanged) or not ring.fits(len(data))
        if restart:
            if not ring.is_current():  # removed or replaced (the agent left and came back)
                ring.close()
                ring = self._ring = Ring.open(self.ring_path, create=True)
                assert ring is not None
            # Checkpoint: every byte before ``start`` (ours, or another
            # process's whose ring records we are about to overwrite) is made
            # durable in the journal itself before the ring starts over.
            self._sync()
            self.checkpoints += 1
        try:
            self._write_all(data)
        except BaseException:
            self._undo(start)
            raise
        try:
            ring.append(start, ino, data, restart=restart)
        except BaseException as exc:
            if isinstance(exc, OSError):  # the ring's write or fdatasync: its pages are in doubt now
                self._broken = f"writing the ring failed: {exc}"
                log.error("journal %s: writing its ring failed (%s); no more appends until it is reopened",
                          self.path, exc)
            ring.forget()
            self._undo(start)
            raise

    def _recover(self) -> None:
        """Replay the ring into the journal after a crash (see
        :func:`replay_ring`); refuse (RingMismatch) if they disagree. A
        writer also makes what the ring vouches for durable in the journal
        itself (``persist``): so reopening after a failed fdatasync is safe."""
        if self.ring_path is None:
            return
        if self._forked is not None:
            raise self._forked
        self._lock.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                self._follow_replacement()
                replay_ring(self._fd, self.path, self.ring_path, self.recovery_dir, persist=self.machine is not None)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._lock.release()

    def _write_all(self, data: bytes) -> None:
        n = os.write(self._fd, data)
        if n == len(data):
            return
        view = memoryview(data)[n:]
        while view:
            n = os.write(self._fd, view)
            if n <= 0:  # pragma: no cover - a regular file never does this
                raise OSError(errno.EIO, "short write", self.path)
            view = view[n:]

    def _write_synced(self, data: bytes, start: int) -> None:
        """Write ``data`` at the end (``start``) and fdatasync it; on any
        failure cut the file back to ``start`` (nothing was acknowledged)."""
        try:
            self._write_all(data)
            self._sync()
        except BaseException:
            self._undo(start)
            raise

    def _undo(self, size: int) -> None:
        # The group was not acknowledged: cut whatever part of it reached the file.
        try:
            os.ftruncate(self._fd, size)
        except OSError as exc:  # pragma: no cover - the next open moves it aside
            log.warning("journal %s: could not cut a failed append: %s", self.path, exc)

class Request:
    """One caller's events waiting for a group commit."""

    __slots__ = ("events", "done", "records", "error")

    def __init__(self, events: list[Event]) -> None:
        self.events = events
        self.done = False
        self.records: list[Record] = []
        self.error: BaseException | None = None

    def settle(self, *, records: list[Record] | None = None, error: BaseException | None = None) -> None:
        self.records = records or []
        self.error = error
        self.done = True

    def result(self) -> list[Record]:
        if self.error is not None:
            raise self.error
        return self.records
