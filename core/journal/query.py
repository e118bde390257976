"""A timeline query and what it asks of a journal line: the event's time,
text and failure, the query (kind, time, failure, pattern), matching it
with a bounded cost, the literals an index can look up, and times as users
write them. Pure: :mod:`capsulefs.core.journal.timeline` runs queries
against the journal and its index.

Rules:
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
"""

from __future__ import annotations

import functools
import json
import re
import time
from typing import Any

from ..errors import CapsuleError
from ..frozen import Frozen

#: Longest --grep pattern, in characters.
MAX_PATTERN = 1000
#: Time all the pattern matching of one query may take, in seconds.
GREP_SECONDS = 5.0
_ENVELOPE = frozenset(("v", "id", "machine", "seq", "clock", "prev", "time", "kind"))


class QueryError(CapsuleError):
    """A timeline query that cannot be answered as asked (bad pattern, bad time)."""


class QueryTooSlow(QueryError):
    """A --grep pattern took longer than its budget."""


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


class Query(Frozen):
    """What to look for; every field narrows. Times are ms since the epoch."""

    __slots__ = ("kinds", "since_ms", "until_ms", "grep", "failed", "tail")
    kinds: tuple[str, ...]
    since_ms: int | None  # inclusive
    until_ms: int | None  # exclusive
    grep: str | None
    failed: bool
    tail: int | None  # only the last N matches

    def __init__(
        self, *, kinds: tuple[str, ...] = (), since_ms: int | None = None, until_ms: int | None = None,
        grep: str | None = None, failed: bool = False, tail: int | None = None,
    ) -> None:
        for name, value in (("kinds", kinds), ("since_ms", since_ms), ("until_ms", until_ms), ("grep", grep),
                            ("failed", failed), ("tail", tail)):
            object.__setattr__(self, name, value)

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
