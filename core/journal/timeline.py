"""The timeline: an agent's journal looked up by kind, time, text and
failure, and its last events read from the end.

Rules:
  * The index is derived data, host-local: ``<state>/timeline/<agent_id>/index.sqlite``,
    outside the capsule (not in its manifest, not exported, not moved,
    removed with the agent), like the journal's tip. It can always be
    built again from the journal, and it is never trusted:
      - before every query it is brought up to date: the line it says it
        ends on is read back from the journal and hashed; if that line is
        not there (the journal was replaced, merged, cut), the index is
        emptied and built again; if it is, only the lines after it are
        added;
      - every answer is a journal line read at the offset the index gives
        and checked again against the query (kind, time, failure, pattern)
        on its own bytes: an index that lies can only leave lines out.
  * Line numbers are the journal's (the first line is 1). An unreadable
    line gets a row of kind "" so that the numbers stay the journal's; a
    line holding NUL bytes (pages a crash left unwritten, which a writer's
    open moves aside) ends what is indexed, as it ends what readers read.
  * ``--grep`` patterns come from users: their cost is bounded. A pattern
    is at most :data:`MAX_PATTERN` characters and compiled by the
    ``regex`` module, whose matching takes a timeout: all the matching of
    one query gets :data:`GREP_SECONDS` in all, then the query fails
    (:class:`QueryTooSlow`) rather than run on. Candidates come from the
    index first: the literal runs a match must contain (found in the
    parsed pattern) are looked up as trigrams in an FTS5 table, so a
    pattern with a literal of 3 characters or more reads only the events
    holding its trigrams. What is matched is the event's text: every
    string value of its fields (the envelope's excluded), one per line.

Theory of operation (the SQLite file): ``events(no, at, len, ms, kind,
failed, big)`` has a row per line (its number, byte offset and length,
its time in ms, its kind, whether it is a failed tool result, whether its
text was too long to index whole), with indexes on kind, time and
failures; ``words`` is a contentless FTS5 table (trigram tokenizer,
``detail=none``) of each event's text, by line number; ``meta`` says how
far it covers the journal. Updates are one transaction each
(``BEGIN IMMEDIATE``, so concurrent refreshes queue), a rebuild too.
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import CapsuleError, FormatError
from .events import line_hash
from ..fsutil import makedirs_durable

if TYPE_CHECKING:
    import sqlite3

log = logging.getLogger(__name__)

#: Where the host store keeps each agent's timeline index: ``<state>/timeline/<agent_id>/``.
TIMELINE_DIR = "timeline"
INDEX_NAME = "index.sqlite"
SCHEMA = 1
#: Longest --grep pattern, in characters.
MAX_PATTERN = 1000
#: Time all the pattern matching of one query may take, in seconds.
GREP_SECONDS = 5.0
#: Longest text of one event put in the trigram index; a longer one is always a candidate.
MAX_INDEXED_TEXT = 64 << 10
#: Bytes read at a time when reading the journal from the end or indexing it.
BLOCK = 64 << 10
PIECE = 8 << 20
#: Indexing at least this many bytes at once says so (the first query of a long history).
NOTICE_BYTES = 64 << 20
_ENVELOPE = frozenset(("v", "id", "machine", "seq", "clock", "prev", "time", "kind"))


class QueryError(CapsuleError):
    """A timeline query that cannot be answered as asked (bad pattern, bad time)."""


class QueryTooSlow(QueryError):
    """A --grep pattern took longer than its budget."""


def timeline_dir(store_root: str, agent_id: str) -> str:
    """The timeline index's directory of an agent of the host store (outside its capsule)."""
    return os.path.join(store_root, TIMELINE_DIR, agent_id)


def forget_timeline(store_root: str, agent_id: str) -> None:
    """Remove an agent's timeline index, if any."""
    d = timeline_dir(store_root, agent_id)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return
    for name in names:
        try:
            os.unlink(os.path.join(d, name))
        except FileNotFoundError:
            pass
    try:
        os.rmdir(d)
    except OSError:  # (something new in it meanwhile: a later forget removes it)
        pass


# -- the journal, read as a reader ------------------------------------------------------


def _open_shared(path: str) -> int:
    """A read-only descriptor of the journal, after its shared flock was
    held once (so no append was half way through): the bytes up to the
    size then seen are whole appends. A rename over it while waiting is followed."""
    while True:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except BaseException:
            os.close(fd)
            raise
        if same:
            return fd
        os.close(fd)


