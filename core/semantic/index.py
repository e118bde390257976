"""The agent's local semantic index: ``memory/vector_index/index.json``.

Rules:
  * The index is derived data. It can always be rebuilt from the journal
    (plus the blobs that memory edits name), and it is never trusted blindly:
    a file that does not parse, whose digest does not match its bytes, or that
    an embedder other than the one in use built, is rebuilt.

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
  * Cache. Between searches an index stays in memory while its index.json's
    sha256 is unchanged.

The parts live in their own modules:
  * :mod:`capsulefs.core.semantic.text`: what is indexed and how it is chunked;
  * :mod:`capsulefs.core.semantic.vectors`: :class:`VectorIndex`, its rows and
    search, and the index.json file format;
  * :mod:`capsulefs.core.semantic.access`: :class:`CapsuleFiles`, reading a
    capsule directory, tar or store agent.
This module brings an index up to date with a journal (update, merge) and
answers queries against a capsule (refresh, search, recall).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .embedders import Embedder, EmbedderSpec, select_embedder
from ..errors import FormatError
from ..journal.events import line_hash
from ..journal.record import Record
from ..capsule.format import VECTOR_INDEX
from .access import CapsuleFiles
from .text import MAX_CHUNKS, BlobReader, chunk_spans, indexed_text, snippet
from .vectors import Entry, JournalPosition, VectorIndex, dump_index, load_index_bytes
from ..journal.lines import split_lines

log = logging.getLogger(__name__)

__all__ = [
    "Hit",
    "UpdateReport",
    "merge_indexes",
    "recall",
    "refresh_index",
    "search_capsule",
    "update_index",
]


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


# -- reading the journal -----------------------------------------------------------


def _parse_lines(data: bytes, start: int) -> tuple[list[Record], int, int, str | None]:
    """Records of the complete lines of ``data`` from ``start``.

    Returns (records, lines seen, end of the last complete line, sha256 of
    that line). A trailing line without its newline is a torn tail (see
    :mod:`capsulefs.core.journal.follow`): it is left alone, not indexed. A line
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
            index, why = load_index_bytes(raw, files.label)
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
