"""The journal: one immutable event per line, hash-chained per machine,
ordered across machines by a Lamport clock, merged by set union.

This module owns the journal *file*: :class:`Journal`, made of three parts
each adding to the one before, and :func:`open_journal` and
:func:`open_agent_journal`. The journal's modules:

  * :mod:`capsulefs.core.journal.follow`: the file held and followed
    (locks, the lease, catching up with other writers, the tip, a file
    renamed over the path, a torn tail), :class:`Follower`;
  * :mod:`capsulefs.core.journal.append`: group commit and durability
    (the write-ahead ring), :class:`Appender`;
  * this module: reading, and :class:`Journal` itself; drafts' lines;
  * :mod:`capsulefs.core.journal.events`: the events and records;
  * :mod:`capsulefs.core.journal.lines`: the lines as bytes (envelope,
    split and join, verify, the reference merge);
  * :mod:`capsulefs.core.journal.chain`: stamping (``ChainState``);
  * :mod:`capsulefs.core.journal.recovery`: replaying the ring after a
    crash, torn-tail files, replacing a journal, where rings live;
  * :mod:`capsulefs.core.journal.ring`: the ring file itself;
  * :mod:`capsulefs.core.journal.lease`: the flock kept between appends;
  * :mod:`capsulefs.core.journal.envelope_index`: the vectorised merge;
  * :mod:`capsulefs.core.journal.tip`: the tip, so that opening need not
    read the history.

Rules (each module states its own): an append is acknowledged only once it
is durable; a Journal belongs to the process that opened it; a torn tail is
moved to a recovery file, never kept or dropped silently.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..capsule import format as fmt
from ..errors import FormatError
from ..fsutil import fsync_dir
from .append import Appender
from .chain import Tail
from .events import Event, parse_draft
from .record import Record
from .lines import split_lines
from .recovery import RingMismatch, agent_recovery_dir, journal_ring_path
from .tip import journal_tip_path

__all__ = ["Journal", "open_agent_journal", "open_journal", "parse_draft_lines"]


class Journal(Appender):
    """An open journal file. Make one with :func:`open_journal`.

    Thread-safe, and safe against other processes using their own Journal on
    the same file. ``machine`` may be None for a read-only use (no appends).
    Not usable in a forked child (:class:`JournalForked`): open it again there.
    """

    def append_drafts(self, data: bytes) -> list[Record]:
        """Validate lines of draft events (kind + fields, as users and
        scripts write them) and append them all, or none if one is bad."""
        return self.append_many(parse_draft_lines(data))


    # -- reading ------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Bytes of whole lines this Journal knows (see :meth:`refresh`)."""
        return self._size

    @property
    def count(self) -> int:
        """Number of lines this Journal knows."""
        return self._state.count

    @property
    def clock(self) -> int:
        """The greatest clock in the journal."""
        return self._state.clock

    def tail(self, machine: str) -> Tail | None:
        return self._state.tails.get(machine)

    def read(self, offset: int = 0, size: int | None = None) -> bytes:
        """Bytes of whole lines only, from ``offset`` (never a torn tail)."""
        if self._fd < 0:
            raise ValueError(f"journal {self.path} is closed")
        end = self._size if size is None else min(self._size, offset + max(size, 0))
        if offset >= end:
            return b""
        data = os.pread(self._fd, end - offset, offset)
        if len(data) < end - offset:  # one read() returns at most 2 GiB - 4 KiB
            pieces = [data]
            while (offset := offset + len(pieces[-1])) < end and pieces[-1]:
                pieces.append(os.pread(self._fd, end - offset, offset))
            data = b"".join(pieces)
        return data

    def lines(self) -> list[bytes]:
        return split_lines(self.read())

    def records(self) -> list[Record]:
        return [Record.from_line(line) for line in self.lines()]


def open_journal(
    path: str | os.PathLike[str],
    *,
    machine: str | None,
    now: Callable[[], float],
    new_id: Callable[[], str],
    recovery_dir: str | os.PathLike[str],
    create: bool = True,
    ring_path: str | os.PathLike[str] | None = None,
    tip_path: str | os.PathLike[str] | None = None,
) -> Journal:
    """Open (or create) a journal file and catch up with it.

    ``machine`` is this host's id (None: read-only). ``now`` gives Unix
    seconds, ``new_id`` a fresh event id (24 hex). A writer moves a torn
    tail to ``recovery_dir`` (a reader leaves it), which must lie outside the capsule so that the capsule
    still verifies. With ``ring_path`` (a file outside the capsule, see
    :mod:`capsulefs.core.journal.ring`), appends are made durable in that
    write-ahead ring, and opening first replays it into the journal if a
    crash left the journal behind; a journal that disagrees with its ring
    raises RingMismatch when opened for appending (read-only, it is logged
    and the journal is read as it is). With ``tip_path`` (a file outside the
    capsule, see :mod:`capsulefs.core.journal.tip`), opening starts from the
    tip saved there if it matches the file, and reads only the bytes after
    it; the Journal writes a new tip every ``TIP_EVERY`` bytes it reads or
    appends. Use it as a context manager, or call ``close()``.
    """
    path = os.fspath(path)
    flags = os.O_RDWR | os.O_APPEND | os.O_CLOEXEC
    created = False
    if create:
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
            created = True
        except FileExistsError:
            fd = os.open(path, flags)
    else:
        fd = os.open(path, flags)
    if created:
        fsync_dir(os.path.dirname(path) or ".")
    journal = Journal(path, fd, machine=machine, now=now, new_id=new_id, recovery_dir=os.fspath(recovery_dir),
                      ring_path=None if ring_path is None else os.fspath(ring_path),
                      tip_path=None if tip_path is None else os.fspath(tip_path))
    try:
        try:
            journal._recover()
        except RingMismatch:
            if machine is not None:
                raise
            journal.ring_path = None  # read-only: show the journal as it is, write nothing
        journal.refresh()
    except BaseException:
        journal.close()
        raise
    return journal


def open_agent_journal(
    agent: Any,
    *,
    machine: str | None,
    now: Callable[[], float],
    new_id: Callable[[], str],
) -> Journal:
    """Open the journal of an agent of the host store (an ``AgentHandle``)."""
    from ..capsule.format import JOURNAL

    return open_journal(
        agent.path(JOURNAL),
        machine=machine,
        now=now,
        new_id=new_id,
        recovery_dir=agent_recovery_dir(agent.store.root, agent.agent_id),
        create=False,
        ring_path=journal_ring_path(agent.store.root, agent.agent_id),
        tip_path=journal_tip_path(agent.store.root, agent.agent_id),
    )


def parse_draft_lines(data: bytes, what: str = "draft", *, first: int = 1) -> list[Event]:
    """Parse newline-separated draft events (one JSON object a line, as
    scripts and ``echo >>`` write them); all valid or FormatError naming the
    line (``what`` names them: "draft", or "journal" for writes through the mount;
    ``first`` is the number of the first line, for a caller reading line by line)."""
    if not data.endswith(b"\n"):
        raise FormatError(f"{what} events must be whole lines, each ending with a newline")
    events = []
    for no, raw in enumerate(data[:-1].split(b"\n"), first):
        if not raw.strip():
            raise FormatError(f"{what} line {no} is empty")
        obj = fmt.load_json(raw, f"{what} line {no}")
        try:
            events.append(parse_draft(obj))
        except FormatError as exc:
            raise FormatError(f"{what} line {no}: {exc}") from None
    return events
