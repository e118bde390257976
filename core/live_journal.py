"""The journal as the mount needs it: append stamped events durably, watch it grow.

Rules:
  * Appending takes validated events (:func:`capsulefs.core.events.parse_draft`
    made them), stamps each (id, machine, seq, clock, prev, time) and writes
    them with one ``write`` on an O_APPEND descriptor, then fsyncs, all under
    an exclusive flock on the journal file, so several appenders (this
    daemon, the CLI, the agent runtime) never interleave or fork a chain.
    A batch is all-or-nothing as far as validation goes: nothing is written
    unless every event was valid.
  * :class:`JournalTail` follows the file as it grows: it hashes only the
    new bytes, only up to the last newline (a line being written is not yet
    part of the journal), and starts over if the file was replaced or shrank.

Theory of operation: this module is the mount's one seam to the journal. The
stamping mirrors the canonical journal module (``capsulefs.core.journal``,
owned by the journal work); when that module offers an equivalent appender,
:func:`open_appender` hands out that one instead and this fallback goes.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .errors import FormatError
from .events import Event, ModelSwitch, Record, line_hash

try:  # the canonical journal, from the journal work
    from .journal import Journal as _Journal, open_journal as _open_journal
except ImportError:  # pragma: no cover - until it lands
    _Journal = None  # type: ignore[assignment,misc]
    _open_journal = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

READ_CHUNK = 1 << 20


def iso_time(now_ns: int) -> str:
    t = _dt.datetime.fromtimestamp(now_ns / 1e9, tz=_dt.timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


@dataclass(slots=True)
class _ChainState:
    ino: int = -1
    scanned: int = 0  # bytes of whole lines taken into account
    clock: int = 0  # highest clock seen
    seq: int = 0  # this machine's last seq
    prev: str | None = None  # sha256 of this machine's last line


class Appender:
    """Appends events to one journal file for one machine (host)."""

    def __init__(
        self,
        path: str,
        *,
        machine: str,
        new_id: Callable[[], str],
        now_ns: Callable[[], int],
    ) -> None:
        self.path = path
        self.machine = machine
        self._new_id = new_id
        self._now_ns = now_ns
        self._state = _ChainState()
        self._machine_key = f'"machine":"{machine}"'.encode()

    def _catch_up(self, fd: int) -> None:
        st = os.fstat(fd)
        s = self._state
        if st.st_ino != s.ino or st.st_size < s.scanned:
            self._state = s = _ChainState(ino=st.st_ino)
        if st.st_size == s.scanned:
            return
        os.lseek(fd, s.scanned, os.SEEK_SET)
        pending = b""
        while chunk := os.read(fd, READ_CHUNK):
            pending += chunk
            end = pending.rfind(b"\n")
            if end < 0:
                continue
            for line in pending[:end].split(b"\n"):
                self._account(line)
            s.scanned += end + 1
            pending = pending[end + 1:]

    def _account(self, line: bytes) -> None:
        if not line:
            return
        rec = Record.from_line(line)
        s = self._state
        s.clock = max(s.clock, rec.clock)
        if rec.machine == self.machine and rec.seq > s.seq:
            s.seq = rec.seq
            s.prev = line_hash(line)

    def close(self) -> None:
        pass

    def append(self, events: Sequence[Event]) -> list[Record]:
        """Stamp and durably append ``events``; return their records."""
        if not events:
            return []
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        rfd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._catch_up(rfd)
            s = self._state
            records = []
            clock, seq, prev = s.clock, s.seq, s.prev
            for ev in events:
                clock += 1
                seq += 1
                rec = Record(
                    id=self._new_id(), machine=self.machine, seq=seq, clock=clock,
                    prev=prev, time=iso_time(self._now_ns()), event=ev,
                )
                prev = rec.digest
                records.append(rec)
            data = b"".join(r.line + b"\n" for r in records)
            n = os.write(fd, data)
            if n != len(data):  # pragma: no cover - a local fs writes all or fails
                raise OSError(f"short write to {self.path}: {n} of {len(data)} bytes")
            os.fsync(fd)
            s.clock, s.seq, s.prev = clock, seq, prev
            s.scanned += len(data)
            return records
        finally:
            os.close(rfd)
            os.close(fd)  # releases the flock


class JournalTail:
    """Follows a journal file: digest and served size of its whole lines."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._ino = -1
        self._size = 0  # bytes of whole lines hashed
        self._h = hashlib.sha256()
        self._lines = 0
        self.model: tuple[str, str] | None = None  # last model_switch (provider, model)
        self.mtime_ns = 0

    def refresh(self) -> None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            st = None
        if st is None:
            self._reset(-1)
            return
        self.mtime_ns = st.st_mtime_ns
        if st.st_ino != self._ino or st.st_size < self._size:
            self._reset(st.st_ino)
        if st.st_size == self._size:
            return
        with open(self.path, "rb") as f:
            f.seek(self._size)
            data = f.read(st.st_size - self._size)
        end = data.rfind(b"\n")
        if end < 0:
            return
        whole = data[: end + 1]
        self._h.update(whole)
        self._size += len(whole)
        for line in whole.splitlines():
            self._lines += 1
            if b'"kind":"model_switch"' in line:
                self._note_model(line)

    def _note_model(self, line: bytes) -> None:
        try:
            ev = Record.from_line(line).event
        except FormatError:  # a bad line is the journal verifier's business
            return
        if isinstance(ev, ModelSwitch):
            self.model = (ev.provider, ev.model)

    def _reset(self, ino: int) -> None:
        self._ino = ino
        self._size = 0
        self._lines = 0
        self._h = hashlib.sha256()
        self.model = None

    @property
    def size(self) -> int:
        return self._size

    @property
    def events(self) -> int:
        return self._lines

    def sha256(self) -> str:
        return self._h.copy().hexdigest()


class JournalAppender:
    """The canonical journal (``capsulefs.core.journal``) behind the same face."""

    def __init__(self, journal: "_Journal") -> None:
        self.journal = journal

    def append(self, events: Sequence[Event]) -> list[Record]:
        return self.journal.append_many(events)

    def close(self) -> None:
        self.journal.close()


def open_appender(
    journal_path: str,
    *,
    machine: str,
    new_id: Callable[[], str],
    now_ns: Callable[[], int],
    recovery_dir: str,
) -> "Appender | JournalAppender":
    """An appender for one journal: the canonical journal's if it is there."""
    if _open_journal is None:  # pragma: no cover - only until the journal module lands
        return Appender(journal_path, machine=machine, new_id=new_id, now_ns=now_ns)
    j = _open_journal(journal_path, machine=machine, now=lambda: now_ns() / 1e9, new_id=new_id,
                      recovery_dir=recovery_dir, create=False)
    return JournalAppender(j)
