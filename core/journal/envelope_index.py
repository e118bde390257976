"""A vectorised index of a journal's envelopes, and the fast merge built on it.

Rules:
  * This module is an optimisation of :func:`capsulefs.core.journal.lines.merge`,
    which stays the reference: whenever the fast path finds anything it does
    not like (a line it cannot read, a chain that does not verify, a fork) it
    hands both inputs to the reference, which raises the precise error (or,
    if the fast path was merely too strict, returns the merge).
  * Like the reference, it reads each line's envelope (clock, machine, seq,
    prev) and checks chains, order and forks; it does not re-check each
    event's own fields or canonical form (``verify_lines`` does). It reads
    the envelope's tokens, not the whole line: a line that is not JSON (or
    holds a key twice) but has each of the four keys once passes it, where
    the reference would refuse; callers verify their inputs first.

Theory of operation:
  A key token such as ``"clock":`` can only occur in valid JSON as an object
  key: inside a string its closing quote would have to be escaped. So when
  ``"clock":`` occurs exactly once in a line, it is the top-level key. The
  index finds every occurrence of the four envelope keys with numpy over the
  whole buffer, keeps the lines where each occurs once, and parses their
  values in bulk (digits, the machine's host id, the prev hex). The few lines
  where a key also occurs nested are read one by one with
  :func:`~capsulefs.core.journal.lines.envelope`. The merge then sorts the two
  inputs' keys together, and checks order, seq runs and chains with array
  comparisons; the only per-line Python work left is hashing each distinct
  line once and cutting the output.
  Two copies of one journal usually share a long common prefix (the history
  before they diverged): it is found with one byte comparison, indexed once,
  and copied to the output as one piece.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import re
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..errors import FormatError
from ..capsule.format import MAX_INT
from .lines import envelope, join_lines, merge, split_lines

log = logging.getLogger(__name__)

#: What the fast path reads: bytes, or an mmap of a journal file.
Buffer = bytes | mmap.mmap

_CHUNK = 1 << 16  # lines parsed per vectorised step (bounds temporary memory)
_INT_WIDTH = 20  # digits window: 18 digits at most, then a terminator
_MACHINE_WIDTH = 67  # '"' + up to 64 chars + '"' + terminator; longer host ids go one by one
_NAME_BYTES = 64  # host id bytes kept per line (as 8 uint64)
_WIDEST = 67  # widest window; lines whose values sit closer to the end go one by one
_BLOCK = 4 << 20  # bytes scanned per vectorised step
_PARALLEL_MIN = 16 << 20  # journals at least this big are indexed on two threads
_KEYS = (b"clock", b"machine", b"prev", b"seq")
_HOST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_COMMA, _BRACE, _QUOTE, _COLON, _NL = ord(","), ord("}"), ord('"'), ord(":"), ord("\n")


class Unreadable(Exception):
    """The fast path gives up; the reference merge decides."""


@dataclass(slots=True)
class EnvelopeIndex:
    """Envelopes of every line of ``data[start:]``; offsets are into ``data``."""

    data: Buffer
    starts: np.ndarray  # int64: offset of each line
    ends: np.ndarray  # int64: offset of each line's newline
    clock: np.ndarray  # int64
    names: list[str]  # the distinct host ids
    mid: np.ndarray  # int64: index into names of each line's machine
    seq: np.ndarray  # int64
    has_prev: np.ndarray  # bool
    prev: np.ndarray  # (n, 8) uint64: the 64 hex characters of prev (zeros when null)

    def __len__(self) -> int:
        return len(self.starts)


def _key_positions(buf: np.ndarray, colons: np.ndarray, before: np.ndarray, key: bytes) -> np.ndarray:
    """Offsets just after each ``"<key>":``. ``colons`` follow a quote and
    ``before`` is the byte before that quote."""
    token = b'"' + key + b'"'
    pos = colons[(before == token[-2]) & (colons >= len(token))]
    for k in range(3, len(token) + 1):  # the quote and the key's last letter are checked
        pos = pos[buf[pos - k] == token[-k]]
    found: np.ndarray = pos + 1
    return found


def _windows(buf: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """Rows of ``width`` bytes from each start (each start + width <= len(buf))."""
    rows: np.ndarray = np.lib.stride_tricks.sliding_window_view(buf, width)[starts]
    return rows


def _parse_uints(buf: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values, ok) of positive integers without leading zeros, then ',' or '}'."""
    w = _windows(buf, starts, _INT_WIDTH)
    digit = (w >= 48) & (w <= 57)
    length = np.argmin(digit, axis=1)  # first non-digit (0 if all are digits: not ok)
    term = w[np.arange(len(w)), length]
    ok = (length >= 1) & (length <= 18) & (w[:, 0] != 48) & ((term == _COMMA) | (term == _BRACE))
    values = np.zeros(len(w), dtype=np.int64)
    longest = int(length[ok].max()) if ok.any() else 0
    for k in range(longest):
        values = np.where(k < length, values * 10 + (w[:, k].astype(np.int64) - 48), values)
    return values, ok & (values <= MAX_INT)  # bigger: the line-by-line reader refuses it, naming it


