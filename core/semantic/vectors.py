"""The vector index in memory (:class:`VectorIndex`) and its file, index.json.

Rules:
  * An index.json is never trusted blindly: one that does not parse or whose
    digest does not match its bytes raises :class:`IndexCorrupt` (and
    :func:`load_index` reports it as unusable, so the caller rebuilds).
  * Every row points back to its source: the event id, its kind and time,
    and the character span ``[start, end)`` of the chunk inside that event's
    indexed text (for memory, inside the memory text of that memory_edit).
  * Vectors are stored as int8 rows with one float32 scale each.
  * Writes go through :func:`capsulefs.core.fsutil.atomic_write`.

Theory of operation:
  * Search is an exact scan: the stored int8 rows are dequantised once into
    a float32 matrix, a query is one matrix-vector product and a partial sort
    (``argpartition``). At 100k rows that is 10-25 ms, bound by memory
    bandwidth. An inverted-file partition (k-means lists, probe the nearest)
    was measured and rejected: on these lexical vectors a short query's
    neighbours spread over many lists, so at 10x speed it kept only 40-50%
    of the true top 10 (bench/bench_index.py shows the trade-off). Rows of
    one event collapse to its best chunk (memory chunks stay separate: each
    is its own span).
  * How the journal position is kept and checked is in
    :mod:`capsulefs.core.semantic.index`; this module only stores it.

On-disk layout (one JSON object, keys sorted, ``digest`` first)::

    digest    str   sha256 hex of the file's bytes with this key removed:
                    sha256(b"{" + bytes after '"digest":"<hex>",'), trailing
                    newline excluded. Any flipped byte is caught.
    format    str   "vector-index/1"
    embedder  obj|null  {"name", "dims", "version"} of the embedder that made
                    the vectors; null only while there are no rows
    journal   obj   the journal position the index covers:
        events  int   number of journal lines covered
        last    str|null  sha256 of the last covered line (file order)
        bytes   int   length of the covered journal prefix, in bytes
        prefix  str|null  sha256 of that prefix
        heads   obj   machine -> [seq, sha256 of that machine's last line]
    memory    obj|null  {"event": id, "order": [clock, machine, seq]} of the
                    memory_edit whose text the memory rows come from
    entries   list  one row per chunk: [event id, kind, time, start, end]
    vectors   obj   {"dtype": "int8", "rows": n, "data": base64 of the n x dims
                    int8 matrix (row-major), "scale": base64 of n little-endian
                    float32}; row i is data[i] * scale[i], L2 norm about 1

The empty index written by :func:`capsulefs.core.capsule.format.empty_vector_index`
(no digest, no rows, no embedder) is accepted as "nothing indexed yet".
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .embedders import EmbedderSpec
from ..errors import FormatError
from ..capsule.format import MAX_INT, check_int, is_sha256, load_json
from ..fsutil import atomic_write, makedirs_durable
from .text import INDEXED_KINDS

log = logging.getLogger(__name__)

__all__ = [
    "INDEX_FORMAT",
    "Entry",
    "IndexCorrupt",
    "JournalPosition",
    "VectorIndex",
    "dump_index",
    "load_index",
    "load_index_bytes",
    "parse_index",
    "save_index",
]

INDEX_FORMAT = "vector-index/1"
_DIGEST_PREFIX = b'{"digest":"'


class IndexCorrupt(FormatError):
    """index.json does not parse, or its digest does not match: rebuild it."""


# -- value types ---------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """One indexed chunk (one row of the vector matrix)."""

    event: str  # id of the event the chunk comes from
    kind: str  # that event's kind (one of INDEXED_KINDS)
    time: str  # that event's time
    start: int  # chunk = indexed_text(event)[start:end]
    end: int

    def to_json(self) -> list[Any]:
        return [self.event, self.kind, self.time, self.start, self.end]

    @classmethod
    def from_json(cls, row: object) -> "Entry":
        # Plain type() tests: this runs once per row of a 100k-row index.
        if type(row) is not list or len(row) != 5:
            raise IndexCorrupt("an index entry is not [event, kind, time, start, end]")
        event, kind, time, start, end = row
        if type(event) is not str or type(kind) is not str or type(time) is not str:
            raise IndexCorrupt("an index entry has a non-string event, kind or time")
        if type(start) is not int or type(end) is not int or not 0 <= start <= end <= MAX_INT:
            raise IndexCorrupt(f"index entry for {event} has a bad span {start!r}..{end!r}")
        return cls(event=event, kind=kind, time=time, start=start, end=end)


@dataclass(frozen=True, slots=True, kw_only=True)
class JournalPosition:
    """Which part of the journal an index covers (see Position in :mod:`capsulefs.core.semantic.index`)."""

    events: int = 0  # journal lines covered
    last: str | None = None  # sha256 of the last covered line, in file order
    bytes: int = 0  # covered prefix of the journal file
    prefix: str | None = None  # sha256 of that prefix
    heads: Mapping[str, tuple[int, str]] = field(default_factory=dict)  # machine -> (seq, line sha256)

    def to_json(self) -> dict[str, Any]:
        return {
            "events": self.events,
            "last": self.last,
            "bytes": self.bytes,
            "prefix": self.prefix,
            "heads": {m: [s, h] for m, (s, h) in sorted(self.heads.items())},
        }

    @classmethod
    def from_json(cls, doc: object) -> "JournalPosition":
        if not isinstance(doc, dict):
            raise IndexCorrupt("index journal position is not an object")
        heads_doc = doc.get("heads", {})
        if not isinstance(heads_doc, dict):
            raise IndexCorrupt("index journal heads is not an object")
        heads = {}
        for machine, head in heads_doc.items():
            if not (isinstance(head, list) and len(head) == 2 and is_sha256(head[1])):
                raise IndexCorrupt(f"index head of {machine[:64]!r} is not [seq, sha256]")
            heads[machine] = (check_int(head[0], f"index head seq of {machine[:64]!r}", error=IndexCorrupt), head[1])
        events = check_int(doc.get("events", 0), "index journal events", error=IndexCorrupt)
        size = check_int(doc.get("bytes", 0), "index journal bytes", error=IndexCorrupt)
        last, prefix = doc.get("last"), doc.get("prefix")
        for name, value in (("last", last), ("prefix", prefix)):
            if value is not None and not is_sha256(value):
                raise IndexCorrupt(f"index journal {name} is not a sha256 (64 lowercase hex) or null")
        return cls(events=events, last=last, bytes=size, prefix=prefix, heads=heads)


# -- the in-memory index ---------------------------------------------------------


def _quantize(vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    vectors = np.asarray(vectors, dtype=np.float32)
    peak = np.abs(vectors).max(axis=1) if len(vectors) else np.zeros(0, np.float32)
    scale = (peak / 127.0).astype(np.float32)
    safe = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.rint(vectors / safe[:, None]).clip(-127, 127).astype(np.int8)
    return q, scale


class VectorIndex:
    """Rows (entries + int8 vectors) and the journal position they cover."""

    def __init__(
        self,
        embedder: EmbedderSpec | None,
        *,
        entries: Sequence[Entry] = (),
        codes: np.ndarray | None = None,
        scale: np.ndarray | None = None,
        position: JournalPosition | None = None,
        memory: tuple[str, tuple[int, str, int]] | None = None,
    ) -> None:
        dims = embedder.dims if embedder else 0
        self.embedder = embedder
        self.entries: list[Entry] = list(entries)
        self.codes = codes if codes is not None else np.zeros((0, dims), np.int8)
        self.scale = scale if scale is not None else np.zeros(0, np.float32)
        self.position = position or JournalPosition()
        self.memory = memory  # (memory_edit id, its order) whose chunks are indexed
        self._layout: tuple[np.ndarray, np.ndarray] | None = None  # (float32 rows, kind codes)
        if self.codes.shape != (len(self.entries), dims) or self.scale.shape != (len(self.entries),):
            raise IndexCorrupt(
                f"index has {len(self.entries)} entries but vectors of shape {self.codes.shape} / {self.scale.shape}"
            )

    def __len__(self) -> int:
        return len(self.entries)

    # -- rows ---------------------------------------------------------------
    def add(self, entries: Sequence[Entry], vectors: np.ndarray) -> None:
        if not entries:
            return
        q, s = _quantize(vectors)
        self.entries.extend(entries)
        self.codes = np.concatenate([self.codes, q])
        self.scale = np.concatenate([self.scale, s])
        self._layout = None

    def drop(self, keep: Callable[[Entry], bool]) -> int:
        mask = np.fromiter((keep(e) for e in self.entries), dtype=bool, count=len(self.entries))
        removed = int((~mask).sum())
        if removed:
            self.entries = [e for e, k in zip(self.entries, mask) if k]
            self.codes = self.codes[mask]
            self.scale = self.scale[mask]
            self._layout = None
        return removed

    def matrix(self) -> np.ndarray:
        """The float32 rows, in row order (a fresh array)."""
        return self.codes.astype(np.float32) * self.scale[:, None]

    def rows(self) -> dict[tuple[str, int, int], tuple[str, str, bytes, float]]:
        """(event, start, end) -> (kind, time, int8 row, scale): to compare indexes."""
        return {
            (e.event, e.start, e.end): (e.kind, e.time, self.codes[i].tobytes(), float(self.scale[i]))
            for i, e in enumerate(self.entries)
        }

    def _get_layout(self) -> tuple[np.ndarray, np.ndarray]:
        """(float32 rows, kind code of each row), computed once per change."""
        if self._layout is None:
            kinds = np.array([INDEXED_KINDS.index(e.kind) if e.kind in INDEXED_KINDS else -1 for e in self.entries], np.int8)
            self._layout = (self.matrix(), kinds)
        return self._layout

    # -- search -------------------------------------------------------------
    def search_vector(self, query: np.ndarray, k: int, *, kinds: Iterable[str] | None = None) -> list[tuple[float, int]]:
        """Best ``k`` (score, row) by an exact scan, one row per event (memory: per span)."""
        if not self.entries or k <= 0:
            return []
        matrix, kind_codes = self._get_layout()
        scores = matrix @ np.asarray(query, dtype=np.float32)
        if kinds is not None:
            wanted = [INDEXED_KINDS.index(x) for x in kinds if x in INDEXED_KINDS]
            scores = np.where(np.isin(kind_codes, wanted), scores, -np.inf)
        return self._best(scores, k)

    def _best(self, scores: np.ndarray, k: int) -> list[tuple[float, int]]:
        n = len(scores)
        want = k
        while True:
            m = min(n, want * 4 + 8)
            top = np.argpartition(-scores, m - 1)[:m] if m < n else np.arange(n)
            top = top[np.lexsort((top, -scores[top]))]
            out: list[tuple[float, int]] = []
            seen: set[str] = set()
            for row in top:
                score = float(scores[row])
                if score == -np.inf:
                    break
                e = self.entries[row]
                key = e.event if e.kind != "memory_edit" else f"{e.event}:{e.start}"
                if key in seen:
                    continue
                seen.add(key)
                out.append((score, int(row)))
                if len(out) == k:
                    return out
            if m >= n:
                return out
            want *= 4


# -- on disk ------------------------------------------------------------------------


def dump_index(index: VectorIndex) -> bytes:
    """The bytes of index.json for ``index`` (see the module doc)."""
    doc = {
        "format": INDEX_FORMAT,
        "embedder": index.embedder.to_json() if index.embedder else None,
        "journal": index.position.to_json(),
        "memory": (
            {"event": index.memory[0], "order": list(index.memory[1])} if index.memory is not None else None
        ),
        "entries": [e.to_json() for e in index.entries],
        "vectors": {
            "dtype": "int8",
            "rows": len(index.entries),
            "data": base64.b64encode(np.ascontiguousarray(index.codes).tobytes()).decode("ascii"),
            "scale": base64.b64encode(index.scale.astype("<f4").tobytes()).decode("ascii"),
        },
    }
    body = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    digest = hashlib.sha256(body).hexdigest()
    return _DIGEST_PREFIX + digest.encode() + b'",' + body[1:] + b"\n"


def parse_index(data: bytes) -> VectorIndex:
    """Parse index.json bytes; raises :class:`IndexCorrupt` on any doubt."""
    data = data.rstrip(b"\n")
    if data.startswith(_DIGEST_PREFIX):
        cut = len(_DIGEST_PREFIX) + 64
        claimed = data[len(_DIGEST_PREFIX) : cut].decode("ascii", "replace")
        if data[cut : cut + 2] != b'",' or hashlib.sha256(b"{" + data[cut + 2 :]).hexdigest() != claimed:
            raise IndexCorrupt("index.json does not match its digest")
        checked = True
    else:
        checked = False
    doc = load_json(data, "index.json", error=IndexCorrupt)
    if not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT:
        raise IndexCorrupt(f"index.json format is not {INDEX_FORMAT!r}")
    if not checked:
        # Only the empty index of a new capsule may come without a digest.
        if doc.get("entries") or doc.get("embedder") is not None:
            raise IndexCorrupt("index.json has rows but no digest")
        return VectorIndex(None)
    try:
        spec = EmbedderSpec.from_json(doc["embedder"]) if doc.get("embedder") is not None else None
    except FormatError as exc:
        raise IndexCorrupt(f"index.json embedder: {exc}") from None
    position = JournalPosition.from_json(doc.get("journal"))
    raw_entries = doc.get("entries")
    if not isinstance(raw_entries, list):
        raise IndexCorrupt("index.json entries is not a list")
    entries = [Entry.from_json(row) for row in raw_entries]
    vec = doc.get("vectors")
    if not isinstance(vec, dict) or vec.get("dtype") != "int8" or vec.get("rows") != len(entries):
        raise IndexCorrupt("index.json vectors do not match its entries")
    dims = spec.dims if spec else 0
    try:
        codes = np.frombuffer(base64.b64decode(vec["data"], validate=True), dtype=np.int8)
        scale = np.frombuffer(base64.b64decode(vec["scale"], validate=True), dtype="<f4").astype(np.float32)
    except (KeyError, TypeError, ValueError) as exc:
        raise IndexCorrupt(f"index.json vectors are not valid base64: {exc}") from None
    if codes.size != len(entries) * dims or not np.isfinite(scale).all():
        raise IndexCorrupt("index.json vector data has the wrong size or non-finite scales")
    memory = None
    mem = doc.get("memory")
    if mem is not None:
        try:
            event, (clock, machine, seq) = mem["event"], mem["order"]
            if type(event) is not str or type(machine) is not str or type(mem["order"]) is not list:
                raise TypeError
            memory = (event, (check_int(clock, "clock"), machine, check_int(seq, "seq")))
        except (KeyError, TypeError, ValueError, FormatError):
            raise IndexCorrupt("index.json memory is not {event, order: [clock, machine, seq]}") from None
    return VectorIndex(
        spec,
        entries=entries,
        codes=codes.reshape(len(entries), dims).copy(),
        scale=scale,
        position=position,
        memory=memory,
    )


def load_index(path: str | os.PathLike[str]) -> tuple[VectorIndex | None, str]:
    """Read index.json. Returns (index, "") or (None, why it is unusable)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        data = None
    return load_index_bytes(data, os.fspath(path))


def load_index_bytes(data: bytes | None, where: str) -> tuple[VectorIndex | None, str]:
    if data is None:
        return None, "no index.json"
    try:
        return parse_index(data), ""
    except IndexCorrupt as exc:
        log.warning("%s is not trusted and will be rebuilt: %s", where, exc)
        return None, str(exc)


def save_index(path: str | os.PathLike[str], index: VectorIndex) -> None:
    makedirs_durable(os.path.dirname(os.path.abspath(path)))
    atomic_write(path, dump_index(index))

