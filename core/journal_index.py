"""A vectorised index of a journal's envelopes, and the fast merge built on it.

Rules:
  * This module is an optimisation of :func:`capsulefs.core.journal.merge`,
    which stays the reference: whenever the fast path finds anything it does
    not like (a line it cannot read, a chain that does not verify, a fork) it
    hands both inputs to the reference, which raises the precise error (or,
    if the fast path was merely too strict, returns the merge).
  * Like the reference, it reads each line's envelope (clock, machine, seq,
    prev) and checks chains, order and forks; it does not re-check each
    event's own fields or canonical form (``verify_lines`` does).

Theory of operation:
  A key token such as ``"clock":`` can only occur in valid JSON as an object
  key: inside a string its closing quote would have to be escaped. So when
  ``"clock":`` occurs exactly once in a line, it is the top-level key. The
  index finds every occurrence of the four envelope keys with numpy over the
  whole buffer, keeps the lines where each occurs once, and parses their
  values in bulk (digits, the machine's host id, the prev hex). The few lines
  where a key also occurs nested are read one by one with
  :func:`~capsulefs.core.journal.envelope`. The merge then sorts the two
  inputs' keys together, and checks order, seq runs and chains with array
  comparisons; the only per-line Python work left is hashing each distinct
  line once and cutting the output.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import numpy as np

from .errors import FormatError

log = logging.getLogger(__name__)

_CHUNK = 1 << 16  # lines parsed per vectorised step (bounds temporary memory)
_INT_WIDTH = 20  # digits window: 18 digits at most, then a terminator
_MACHINE_WIDTH = 67  # '"' + up to 64 chars + '"' + terminator; longer host ids go one by one
_WIDEST = 67  # widest window; lines whose values sit closer to the end go one by one
_BLOCK = 4 << 20  # bytes scanned per vectorised step
_KEYS = (b"clock", b"machine", b"prev", b"seq")
_HOST_CHARS = np.zeros(256, dtype=bool)
for _c in b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-":
    _HOST_CHARS[_c] = True
_ALNUM = _HOST_CHARS.copy()
_ALNUM[[ord("."), ord("_"), ord("-")]] = False
_HEX_VALUE = np.full(256, -1, dtype=np.int16)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_VALUE[_c] = _i
_POW10 = np.array([10**k for k in range(19)], dtype=np.int64)
_COMMA, _BRACE, _QUOTE, _COLON, _NL = ord(","), ord("}"), ord('"'), ord(":"), ord("\n")


class Unreadable(Exception):
    """The fast path gives up; the reference merge decides."""


@dataclass(slots=True)
class EnvelopeIndex:
    """Envelopes of every line of one journal's bytes."""

    data: bytes
    starts: np.ndarray  # int64: offset of each line
    ends: np.ndarray  # int64: offset of each line's newline
    clock: np.ndarray  # int64
    machine: list[str]  # host id of each line
    seq: np.ndarray  # int64
    has_prev: np.ndarray  # bool
    prev: np.ndarray  # (n, 32) uint8: prev digest (zeros when null)

    def __len__(self) -> int:
        return len(self.starts)


def _key_positions(buf: np.ndarray, colons: np.ndarray, key: bytes) -> np.ndarray:
    """Offsets just after each ``"<key>":`` (colons already follow a quote)."""
    token = b'"' + key + b'"'
    pos = colons[colons >= len(token)]
    for k in range(2, len(token) + 1):  # token[-1] (the quote) is pre-filtered
        pos = pos[buf[pos - k] == token[-k]]
    return pos + 1


