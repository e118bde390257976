"""Keeping a journal's flock between appends: the lease.

An append takes the journal's flock, then asks the file who it is (is the
path still the file we hold?) and how long it is (did another process
append?), and reads the ring's first header (did another process restart
the ring?). Each of those questions is a system call, and right after the
previous append's device wait each one costs several times what it costs
hot. Every process that changes the journal or its ring, and everyone who
renames a file over it or removes it, holds the journal's flock while doing
so. So a Journal that never let the flock go since its last append knows
the answers already: nothing changed behind it.

That is the lease. After a successful commit a Journal keeps the flock
(:meth:`Journal._release` with ``lease=True``) and notes until when; its
next append within that time skips the flock, the identity and size checks
and the ring's header read. One thread per process, the :class:`Keeper`,
gives the flock back once a journal has been idle for ``IDLE`` seconds.

Rules:
  * A lease lasts ``IDLE`` after the last append, and never more than
    ``MAX_HOLD`` after the flock was taken (plus the commit then running): a process appending in a tight
    loop gives the flock back at least that often, so another process
    waiting for it (an appender, recovery, a replacement, a removal) waits
    at most about ``MAX_HOLD``.
  * The keeper takes a journal's thread lock only without blocking (an
    append in progress is looked at again later), and never holds its own
    lock while waiting for anything: it cannot deadlock with appenders.
  * Only a commit that succeeded keeps the lease; any failure, and any
    other use of the journal's locks, gives the flock back at once.
  * Only a run of appends takes a lease: an append that comes more than
    ``IDLE`` after the previous one gives the flock back at once, as
    before. A process that keeps the GIL for a long time (a long call into
    C) right after a run of appends delays the keeper, and so others, by
    that long.
  * A forked child forgets every lease (the open file, and so the flock,
    is shared with the parent): its journals ask the file again.
  * Appenders do not wake the keeper, except when they take a new lease.
    The keeper wakes at the deadline it knows; a journal whose lease was
    extended meanwhile tells it the new one.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

__all__ = ["IDLE", "MAX_HOLD", "Keeper", "Leaseholder", "keeper"]

#: Seconds a journal keeps its flock after its last append.
IDLE = 0.002
#: Seconds a journal keeps its flock at most, however often it appends.
MAX_HOLD = 0.005


class Leaseholder(Protocol):
    def _lease_over(self, now: float) -> float | None:
        """Give the flock back if the lease is over (without blocking on the
        journal's lock); None once given back, else the deadline to look again."""
        ...


class Keeper:
    """Gives back the flocks that journals keep between appends."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._cond = threading.Condition()
        self._held: dict[Leaseholder, float] = {}  # journal -> when to look at it again
        self._thread: threading.Thread | None = None

    def hold(self, journal: Leaseholder, deadline: float) -> None:
        """A journal takes a new lease, to end at ``deadline`` unless
        extended. Raises (and holds nothing) if the keeper cannot run."""
        with self._cond:
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="journal-lease-keeper", daemon=True)
                thread.start()  # RuntimeError if no thread can be started: no lease
                self._thread = thread
            self._held[journal] = deadline
            self._cond.notify()

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's keeper thread is not here, and
        the flocks the parent's leases kept are the parent's (the open file
        is shared): every journal here asks the file again at its next
        append. A journal lock the keeper held at the fork is freed."""
        for journal in self._held:
            journal._leased = False  # type: ignore[attr-defined]
            if journal._lock.locked():  # type: ignore[attr-defined]  # held by a thread that is not here
                journal._lock = threading.Lock()  # type: ignore[attr-defined]
        self._held.clear()

    def _run(self) -> None:
        with self._cond:
            while True:
                if not self._held:
                    self._cond.wait()
                    continue
                now = self.clock()
                due = min(self._held.values())
                if due > now:
                    self._cond.wait(due - now)
                    continue
                for journal, deadline in list(self._held.items()):
                    if deadline <= now:
                        again = journal._lease_over(now)
                        if again is None:
                            del self._held[journal]
                        else:
                            self._held[journal] = max(again, now + IDLE / 4)


_keeper = Keeper()


def keeper() -> Keeper:
    """The process's keeper."""
    return _keeper


def _after_fork() -> None:
    global _keeper
    _keeper.forget_after_fork()
    _keeper = Keeper()  # the parent's thread is not the child's


os.register_at_fork(after_in_child=_after_fork)