class Snapshot:
    """A journal open for reading, and how far its appends had gone when opened."""

    __slots__ = ("fd", "size")

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size  # bytes, up to the end of the last whole line

    def read(self, at: int, n: int) -> bytes:
        data = os.pread(self.fd, n, at)
        while len(data) < n:  # (a read returns at most 2 GiB at once)
            more = os.pread(self.fd, n - len(data), at + len(data))
            if not more:
                raise FormatError(f"the journal ended at byte {at + len(data)}, before {at + n}")
            data += more
        return data


def open_snapshot(path: str) -> Snapshot:
    """The journal at ``path`` as it is now (its whole lines). Close ``fd`` after use."""
    fd = _open_shared(path)
    try:
        size = os.fstat(fd).st_size
        fcntl.flock(fd, fcntl.LOCK_UN)  # what is before ``size`` no longer changes (append only)
        end = size
        while end > 0:  # back to the end of the last whole line (a torn tail is not yet a line)
            lo = max(0, end - BLOCK)
            nl = os.pread(fd, end - lo, lo).rfind(b"\n")
            if nl >= 0:
                end = lo + nl + 1
                break
            end = lo
        return Snapshot(fd, end)
    except BaseException:
        os.close(fd)
        raise


def last_lines(snap: Snapshot, n: int) -> list[bytes] | None:
    """The last ``n`` whole lines, read back from the end in blocks; None
    if one of them holds NUL bytes (a crash's leftovers: the caller reads
    the whole journal as a reader does, which knows where they start)."""
    if n <= 0 or snap.size == 0:
        return []
    blocks: list[bytes] = []
    newlines = 0
    lo = snap.size
    while lo > 0 and newlines <= n:
        start = max(0, lo - BLOCK)
        block = snap.read(start, lo - start)
        blocks.append(block)
        newlines += block.count(b"\n")
        lo = start
    data = b"".join(reversed(blocks))
    lines = data[:-1].split(b"\n")
    if lo > 0:
        del lines[0]  # (maybe the end of a line before: more than n follow it)
    lines = lines[-n:]
    if any(b"\0" in line for line in lines):
        return None
    return lines


# -- what a line says ----------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def _day_ms(day: str) -> int | None:
    import datetime as _dt

    try:
        when = _dt.date.fromisoformat(day)
    except ValueError:
        return None
    return (when - _dt.date(1970, 1, 1)).days * 86_400_000


_CLOCK = re.compile(r"T([01][0-9]|2[0-3]):([0-5][0-9]):([0-5][0-9])(?:\.([0-9]{1,9}))?Z")


def event_ms(stamp: object) -> int | None:
    """An event's ``time`` (``2026-12-02T14:04:58.123Z``, as stamping
    writes it) in ms since the epoch, or None if it is not of that form."""
    if not isinstance(stamp, str) or len(stamp) < 20:
        return None
    day = _day_ms(stamp[:10])
    m = _CLOCK.fullmatch(stamp, 10)
    if day is None or m is None:
        return None
    hh, mm, ss, frac = m.groups()
    return day + (int(hh) * 3600 + int(mm) * 60 + int(ss)) * 1000 + (int((frac + "00")[:3]) if frac else 0)


def _strings(value: Any, out: list[str]) -> None:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _strings(v, out)
    elif isinstance(value, list):
        for v in value:
            _strings(v, out)


def event_text(doc: dict[str, Any]) -> str:
    """What --grep matches: every string value of the event's fields (not
    the envelope's), one per line, in the line's key order."""
    out: list[str] = []
    for key, value in doc.items():
        if key not in _ENVELOPE:
            _strings(value, out)
    return "\n".join(out)


_decode = json.JSONDecoder().decode


def parse_line(line: bytes) -> dict[str, Any] | None:
    """The line as a JSON object, or None if it is not one."""
    try:
        doc = _decode(line.decode())
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def is_failure(doc: dict[str, Any]) -> bool:
    """A failed tool call: its result says is_error."""
    return doc.get("kind") == "tool_result" and doc.get("is_error") is True


# -- queries ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Query:
    """What to look for; every field narrows. Times are ms since the epoch."""

    kinds: tuple[str, ...] = ()
    since_ms: int | None = None  # inclusive
    until_ms: int | None = None  # exclusive
    grep: str | None = None
    failed: bool = False
    tail: int | None = None  # only the last N matches

    @property
    def filters(self) -> bool:
        return bool(self.kinds or self.since_ms is not None or self.until_ms is not None or self.grep or self.failed)


