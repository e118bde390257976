"""The journal: one immutable event per line, hash-chained per machine,
ordered across machines by a Lamport clock, merged by set union.

Rules:
  * A line is canonical JSON (see :mod:`capsulefs.core.events`), so its
    sha256 is its identity. ``prev`` is the hash of the same machine's
    previous line, ``seq`` counts 1, 2, 3... per machine without gaps.
  * The file is sorted by (clock, machine, seq). A local append gets
    clock = (greatest clock in the file) + 1, so it always goes at the end.
  * An append is acknowledged only once it is durable: after an fdatasync
    of the journal, or, for a journal with a write-ahead ring (every agent
    of the host store), after an fdatasync of the ring record that holds
    the same bytes. One ``write`` carries a whole group of lines
    (:meth:`Journal.append_many`), and threads sharing a Journal share
    commits: the others queue while one writes and syncs.
  * A ring never vouches for less than the journal lacks: before the ring
    starts over at its offset 0 (full, or another process appended), the
    journal itself is fdatasynced (a checkpoint). Before a journal with a
    ring is read or appended to after a crash, the ring is replayed into
    it; a journal that disagrees with its ring is refused (RingMismatch),
    never repaired by guessing.
  * A file that does not end with a newline has a torn tail: bytes of an
    append that crashed before it was acknowledged. Opening (or catching up
    with) the journal moves that tail into a recovery file outside the
    capsule and logs a warning. It is never kept, never dropped silently.
  * Nothing here rewrites or deletes an event. :func:`merge` builds a new
    list of lines; writing it somewhere is the caller's business.

Theory of operation (appends):
  Appenders on one host are serialized by ``flock`` on the journal file
  itself (no lock file to leak into the capsule) plus a thread lock. Each
  :class:`Journal` keeps the chain state (per-machine tails, greatest clock,
  size of the whole lines) in memory. Under the lock it compares the file's
  size with the size it knows: if another process appended, it reads only
  the new bytes and absorbs them before stamping. So an append costs a
  statx of the path (the inode only: see ``fsutil.path_identity``) and an
  lseek, one write and one fdatasync, whatever the journal's length.
  If another file was renamed over the journal's path (by someone holding
  the old file's flock), the Journal follows it: nothing is appended to an
  unlinked file.

Theory of operation (the write-ahead ring):
  Growing a file makes its fdatasync write the inode (the new size) after
  the data: two dependent writes. A ring (:mod:`capsulefs.core.journal_ring`)
  is a file of fixed size written in place, whose fdatasync writes data
  only. With one, an append writes its lines to the journal (O_APPEND, not
  synced: readers see them at once), then one record (header, checksum, the
  same bytes, their journal offset and inode) after the previous record in
  the ring, fdatasyncs the ring and acknowledges. The ring's records form
  one chain, contiguous in journal offsets from its first record, whose
  offset is where the journal was last synced by itself. A Journal
  continues its own chain only if the journal still ends where its chain
  does and the ring still starts with the chain's first header; otherwise
  (another process appended, or reset or restarted the ring) it
  checkpoints: fdatasync of the journal, then a new chain at offset 0. A
  full ring is a checkpoint too, so the journal is synced about once per
  ring size of events.

  Recovery (:func:`replay_ring`, under the journal's flock) reads the chain
  and compares it with the journal from the chain's first offset: missing
  bytes (lost by a crash, or a line cut short) are appended, the journal
  fdatasynced and the ring reset; zero bytes where the ring has data (a
  grown file whose data never reached the disk) are saved as a torn tail
  and replaced. Anything else is a disagreement: both files are left alone,
  an error names them, and appending is refused. Whole lines past the
  chain's end were never acknowledged and stay; a torn tail past it goes to
  the recovery directory as always. The host store replays every agent's
  ring when it opens, before anything reads a journal file.

Theory of operation (verify and merge):
  :func:`verify_lines` parses every line fully (schema and canonical form)
  and lists every problem with its line number, machine and seq.
  :func:`merge` is the reference merge, line by line: it pulls out the
  envelope of each line (a strict grammar match for JSON up to two levels
  deep, ``json.loads`` for anything deeper), checks each input's order and
  seq runs, merges the two sorted inputs, and checks the union's chains by
  hashing each distinct line once. An input whose chain does not verify is
  refused; so are two different lines with the same (machine, seq), which
  is a fork. :func:`merge_bytes` gives the same result vectorised (see
  :mod:`capsulefs.core.journal_index`), and defers to :func:`merge` for
  anything it does not accept, so the errors are the reference's.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import json
import logging
import mmap
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from hashlib import sha256
from typing import Any

from .errors import FormatError, IntegrityError, NotFoundError
from .events import Event, Record, UnknownEvent, line_hash, parse_draft
from .fsutil import atomic_write, fsync_dir, makedirs_durable, path_identity
from .journal_ring import Ring
from .journal_ring import remove as remove_ring

log = logging.getLogger(__name__)

#: Name of a recovery file for a torn tail: ``<journal name>.torn-<n>``.
TORN_SUFFIX = ".torn-"
#: Catching up with at least this many bytes is done in bulk (vectorised).
BULK_CATCH_UP = 1 << 20

Key = tuple[int, str, int]  # (clock, machine, seq): the journal's sort key


class RingMismatch(FormatError):
    """A journal disagrees with its write-ahead ring: neither is touched and
    nothing is appended until someone looks (the message names both files)."""


class ChainError(IntegrityError):
    """A journal's chains do not verify; ``problems`` lists every finding."""

    def __init__(self, what: str, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        shown = "; ".join(self.problems[:5])
        more = f" (and {len(self.problems) - 5} more)" if len(self.problems) > 5 else ""
        super().__init__(f"{what}: {shown}{more}")


# -- the envelope, fast --------------------------------------------------------
#
# A strict grammar for a JSON object whose values nest at most one level. The
# named envelope keys may appear only once at the top level (the lookahead
# keeps every other top-level key from being one of them), so a match proves
# the captured values are the envelope's. Deeper lines go to json.loads.

_STR = rb'"[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*"'
_NUM = rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_SCALAR = rb"(?:" + _STR + rb"|" + _NUM + rb"|true|false|null)"
_VALUE = (
    rb"(?:" + _SCALAR
    + rb"|\{(?:" + _STR + rb":" + _SCALAR + rb"(?:," + _STR + rb":" + _SCALAR + rb")*)?\}"
    + rb"|\[(?:" + _SCALAR + rb"(?:," + _SCALAR + rb")*)?\])"
)
_OTHER = rb'(?!"(?:clock|id|kind|machine|prev|seq|time|v)")' + _STR + rb":" + _VALUE
_SKIP = rb"(?:" + _OTHER + rb",)*?"
_INT = rb"([1-9][0-9]{0,17})"
_ENVELOPE_RE = re.compile(
    rb"\{" + _SKIP + rb'"clock":' + _INT
    + rb"," + _SKIP + rb'"id":"[0-9a-f]{8,64}"'
    + rb"," + _SKIP + rb'"kind":"[a-z][a-z0-9_.]{0,63}"'
    + rb"," + _SKIP + rb'"machine":"([A-Za-z0-9][A-Za-z0-9._-]{0,127})"'
    + rb"," + _SKIP + rb'"prev":(null|"[0-9a-f]{64}")'
    + rb"," + _SKIP + rb'"seq":' + _INT
    + rb"," + _SKIP + rb'"time":' + _STR
    + rb"," + _SKIP + rb'"v":' + _INT
    + rb"(?:," + _OTHER + rb")*\}"
)
_fullmatch = _ENVELOPE_RE.fullmatch
_HOST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HEX64_RE = re.compile(r"[0-9a-f]{64}")
_ID_RE = re.compile(r"[0-9a-f]{8,64}")
_KIND_RE = re.compile(r"[a-z][a-z0-9_.]{0,63}")


def _posint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def envelope(line: bytes) -> tuple[Key, str | None]:
    """((clock, machine, seq), prev) of one line, checking it is a JSON object
    with a well-formed envelope. Raises FormatError. Does not check the
    event's own fields or the canonical form (:func:`verify_lines` does)."""
    m = _fullmatch(line)
    if m is not None and (line.isascii() or _utf8(line)):
        clock, machine, prev, seq, _v = m.groups()
        return (int(clock), machine.decode(), int(seq)), (None if prev == b"null" else prev[1:-1].decode())
    try:
        doc = json.loads(line)
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise FormatError("not a JSON object")
    missing = [k for k in ("clock", "id", "kind", "machine", "prev", "seq", "time", "v") if k not in doc]
    if missing:
        raise FormatError(f"lacks {', '.join(missing)}")
    clock, machine, seq, prev = doc["clock"], doc["machine"], doc["seq"], doc["prev"]
    if not (_posint(clock) and _posint(seq) and _posint(doc["v"])):
        raise FormatError("clock, seq and v must be positive integers")
    if not isinstance(machine, str) or not _HOST_RE.fullmatch(machine):
        raise FormatError(f"machine {machine!r} is not a host id")
    if prev is not None and not (isinstance(prev, str) and _HEX64_RE.fullmatch(prev)):
        raise FormatError(f"prev {prev!r} is neither null nor a sha256")
    if not isinstance(doc["id"], str) or not _ID_RE.fullmatch(doc["id"]):
        raise FormatError(f"id {doc['id']!r} is not 8-64 lowercase hex digits")
    if not isinstance(doc["kind"], str) or not _KIND_RE.fullmatch(doc["kind"]):
        raise FormatError(f"kind {doc['kind']!r} is not a valid event kind")
    if not isinstance(doc["time"], str):
        raise FormatError("time must be a string")
    return (clock, machine, seq), prev


def _utf8(line: bytes) -> bool:
    try:
        line.decode()
    except UnicodeDecodeError:
        return False
    return True


def split_lines(data: bytes, what: str = "journal") -> list[bytes]:
    """The lines of a journal's bytes (without newlines). Refuses a torn tail."""
    if not data:
        return []
    if not data.endswith(b"\n"):
        torn = len(data) - data.rfind(b"\n") - 1
        raise FormatError(f"{what} does not end with a newline (torn tail of {torn} bytes)")
    return data[:-1].split(b"\n")


def join_lines(lines: Iterable[bytes]) -> bytes:
    out = b"\n".join(lines)
    return out + b"\n" if out else b""


# -- verifying -----------------------------------------------------------------


def verify_lines(lines: Sequence[bytes], *, full: bool = True) -> list[str]:
    """Every problem of a journal, each naming its line (1-based), machine and seq.

    Checks that each line parses (``full``: as a canonical Record, schema
    included; otherwise only its envelope), that lines are strictly sorted by
    (clock, machine, seq), and that each machine's seqs run 1, 2, 3... with
    ``prev`` equal to the hash of the previous line of that machine and a
    clock greater than that line's. The same (machine, seq) twice with
    different bytes is reported as a fork or tampering.
    """
    problems: list[str] = []
    # machine -> [seq, digest, clock, lineno] of its last line
    tails: dict[str, list[Any]] = {}
    # machine -> line numbers by seq (index seq-1), to name forks
    where: dict[str, list[int]] = {}
    last_key: Key | None = None
    last_no = 0
    for no, line in enumerate(lines, 1):
        try:
            if full:
                rec = Record.from_line(line)
                key: Key = rec.order
                prev = rec.prev
            else:
                key, prev = envelope(line)
        except FormatError as exc:
            problems.append(f"line {no}: {exc}")
            continue
        clock, machine, seq = key
        if last_key is not None and key <= last_key:
            if key == last_key:
                pass  # reported below as a duplicate or a fork
            else:
                problems.append(
                    f"line {no}: machine {machine} seq {seq}: out of order, (clock {clock}, {machine}, seq {seq}) "
                    f"sorts before line {last_no} (clock {last_key[0]}, {last_key[1]}, seq {last_key[2]})"
                )
        last_key, last_no = key, no
        digest = line_hash(line)
        seen = where.setdefault(machine, [])
        tail = tails.get(machine)
        if seq <= len(seen) and seen[seq - 1]:
            other = seen[seq - 1]
            if lines[other - 1] == line:
                problems.append(f"line {no}: machine {machine} seq {seq}: duplicates line {other}")
            else:
                problems.append(
                    f"line {no}: machine {machine} seq {seq}: differs from line {other}, which has the same "
                    "machine and seq (a fork, or tampering)"
                )
            continue
        if tail is None:
            if seq != 1:
                problems.append(f"line {no}: machine {machine} seq {seq}: the machine's first line must have seq 1")
            elif prev is not None:
                problems.append(f"line {no}: machine {machine} seq 1: prev must be null for a machine's first line")
        else:
            t_seq, t_digest, t_clock, t_no = tail
            if seq != t_seq + 1:
                problems.append(
                    f"line {no}: machine {machine} seq {seq}: gap, the machine's previous line is seq {t_seq} "
                    f"(line {t_no})"
                )
            elif prev != t_digest:
                problems.append(
                    f"line {no}: machine {machine} seq {seq}: prev does not match the hash of machine {machine} "
                    f"seq {t_seq} (line {t_no}); one of them was altered (tampering or a fork)"
                )
            if clock <= t_clock:
                problems.append(
                    f"line {no}: machine {machine} seq {seq}: clock {clock} is not greater than clock {t_clock} "
                    f"of seq {t_seq} (line {t_no})"
                )
        if seq > len(seen):
            seen.extend([0] * (seq - len(seen)))
        seen[seq - 1] = no
        tails[machine] = [seq, digest, clock, no]
    return problems


def check_lines(lines: Sequence[bytes], what: str = "journal", *, full: bool = True) -> None:
    """Raise ChainError listing every problem, if there is any."""
    problems = verify_lines(lines, full=full)
    if problems:
        raise ChainError(f"{what} does not verify", problems)


def check_journal_bytes(data: bytes) -> list[str]:
    """Content check for ``memory/timeline_events.jsonl`` in a capsule."""
    try:
        lines = split_lines(data)
    except FormatError as exc:
        return [str(exc)]
    return verify_lines(lines)


# -- merging ---------------------------------------------------------------------


def merge(a: Sequence[bytes], b: Sequence[bytes]) -> list[bytes]:
    """The union of two journals' lines, sorted by (clock, machine, seq).

    Commutative, associative and idempotent. Raises ChainError (naming the
    input, line, machine and seq) if either input's chains do not verify,
    or if the inputs hold different lines for the same (machine, seq).
    """
    out: list[bytes] = []
    append = out.append
    na, nb = len(a), len(b)
    i = j = 0
    # Per input: last key (order) and last seq per machine (runs without gaps).
    last_a: Key = (0, "", 0)
    last_b: Key = (0, "", 0)
    seqs_a: dict[str, int] = {}
    seqs_b: dict[str, int] = {}
    # The union: per machine [seq, digest, clock].
    tails: dict[str, list[Any]] = {}
    ka = pa = kb = pb = None

    def bad(which: str, lines: Sequence[bytes], no: int, msg: str) -> ChainError:
        found = verify_lines(lines, full=False)
        return ChainError(f"merge refused: input {which} does not verify", found or [f"line {no}: {msg}"])

    while True:
        # Pull the next envelope of each input that needs one.
        if ka is None and i < na:
            line = a[i]
            try:
                ka, pa = envelope(line) if not (j < nb and kb is not None and b[j] == line) else (kb, pb)
            except FormatError as exc:
                raise bad("A", a, i + 1, str(exc)) from None
            if ka <= last_a:
                raise bad("A", a, i + 1, "out of order")
            if seqs_a.get(ka[1], 0) + 1 != ka[2]:
                raise bad("A", a, i + 1, f"machine {ka[1]} seq {ka[2]}: gap")
            seqs_a[ka[1]] = ka[2]
            last_a = ka
        if kb is None and j < nb:
            line = b[j]
            try:
                kb, pb = envelope(line) if not (ka is not None and a[i] == line) else (ka, pa)
            except FormatError as exc:
                raise bad("B", b, j + 1, str(exc)) from None
            if kb <= last_b:
                raise bad("B", b, j + 1, "out of order")
            if seqs_b.get(kb[1], 0) + 1 != kb[2]:
                raise bad("B", b, j + 1, f"machine {kb[1]} seq {kb[2]}: gap")
            seqs_b[kb[1]] = kb[2]
            last_b = kb
        # Take the smaller (both, when equal).
        if ka is not None and (kb is None or ka < kb):
            line, key, prev = a[i], ka, pa
            i += 1
            ka = None
        elif kb is not None and (ka is None or kb < ka):
            line, key, prev = b[j], kb, pb
            j += 1
            kb = None
        elif ka is not None:  # same key in both
            line, key, prev = a[i], ka, pa
            if b[j] != line:
                raise _union_error(
                    a, b, f"machine {ka[1]} seq {ka[2]}: input A line {i + 1} and input B line {j + 1} are "
                    "different events with the same machine and seq (a fork, or tampering)"
                )
            i += 1
            j += 1
            ka = kb = None
        else:
            break
        # Check the union's chain for this line's machine.
        clock, machine, seq = key
        digest = sha256(line).hexdigest()
        tail = tails.get(machine)
        if tail is None:
            if seq != 1 or prev is not None:
                raise _union_error(a, b, f"machine {machine} seq {seq}: the machine's first line must have seq 1 and prev null")
        else:
            if seq != tail[0] + 1:
                raise _union_error(
                    a, b, f"machine {machine} seq {seq}: follows seq {tail[0]}: the inputs hold different events "
                    "for this machine (a fork)"
                )
            if prev != tail[1]:
                raise _union_error(
                    a, b, f"machine {machine} seq {seq}: prev does not match the hash of seq {tail[0]} (tampering or a fork)"
                )
            if clock <= tail[2]:
                raise _union_error(
                    a, b, f"machine {machine} seq {seq}: clock {clock} is not greater than the clock of seq {tail[0]}"
                )
        tails[machine] = [seq, digest, clock]
        append(line)
    return out


def _union_error(a: Sequence[bytes], b: Sequence[bytes], msg: str) -> ChainError:
    """The union does not verify: blame an input that does not verify by
    itself, else the two inputs together (a fork between them)."""
    for which, lines in (("A", a), ("B", b)):
        found = verify_lines(lines, full=False)
        if found:
            return ChainError(f"merge refused: input {which} does not verify", found)
    return ChainError("merge refused", [msg])


def merge_bytes(a: bytes, b: bytes) -> bytes:
    """:func:`merge` on whole journal files, vectorised (same result, same refusals).

    The fast path (:mod:`capsulefs.core.journal_index`) hands anything it
    does not accept to :func:`merge`, which raises the precise ChainError.
    """
    return b"".join(merge_pieces(a, b))


def merge_pieces(a: "bytes | mmap.mmap", b: "bytes | mmap.mmap") -> Iterable[bytes | memoryview]:
    """:func:`merge_bytes` as pieces (the inputs may be mmaps of the journal
    files), for writing without building the whole result. Every check is
    done before this returns."""
    from .journal_index import Unreadable, fast_merge

    try:
        return fast_merge(a, b)
    except Unreadable as exc:
        log.debug("fast merge declined (%s); using the reference merge", exc)
    return [join_lines(merge(split_lines(bytes(a), "journal A"), split_lines(bytes(b), "journal B")))]


# -- stamping ----------------------------------------------------------------------


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

    __slots__ = ("tails", "clock", "count", "last")

    def __init__(self) -> None:
        self.tails: dict[str, Tail] = {}  # machine -> its last line
        self.clock = 0  # greatest clock seen
        self.count = 0  # lines absorbed
        self.last: Key | None = None  # key of the last line

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
        from .journal_index import Unreadable, index_journal

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
        records: list[Record] = []
        when = format_time(now())
        tail = self.tails.get(machine)
        seq, prev = (tail.seq, tail.digest) if tail else (0, None)
        clock = self.clock
        for event in events:
            if not isinstance(event, Event):
                raise FormatError(f"cannot append {type(event).__name__}: not an event")
            if records:
                prev = records[-1].digest
            seq += 1
            clock += 1
            rec = Record(id=new_id(), machine=machine, seq=seq, clock=clock, prev=prev, time=when, event=event)
            if isinstance(event, UnknownEvent):
                Record.from_line(rec.line)  # a kind we do not know must still make a readable line
            records.append(rec)
        return records

    def take(self, records: Iterable[Record]) -> None:
        """Absorb records made by :meth:`plan` (after they were written)."""
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


# -- the journal file ---------------------------------------------------------------


def _fdatasync(fd: int) -> None:
    (getattr(os, "fdatasync", None) or os.fsync)(fd)


class Journal:
    """An open journal file. Make one with :func:`open_journal`.

    Thread-safe, and safe against other processes using their own Journal on
    the same file. ``machine`` may be None for a read-only use (no appends).
    """

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
    ) -> None:
        self.path = path
        self.machine = machine
        self.recovery_dir = recovery_dir
        self.ring_path = ring_path  # None: each append fdatasyncs the journal itself
        self._ring: Ring | None = None  # opened (created) at the first append
        self._id: tuple[int, int] | None = None  # (st_ino, st_dev) of the file held
        self._fd = fd
        self._now = now
        self._new_id = new_id
        self._lock = threading.Lock()
        self._state = ChainState()
        self._size = 0  # bytes of whole lines absorbed
        self._cond = threading.Condition()  # guards _pending and _leading
        self._pending: list[_Request] = []  # events queued for the next group commit
        self._leading = False  # a thread is writing a group
        self.commits = 0  # groups written (one write and one fdatasync each)
        self.checkpoints = 0  # fdatasyncs of the journal itself made by appends with a ring

    # -- lifecycle ---------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            if self._ring is not None:
                self._ring.close()
                self._ring = None

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._fd < 0

    # -- locking and catching up ------------------------------------------------
    def _locked(self) -> "_Locked":
        if self._fd < 0:
            raise ValueError(f"journal {self.path} is closed")
        return _Locked(self)

    def _catch_up(self, size: int) -> None:
        """Absorb whatever other writers appended; move a torn tail aside.
        ``size`` is the file's current size. Caller holds both locks."""
        if size == self._size:
            return
        if size < self._size:
            # Only a torn tail (never part of _size) is ever cut; a shorter
            # file was rewritten behind our back: start over.
            log.warning("journal %s shrank from %d to %d bytes; re-reading it", self.path, self._size, size)
            self._state = ChainState()
            self._size = 0
        data = os.pread(self._fd, size - self._size, self._size)
        end = data.rfind(b"\n") + 1
        if end < len(data):
            self._move_torn_tail(self._size + end, data[end:])
        start = 0
        base_no = self._state.count
        state = self._state
        if end >= BULK_CATCH_UP and state.absorb_bulk(data[:end]):
            self._size += end
            return
        while start < end:
            nl = data.index(b"\n", start)
            try:
                state.absorb(data[start:nl])
            except FormatError as exc:
                # Stop at the last good line: appending after a line we cannot
                # read would stamp a wrong chain. verify names the line too.
                self._size += start
                raise FormatError(f"{self.path}: line {base_no + 1 + _count_lines(data, start)}: {exc}") from None
            start = nl + 1
        self._size += end

    def _follow_replacement(self) -> int:
        """If another file was renamed over the journal's path (whoever does
        that holds the old file's flock while renaming), switch to it: an
        append to the old, unlinked file would be lost. Caller holds the
        thread lock and the flock of the current descriptor. Returns the
        size of the file now held.

        No stat of the journal here: asking for a file's timestamps makes
        its next write take a fine-grained one (Linux multigrain
        timestamps), which then gives the ring a new mtime on every write
        and its fdatasync an inode to write (see ``fsutil.path_identity``)."""
        try:
            on_disk = path_identity(self.path)
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
        self._state = ChainState()
        self._size = 0
        held = os.fstat(fd)
        self._id = (held.st_ino, held.st_dev)
        return held.st_size

    def _move_torn_tail(self, offset: int, tail: bytes) -> None:
        dest = _save_torn(self.recovery_dir, self.path, tail)  # saved durably before the journal is cut
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

    # -- appending -------------------------------------------------------------
    def append(self, event: Event) -> Record:
        """Stamp ``event``, append it durably, and return its record."""
        return self.append_many([event])[0]

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
        req = _Request(events)
        with self._cond:
            self._pending.append(req)
            while self._leading and not req.done:
                self._cond.wait()
            if not req.done:
                self._leading = True
                group, self._pending = self._pending, []
        if not req.done:
            try:
                self._commit(group)
            finally:
                with self._cond:
                    self._leading = False
                    self._cond.notify_all()
        return req.result()

    def _commit(self, group: list["_Request"]) -> None:
        """Write the queued groups of events as one; settle every request."""
        assert self.machine is not None
        try:
            with self._locked():
                state = self._state.copy()
                planned = []
                for req in group:
                    try:
                        records = state.plan(req.events, machine=self.machine, now=self._now, new_id=self._new_id)
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
                    try:
                        self._write_all(data)
                        _fdatasync(self._fd)
                    except BaseException:
                        self._undo(self._size)
                        raise
                else:
                    self._commit_with_ring(data)
                self._state = state
                self._size = end
                self.commits += 1
                for req, records in planned:
                    req.settle(records=records)
        except BaseException as exc:
            for req in group:
                if not req.done:
                    req.settle(error=exc)
            if not isinstance(exc, Exception):
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
            try:
                self._write_all(data)
                _fdatasync(self._fd)
            except BaseException:
                self._undo(start)
                raise
            self.checkpoints += 1
            return
        assert self._id is not None
        ino = self._id[0]
        restart = not ring.continues(start, ino) or not ring.fits(len(data))
        if restart:
            if not ring.is_current():  # removed or replaced (the agent left and came back)
                ring.close()
                ring = self._ring = Ring.open(self.ring_path, create=True)
                assert ring is not None
            # Checkpoint: every byte before ``start`` (ours, or another
            # process's whose ring records we are about to overwrite) is made
            # durable in the journal itself before the ring starts over.
            _fdatasync(self._fd)
            self.checkpoints += 1
        try:
            self._write_all(data)
            ring.append(start, ino, data, restart=restart)
        except BaseException:
            ring.forget()
            self._undo(start)
            raise

    def _recover(self) -> None:
        """Replay the ring into the journal after a crash (see
        :func:`replay_ring`); refuse (RingMismatch) if they disagree."""
        if self.ring_path is None:
            return
        self._lock.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                self._follow_replacement()
                replay_ring(self._fd, self.path, self.ring_path, self.recovery_dir)
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

    def _undo(self, size: int) -> None:
        # The group was not acknowledged: cut whatever part of it reached the file.
        try:
            os.ftruncate(self._fd, size)
        except OSError as exc:  # pragma: no cover - the next open moves it aside
            log.warning("journal %s: could not cut a failed append: %s", self.path, exc)

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
        return os.pread(self._fd, end - offset, offset)

    def lines(self) -> list[bytes]:
        return split_lines(self.read())

    def records(self) -> list[Record]:
        return [Record.from_line(line) for line in self.lines()]


