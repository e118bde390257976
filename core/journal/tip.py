"""The journal's tip: what opening a journal needs to know about its history
(each machine's last line, the clock, the count, the last model switch, the
running digest), kept on disk beside the journal, so that opening it costs
the bytes appended since, not the history.

Rules:
  * Derived data, host-local: ``<state>/journal-tip/<agent_id>``, never
    part of a capsule (not listed in its manifest, not exported, not moved:
    an agent that arrives has none until its journal is first read whole).
    Removed with the agent; an installed agent's old one is removed too.
  * Never trusted blindly. A tip is used only if its checksum holds and
    every machine's last line is where the tip says (its offset), with the
    hash and envelope (clock, machine, seq) it says, and the last of them
    ends exactly at the tip's size. Otherwise it is ignored (logged) and the
    journal is read from its start, as without a tip.
  * What the check does not see is what a :class:`~capsulefs.core.journal.file.Journal`
    catching up in memory does not see either: an edit in place of lines
    before the tip that leaves every machine's last line where it was.
    ``verify`` (and import, and a move's target) read every line.
  * Written atomically (temp file, fsync, rename, fsync of the directory)
    by a journal that caught up with or appended :data:`TIP_EVERY` bytes
    past the tip it knows. A tip that cannot be written is logged and the
    journal goes on: it is an optimisation, never a condition.

Theory of operation: a new tip is the old one advanced over the new bytes
(:func:`advance_tip`). The journal's chain state (in memory, already
caught up) gives the tails; the new bytes are read once to find the offset
of each machine's new last line (scanning back from the end, usually one
line), the last ``model_switch`` among them, and to extend the running
SHA-256 (:mod:`capsulefs.core.sha256_state`), which the mount's manifest
uses instead of hashing the whole journal again.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import sha256_state
from ..errors import FormatError
from .events import ModelSwitch, line_hash
from .record import Record
from ..fsutil import atomic_write, makedirs_durable
from ..store.layout import JOURNAL_TIP_DIR

if TYPE_CHECKING:
    from .chain import ChainState

log = logging.getLogger(__name__)

#: Where the host store keeps each agent's tip: ``<state>/journal-tip/<agent_id>``.
#: A journal writes a new tip once it knows this many bytes past the last one.
TIP_EVERY = 256 << 10
#: Longest line a tip check reads (a longer one makes the tip unusable).
MAX_LINE = 64 << 20
_VERSION = 1
_MODEL = b'"kind":"model_switch"'


def journal_tip_path(store_root: str, agent_id: str) -> str:
    """The tip of an agent of the host store (outside its capsule)."""
    return os.path.join(store_root, JOURNAL_TIP_DIR, agent_id)


@dataclass(frozen=True, slots=True, kw_only=True)
class MachineTail:
    """One machine's last line in the journal."""

    seq: int
    digest: str  # sha256 of the line
    clock: int
    at: int  # byte offset where the line starts


@dataclass(frozen=True, slots=True, kw_only=True)
class Tip:
    """The journal's first ``size`` bytes (whole lines), summed up."""

    size: int  # bytes covered: whole lines, the last ending at size
    count: int  # lines covered
    clock: int  # greatest clock (the last line's: the file is sorted)
    last: str | None  # machine of the line ending at size (None: empty)
    tails: Mapping[str, MachineTail]
    model: tuple[str, str] | None  # the last model_switch (provider, model)
    sha_state: bytes | None  # running SHA-256 of the covered bytes (sha256_state), if saved
    sha_lib: str  # the library that saved it

    def chain_state(self) -> "ChainState":
        """The stamping state this tip stands for."""
        from .chain import ChainState, Tail

        state = ChainState()
        state.tails = {m: Tail(seq=t.seq, digest=t.digest, clock=t.clock) for m, t in self.tails.items()}
        state.clock = self.clock
        state.count = self.count
        if self.last is not None:
            t = self.tails[self.last]
            state.last = (t.clock, self.last, t.seq)
        return state

    def sha256(self) -> "sha256_state.Sha256State | None":
        """The running digest of the covered bytes, if it can be resumed here."""
        if self.sha_state is None:
            return None
        return sha256_state.resume(self.sha_state, self.sha_lib, self.size)


EMPTY = Tip(size=0, count=0, clock=0, last=None, tails={}, model=None, sha_state=None, sha_lib="")


# -- the file -------------------------------------------------------------------