def _windows(buf: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """Rows of ``width`` bytes from each start (each start + width <= len(buf))."""
    return np.lib.stride_tricks.sliding_window_view(buf, width)[starts]


def _parse_uints(buf: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values, ok) of positive integers without leading zeros, then ',' or '}'."""
    w = _windows(buf, starts, _INT_WIDTH)
    digit = (w >= 48) & (w <= 57)
    length = np.argmin(digit, axis=1)  # first non-digit
    term = w[np.arange(len(w)), length]
    ok = (length >= 1) & (length <= 18) & (w[:, 0] != 48) & ((term == _COMMA) | (term == _BRACE))
    exps = length[:, None] - 1 - np.arange(_INT_WIDTH)
    weights = np.where(exps >= 0, _POW10[np.clip(exps, 0, 18)], 0)
    values = ((w.astype(np.int64) - 48) * weights * digit).sum(axis=1)
    return values, ok


def _parse_machines(buf: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(end offsets of the host id, ok) for values '"<host id>"' then ',' or '}'."""
    w = _windows(buf, starts, _MACHINE_WIDTH)
    quote = w[:, 1:] == _QUOTE
    length = np.argmax(quote, axis=1)  # chars before the closing quote
    found = quote[np.arange(len(w)), length]
    inside = np.arange(_MACHINE_WIDTH - 1) < length[:, None]
    chars_ok = np.all(_HOST_CHARS[w[:, 1:]] | ~inside, axis=1)
    term = w[np.arange(len(w)), np.minimum(length + 2, _MACHINE_WIDTH - 1)]
    ok = (
        (w[:, 0] == _QUOTE) & found & (length >= 1) & _ALNUM[w[:, 1]] & chars_ok
        & ((term == _COMMA) | (term == _BRACE))
    )
    return starts + 1 + length, ok


def _parse_prevs(buf: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(has_prev, digests (n, 32), ok) for values null or '"<64 hex>"', then ',' or '}'."""
    w = _windows(buf, starts, 67)
    is_null = (w[:, 0] == ord("n")) & (w[:, 1] == ord("u")) & (w[:, 2] == ord("l")) & (w[:, 3] == ord("l"))
    null_ok = is_null & ((w[:, 4] == _COMMA) | (w[:, 4] == _BRACE))
    nib = _HEX_VALUE[w[:, 1:65]]
    hex_ok = (w[:, 0] == _QUOTE) & np.all(nib >= 0, axis=1) & (w[:, 65] == _QUOTE) & (
        (w[:, 66] == _COMMA) | (w[:, 66] == _BRACE)
    )
    nib = np.maximum(nib, 0).astype(np.uint8)
    digests = (nib[:, 0::2] << 4) | nib[:, 1::2]
    digests[~hex_ok] = 0
    return hex_ok, digests, null_ok | hex_ok


def index_journal(data: bytes) -> EnvelopeIndex:
    """Index every line's envelope. Raises Unreadable if a line cannot be read."""
    from .journal import envelope  # the per-line reader, for the odd lines

    if data and not data.endswith(b"\n"):
        raise Unreadable("torn tail")
    buf = np.frombuffer(data, dtype=np.uint8)
    # One pass over the bytes, in blocks small enough for the allocator to
    # reuse (fresh memory costs page faults): newlines and key tokens.
    newlines, found = [], {key: [] for key in _KEYS}
    for lo in range(0, len(buf), _BLOCK):
        block = buf[lo : lo + _BLOCK]
        newlines.append(np.flatnonzero(block == _NL) + lo)
        colons = np.flatnonzero(block == _COLON) + lo
        colons = colons[colons > 0]
        colons = colons[buf[colons - 1] == _QUOTE]
        for key in _KEYS:
            found[key].append(_key_positions(buf, colons, key))
    nl = np.concatenate(newlines) if newlines else np.zeros(0, dtype=np.int64)
    n = len(nl)
    starts = np.zeros(n, dtype=np.int64)
    starts[1:] = nl[:-1] + 1
    ends = nl
    clock = np.zeros(n, dtype=np.int64)
    seq = np.zeros(n, dtype=np.int64)
    has_prev = np.zeros(n, dtype=bool)
    prev = np.zeros((n, 32), dtype=np.uint8)
    m_end = np.zeros(n, dtype=np.int64)
    if n == 0:
        return EnvelopeIndex(data, starts, ends, clock, [], seq, has_prev, prev)

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
        m_end[lo:hi], ok3 = _parse_machines(buf, value_at[b"machine"][lo:hi])
        has_prev[lo:hi], prev[lo:hi], ok4 = _parse_prevs(buf, value_at[b"prev"][lo:hi])
        good[lo:hi] &= ok1 & ok2 & ok3 & ok4
    m_start = value_at[b"machine"] + 1

    names: dict[bytes, str] = {}
    machine = []
    for s, e in zip(m_start.tolist(), m_end.tolist()):
        raw = data[s:e]
        name = names.get(raw)
        if name is None:
            name = names[raw] = raw.decode("ascii", "replace")
        machine.append(name)

    for i in np.flatnonzero(~good).tolist():
        try:
            (c, mach, s), p = envelope(data[starts[i] : ends[i]])
        except FormatError as exc:
            raise Unreadable(str(exc)) from None
        clock[i], machine[i], seq[i] = c, mach, s
        has_prev[i] = p is not None
        prev[i] = np.frombuffer(bytes.fromhex(p), dtype=np.uint8) if p is not None else 0
    return EnvelopeIndex(data, starts, ends, clock, machine, seq, has_prev, prev)


def _ranks(*indexes: EnvelopeIndex) -> list[np.ndarray]:
    """Machine names as int ranks in string order, shared across indexes."""
    names = sorted({m for ix in indexes for m in set(ix.machine)})
    rank = {m: i for i, m in enumerate(names)}
    return [np.fromiter((rank[m] for m in ix.machine), dtype=np.int64, count=len(ix)) for ix in indexes]


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


def fast_merge(a: bytes, b: bytes) -> bytes:
    """Merge two journals' bytes; raises Unreadable when the reference must decide."""
    ia, ib = index_journal(a), index_journal(b)
    ma, mb = _ranks(ia, ib)
    for ix, m in ((ia, ma), (ib, mb)):
        if not (_strictly_sorted(ix.clock, m, ix.seq) and _runs_ok(m, ix.seq)):
            raise Unreadable("an input is out of order or has a gap")

    na = len(ia)
    clock = np.concatenate([ia.clock, ib.clock])
    mach = np.concatenate([ma, mb])
    seq = np.concatenate([ia.seq, ib.seq])
    order = np.lexsort((seq, mach, clock))
    c, m, s = clock[order], mach[order], seq[order]
    dup = np.zeros(len(order), dtype=bool)
    if len(order) > 1:
        dup[1:] = (c[1:] == c[:-1]) & (m[1:] == m[:-1]) & (s[1:] == s[:-1])
    # Every duplicate key must hold the same bytes in both inputs.
    for k in np.flatnonzero(dup).tolist():
        x, y = order[k - 1], order[k]
        if _line(ia, ib, na, x) != _line(ia, ib, na, y):
            raise Unreadable("fork")
    keep = order[~dup]
    c, m, s = clock[keep], mach[keep], seq[keep]
    has_prev = np.concatenate([ia.has_prev, ib.has_prev])[keep]
    prev = np.concatenate([ia.prev, ib.prev])[keep]

    # Hash each distinct line once.
    views = (memoryview(a), memoryview(b))
    bounds = (ia.starts, ia.ends, ib.starts, ib.ends)
    src = keep >= na
    row = np.where(src, keep - na, keep)
    sa, ea, sb, eb = (x.tolist() for x in bounds)
    sha = hashlib.sha256
    pieces: list[bytes] = []
    digests = bytearray()
    for from_b, r in zip(src.tolist(), row.tolist()):
        if from_b:
            piece = views[1][sb[r] : eb[r] + 1]
        else:
            piece = views[0][sa[r] : ea[r] + 1]
        digests += sha(piece[:-1]).digest()
        pieces.append(piece)  # type: ignore[arg-type]
    hashes = np.frombuffer(bytes(digests), dtype=np.uint8).reshape(-1, 32)

    # The union's chains: per machine, seqs 1, 2, 3... each prev the hash of the one before.
    by = np.lexsort((s, m))
    mm, ss, cc = m[by], s[by], c[by]
    first = np.ones(len(by), dtype=bool)
    first[1:] = mm[1:] != mm[:-1]
    if not (ss[first] == 1).all() or has_prev[by][first].any():
        raise Unreadable("a machine's first line")
    later = np.flatnonzero(~first)
    if len(later):
        cur, before = by[later], by[later - 1]
        if not ((ss[later] == ss[later - 1] + 1).all() and (cc[later] > cc[later - 1]).all()):
            raise Unreadable("fork or gap in the union")
        if not (has_prev[cur].all() and (prev[cur] == hashes[before]).all()):
            raise Unreadable("prev mismatch")
    return b"".join(pieces)


def _line(ia: EnvelopeIndex, ib: EnvelopeIndex, na: int, k: int) -> bytes:
    ix, r = (ia, k) if k < na else (ib, k - na)
    return ix.data[ix.starts[r] : ix.ends[r]]
