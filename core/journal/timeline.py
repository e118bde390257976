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
  * ``--grep`` patterns come from users: their cost is bounded (see
    :mod:`capsulefs.core.journal.query`, where queries and matching are).
    Candidates come from the index first: the literal runs a match must
    contain are looked up as trigrams in an FTS5 table.

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
import logging
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, NamedTuple

from ..errors import FormatError
from .events import line_hash
from .query import Matcher, Query, event_ms, event_text, fts_query, is_failure, parse_line, required_literals
from ..fsutil import makedirs_durable
from ..store.layout import TIMELINE_DIR

if TYPE_CHECKING:
    import sqlite3

log = logging.getLogger(__name__)

#: Where the host store keeps each agent's timeline index: ``<state>/timeline/<agent_id>/``.
INDEX_NAME = "index.sqlite"
SCHEMA = 1
#: Longest text of one event put in the trigram index; a longer one is always a candidate.
MAX_INDEXED_TEXT = 64 << 10
#: Bytes read at a time when reading the journal from the end or indexing it.
BLOCK = 64 << 10
PIECE = 8 << 20
#: Indexing at least this many bytes at once says so (the first query of a long history).
NOTICE_BYTES = 64 << 20


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
