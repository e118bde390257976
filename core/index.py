"""The agent's local semantic index: ``memory/vector_index/index.json``.

Rules:
  * The index is derived data. It can always be rebuilt from the journal
    (plus the blobs that memory edits name), and it is never trusted blindly:
    a file that does not parse, whose digest does not match its bytes, or that
    an embedder other than the one in use built, is rebuilt.
  * What is indexed: user and assistant messages, tool calls (name and
    arguments), tool results, and the current working memory (the text of the
    latest ``memory_edit`` in journal order). Reasoning is private and is
    never indexed; nor are notes, system prompts or workspace updates.
  * Every row points back to its source: the event id, its kind and time,
    and the character span ``[start, end)`` of the chunk inside that event's
    indexed text (for memory, inside the memory text of that memory_edit).
  * Writes go through :func:`capsulefs.core.fsutil.atomic_write`.

Theory of operation:
  * Position. The journal is a set of per-machine hash chains (seq 1, 2, ...
    with ``prev`` hashes). The index records the head ``(seq, sha256 of line)``
    of every machine it has covered: because chains have no gaps, the heads
    name exactly the set of events indexed, in whatever order a merge wrote
    them. It also records how many bytes of the journal file it covered and
    the sha256 of that prefix, for the common case of plain appends.
  * Update. If the journal still starts with the covered prefix, only the
    lines after it are parsed and indexed (appends). Otherwise (a merge or
    move rewrote the file) every line is parsed; if every recorded head is
    still in the journal with the same hash, the events past the heads are
    indexed (the union); if not (a head vanished or changed), the journal is
    not the one the index was built from and the index is rebuilt.
  * Merge. :func:`merge_indexes` unions the rows of two indexes of the same
    agent made by the same embedder when both sides' heads hold in the merged
    journal: nothing either side had is embedded again. Otherwise it is an
    update of our index against the merged journal.
  * Memory. Each memory_edit holds the whole new working memory. Only the
    latest one (by the journal order ``(clock, machine, seq)``) is indexed:
    when a later one arrives, the old memory's rows are dropped. So an
    incremental update and a full rebuild give the same rows.
  * Chunking. A text is cut at blank lines (and before markdown headings)
    into chunks of at most ``CHUNK_CHARS`` characters; an overlong paragraph
    is cut at a sentence end or space. At most ``MAX_CHUNKS`` per event.
  * Search is an exact scan: the stored int8 rows are dequantised once into
    a float32 matrix, a query is one matrix-vector product and a partial sort
    (``argpartition``). At 100k rows that is 10-25 ms, bound by memory
    bandwidth. An inverted-file partition (k-means lists, probe the nearest)
    was measured and rejected: on these lexical vectors a short query's
    neighbours spread over many lists, so at 10x speed it kept only 40-50%
    of the true top 10 (bench/bench_index.py shows the trade-off). Rows of
    one event collapse to its best chunk (memory chunks stay separate: each
    is its own span).
  * Access. :class:`CapsuleFiles` reads a capsule directory, a capsule tar
    (read-only) or a store agent (whose index is written through the store,
    so its manifest stays in step). Between searches an index stays in
    memory while its index.json's sha256 is unchanged.

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

The empty index written by :func:`capsulefs.core.format.empty_vector_index`
(no digest, no rows, no embedder) is accepted as "nothing indexed yet".
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .embedders import Embedder, EmbedderSpec, select_embedder
from .errors import CapsuleError, FormatError, IntegrityError, NotFoundError
from .events import (
    AssistantMessage,
    MemoryEdit,
    Record,
    ToolCall,
    ToolResult,
    UserMessage,
    line_hash,
)
from .format import BLOBS_DIR, JOURNAL, VECTOR_INDEX, check_sha256
from .fsutil import atomic_write, makedirs_durable
from .journal import split_lines

log = logging.getLogger(__name__)

__all__ = [
    "INDEX_FORMAT",
    "CapsuleFiles",
    "Entry",
    "Hit",
    "JournalPosition",
    "UpdateReport",
    "VectorIndex",
    "chunk_spans",
    "indexed_text",
    "load_index",
    "merge_indexes",
    "recall",
    "refresh_index",
    "save_index",
    "search_capsule",
    "update_index",
]

INDEX_FORMAT = "vector-index/1"
CHUNK_CHARS = 600  # longest chunk, in characters
MAX_CHUNKS = 64  # chunks kept per event (a huge tool output is cut)
SNIPPET_CHARS = 160
INDEXED_KINDS = ("user_message", "assistant_message", "tool_call", "tool_result", "memory_edit")
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
        if type(start) is not int or type(end) is not int or not 0 <= start <= end:
            raise IndexCorrupt(f"index entry for {event} has a bad span {start!r}..{end!r}")
        return cls(event=event, kind=kind, time=time, start=start, end=end)


@dataclass(frozen=True, slots=True, kw_only=True)
class JournalPosition:
    """Which part of the journal an index covers (see the module doc)."""

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
            if not (isinstance(head, list) and len(head) == 2 and isinstance(head[0], int) and isinstance(head[1], str)):
                raise IndexCorrupt(f"index head of {machine!r} is not [seq, sha256]")
            heads[machine] = (head[0], head[1])
        events, size = doc.get("events", 0), doc.get("bytes", 0)
        if not isinstance(events, int) or not isinstance(size, int) or events < 0 or size < 0:
            raise IndexCorrupt("index journal events/bytes are not non-negative integers")
        return cls(events=events, last=doc.get("last"), bytes=size, prefix=doc.get("prefix"), heads=heads)


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateReport:
    """What an update did, for logs and tests."""

    mode: str  # "fresh" (up to date), "append", "union" or "rebuild"
    reason: str  # why (for a rebuild: what was wrong)
    added: int  # rows added
    removed: int  # rows dropped (an older memory's chunks)
    events: int  # journal events newly covered


@dataclass(frozen=True, slots=True, kw_only=True)
class Hit:
    """One search result."""

    score: float  # cosine similarity, -1..1
    event: str  # event id (for memory: the memory_edit that wrote that memory)
    kind: str
    time: str
    start: int  # the chunk's span in the event's indexed text
    end: int
    snippet: str  # the chunk's text, whitespace collapsed, cut to SNIPPET_CHARS


# -- what gets indexed ------------------------------------------------------------


BlobReader = Callable[[str], bytes]


def indexed_text(record: Record, blobs: BlobReader | None = None) -> str | None:
    """The text of ``record`` that the index embeds, or None if not indexed.

    A memory_edit's text may live in a blob; ``blobs(sha256)`` reads it.
    """
    event = record.event
    match event:
        case UserMessage() | AssistantMessage():
            return event.text
        case ToolResult():
            return event.content
        case ToolCall():
            args = json.dumps(event.arguments, ensure_ascii=False, sort_keys=True)
            return f"{event.name} {args}"
        case MemoryEdit():
            if event.text is not None:
                return event.text
            if blobs is None:
                return None
            try:
                return blobs(event.blob).decode("utf-8", "replace")  # type: ignore[arg-type]
            except (OSError, CapsuleError) as exc:
                log.warning("memory_edit %s: cannot read blob %s (%s); memory not indexed", record.id, event.blob, exc)
                return None
    return None  # reasoning (private), notes, system, workspace updates, unknown kinds


_PARA_RE = re.compile(r"\S(?:.*?\S)?(?=\n[ \t]*\n|\s*\Z)", re.S)
_SENTENCE_END_RE = re.compile(r"[.!?;:\n]\s")


def _split_long(text: str, start: int, end: int, limit: int) -> Iterable[tuple[int, int]]:
    while end - start > limit:
        window = text[start : start + limit]
        cut = -1
        for m in _SENTENCE_END_RE.finditer(window):
            if m.start() + 1 >= limit // 2:
                cut = m.start() + 1
        if cut < 0:
            space = window.rfind(" ", limit // 2)
            cut = space if space > 0 else limit
        stop = start + cut
        while stop > start + 1 and text[stop - 1].isspace():
            stop -= 1
        yield start, stop
        start += cut
        while start < end and text[start].isspace():
            start += 1
    if start < end:
        yield start, end


def chunk_spans(text: str, limit: int = CHUNK_CHARS) -> list[tuple[int, int]]:
    """Cut ``text`` into chunk spans ``[start, end)`` of at most ``limit`` chars.

    Paragraphs (split at blank lines) are packed greedily; a markdown heading
    starts a new chunk; an overlong paragraph is cut at a sentence end or a
    space. Spans never start or end in whitespace.
    """
    out: list[tuple[int, int]] = []
    cur: tuple[int, int] | None = None
    for m in _PARA_RE.finditer(text):
        s, e = m.start(), m.end()
        heading = text[s] == "#"
        if cur is not None and (heading or e - cur[0] > limit):
            out.append(cur)
            cur = None
        if e - s > limit:
            out.extend(_split_long(text, s, e, limit))
            continue
        cur = (s, e) if cur is None else (cur[0], e)
    if cur is not None:
        out.append(cur)
    return out


def snippet(text: str, start: int, end: int, limit: int = SNIPPET_CHARS) -> str:
    flat = " ".join(text[start:end].split())
    return flat if len(flat) <= limit else flat[: limit - 1].rstrip() + "…"


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


# -- reading the journal -----------------------------------------------------------


def _parse_lines(data: bytes, start: int) -> tuple[list[Record], int, int, str | None]:
    """Records of the complete lines of ``data`` from ``start``.

    Returns (records, lines seen, end of the last complete line, sha256 of
    that line). A trailing line without its newline is a torn tail (see
    :mod:`capsulefs.core.journal`): it is left alone, not indexed. A line
    that does not parse is skipped with a warning (``journal verify`` is the
    place that reports it).
    """
    end = data.rfind(b"\n") + 1
    if end <= start:
        return [], 0, start, None
    lines = split_lines(data[start:end])
    records = []
    for no, line in enumerate(lines, 1):
        try:
            records.append(Record.from_line(line))
        except FormatError as exc:
            log.warning("journal line %d (after byte %d) is not indexed: %s", no, start, exc)
    return records, len(lines), end, line_hash(lines[-1])


def _heads_of(records: Iterable[Record], base: Mapping[str, tuple[int, str]] | None = None) -> dict[str, tuple[int, str]]:
    heads = dict(base or {})
    for r in records:
        if r.seq > heads.get(r.machine, (0, ""))[0]:
            heads[r.machine] = (r.seq, r.digest)
    return heads


# -- update -----------------------------------------------------------------------


def _index_records(
    index: VectorIndex, records: Sequence[Record], embedder: Embedder, blobs: BlobReader | None
) -> tuple[int, int]:
    """Embed and add the rows of ``records``; returns (added, removed)."""
    entries: list[Entry] = []
    texts: list[str] = []
    newest_memory: Record | None = None
    for r in records:
        if r.kind == "memory_edit":
            if newest_memory is None or r.order > newest_memory.order:
                newest_memory = r
            continue
        text = indexed_text(r)
        if text is None:
            continue
        for s, e in chunk_spans(text)[:MAX_CHUNKS]:
            entries.append(Entry(event=r.id, kind=r.kind, time=r.time, start=s, end=e))
            texts.append(text[s:e])
    removed = 0
    if newest_memory is not None and (index.memory is None or newest_memory.order > tuple(index.memory[1])):
        old = index.memory[0] if index.memory else None
        removed = index.drop(lambda e: not (e.kind == "memory_edit" and e.event == old))
        index.memory = (newest_memory.id, newest_memory.order)
        text = indexed_text(newest_memory, blobs)
        if text is not None:
            for s, e in chunk_spans(text)[:MAX_CHUNKS]:
                entries.append(Entry(event=newest_memory.id, kind="memory_edit", time=newest_memory.time, start=s, end=e))
                texts.append(text[s:e])
    if entries:
        index.add(entries, embedder.embed(texts))
    return len(entries), removed


def update_index(
    index: VectorIndex | None,
    journal: bytes,
    embedder: Embedder,
    *,
    blobs: BlobReader | None = None,
) -> tuple[VectorIndex, UpdateReport]:
    """Bring ``index`` up to date with the journal bytes ``journal``.

    Appends are indexed incrementally; a rewritten journal whose heads still
    hold is unioned; anything else (no index, other embedder, a journal that
    lost or changed a head) is a full rebuild. ``index`` is updated in place
    unless rebuilt; the returned index is the one to use.
    """
    spec = embedder.spec
    pos = index.position if index is not None else None
    reason = ""
    if index is None:
        reason = "no usable index"
    elif index.embedder != spec and (len(index) or index.embedder is not None):
        reason = f"index was built by {_spec_str(index.embedder)}, not {_spec_str(spec)}"
    elif index.embedder is None:
        index = VectorIndex(spec, position=index.position, memory=index.memory)

    if not reason:
        assert index is not None and pos is not None
        view = memoryview(journal)
        prefix = hashlib.sha256(view[: pos.bytes]) if pos.bytes <= len(journal) else None
        if prefix is not None and prefix.hexdigest() == (pos.prefix or hashlib.sha256(b"").hexdigest()):
            records, lines, end, last = _parse_lines(journal, pos.bytes)
            if not lines:
                return index, UpdateReport(mode="fresh", reason="up to date", added=0, removed=0, events=0)
            new = [r for r in records if r.seq > pos.heads.get(r.machine, (0, ""))[0]]
            added, removed = _index_records(index, new, embedder, blobs)
            prefix.update(view[pos.bytes : end])
            index.position = JournalPosition(
                events=pos.events + lines,
                last=last,
                bytes=end,
                prefix=prefix.hexdigest(),
                heads=_heads_of(new, pos.heads),
            )
            return index, UpdateReport(mode="append", reason="journal grew", added=added, removed=removed, events=len(new))
        records, lines, end, last = _parse_lines(journal, 0)
        by_seq = {(r.machine, r.seq): r.digest for r in records}
        broken = [m for m, (seq, h) in pos.heads.items() if by_seq.get((m, seq)) != h]
        if broken:
            reason = f"journal no longer holds the indexed head of machine {broken[0]}"
        else:
            new = [r for r in records if r.seq > pos.heads.get(r.machine, (0, ""))[0]]
            added, removed = _index_records(index, new, embedder, blobs)
            index.position = JournalPosition(
                events=lines, last=last, bytes=end, prefix=hashlib.sha256(memoryview(journal)[:end]).hexdigest(), heads=_heads_of(records)
            )
            # Even with nothing new the position moved (the file was rewritten): save it.
            return index, UpdateReport(mode="union", reason="journal rewritten (merge)", added=added, removed=removed, events=len(new))

    log.info("rebuilding the semantic index: %s", reason)
    records, lines, end, last = _parse_lines(journal, 0)
    fresh = VectorIndex(spec)
    added, _ = _index_records(fresh, records, embedder, blobs)
    fresh.position = JournalPosition(
        events=lines, last=last, bytes=end, prefix=hashlib.sha256(memoryview(journal)[:end]).hexdigest(), heads=_heads_of(records)
    )
    return fresh, UpdateReport(mode="rebuild", reason=reason, added=added, removed=0, events=len(records))


def merge_indexes(
    ours: VectorIndex | None,
    theirs: VectorIndex | None,
    journal: bytes,
    embedder: Embedder,
    *,
    blobs: BlobReader | None = None,
) -> tuple[VectorIndex, UpdateReport]:
    """The index of a merged journal, reusing both sides' vectors.

    When both indexes were made by ``embedder`` and both sides' heads hold in
    the merged ``journal``, their rows are unioned (nothing is re-embedded
    that either side had); then the events neither covered are indexed.
    Otherwise this is :func:`update_index` of ``ours``.
    """
    spec = embedder.spec
    usable = [i for i in (ours, theirs) if i is not None and i.embedder == spec]
    if len(usable) < 2:
        return update_index(ours if ours is not None else theirs, journal, embedder, blobs=blobs)
    a, b = usable
    records, lines, end, last = _parse_lines(journal, 0)
    by_seq = {(r.machine, r.seq): r.digest for r in records}
    for side in (a, b):
        if any(by_seq.get((m, s)) != h for m, (s, h) in side.position.heads.items()):
            return update_index(ours, journal, embedder, blobs=blobs)
    heads = {}
    for m in set(a.position.heads) | set(b.position.heads):
        heads[m] = max(a.position.heads.get(m, (0, "")), b.position.heads.get(m, (0, "")))
    memory = max((i.memory for i in (a, b) if i.memory), key=lambda mem: tuple(mem[1]), default=None)
    merged = VectorIndex(spec, memory=memory)
    seen: set[tuple[str, int, int]] = set()
    for side in (a, b):
        keep = []
        for i, e in enumerate(side.entries):
            key = (e.event, e.start, e.end)
            if key in seen or (e.kind == "memory_edit" and (memory is None or e.event != memory[0])):
                continue
            seen.add(key)
            keep.append(i)
        merged.entries.extend(side.entries[i] for i in keep)
        merged.codes = np.concatenate([merged.codes, side.codes[keep]])
        merged.scale = np.concatenate([merged.scale, side.scale[keep]])
    new = [r for r in records if r.seq > heads.get(r.machine, (0, ""))[0]]
    added, removed = _index_records(merged, new, embedder, blobs)
    merged.position = JournalPosition(
        events=lines, last=last, bytes=end, prefix=hashlib.sha256(memoryview(journal)[:end]).hexdigest(), heads=_heads_of(records)
    )
    return merged, UpdateReport(mode="union", reason="merged two indexes", added=added, removed=removed, events=len(new))


def _spec_str(spec: EmbedderSpec | None) -> str:
    return "no embedder" if spec is None else f"{spec.name}/{spec.dims}d v{spec.version}"


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
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IndexCorrupt(f"index.json is not valid JSON: {exc}") from None
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
            clock, machine, seq = mem["order"]
            memory = (str(mem["event"]), (int(clock), str(machine), int(seq)))
        except (KeyError, TypeError, ValueError):
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
    return _load(data, os.fspath(path))


def _load(data: bytes | None, where: str) -> tuple[VectorIndex | None, str]:
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


# -- a capsule's files ---------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CapsuleFiles:
    """How to read one agent's capsule files, and to replace its index."""

    label: str  # where the capsule is (for messages, and the in-memory cache key)
    read: Callable[[str], bytes | None]  # capsule-relative path -> bytes, None if absent
    write_index: Callable[[bytes], None] | None  # replaces index.json; None: read-only (a tar)

    @classmethod
    def of(cls, capsule: "str | os.PathLike[str] | CapsuleFiles | Any") -> "CapsuleFiles":
        """From a capsule directory, a capsule tar (read-only), a CapsuleFiles,
        or anything with ``.path(relpath)`` (the host store's agent handle;
        when it has ``write_files``, the index is written through it so that
        the manifest stays in step)."""
        if isinstance(capsule, CapsuleFiles):
            return capsule
        if isinstance(capsule, (str, os.PathLike)) and os.path.isfile(capsule):
            return cls._of_tar(os.fspath(capsule))
        if isinstance(capsule, (str, os.PathLike)):
            root = os.fspath(capsule)

            def at(rel: str) -> str:
                return os.path.join(root, *rel.split("/"))

        elif callable(getattr(capsule, "path", None)):

            def at(rel: str) -> str:
                return os.fspath(capsule.path(rel))

        else:
            raise TypeError(f"not a capsule directory, tar or agent handle: {capsule!r}")
        index_path = at(VECTOR_INDEX)
        if callable(getattr(capsule, "write_files", None)):

            def write(data: bytes) -> None:
                capsule.write_files({VECTOR_INDEX: data})

        else:

            def write(data: bytes) -> None:
                makedirs_durable(os.path.dirname(os.path.abspath(index_path)))
                atomic_write(index_path, data)

        def read(rel: str) -> bytes | None:
            try:
                with open(at(rel), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None

        return cls(label=index_path, read=read, write_index=write)

    @classmethod
    def _of_tar(cls, path: str) -> "CapsuleFiles":
        from .tarball import scan_tar

        blobs: dict[str, bytes] = {}

        def keep_small_blobs(rel: str, size: int, f: Any) -> str:
            data = f.read(size) if rel.startswith(BLOBS_DIR + "/") and size <= TAR_BLOB_LIMIT else None
            if data is None:
                h = hashlib.sha256()
                while chunk := f.read(1 << 20):
                    h.update(chunk)
                return h.hexdigest()
            blobs[rel] = data
            return hashlib.sha256(data).hexdigest()

        listing = scan_tar(path, keep_small_blobs)
        if listing.problems:
            raise FormatError(f"{path}: {listing.problems[0]}")
        files = {**blobs, **listing.contents}
        return cls(label=f"tar:{os.path.abspath(path)}", read=files.get, write_index=None)

    def read_journal(self) -> bytes:
        return self.read(JOURNAL) or b""

    def read_blob(self, sha256: str) -> bytes:
        data = self.read(f"{BLOBS_DIR}/{check_sha256(sha256, 'memory blob')}")
        if data is None:
            raise NotFoundError(f"blob {sha256} is not in the capsule")
        if hashlib.sha256(data).hexdigest() != sha256:
            raise IntegrityError(f"blob {sha256} does not match its name")
        return data


TAR_BLOB_LIMIT = 4 << 20  # blobs kept in memory when searching a tar (memory edits are small)


def refresh_index(
    capsule: Any, embedder: Embedder | None = None, *, save: bool = True
) -> tuple[VectorIndex, bytes, UpdateReport]:
    """Load the capsule's index, bring it up to date, and (if it changed and
    ``save``) write it back. Returns the index, the journal bytes it covers,
    and what was done."""
    files = CapsuleFiles.of(capsule)
    embedder = embedder or select_embedder()
    with _cache_lock:
        journal = files.read_journal()
        raw = files.read(VECTOR_INDEX)
        key = hashlib.sha256(raw).hexdigest() if raw is not None else None
        cached = _cache.get(files.label)
        index: VectorIndex | None
        if cached is not None and key is not None and cached[0] == key:
            index, why = cached[1], ""
        else:
            index, why = _load(raw, files.label)
        index, report = update_index(index, journal, embedder, blobs=files.read_blob)
        if save and files.write_index is not None and (report.mode != "fresh" or why):
            data = dump_index(index)
            files.write_index(data)
            key = hashlib.sha256(data).hexdigest()
        if key is not None:
            _cache.pop(files.label, None)
            _cache[files.label] = (key, index)
            while len(_cache) > CACHE_INDEXES:
                _cache.pop(next(iter(_cache)))
    log.debug("index %s: %s (%s), +%d -%d rows", files.label, report.mode, report.reason, report.added, report.removed)
    return index, journal, report


# Indexes kept in memory between calls, by capsule, while index.json's
# sha256 is unchanged: a recall tool called again and again neither parses
# nor decodes a large index (hashing 77 MB takes ~0.1 s, loading it ~2 s). An index updated but not
# saved (save=False) stays here too, so the next call is incremental. The
# lock makes refresh + search one step for the threads of one process.
CACHE_INDEXES = 4
_cache: dict[str, tuple[str, VectorIndex]] = {}
_cache_lock = threading.RLock()



def _find_records(journal: bytes, ids: set[str]) -> dict[str, Record]:
    """The records with these ids, found by their canonical ``"id":"..."`` key."""
    found: dict[str, Record] = {}
    for event_id in ids:
        needle = b'"id":"' + event_id.encode() + b'"'
        pos = journal.find(needle)
        while pos >= 0:
            start = journal.rfind(b"\n", 0, pos) + 1
            end = journal.find(b"\n", pos)
            end = len(journal) if end < 0 else end
            try:
                record = Record.from_line(journal[start:end])
            except FormatError:
                record = None
            if record is not None and record.id == event_id:
                found[event_id] = record
                break
            pos = journal.find(needle, pos + 1)
    return found


def search_capsule(
    capsule: Any,
    query: str,
    k: int = 5,
    *,
    embedder: Embedder | None = None,
    save: bool = True,
    kinds: Iterable[str] | None = None,
) -> list[Hit]:
    """The ``k`` chunks of the agent's history that best match ``query``.

    Brings the index up to date first (see :func:`refresh_index`).
    """
    files = CapsuleFiles.of(capsule)
    embedder = embedder or select_embedder()
    qvec = embedder.embed([query])[0]
    with _cache_lock:
        index, journal, _ = refresh_index(files, embedder, save=save)
        ranked = index.search_vector(qvec, k, kinds=kinds)
        rows = [(score, index.entries[row]) for score, row in ranked]
    records = _find_records(journal, {e.event for _, e in rows})
    hits = []
    for score, e in rows:
        record = records.get(e.event)
        text = indexed_text(record, files.read_blob) if record is not None else None
        hits.append(
            Hit(
                score=round(score, 4),
                event=e.event,
                kind=e.kind,
                time=e.time,
                start=e.start,
                end=e.end,
                snippet=snippet(text, e.start, e.end) if text is not None else "",
            )
        )
    return hits


def recall(capsule_dir_or_paths: Any, query: str, k: int = 5) -> list[Hit]:
    """The reference agent's ``recall`` tool: best ``k`` matches for ``query``.

    ``capsule_dir_or_paths`` is a capsule directory, a :class:`CapsuleFiles`,
    or the store's agent handle. The index is updated (and saved) first.
    """
    return search_capsule(capsule_dir_or_paths, query, k)