def _parse_machines(buf: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(host ids as 64 zero-padded bytes viewed as 8 uint64, ok) for values
    '"<host id>"' then ',' or '}'. The host id's characters are checked once
    per distinct host id (:func:`_machine_ids`); longer ones are not ok here."""
    w = _windows(buf, starts, _MACHINE_WIDTH)
    quote = w[:, 1:] == _QUOTE
    length = np.argmax(quote, axis=1)  # chars before the closing quote
    rows = np.arange(len(w))
    term = w[rows, np.minimum(length + 2, _MACHINE_WIDTH - 1)]
    ok = (w[:, 0] == _QUOTE) & quote[rows, length] & (length <= _NAME_BYTES) & ((term == _COMMA) | (term == _BRACE))
    inside = np.arange(_NAME_BYTES) < length[:, None]
    names = np.ascontiguousarray(w[:, 1 : 1 + _NAME_BYTES] * inside)
    return names.view(np.uint64), ok


def _parse_prevs(buf: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(has_prev, the 64 characters of prev as 8 uint64, ok) for values null or
    '"<64 characters>"', then ',' or '}'. The characters are not checked here:
    they must equal the lowercase hex of a computed digest, or the chain fails."""
    w = _windows(buf, starts, 67)
    is_null = (w[:, 0] == ord("n")) & (w[:, 1] == ord("u")) & (w[:, 2] == ord("l")) & (w[:, 3] == ord("l"))
    null_ok = is_null & ((w[:, 4] == _COMMA) | (w[:, 4] == _BRACE))
    quoted = (w[:, 0] == _QUOTE) & (w[:, 65] == _QUOTE) & ((w[:, 66] == _COMMA) | (w[:, 66] == _BRACE))
    text = np.ascontiguousarray(w[:, 1:65]).view(np.uint64)
    return quoted, text, null_ok | quoted


_NAME_MIX = (np.arange(1, _NAME_BYTES // 8 + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) | np.uint64(1)


def _machine_ids(rows: np.ndarray, lines: np.ndarray) -> tuple[list[str], np.ndarray]:
    """Distinct host ids among ``lines`` (rows: 64 zero-padded bytes as 8 uint64)
    and the id of each of those lines. Exact: a key shared by two host ids is
    detected (and left to the reference merge)."""
    if len(lines) == 0:
        return [], np.zeros(0, dtype=np.int64)
    keys = np.zeros(len(lines), dtype=np.uint64)
    for lo in range(0, len(lines), _CHUNK):
        sub = rows[lines[lo : lo + _CHUNK]]
        keys[lo : lo + _CHUNK] = (sub * _NAME_MIX).sum(axis=1, dtype=np.uint64)
    _uniq, first, inv = np.unique(keys, return_index=True, return_inverse=True)
    inv = inv.reshape(-1).astype(np.int64)
    rep = rows[lines[first]]
    for lo in range(0, len(lines), _CHUNK):
        if not (rows[lines[lo : lo + _CHUNK]] == rep[inv[lo : lo + _CHUNK]]).all():
            raise Unreadable("two host ids share a key")
    names = [r.tobytes().rstrip(b"\0").decode("latin-1") for r in rep]
    if not all(_HOST_RE.fullmatch(name) for name in names):
        raise Unreadable("a machine is not a host id")
    return names, inv


def index_journal(data: Buffer, start: int = 0, end: int | None = None) -> EnvelopeIndex:
    """Index the envelope of every line of ``data[start:end]`` (both at line
    boundaries). Raises Unreadable if a line cannot be read."""
    if len(data) > start and data[-1:] != b"\n":
        raise Unreadable("torn tail")
    buf = np.frombuffer(data, dtype=np.uint8)[start:]  # windows may look past ``end``
    scan = len(buf) if end is None else end - start
    # One pass over the bytes, in blocks small enough for the allocator to
    # reuse (fresh memory costs page faults): newlines and key tokens.
    newlines: list[np.ndarray] = []
    found: dict[bytes, list[np.ndarray]] = {key: [] for key in _KEYS}
    for lo in range(0, scan, _BLOCK):
        block = buf[lo : min(lo + _BLOCK, scan)]
        newlines.append(np.flatnonzero(block == _NL) + lo)
        colons = np.flatnonzero(block == _COLON) + lo
        colons = colons[colons > 1]
        colons = colons[buf[colons - 1] == _QUOTE]
        before = buf[colons - 2]
        for key in _KEYS:
            found[key].append(_key_positions(buf, colons, before, key))
    nl = np.concatenate(newlines).astype(np.int64) if newlines else np.zeros(0, dtype=np.int64)
    n = len(nl)
    starts = np.zeros(n, dtype=np.int64)
    starts[1:] = nl[:-1] + 1
    ends = nl
    clock = np.zeros(n, dtype=np.int64)
    seq = np.zeros(n, dtype=np.int64)
    has_prev = np.zeros(n, dtype=bool)
    prev = np.zeros((n, 8), dtype=np.uint64)
    name_rows = np.zeros((n, _NAME_BYTES // 8), dtype=np.uint64)
    if n == 0:
        return EnvelopeIndex(data, starts + start, ends + start, clock, [], np.zeros(0, dtype=np.int64), seq, has_prev, prev)

    good = (ends - starts >= 2) & (buf[starts] == ord("{")) & (buf[np.maximum(ends - 1, 0)] == _BRACE)
    last_row = len(buf) - _WIDEST  # windows must fit in the buffer
    value_at = {}
    for key in _KEYS:
        pos = np.concatenate(found[key])
        line = np.searchsorted(nl, pos)
        good &= np.bincount(line, minlength=n)[:n] == 1
        at = np.zeros(n, dtype=np.int64)
        at[line[line < n]] = pos[line < n]
        good &= at <= last_row
        value_at[key] = np.clip(at, 0, max(last_row, 0))
    if last_row < 0:
        good[:] = False  # a tiny journal: every line goes one by one

    for lo in range(0, n if last_row >= 0 else 0, _CHUNK):
        hi = min(n, lo + _CHUNK)
        clock[lo:hi], ok1 = _parse_uints(buf, value_at[b"clock"][lo:hi])
        seq[lo:hi], ok2 = _parse_uints(buf, value_at[b"seq"][lo:hi])
        name_rows[lo:hi], ok3 = _parse_machines(buf, value_at[b"machine"][lo:hi])
        has_prev[lo:hi], prev[lo:hi], ok4 = _parse_prevs(buf, value_at[b"prev"][lo:hi])
        good[lo:hi] &= ok1 & ok2 & ok3 & ok4

    names, ids = _machine_ids(name_rows, np.flatnonzero(good))
    mid = np.zeros(n, dtype=np.int64)
    mid[good] = ids
    name_id = {name: i for i, name in enumerate(names)}
    for i in np.flatnonzero(~good).tolist():
        try:
            (c, mach, s), p = envelope(bytes(data[start + starts[i] : start + ends[i]]))
        except FormatError as exc:
            raise Unreadable(str(exc)) from None
        clock[i], seq[i] = c, s
        if mach not in name_id:
            name_id[mach] = len(names)
            names.append(mach)
        mid[i] = name_id[mach]
        has_prev[i] = p is not None
        prev[i] = np.frombuffer(p.encode(), dtype=np.uint64) if p is not None else 0
    return EnvelopeIndex(data, starts + start, ends + start, clock, names, mid, seq, has_prev, prev)


def index_parallel(data: Buffer, start: int = 0, *, parts: int = 2, min_size: int = _PARALLEL_MIN) -> EnvelopeIndex:
    """:func:`index_journal` of ``data[start:]``, cut at newlines into ``parts``
    indexed on threads (numpy releases the GIL in its loops), when it holds at
    least ``min_size`` bytes."""
    size = len(data) - start
    if parts < 2 or size < min_size:
        return index_journal(data, start)
    cuts = [start]
    for k in range(1, parts):
        nl = data.find(b"\n", start + size * k // parts)
        if nl < 0 or nl + 1 >= len(data):
            break
        if nl + 1 > cuts[-1]:
            cuts.append(nl + 1)
    cuts.append(len(data))
    with ThreadPoolExecutor(max_workers=len(cuts) - 1) as pool:
        pieces = list(pool.map(lambda r: index_journal(data, r[0], r[1]), zip(cuts, cuts[1:])))
    names: list[str] = []
    name_id: dict[str, int] = {}
    mids = []
    for part in pieces:
        for name in part.names:
            if name not in name_id:
                name_id[name] = len(names)
                names.append(name)
        table = np.array([name_id[m] for m in part.names] or [0], dtype=np.int64)
        mids.append(table[part.mid])
    return EnvelopeIndex(
        data,
        np.concatenate([x.starts for x in pieces]),
        np.concatenate([x.ends for x in pieces]),
        np.concatenate([x.clock for x in pieces]),
        names,
        np.concatenate(mids),
        np.concatenate([x.seq for x in pieces]),
        np.concatenate([x.has_prev for x in pieces]),
        np.concatenate([x.prev for x in pieces]),
    )


def _ranks(*indexes: EnvelopeIndex) -> list[np.ndarray]:
    """Machine names as int ranks in string order, shared across indexes."""
    names = sorted({m for ix in indexes for m in ix.names})
    rank = {m: i for i, m in enumerate(names)}
    out = []
    for ix in indexes:
        table = np.array([rank[m] for m in ix.names], dtype=np.int64)
        out.append(table[ix.mid] if len(ix) else np.zeros(0, dtype=np.int64))
    return out


def _strictly_sorted(clock: np.ndarray, mach: np.ndarray, seq: np.ndarray) -> bool:
    if len(clock) < 2:
        return True
    c0, c1, m0, m1, s0, s1 = clock[:-1], clock[1:], mach[:-1], mach[1:], seq[:-1], seq[1:]
    gt = (c1 > c0) | ((c1 == c0) & ((m1 > m0) | ((m1 == m0) & (s1 > s0))))
    return bool(gt.all())


def _runs_ok(mach: np.ndarray, seq: np.ndarray) -> bool:
    """Each machine's seqs, in file order, are 1, 2, 3..."""
    if len(mach) == 0:
        return True
    order = np.argsort(mach, kind="stable")
    m = mach[order]
    first = np.ones(len(m), dtype=bool)
    first[1:] = m[1:] != m[:-1]
    group_start = np.maximum.accumulate(np.where(first, np.arange(len(m)), 0))
    return bool((seq[order] == np.arange(len(m)) - group_start + 1).all())


def common_prefix(a: Buffer, b: Buffer) -> int:
    """Length of the longest run of whole lines both start with."""
    n = min(len(a), len(b))
    lo, step = 0, 1 << 20
    while lo < n:
        hi = min(n, lo + step)
        if a[lo:hi] != b[lo:hi]:
            diff = np.flatnonzero(np.frombuffer(a, np.uint8, hi - lo, lo) != np.frombuffer(b, np.uint8, hi - lo, lo))
            lo += int(diff[0])
            break
        lo = hi
    return a.rfind(b"\n", 0, lo) + 1


def _pick(from_b: np.ndarray, rows: np.ndarray, xa: np.ndarray, xb: np.ndarray) -> np.ndarray:
    """``xb[rows]`` where ``from_b``, else ``xa[rows]``."""
    if not from_b.any():
        picked: np.ndarray = xa[rows]
        return picked
    out = np.empty((len(rows),) + xa.shape[1:], dtype=xa.dtype)
    out[~from_b] = xa[rows[~from_b]]
    out[from_b] = xb[rows[from_b]]
    return out


def fast_merge(a: Buffer, b: Buffer) -> Iterator[bytes | memoryview]:
    """Merge two journals' bytes (bytes or mmap); return the merged journal as
    pieces to join or write (made as they are consumed, after every check
    passed). Raises Unreadable, before returning, when the reference must
    decide."""
    p = common_prefix(a, b)
    ia = index_parallel(a)
    ib = index_parallel(b, p)  # B's lines after the shared prefix
    kp = int(np.searchsorted(ia.ends, p))  # lines in the shared prefix
    ra, rb = _ranks(ia, ib)
    if not (_strictly_sorted(ia.clock, ra, ia.seq) and _runs_ok(ra, ia.seq)):
        raise Unreadable("input A is out of order or has a gap")
    bc, bm, bs = (np.concatenate([x[:kp], y]) for x, y in ((ia.clock, ib.clock), (ra, rb), (ia.seq, ib.seq)))
    if not (_strictly_sorted(bc, bm, bs) and _runs_ok(bm, bs)):
        raise Unreadable("input B is out of order or has a gap")

    # The tails after the prefix, merged: rows 0..nta-1 are A's, then B's.
    nta = len(ia) - kp
    clock = np.concatenate([ia.clock[kp:], ib.clock])
    mach = np.concatenate([ra[kp:], rb])
    seq = np.concatenate([ia.seq[kp:], ib.seq])
    order = np.lexsort((seq, mach, clock))
    c, m, s = clock[order], mach[order], seq[order]
    dup = np.zeros(len(order), dtype=bool)
    if len(order) > 1:
        dup[1:] = (c[1:] == c[:-1]) & (m[1:] == m[:-1]) & (s[1:] == s[:-1])
    for k in np.flatnonzero(dup).tolist():  # the same key must hold the same bytes
        x, y = sorted((int(order[k - 1]), int(order[k])))
        if y < nta or x >= nta:
            raise Unreadable("a key twice in one input")
        xa, yb = kp + x, y - nta
        if a[ia.starts[xa] : ia.ends[xa]] != b[ib.starts[yb] : ib.ends[yb]]:
            raise Unreadable("fork")
    keep = order[~dup]

    # The union: the prefix, then the kept tail rows; (source, row) of each line.
    from_b = np.concatenate([np.zeros(kp, dtype=bool), keep >= nta])
    row = np.concatenate([np.arange(kp), np.where(keep >= nta, keep - nta, keep + kp)])
    uc = np.concatenate([ia.clock[:kp], clock[keep]])
    um = np.concatenate([ra[:kp], mach[keep]])
    us = np.concatenate([ia.seq[:kp], seq[keep]])
    has_prev = _pick(from_b, row, ia.has_prev, ib.has_prev)

    sha = hashlib.sha256
    # Hash each distinct line once, as the hex text a prev holds. In chunks,
    # dropping each slice at once: small buffers are reused, fresh ones fault.
    hashes = np.empty((len(row), 8), dtype=np.uint64)
    for ix, mask, data in ((ia, ~from_b, a), (ib, from_b, b)):
        at = np.flatnonzero(mask)
        for lo in range(0, len(at), _CHUNK):
            rows = row[at[lo : lo + _CHUNK]]
            digests = [sha(data[x:y]).hexdigest() for x, y in zip(ix.starts[rows].tolist(), ix.ends[rows].tolist())]
            hashes[at[lo : lo + _CHUNK]] = np.frombuffer("".join(digests).encode("ascii"), dtype=np.uint64).reshape(-1, 8)

    # The union's chains: per machine, seqs 1, 2, 3... each prev the hash of the one before.
    by = np.lexsort((us, um))
    mm, ss, cc = um[by], us[by], uc[by]
    first = np.ones(len(by), dtype=bool)
    first[1:] = mm[1:] != mm[:-1]
    if not (ss[first] == 1).all() or has_prev[by][first].any():
        raise Unreadable("a machine's first line")
    later = np.flatnonzero(~first)
    if len(later):
        cur, before = by[later], by[later - 1]
        if not ((ss[later] == ss[later - 1] + 1).all() and (cc[later] > cc[later - 1]).all()):
            raise Unreadable("fork or gap in the union")
        if not has_prev[cur].all():
            raise Unreadable("a later line without prev")
        for lo in range(0, len(cur), _CHUNK):
            c, bf = cur[lo : lo + _CHUNK], before[lo : lo + _CHUNK]
            if not (_pick(from_b[c], row[c], ia.prev, ib.prev) == hashes[bf]).all():
                raise Unreadable("prev mismatch")

    # The output: the prefix in one piece, then runs of consecutive lines of
    # one input, cut lazily in chunks (so their buffers are reused).
    tail_b, tail_row = from_b[kp:], row[kp:]
    if not len(tail_row):
        return iter([memoryview(a)[:p]])
    brk = np.ones(len(tail_row), dtype=bool)
    brk[1:] = (tail_b[1:] != tail_b[:-1]) | (tail_row[1:] != tail_row[:-1] + 1)
    first_row = tail_row[brk]
    last_row = tail_row[np.append(np.flatnonzero(brk)[1:] - 1, len(tail_row) - 1)]
    run_b = tail_b[brk]
    starts = _pick(run_b, first_row, ia.starts, ib.starts)
    ends = _pick(run_b, last_row, ia.ends, ib.ends) + 1
    return _pieces(a, b, p, run_b, starts, ends)


def _pieces(a: Buffer, b: Buffer, p: int, run_b: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> Iterator[bytes | memoryview]:
    yield memoryview(a)[:p]
    src = (a, b)
    for k in range(0, len(lo), _CHUNK // 4):
        runs = zip(run_b[k : k + _CHUNK // 4].tolist(), lo[k : k + _CHUNK // 4].tolist(), hi[k : k + _CHUNK // 4].tolist())
        yield b"".join([src[s][x:y] for s, x, y in runs])


def merge_bytes(a: bytes, b: bytes) -> bytes:
    """:func:`~capsulefs.core.journal.lines.merge` on whole journal files,
    vectorised (same result, same refusals, on inputs whose every line
    :func:`~capsulefs.core.journal.lines.envelope` reads).

    The fast path (:func:`fast_merge`) hands anything it does not accept to
    the reference merge, which raises the precise ChainError.
    It reads envelope tokens, not whole lines: a line whose body is broken
    but whose envelope keys it finds may pass it. Verify inputs first.
    """
    return b"".join(merge_pieces(a, b))


def merge_pieces(a: Buffer, b: Buffer) -> Iterable[bytes | memoryview]:
    """:func:`merge_bytes` as pieces (the inputs may be mmaps of the journal
    files), for writing without building the whole result. Every check is
    done before this returns."""
    try:
        return fast_merge(a, b)
    except Unreadable as exc:
        log.debug("fast merge declined (%s); using the reference merge", exc)
    return [join_lines(merge(split_lines(bytes(a), "journal A"), split_lines(bytes(b), "journal B")))]
