"""What one open journal holds: the file, its paths, the chain state, the
lease and the group commit's queue. :class:`JournalState` is the base of
:class:`~capsulefs.core.journal.follow.Follower` (following the file),
:class:`~capsulefs.core.journal.append.Appender` (appending) and
:class:`~capsulefs.core.journal.file.Journal` (reading, opening): its
constructor is the one place each field is made and said; the parts add
methods only. Make a Journal with
:func:`~capsulefs.core.journal.file.open_journal`.

Rules:
  * A Journal belongs to the process that opened it (flock belongs to the
    open file description, which a forked child shares): in a forked child
    every use but close() raises JournalForked (:meth:`JournalState._forget_after_fork`).
  * A Journal whose write or fdatasync failed is broken: no more appends
    through it (:attr:`JournalState.broken`); reopening writes again what the
    ring vouches for.
"""

from __future__ import annotations

import errno
import os
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import CapsuleError
from ..linuxfs import identity_probe
from .chain import ChainState
from .lease import IDLE, MAX_HOLD
from .ring import Ring
from .tip import TIP_EVERY, Tip

if TYPE_CHECKING:
    from .append import Request

#: A size no journal reaches: the ``_tip_due`` of a journal without a tip.
NO_TIP = 1 << 62


class JournalForked(CapsuleError):
    """A Journal was used in a child forked from the process that opened it."""


class JournalState:
    """The fields of an open journal (see the module's rules)."""

    def __init__(
        self,
        path: str,
        fd: int,
        *,
        machine: str | None,
        now: Callable[[], float],
        new_id: Callable[[], str],
        recovery_dir: str,
        ring_path: str | None = None,
        tip_path: str | None = None,
    ) -> None:
        self.path = path
        self.machine = machine
        self.recovery_dir = recovery_dir
        self.ring_path = ring_path  # None: each append fdatasyncs the journal itself
        self.tip_path = tip_path  # None: no tip (see journal_tip): opening reads the whole file
        self._tip: Tip | None = None  # the tip on disk this Journal checked or wrote
        self._tip_due = TIP_EVERY if tip_path is not None else NO_TIP  # write a tip once _size reaches this
        self._ring: Ring | None = None  # opened (created) at the first append
        self._id: tuple[int, int] | None = None  # (st_ino, st_dev) of the file held
        self._identity = identity_probe(path)  # (st_ino, st_dev) of whatever ``path`` names now
        self._fd = fd
        self._now = now
        self._new_id = new_id
        self._lock = threading.Lock()
        self._state = ChainState()
        self._size = 0  # bytes of whole lines absorbed
        # Set when writing or syncing failed: Linux reports a failed write-back
        # once per file, so a retried fdatasync can return 0 over pages that
        # never reached the disk, and a ring restarted after it would overwrite
        # the only durable copy. No more appends through this object: reopen
        # (which writes what the ring vouches for again and syncs it) to go on.
        self._broken: str | None = None
        # The lease (see journal_lease): the flock kept since our last commit,
        # until _lease_end (at most _lease_start + MAX_HOLD). Guarded by _lock.
        self._leased = False
        self._lease_start = 0.0
        self._lease_end = 0.0
        self._lease_pause = False  # the lease just ended at MAX_HOLD: the next commit takes none
        self._last_commit = float("-inf")  # keeper clock at the end of our last commit
        self.lease_idle = IDLE  # seconds the flock is kept after an append in a run of them
        self.lease_max = MAX_HOLD  # ... and at most after it was taken
        self._unchanged = False  # this holder of the lock found the lease held: nothing changed behind us
        self.leased_commits = 0  # commits that found the lease held (no flock or checks)
        self._pid = os.getpid()  # the process that opened it; a forked child may not use it
        self._forked: JournalForked | None = None  # set in a forked child (see _forget_after_fork)
        # Appending (:class:`~capsulefs.core.journal.append.Appender`): the group commit's queue.
        self._queue_lock = threading.Lock()
        self._cond = threading.Condition(self._queue_lock)  # guards _pending, _leading and _waiting
        self._pending: list[Request] = []  # events queued for the next group commit
        self._leading = False  # a thread is writing a group
        self._waiting = 0  # threads waiting for a group commit (notify only if any)
        self.commits = 0  # groups written (one write and one fdatasync each)
        self.checkpoints = 0  # fdatasyncs of the journal itself made by appends with a ring
        _open_journals.add(self)

    @property
    def broken(self) -> str | None:
        """Why appends through this object stopped (a failed write or
        fdatasync), or None: reopen the journal to append again."""
        return self._broken

    def _refusal(self) -> Exception:
        """The error for an append through a Journal that may not append any more."""
        if self._forked is not None:
            return self._forked
        return OSError(errno.EIO, f"journal {self.path}: an earlier append failed ({self._broken}); "
                                  f"reopen the journal to append again")

    def _forget_after_fork(self) -> None:
        """In a forked child. flock belongs to the open file description,
        which the child shares with its parent: both would hold the lock and
        could interleave appends (or one cut the other's line in progress as
        a torn tail). The rest of the object (thread locks, the group-commit
        queue, the ring's page image, the lease) is the parent's at an
        arbitrary instant, maybe mid-append. So it is not reopened behind the
        caller's back: every use but close() raises, and the child opens its
        own Journal. Set here, checked where an append already checks
        ``_broken``: nothing is added to the append path."""
        self._forked = JournalForked(
            f"journal {self.path} was opened by process {self._pid} and used in process {os.getpid()}, a child "
            f"forked from it: the two share the open file and so its flock, which then serializes nothing; "
            f"open the journal again in this process")
        self._broken = self._broken or "used in a forked child"


#: Every Journal open in this process, for :func:`_after_fork`.
_open_journals: "weakref.WeakSet[JournalState]" = weakref.WeakSet()


def _after_fork() -> None:
    for journal in list(_open_journals):
        journal._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork)