class _Request:
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


class _Locked:
    """Both locks held, and the state caught up with the file."""

    __slots__ = ("_j",)

    def __init__(self, journal: Journal) -> None:
        self._j = journal

    def __enter__(self) -> None:
        j = self._j
        j._lock.acquire()
        try:
            fcntl.flock(j._fd, fcntl.LOCK_EX)
            try:
                j._catch_up(j._follow_replacement())
            except BaseException:
                fcntl.flock(j._fd, fcntl.LOCK_UN)
                raise
        except BaseException:
            j._lock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        j = self._j
        try:
            fcntl.flock(j._fd, fcntl.LOCK_UN)
        finally:
            j._lock.release()


def _count_lines(data: bytes, end: int) -> int:
    return data.count(b"\n", 0, end)


def open_journal(
    path: str | os.PathLike[str],
    *,
    machine: str | None,
    now: Callable[[], float],
    new_id: Callable[[], str],
    recovery_dir: str | os.PathLike[str],
    create: bool = True,
    ring_path: str | os.PathLike[str] | None = None,
) -> Journal:
    """Open (or create) a journal file and catch up with it.

    ``machine`` is this host's id (None: read-only). ``now`` gives Unix
    seconds, ``new_id`` a fresh event id (24 hex). A torn tail is moved to
    ``recovery_dir``, which must lie outside the capsule so that the capsule
    still verifies. With ``ring_path`` (a file outside the capsule, see
    :mod:`capsulefs.core.journal_ring`), appends are made durable in that
    write-ahead ring, and opening first replays it into the journal if a
    crash left the journal behind; a journal that disagrees with its ring
    raises RingMismatch when opened for appending (read-only, it is logged
    and the journal is read as it is). Use it as a context manager, or call
    ``close()``.
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
                      ring_path=None if ring_path is None else os.fspath(ring_path))
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


#: Where torn tails of the host store's agents go: ``<state>/recovery/<agent_id>/``,
#: outside the agent's capsule directory, so the capsule still verifies.
RECOVERY_DIR = "recovery"
#: Where the host store keeps each agent's write-ahead ring:
#: ``<state>/journal-wal/<agent_id>`` (outside the capsule, like recovery/).
WAL_DIR = "journal-wal"


def journal_ring_path(store_root: str, agent_id: str) -> str:
    """The write-ahead ring of an agent of the host store."""
    return os.path.join(store_root, WAL_DIR, agent_id)


def agent_recovery_dir(store_root: str, agent_id: str) -> str:
    return os.path.join(store_root, RECOVERY_DIR, agent_id)


def _save_torn(recovery_dir: str, journal_path: str, tail: bytes) -> str:
    """Save bytes cut from a journal as ``<name>.torn-<n>`` (durably); return the path."""
    makedirs_durable(recovery_dir)
    name = os.path.basename(journal_path) + TORN_SUFFIX
    taken = [int(n[len(name):]) for n in os.listdir(recovery_dir) if n.startswith(name) and n[len(name):].isdigit()]
    dest = os.path.join(recovery_dir, f"{name}{max(taken, default=0) + 1}")
    atomic_write(dest, tail)
    return dest


def replay_ring(fd: int, path: str, ring_path: str, recovery_dir: str) -> int:
    """Bring the journal open on ``fd`` up to date with its ring after a
    crash; return how many bytes were restored. Caller holds the flock.

    The ring's chain vouches for journal bytes [start, end) of one inode.
    If the journal holds them all, nothing is done (they may still be only
    in the page cache: the ring is kept). If the journal holds a prefix of
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
        entries = ring.scan()
        if not entries:
            return 0
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
            if size >= end:
                return 0  # every acknowledged byte is in the journal (maybe only cached: keep the ring)
            cut = -1
            missing = want[len(have):]
        else:
            k = next(i for i, (x, y) in enumerate(zip(have, want)) if x != y)
            rest = os.pread(fd, size - (start + k), start + k)
            if rest.count(0) != len(rest):
                raise refuse(f"they differ at journal byte {start + k}")
            cut = start + k
            dest = _save_torn(recovery_dir, path, rest)
            log.warning("journal %s: %d zero bytes at offset %d (a crash left them unwritten) moved to %s",
                        path, len(rest), cut, dest)
            os.ftruncate(fd, cut)
            missing = want[k:]
        view = memoryview(missing)
        while view:
            view = view[os.write(fd, view):]
        _fdatasync(fd)
        ring.reset()
        log.warning("journal %s: restored %d bytes of acknowledged events from its write-ahead ring %s "
                    "(a crash had kept them from reaching the journal file)", path, len(missing), ring_path)
        return len(missing)
    finally:
        ring.close()


