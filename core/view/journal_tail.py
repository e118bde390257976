"""The journal as the mount needs it: append durably, and follow it as it grows.

Rules:
  * Appending is the canonical journal's (:mod:`capsulefs.core.journal.file`):
    events are stamped (id, machine, seq, clock, prev, time) and written
    under its locks with one write per group, made durable by one fdatasync
    (of the agent's write-ahead ring, for the store's agents), so several
    appenders (this daemon, the CLI, the agent runtime) never interleave or
    fork a chain. A group is all or nothing.
  * :class:`JournalTail` follows the file for the served manifest: it
    hashes only the new bytes, only up to the last newline (a line being
    written is not yet part of the journal), and starts over if the file
    was replaced or shrank. It starts from the journal's tip (see
    :mod:`capsulefs.core.journal.tip`) when the tip matches the file and
    holds a running digest: then even its first look reads only the bytes
    appended since the tip. It never writes.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from typing import Protocol, Self

from ..errors import FormatError
from ..journal.events import ModelSwitch
from ..journal.record import Record
from ..journal.file import Journal, open_journal
from ..journal.tip import checked_tip


class _Hash(Protocol):
    """What the tail needs of a running sha256: hashlib's, or a ``Sha256State`` resumed from the tip."""

    def update(self, data: bytes, /) -> None: ...

    def copy(self) -> Self: ...

    def hexdigest(self) -> str: ...

log = logging.getLogger(__name__)

READ_CHUNK = 8 << 20


class JournalTail:
    """Follows a journal file: digest and served size of its whole lines."""

    def __init__(self, path: str, *, chunk: int = READ_CHUNK, tip_path: str | None = None) -> None:
        self.path = path
        self.chunk = chunk  # read the growth in pieces of this size
        self.tip_path = tip_path  # the journal's tip, to start from (None: hash the whole file)
        self._ino = -1
        self._size = 0  # bytes of whole lines hashed
        self._h: _Hash = hashlib.sha256()  # (or a sha256_state.Sha256State resumed from the tip)
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
            if self._size == 0 and self.tip_path is not None:
                self._start_from_tip(f.fileno(), st.st_size)
            f.seek(self._size)
            left = st.st_size - self._size
            carry = b""
            while left > 0:
                chunk = f.read(min(left, self.chunk))
                if not chunk:
                    break
                left -= len(chunk)
                data = carry + chunk
                end = data.rfind(b"\n") + 1
                self._take(data[:end])
                carry = data[end:]

    def _start_from_tip(self, fd: int, size: int) -> None:
        tip = checked_tip(fd, self.tip_path or "", size)
        sha = tip.sha256() if tip is not None else None
        if tip is None or sha is None:
            return
        self._h = sha
        self._size = tip.size
        self._lines = tip.count
        self.model = tip.model

    def _take(self, whole: bytes) -> None:
        """Account for whole lines (``whole`` ends with a newline, or is empty)."""
        if not whole:
            return
        self._h.update(whole)
        self._size += len(whole)
        self._lines += whole.count(b"\n")
        if b'"kind":"model_switch"' in whole:
            for line in whole.splitlines():
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


def open_appender(
    journal_path: str,
    *,
    machine: str,
    new_id: Callable[[], str],
    now_ns: Callable[[], int],
    recovery_dir: str,
    ring_path: str | None = None,
    tip_path: str | None = None,
) -> Journal:
    """The journal of one agent, open for appending as ``machine`` (with its
    write-ahead ring, if ``ring_path``: see :mod:`capsulefs.core.journal.ring`;
    and its tip, if ``tip_path``: see :mod:`capsulefs.core.journal.tip`)."""
    return open_journal(journal_path, machine=machine, now=lambda: now_ns() / 1e9, new_id=new_id,
                        recovery_dir=recovery_dir, create=False, ring_path=ring_path, tip_path=tip_path)
