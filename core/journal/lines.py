"""The journal's lines as bytes: each line's envelope, a file's lines split
and joined, chains verified, and the reference merge of two journals.

Everything here is a pure function of bytes already in memory: no file is
opened, nothing is stamped (:mod:`capsulefs.core.journal.chain` does that)
and nothing is appended (:mod:`capsulefs.core.journal.append` does that).

Rules:
  * A line is canonical JSON (see :mod:`capsulefs.core.journal.events`), so its
    sha256 is its identity. ``prev`` is the hash of the same machine's
    previous line, ``seq`` counts 1, 2, 3... per machine without gaps.
  * The file is sorted by (clock, machine, seq).
  * Nothing here rewrites or deletes an event. :func:`merge` builds a new
    list of lines; writing it somewhere is the caller's business.

Theory of operation (verify and merge):
  :func:`verify_lines` parses every line fully (schema and canonical form)
  and lists every problem with its line number, machine and seq.
  :func:`merge` is the reference merge, line by line: it pulls out the
  envelope of each line (a strict grammar match for JSON up to two levels
  deep, ``load_json`` for anything deeper), checks each input's order and
  seq runs, merges the two sorted inputs, and checks the union's chains by
  hashing each distinct line once. An input whose chain does not verify is
  refused; so are two different lines with the same (machine, seq), which
  is a fork. :func:`capsulefs.core.journal.envelope_index.merge_bytes` gives the same
  result vectorised, and defers to :func:`merge` for anything it does not
  accept, so the errors are the reference's.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from hashlib import sha256
from typing import Any

from ..errors import FormatError, IntegrityError
from ..capsule.format import MAX_INT, load_json
from .events import line_hash
from .record import Record

log = logging.getLogger(__name__)

Key = tuple[int, str, int]  # (clock, machine, seq): the journal's sort key


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
# the captured values are the envelope's. Deeper lines go to load_json.

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
_INT = rb"([1-9][0-9]{0,15})"  # below 10**16; MAX_INT is checked after
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
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_INT


def envelope(line: bytes) -> tuple[Key, str | None]:
    """((clock, machine, seq), prev) of one line, checking it is a JSON object
    with a well-formed envelope. Raises FormatError. Does not check the
    event's own fields or the canonical form (:func:`verify_lines` does)."""
    m = _fullmatch(line)
    if m is not None and (line.isascii() or _utf8(line)):
        clock, machine, prev, seq, v = m.groups()
        c, s = int(clock), int(seq)
        if c <= MAX_INT and s <= MAX_INT and int(v) <= MAX_INT:
            return (c, machine.decode(), s), (None if prev == b"null" else prev[1:-1].decode())
    doc = load_json(line, "the line")
    if not isinstance(doc, dict):
        raise FormatError("not a JSON object")
    missing = [k for k in ("clock", "id", "kind", "machine", "prev", "seq", "time", "v") if k not in doc]
    if missing:
        raise FormatError(f"lacks {', '.join(missing)}")
    clock, machine, seq, prev = doc["clock"], doc["machine"], doc["seq"], doc["prev"]
    if not (_posint(clock) and _posint(seq) and _posint(doc["v"])):
        raise FormatError("clock, seq and v must be integers from 1 to 2**53-1")
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
    # machine -> line numbers of its seqs 1, 2, 3... as long as they run
    # without a gap, to name forks; a seq beyond the run goes to ``stray``
    # (memory follows the number of lines, never the value of a seq)
    where: dict[str, list[int]] = {}
    stray: dict[str, dict[int, int]] = {}
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
        other = seen[seq - 1] if seq <= len(seen) else stray.get(machine, {}).get(seq)
        if other is not None:
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
        if seq == len(seen) + 1:
            seen.append(no)
        else:  # (never below: a seq the run holds was answered above)
            stray.setdefault(machine, {})[seq] = no
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