class Matcher:
    """A query's test of one line, with the pattern's time budget."""

    def __init__(self, query: Query) -> None:
        self.query = query
        self.spent = 0.0  # seconds spent matching the pattern so far
        self._pattern = compile_pattern(query.grep) if query.grep is not None else None

    def matches(self, doc: dict[str, Any] | None) -> bool:
        q = self.query
        if doc is None:
            return not q.filters  # an unreadable line matches no filter
        if q.kinds and doc.get("kind") not in q.kinds:
            return False
        if q.failed and not is_failure(doc):
            return False
        if q.since_ms is not None or q.until_ms is not None:
            ms = event_ms(doc.get("time"))
            if ms is None or (q.since_ms is not None and ms < q.since_ms) or (q.until_ms is not None and ms >= q.until_ms):
                return False
        if self._pattern is not None:
            left = GREP_SECONDS - self.spent
            if left <= 0:
                raise self._too_slow()
            text = event_text(doc)
            began = time.monotonic()
            try:
                return self._pattern.search(text, timeout=left) is not None
            except TimeoutError:
                raise self._too_slow() from None
            finally:
                self.spent += time.monotonic() - began
        return True

    def _too_slow(self) -> QueryTooSlow:
        return QueryTooSlow(f"--grep {self.query.grep!r} took more than {GREP_SECONDS:g} s; "
                            f"give a longer literal, or narrow it with --kind, --since or --until")


def compile_pattern(pattern: str) -> Any:
    """The ``regex`` module's compiled pattern; QueryError if it is too long or bad."""
    if len(pattern) > MAX_PATTERN:
        raise QueryError(f"--grep pattern is longer than {MAX_PATTERN} characters")
    import regex  # (only for --grep)

    try:
        return regex.compile(pattern, regex.VERSION0)
    except (regex.error, ValueError, OverflowError, RecursionError) as exc:
        raise QueryError(f"--grep pattern {pattern!r} is not a regular expression: {exc}") from None


def required_literals(pattern: str) -> list[list[str]]:
    """What a match must contain, as a conjunction of alternatives: each
    inner list is literal runs one of which every match holds. Empty when
    nothing is known (then every event is a candidate). Found in Python's
    own parse of the pattern; a pattern it cannot parse gives nothing."""
    try:
        import re._parser as sre  # type: ignore[import-not-found]
        from re import _constants as c  # type: ignore[attr-defined]

        tree = sre.parse(pattern)
    except Exception:  # (regex-only syntax, or anything else: no prefilter)
        return []
    icase = tree.state.flags & c.SRE_FLAG_IGNORECASE or re.search(r"\(\?[a-zA-Z-]*i", pattern)
    if icase and not pattern.isascii():  # (SQLite's case folding need not be Python's)
        return []
    return [alts for alts in _required(list(tree), c) if alts]


def _required(items: list[Any], c: Any) -> list[list[str]]:
    """Conjunction of alternatives of literal runs (each >= 3 characters) in a parsed sequence."""
    out: list[list[str]] = []
    run: list[str] = []

    def close() -> None:
        if len(run) >= 3:
            out.append(["".join(run)])
        run.clear()

    for op, av in items:
        if op is c.LITERAL:
            run.append(chr(av))
            continue
        close()
        if op is c.SUBPATTERN:
            out.extend(_required(list(av[-1]), c))
        elif op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT) and av[0] >= 1:
            out.extend(_required(list(av[2]), c))
        elif op is c.BRANCH:
            alts: list[str] = []
            for branch in av[1]:
                found = _required(list(branch), c)
                best = max((a[0] for a in found if len(a) == 1), key=len, default=None)
                if best is None:
                    alts = []
                    break
                alts.append(best)
            if alts:
                out.append(alts)
    close()
    return out


def fts_query(literals: list[list[str]]) -> str | None:
    """An FTS5 query (trigram tokenizer, detail=none: no phrases) whose
    matches include every text holding the literals: each run becomes the
    AND of its trigrams; alternatives are ORed. None if nothing to ask."""
    def trigrams(run: str) -> str:
        grams = list(dict.fromkeys(run[i : i + 3] for i in range(len(run) - 2)))
        if len(grams) > 12:  # a few spread over the run narrow enough
            step = len(grams) / 12
            grams = [grams[int(i * step)] for i in range(12)]
        return " AND ".join('"' + g.replace('"', '""') + '"' for g in grams)

    parts = []
    for alts in literals:
        ors = [f"({trigrams(run)})" for run in alts]
        parts.append(ors[0] if len(ors) == 1 else "(" + " OR ".join(ors) + ")")
    return " AND ".join(parts) if parts else None


