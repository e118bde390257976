"""Stamping: the per-machine chain state a journal needs to stamp its next
events, kept in memory and fed line by line (or in bulk).

:class:`ChainState` holds each machine's :class:`Tail` (last seq, hash of
its last line, its clock) and the greatest clock seen. It is pure: time and
event ids come in as parameters, and it never touches a file.

Rules:
  * A machine's next line gets seq = its last seq + 1 and prev = the hash
    of its last line (null and seq 1 for its first line).
  * A local append gets clock = (greatest clock in the file) + 1, so it
    always goes at the end of the file.
  * :meth:`ChainState.plan` stamps without taking the records: the caller
    writes them, then :meth:`ChainState.take` absorbs them, so a failed
    write leaves the state as it was.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone

from ..errors import FormatError
from .events import Event, UnknownEvent, line_hash
from .record import Record
from ..capsule.format import MAX_INT, check_host_id
from .lines import Key, envelope


def format_time(seconds: float) -> str:
    """UTC ISO-8601 with milliseconds, e.g. 2026-12-02T14:04:58.123Z."""
    ms = int(seconds * 1000)
    return _second(ms // 1000) + f"{ms % 1000:03d}Z"


@functools.lru_cache(maxsize=4)
def _second(whole: int) -> str:
    return datetime.fromtimestamp(whole, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.")


@dataclass(frozen=True, slots=True, kw_only=True)
class Tail:
    seq: int  # the machine's last seq
    digest: str  # sha256 of its last line
    clock: int  # clock of its last line


class ChainState:
    """What stamping needs to know about a journal, built line by line.

    Pure and in memory: :class:`Journal` keeps one for its file, tests use
    one to simulate replicas.
    """

    __slots__ = ("tails", "clock", "count", "last", "_checked")

    def __init__(self) -> None:
        self.tails: dict[str, Tail] = {}  # machine -> its last line
        self.clock = 0  # greatest clock seen
        self.count = 0  # lines absorbed
        self.last: Key | None = None  # key of the last line
        self._checked: str | None = None  # the machine id plan last checked

    def absorb(self, line: bytes) -> Key:
        """Take one more line (the next in the file). Raises FormatError."""
        key, _prev = envelope(line)
        self._take(key, line_hash(line))
        return key

    def copy(self) -> "ChainState":
        other = ChainState()
        other.tails = dict(self.tails)
        other.clock, other.count, other.last = self.clock, self.count, self.last
        return other

    def absorb_bulk(self, data: bytes) -> bool:
        """Take many whole lines at once (vectorised); False, with nothing
        taken, if some line needs the line-by-line path (which names it)."""
        from .envelope_index import Unreadable, index_journal

        try:
            ix = index_journal(data)
        except Unreadable:
            return False
        n = len(ix)
        if n == 0:
            return True
        last_of: dict[int, int] = {}
        for i, m in enumerate(ix.mid.tolist()):
            last_of[m] = i  # the last line of each machine
        for m, i in sorted(last_of.items(), key=lambda kv: kv[1]):
            line = data[ix.starts[i] : ix.ends[i]]
            self.tails[ix.names[m]] = Tail(seq=int(ix.seq[i]), digest=line_hash(line), clock=int(ix.clock[i]))
        self.clock = max(self.clock, int(ix.clock.max()))
        self.count += n
        self.last = (int(ix.clock[-1]), ix.names[int(ix.mid[-1])], int(ix.seq[-1]))
        return True

    def _take(self, key: Key, digest: str) -> None:
        clock, machine, seq = key
        self.tails[machine] = Tail(seq=seq, digest=digest, clock=clock)
        if clock > self.clock:
            self.clock = clock
        self.count += 1
        self.last = key

    def plan(
        self,
        events: Iterable[Event],
        *,
        machine: str,
        now: Callable[[], float],
        new_id: Callable[[], str],
    ) -> list[Record]:
        """Stamp events as the next lines of ``machine``, without taking them
        (see :meth:`take`): nothing changes if writing them fails."""
        if machine is not self._checked:  # Record.stamped trusts the envelope it is given
            check_host_id(machine)
            self._checked = machine
        records: list[Record] = []
        when = format_time(now())
        tail = self.tails.get(machine)
        seq, prev = (tail.seq, tail.digest) if tail else (0, None)
        clock = self.clock
        stamp = Record.stamped
        for event in events:
            if not isinstance(event, Event):
                raise FormatError(f"cannot append {type(event).__name__}: not an event")
            if records:
                prev = records[-1].digest
            seq += 1
            clock += 1
            if clock > MAX_INT:  # (a machine's seq never passes its clock)
                raise FormatError("the journal's clock has reached 2**53-1, the largest the format allows: "
                                  "nothing more can be appended")
            rec = stamp(event, id=new_id(), machine=machine, seq=seq, clock=clock, prev=prev, time=when)
            if isinstance(event, UnknownEvent):
                Record.from_line(rec.line)  # a kind we do not know must still make a readable line
            records.append(rec)
        return records

    def take(self, records: Iterable[Record]) -> None:
        """Absorb records made by :meth:`plan` (after they were written)."""
        if type(records) is list and len(records) == 1:  # one append: its record is its machine's tail
            rec = records[0]
            if rec.clock > self.clock:
                self.clock = rec.clock
            self.count += 1
            self.last = (rec.clock, rec.machine, rec.seq)
            self.tails[rec.machine] = Tail(seq=rec.seq, digest=line_hash(rec.line), clock=rec.clock)
            return
        last: dict[str, Record] = {}
        for rec in records:
            if rec.clock > self.clock:
                self.clock = rec.clock
            self.count += 1
            self.last = rec.order
            last[rec.machine] = rec
        for machine, rec in last.items():  # only a machine's last line is its tail
            self.tails[machine] = Tail(seq=rec.seq, digest=rec.digest, clock=rec.clock)

    def stamp(
        self,
        events: Iterable[Event],
        *,
        machine: str,
        now: Callable[[], float],
        new_id: Callable[[], str],
    ) -> list[Record]:
        """Stamp events as the next lines of ``machine`` and absorb them."""
        records = self.plan(events, machine=machine, now=now, new_id=new_id)
        self.take(records)
        return records