def _open_locked(path: str) -> int:
    """A descriptor of the journal at ``path`` with its flock held, following
    a rename over it while waiting for the lock."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
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
    try:
        return replay_ring(fd, path, ring_path, recovery_dir)
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
    try:
        fd = _open_locked(path)
    except FileNotFoundError:
        yield
        return
    try:
        if os.path.exists(ring_path):
            replay_ring(fd, path, ring_path, recovery_dir)
            _fdatasync(fd)
            ring = Ring.open(ring_path, create=False)
            if ring is not None:
                try:
                    ring.reset()
                finally:
                    ring.close()
        yield
    finally:
        os.close(fd)


def forget_ring(ring_path: str) -> None:
    """Remove a ring whose journal is gone or not yet there (an agent removed
    from the store, or about to be installed)."""
    if remove_ring(ring_path):
        log.info("removed write-ahead ring %s", ring_path)


def open_agent_journal(
    agent: Any,
    *,
    machine: str | None,
    now: Callable[[], float],
    new_id: Callable[[], str],
) -> Journal:
    """Open the journal of an agent of the host store (an ``AgentHandle``)."""
    from .format import JOURNAL

    return open_journal(
        agent.path(JOURNAL),
        machine=machine,
        now=now,
        new_id=new_id,
        recovery_dir=agent_recovery_dir(agent.store.root, agent.agent_id),
        create=False,
        ring_path=journal_ring_path(agent.store.root, agent.agent_id),
    )


def parse_draft_lines(data: bytes) -> list[Event]:
    """Parse newline-separated draft events; each must be a whole line."""
    if not data.endswith(b"\n"):
        raise FormatError("draft events must be whole lines, each ending with a newline")
    events = []
    for no, raw in enumerate(data[:-1].split(b"\n"), 1):
        if not raw.strip():
            raise FormatError(f"draft line {no} is empty")
        try:
            obj = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as exc:
            raise FormatError(f"draft line {no} is not valid JSON: {exc}") from None
        try:
            events.append(parse_draft(obj))
        except FormatError as exc:
            raise FormatError(f"draft line {no}: {exc}") from None
    return events
