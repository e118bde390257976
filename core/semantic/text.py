"""What the semantic index embeds, and how it cuts that text into chunks.

Rules:
  * What is indexed: user and assistant messages, tool calls (name and
    arguments), tool results, and the current working memory (the text of the
    latest ``memory_edit`` in journal order). Reasoning is private and is
    never indexed; nor are notes, system prompts or workspace updates.
  * A chunk is a span ``[start, end)`` of an event's :func:`indexed_text`;
    the index stores spans, never the text itself.
  * Pure text: no vectors, no files (a memory blob is read through the
    ``blobs`` callable the caller passes).

Theory of operation:
  * Chunking. A text is cut at blank lines (and before markdown headings)
    into chunks of at most ``CHUNK_CHARS`` characters; an overlong paragraph
    is cut at a sentence end or space. At most ``MAX_CHUNKS`` per event.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable

from ..errors import CapsuleError
from ..journal.events import AssistantMessage, MemoryEdit, ToolCall, ToolResult, UserMessage
from ..journal.record import Record

log = logging.getLogger(__name__)

__all__ = [
    "CHUNK_CHARS",
    "INDEXED_KINDS",
    "MAX_CHUNKS",
    "SNIPPET_CHARS",
    "BlobReader",
    "chunk_spans",
    "indexed_text",
    "snippet",
]

CHUNK_CHARS = 600  # longest chunk, in characters
MAX_CHUNKS = 64  # chunks kept per event (a huge tool output is cut)
SNIPPET_CHARS = 160
INDEXED_KINDS = ("user_message", "assistant_message", "tool_call", "tool_result", "memory_edit")


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