def tip_bytes(tip: Tip) -> bytes:
    """Line 1: the tip as canonical JSON; line 2: blake2b-128 of line 1."""
    body = {
        "v": _VERSION,
        "size": tip.size,
        "count": tip.count,
        "clock": tip.clock,
        "last": tip.last,
        "tails": {m: [t.seq, t.digest, t.clock, t.at] for m, t in sorted(tip.tails.items())},
        "model": list(tip.model) if tip.model else None,
        "sha256": None if tip.sha_state is None else {
            "lib": tip.sha_lib, "state": base64.b64encode(tip.sha_state).decode("ascii")},
    }
    line = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return line + b"\n" + hashlib.blake2b(line, digest_size=16).hexdigest().encode() + b"\n"


def _int(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise FormatError(f"{what} is not a count")
    return value


def parse_tip(data: bytes) -> Tip:
    """A tip from its file's bytes; FormatError if damaged or of another version."""
    line, sep, rest = data.partition(b"\n")
    if not sep or rest.rstrip(b"\n") != hashlib.blake2b(line, digest_size=16).hexdigest().encode():
        raise FormatError("its checksum does not match")
    try:
        doc = json.loads(line)
    except ValueError as exc:
        raise FormatError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("v") != _VERSION:
        raise FormatError("not a tip of this version")
    try:
        tails = {}
        for m, (seq, digest, clock, at) in doc["tails"].items():
            if not isinstance(m, str) or not isinstance(digest, str) or len(digest) != 64:
                raise FormatError(f"tail of {m!r} is malformed")
            tails[m] = MachineTail(seq=_int(seq, "seq"), digest=digest, clock=_int(clock, "clock"), at=_int(at, "at"))
        last = doc["last"]
        if (last is None) != (not tails) or (last is not None and last not in tails):
            raise FormatError("its last machine has no tail")
        model = doc["model"]
        if model is not None and not (isinstance(model, list) and len(model) == 2
                                      and all(isinstance(x, str) for x in model)):
            raise FormatError("model is malformed")
        sha = doc["sha256"]
        state = None if sha is None else base64.b64decode(sha["state"], validate=True)
        return Tip(size=_int(doc["size"], "size"), count=_int(doc["count"], "count"),
                   clock=_int(doc["clock"], "clock"), last=last, tails=tails,
                   model=None if model is None else (model[0], model[1]),
                   sha_state=state, sha_lib=str(sha["lib"]) if sha is not None else "")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise FormatError(f"malformed: {exc!r}") from None


def load_tip(path: str) -> Tip | None:
    """The tip saved at ``path``, or None (absent, unreadable: logged)."""
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.info("journal tip %s cannot be read (%s); reading the journal whole", path, exc)
        return None
    try:
        return parse_tip(data)
    except FormatError as exc:
        log.warning("journal tip %s is not usable (%s); reading the journal whole", path, exc)
        return None


def save_tip(path: str, tip: Tip) -> None:
    """Write ``tip`` atomically at ``path`` (its directory made if needed)."""
    makedirs_durable(os.path.dirname(path), 0o700)
    atomic_write(path, tip_bytes(tip), mode=0o600)


def forget_tip(path: str) -> None:
    """Remove an agent's tip, if any (the agent left, or was installed anew)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# -- checking a tip against the journal ------------------------------------------


def line_at(fd: int, at: int, end: int) -> bytes | None:
    """The line starting at byte ``at`` (without its newline), if it ends
    (its newline included) at or before ``end``; else None."""
    want = 4096
    while True:
        data = os.pread(fd, min(want, end - at), at)
        nl = data.find(b"\n")
        if nl >= 0:
            return data[:nl]
        if at + len(data) >= end or len(data) < min(want, end - at) or want >= MAX_LINE:
            return None
        want *= 4


def mismatch(fd: int, tip: Tip, file_size: int) -> str | None:
    """Why ``tip`` does not describe the journal open at ``fd`` (``file_size``
    bytes now), or None if every machine's last line is where it says."""
    if tip.size > file_size:
        return f"it covers {tip.size} bytes, the journal has {file_size}"
    if tip.size == 0:
        return None if tip.count == 0 and not tip.tails else "it is empty but lists lines"
    from .lines import envelope  # (its grammar compiles on first import: only where tips are checked)

    if tip.last is None or tip.clock != max(t.clock for t in tip.tails.values()):
        return "its clock is not its tails' greatest"
    for machine, t in tip.tails.items():
        line = line_at(fd, t.at, tip.size)
        if line is None:
            return f"no whole line of {machine} at byte {t.at}"
        if line_hash(line) != t.digest:
            return f"the line at byte {t.at} is not {machine}'s last line it recorded"
        try:
            key, _prev = envelope(line)
        except FormatError as exc:
            return f"the line at byte {t.at} is unreadable ({exc})"
        if key != (t.clock, machine, t.seq):
            return f"the line at byte {t.at} is {key}, not {(t.clock, machine, t.seq)}"
        if machine == tip.last and t.at + len(line) + 1 != tip.size:
            return f"its last line does not end at byte {tip.size}"
    return None


def checked_tip(fd: int, path: str, file_size: int) -> Tip | None:
    """The tip saved at ``path`` if it describes the journal open at ``fd``;
    None (logged) if there is none or it does not."""
    tip = load_tip(path)
    if tip is None:
        return None
    try:
        why = mismatch(fd, tip, file_size)
    except OSError as exc:
        why = f"reading the journal failed: {exc}"
    if why is None:
        return tip
    log.warning("journal tip %s does not match its journal (%s); reading the journal whole", path, why)
    return None


# -- advancing a tip ---------------------------------------------------------------------


PIECE = 8 << 20  # bytes read at a time when advancing over many


def _pieces_backwards(fd: int, start: int, end: int) -> "Iterator[tuple[int, bytes]]":
    """(offset, bytes) of whole lines in ``[start, end)``, last piece first.
    ``start`` and ``end`` are line boundaries."""
    want = PIECE
    while end > start:
        lo = max(start, end - want)
        data = os.pread(fd, end - lo, lo)
        if len(data) != end - lo:
            raise FormatError(f"the journal no longer holds {end} bytes")
        cut = 0 if lo == start else data.find(b"\n") + 1
        if cut == len(data):  # one line longer than the piece: read more
            want *= 2
            continue
        yield lo + cut, data[cut:]
        end = lo + cut
        want = PIECE


def _last_model(data: bytes) -> tuple[str, str] | None:
    """The last model_switch event among the whole lines ``data``."""
    end = len(data)
    while (hit := data.rfind(_MODEL, 0, end)) >= 0:
        start = data.rfind(b"\n", 0, hit) + 1
        stop = data.find(b"\n", hit)
        try:
            ev = Record.from_line(data[start:stop]).event
        except FormatError:  # a bad line is verify's business
            ev = None
        if isinstance(ev, ModelSwitch):
            return ev.provider, ev.model
        end = start
    return None


def advance_tip(fd: int, old: Tip | None, state: "ChainState", size: int) -> Tip:
    """The tip of the journal open at ``fd`` up to ``size``, whose chain
    state (caught up to ``size``) is ``state``, from the tip ``old`` it
    extends (None: from the start). Reads the bytes after ``old``: back from
    the end until every machine whose tail moved is found (usually one
    line), and all of them once for the running digest. FormatError if a
    machine's new last line is not among them (the state is not this file's)."""
    base = old or EMPTY
    if size < base.size:
        raise FormatError(f"the journal is {size} bytes, less than its tip's {base.size}")
    tails = dict(base.tails)
    want: dict[str, str] = {}
    for machine, t in state.tails.items():
        known = base.tails.get(machine)
        if known is None or known.seq != t.seq or known.digest != t.digest:
            want[t.digest] = machine
    model = None
    for offset, data in _pieces_backwards(fd, base.size, size):
        if model is None:
            model = _last_model(data)
        end = len(data)
        while want and end > 0:
            start = data.rfind(b"\n", 0, end - 1) + 1
            found = want.pop(line_hash(data[start : end - 1]), None)
            if found is not None:
                t = state.tails[found]
                tails[found] = MachineTail(seq=t.seq, digest=t.digest, clock=t.clock, at=offset + start)
            end = start
        if not want and model is not None:
            break
    if want:
        raise FormatError(f"the last line of {', '.join(sorted(want.values()))} is not in the journal's new bytes")
    sha = None
    if sha256_state.available():
        sha = base.sha256()
        if sha is None:  # a first tip (or one saved without a state): hash what it covered too
            sha = sha256_state.Sha256State()
            _hash_range(fd, sha, 0, base.size)
        _hash_range(fd, sha, base.size, size)
    return Tip(size=size, count=state.count, clock=state.clock,
               last=None if state.last is None else state.last[1], tails=tails,
               model=model or base.model,
               sha_state=None if sha is None else sha.state(), sha_lib=sha256_state.library() if sha else "")


def _hash_range(fd: int, sha: "sha256_state.Sha256State", start: int, end: int) -> None:
    while start < end:
        piece = os.pread(fd, min(PIECE, end - start), start)
        if not piece:
            raise FormatError(f"the journal ended at byte {start}, before {end}")
        sha.update(piece)
        start += len(piece)
