"""Fuzz targets: the journal's tip file, and what ``capsulefs log`` parses
from users (--since/--until times, --grep patterns)."""

from __future__ import annotations

from pathlib import Path

from capsulefs.core.journal import query
from capsulefs.core.journal.tip import EMPTY, MachineTail, Tip, parse_tip, tip_bytes

from . import Target


def _tip_seeds() -> list[bytes]:
    tail = MachineTail(seq=3, digest="ab" * 32, clock=7, at=120)
    return [tip_bytes(EMPTY),
            tip_bytes(Tip(size=400, count=3, clock=7, last="host-a", tails={"host-a": tail},
                          model=("openai", "gpt-x"), sha_state=bytes(112), sha_lib="OpenSSL 3"))]


def _run_tip(data: bytes, scratch: Path) -> None:
    parse_tip(data)  # FormatError (a CapsuleError) if damaged


def _run_tip_body(data: bytes, scratch: Path) -> None:
    """The tip's JSON line with a checksum that matches: the fields' checks."""
    import hashlib

    line = data.split(b"\n", 1)[0]
    parse_tip(line + b"\n" + hashlib.blake2b(line, digest_size=16).hexdigest().encode() + b"\n")


def _run_when(data: bytes, scratch: Path) -> None:
    query.parse_when(data.decode("utf-8", "replace"), now=1_796_200_000.0)


def _run_grep(data: bytes, scratch: Path) -> None:
    pattern = data.decode("utf-8", "replace")
    query.fts_query(query.required_literals(pattern))  # never raises: no literal, no prefilter
    matcher = query.Matcher(query.Query(grep=pattern))  # QueryError if bad
    matcher.matches({"kind": "note", "text": "x" * 200 + " hello world"})  # QueryTooSlow past its budget


TARGETS = [
    Target("journal-tip", _tip_seeds, _run_tip),
    Target("journal-tip-fields", _tip_seeds, _run_tip_body),
    Target("log-time", lambda: [b"2026-12-07", b"2026-12-07T14:00:05.5+01:00", b"14:00", b"yesterday", b"3d"],
           _run_when),
    Target("log-grep", lambda: [b"build \\d+ failed", b"(ed|abc)+x", b"(?i)err", b"[a-z]{3,}"], _run_grep),
]