# -- times as users write them --------------------------------------------------------------------

_RELATIVE = re.compile(r"(\d{1,9})\s*(s|m|h|d|w)")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_when(text: str, now: float | None = None) -> int:
    """A time as --since/--until take it, in ms since the epoch:
    ``2026-12-07``, ``2026-12-07T14:00[:05][Z|+01:00]`` (a space may stand
    for the T), ``14:00`` (today), ``today``, ``yesterday``, or a span ago:
    ``30m``, ``2h``, ``3d``, ``1w``, ``90s``. Times without a zone are the
    local time. QueryError if it is none of these."""
    import datetime as _dt

    now = time.time() if now is None else now
    t = text.strip()
    if m := _RELATIVE.fullmatch(t):
        return int((now - int(m.group(1)) * _UNITS[m.group(2)]) * 1000)
    local_now = _dt.datetime.fromtimestamp(now).astimezone()
    midnight = local_now.replace(hour=0, minute=0, second=0, microsecond=0)
    if t == "today":
        return int(midnight.timestamp() * 1000)
    if t == "yesterday":
        return int((midnight - _dt.timedelta(days=1)).timestamp() * 1000)
    if re.fullmatch(r"\d{1,2}:\d{2}(:\d{2})?", t):
        t = midnight.strftime("%Y-%m-%d") + "T" + t.zfill(len(t) + (1 if t.index(":") == 1 else 0))
    if len(t) > 40 or not re.fullmatch(r"\d{4}-\d{2}-\d{2}([T ]\d{2}:\d{2}(:\d{2}(\.\d{1,6})?)?)?(Z|[+-]\d{2}:?\d{2})?", t):
        raise QueryError(f"time {text!r} is not a date (2026-12-07), a time (14:00, 2026-12-07T14:00Z), "
                         f"today, yesterday, or a span ago (30m, 2h, 3d, 1w)")
    try:
        when = _dt.datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError as exc:
        raise QueryError(f"time {text!r} is not a valid date or time: {exc}") from None
    if when.tzinfo is None:
        when = when.astimezone()  # local time
    return int(when.timestamp() * 1000)


# -- the index --------------------------------------------------------------------------------------

_SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS meta(k TEXT PRIMARY KEY, v);
CREATE TABLE IF NOT EXISTS events(
    no INTEGER PRIMARY KEY,   -- the journal's line number (1-based)
    at INTEGER NOT NULL,      -- byte offset of the line
    len INTEGER NOT NULL,     -- its length, without the newline
    ms INTEGER,               -- its time, ms since the epoch (NULL: unreadable)
    kind TEXT NOT NULL,       -- its kind ('' if unreadable)
    failed INTEGER NOT NULL,  -- 1: a tool_result with is_error
    big INTEGER NOT NULL      -- 1: its text is longer than what the trigram index holds
);
CREATE INDEX IF NOT EXISTS events_kind ON events(kind, no);
CREATE INDEX IF NOT EXISTS events_kind_ms ON events(kind, ms);
CREATE INDEX IF NOT EXISTS events_ms ON events(ms);
CREATE INDEX IF NOT EXISTS events_failed ON events(no) WHERE failed;
CREATE INDEX IF NOT EXISTS events_big ON events(no) WHERE big;
CREATE VIRTUAL TABLE IF NOT EXISTS words USING fts5(text, content='', tokenize='trigram', detail=none);
"""


class Position(NamedTuple):
    size: int  # journal bytes covered
    lines: int  # lines covered (stored as "count")
    last: str  # sha256 of the line ending at ``size`` ('' when empty)


class TimelineIndex:
    """One agent's timeline index (a SQLite file), over one journal file."""

    def __init__(self, db_path: str, journal_path: str) -> None:
        self.db_path = db_path
        self.journal_path = journal_path
        self.rebuilt = False  # (for tests and benchmarks: the last refresh started over)
        self.added = 0  # lines the last refresh added

    def _connect(self) -> "sqlite3.Connection":
        import sqlite3  # (only where the index is used: --tail alone loads none of it)

        makedirs_durable(os.path.dirname(self.db_path), 0o700)
        db = sqlite3.connect(self.db_path, timeout=30, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=DELETE")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA_SQL)
            version = db.execute("SELECT v FROM meta WHERE k='schema'").fetchone()
            if version is None:
                db.execute("INSERT OR REPLACE INTO meta VALUES('schema', ?)", (SCHEMA,))
            elif version[0] != SCHEMA:
                raise sqlite3.DatabaseError(f"schema {version[0]!r}, not {SCHEMA}")
        except BaseException:
            db.close()
            raise
        return db

    def open(self) -> "sqlite3.Connection":
        """The index's connection; an unusable file is removed and made anew (logged)."""
        import sqlite3

        try:
            return self._connect()
        except sqlite3.DatabaseError as exc:
            log.warning("timeline index %s is unusable (%s); building it again", self.db_path, exc)
        for suffix in ("", "-journal", "-wal", "-shm"):
            try:
                os.unlink(self.db_path + suffix)
            except FileNotFoundError:
                pass
        return self._connect()

    @staticmethod
    def _position(db: "sqlite3.Connection") -> Position:
        got = dict(db.execute("SELECT k, v FROM meta WHERE k IN ('size', 'count', 'last')").fetchall())
        try:
            return Position(int(got.get("size", 0)), int(got.get("count", 0)), str(got.get("last", "")))
        except (TypeError, ValueError):
            return Position(-1, 0, "")

    @staticmethod
    def _holds(snap: Snapshot, pos: Position) -> bool:
        """Whether the journal still ends its first ``pos.size`` bytes with the line the index ended on."""
        if pos.size < 0 or pos.size > snap.size:
            return False
        if pos.size == 0:
            return pos.lines == 0
        want = BLOCK
        while True:
            lo = max(0, pos.size - 1 - want)
            data = snap.read(lo, pos.size - lo)
            if not data.endswith(b"\n"):
                return False
            nl = data.rfind(b"\n", 0, len(data) - 1)
            if nl >= 0 or lo == 0:
                return line_hash(data[nl + 1 : -1]) == pos.last
            want *= 4

    def refresh(self, db: "sqlite3.Connection", snap: Snapshot) -> None:
        """Bring the index up to date with the journal (``snap``): add the
        lines after its position, or start over if it does not hold."""
        self.rebuilt = False
        self.added = 0
        pos = self._position(db)
        if pos.size == snap.size and self._holds(snap, pos):
            return
        db.execute("BEGIN IMMEDIATE")
        try:
            pos = self._position(db)  # (another process may have added meanwhile)
            if not self._holds(snap, pos):
                if pos.size:
                    log.warning("timeline index %s does not match its journal; building it again", self.db_path)
                db.execute("DELETE FROM events")
                db.execute("INSERT INTO words(words) VALUES('delete-all')")
                pos = Position(0, 0, "")
                self.rebuilt = True
            if pos.size < snap.size:
                if snap.size - pos.size >= NOTICE_BYTES:
                    log.warning("timeline index: indexing %d MiB of journal (%s); done once, later queries add only "
                                "what was appended since", (snap.size - pos.size) >> 20, self.journal_path)
                pos = self._add(db, snap, pos)
            db.executemany("INSERT OR REPLACE INTO meta VALUES(?, ?)",
                           (("size", pos.size), ("count", pos.lines), ("last", pos.last)))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def _add(self, db: "sqlite3.Connection", snap: Snapshot, pos: Position) -> Position:
        at, no, last = pos.size, pos.lines, pos.last
        while at < snap.size:
            data = snap.read(at, min(PIECE, snap.size - at))
            end = data.rfind(b"\n") + 1
            if end == 0:  # one line longer than the piece
                data = snap.read(at, snap.size - at)
                end = data.find(b"\n") + 1
                data = data[:end]
            data = data[:end]
            rows: list[tuple[int, int, int, int | None, str, int, int]] = []
            texts = []
            start = 0
            stop = False
            while start < end:
                nl = data.index(b"\n", start)
                line = data[start:nl]
                if b"\0" in line:
                    stop = True
                    break
                no += 1
                doc = parse_line(line)
                if doc is None:
                    rows.append((no, at + start, nl - start, None, "", 0, 0))
                else:
                    text = event_text(doc)
                    big = len(text) > MAX_INDEXED_TEXT
                    kind = doc.get("kind")
                    rows.append((no, at + start, nl - start, event_ms(doc.get("time")),
                                 kind if isinstance(kind, str) else "", int(is_failure(doc)), int(big)))
                    if text and not big:
                        texts.append((no, text))
                start = nl + 1
            db.executemany("INSERT INTO events VALUES(?, ?, ?, ?, ?, ?, ?)", rows)
            db.executemany("INSERT INTO words(rowid, text) VALUES(?, ?)", texts)
            self.added += len(rows)
            if rows:
                last = line_hash(data[rows[-1][1] - at : rows[-1][1] - at + rows[-1][2]])
            at += start
            if stop:
                break
        return Position(at, no, last)

    def candidates(self, db: "sqlite3.Connection", q: Query, *, newest_first: bool) -> Iterator[tuple[int, int, int]]:
        """(no, at, len) of the lines the index says may match ``q``."""
        where: list[str] = ["1"]
        args: list[object] = []
        if q.kinds:
            where.append(f"kind IN ({', '.join('?' * len(q.kinds))})")
            args += list(q.kinds)
        if q.since_ms is not None:
            where.append("ms >= ?")
            args.append(q.since_ms)
        if q.until_ms is not None:
            where.append("ms < ?")
            args.append(q.until_ms)
        if q.failed:
            where.append("failed")
        if q.grep:
            fts = fts_query(required_literals(q.grep))
            if fts is not None:  # (one IN over both: the candidates then drive the search)
                where.append("no IN (SELECT rowid FROM words WHERE words MATCH ? UNION ALL SELECT no FROM events WHERE big)")
                args.append(fts)
        order = "DESC" if newest_first else "ASC"
        yield from db.execute(f"SELECT no, at, len FROM events WHERE {' AND '.join(where)} ORDER BY no {order}", args)


def query_index(index: TimelineIndex, snap: Snapshot, q: Query) -> list[tuple[int, bytes]]:
    """(line number, line) of every journal line matching ``q`` (the last
    ``q.tail`` of them, if set), in journal order; the index brought up to
    date first. Every line is read from the journal and checked again."""
    matcher = Matcher(q)
    db = index.open()
    try:
        index.refresh(db, snap)
        out: list[tuple[int, bytes]] = []
        newest_first = q.tail is not None
        for no, at, n in index.candidates(db, q, newest_first=newest_first):
            if q.tail is not None and len(out) >= q.tail:
                break
            line = snap.read(at, n + 1) if at + n < snap.size else b""
            if not line.endswith(b"\n") or (at > 0 and snap.read(at - 1, 1) != b"\n"):
                log.warning("timeline index %s points into the middle of a line (line %d); it is built again "
                            "at the next query, and this one reads the whole journal", index.db_path, no)
                db.execute("UPDATE meta SET v = -1 WHERE k = 'size'")
                return scan(iter_lines(snap), q)
            line = line[:-1]
            if matcher.matches(parse_line(line)):
                out.append((no, line))
        if newest_first:
            out.reverse()
        return out
    finally:
        db.close()


def iter_lines(snap: Snapshot) -> Iterator[bytes]:
    """Every whole line of the journal, in order, read in pieces."""
    at = 0
    while at < snap.size:
        data = snap.read(at, min(PIECE, snap.size - at))
        end = data.rfind(b"\n") + 1
        if end == 0:
            data = snap.read(at, snap.size - at)
            end = data.find(b"\n") + 1
        yield from data[: end - 1].split(b"\n")
        at += end


def scan(lines: Iterable[bytes], q: Query) -> list[tuple[int, bytes]]:
    """:func:`query_index` without an index: every line parsed and tested
    (a capsule directory or tar, or a store this user cannot write)."""
    matcher = Matcher(q)
    out: list[tuple[int, bytes]] = []
    for no, line in enumerate(lines, 1):
        if b"\0" in line:
            break
        if matcher.matches(parse_line(line)):
            out.append((no, line))
            if q.tail is not None and len(out) > q.tail:
                del out[0]
    return out


def answer(snap: Snapshot, q: Query, index: TimelineIndex | None) -> list[tuple[int, bytes]]:
    """:func:`query_index` where the index can be used, else :func:`scan`
    (no index given, or it cannot be opened or written: a store this user
    may only read)."""
    import sqlite3

    if index is not None:
        try:
            return query_index(index, snap, q)
        except (OSError, sqlite3.Error) as exc:
            log.info("timeline index %s cannot be used (%s); reading the whole journal", index.db_path, exc)
    return scan(iter_lines(snap), q)
