"""Builders for the semantic index tests: chained journals and the labelled corpus."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from capsulefs.core.semantic.embedders import EmbedderSpec, HashedEmbedder
from capsulefs.core.journal.events import event_from_fields
from capsulefs.core.journal.record import Record

CORPUS = Path(__file__).resolve().parent / "data" / "index_corpus.json"


def event_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:24]


class Writer:
    """One machine appending to its own hash chain, with a Lamport clock."""

    def __init__(self, machine: str) -> None:
        self.machine = machine
        self.seq = 0
        self.clock = 0
        self.prev: str | None = None

    def see(self, records: Iterable[Record]) -> None:
        for r in records:
            self.clock = max(self.clock, r.clock)

    def write(self, key: str, kind: str, **fields: Any) -> Record:
        if kind == "reasoning":
            fields = {"provider": "anthropic", "model": "m", "payload_format": "anthropic.thinking", "data": {}, **fields}
        self.seq += 1
        self.clock += 1
        rec = Record(
            id=event_id(key),
            machine=self.machine,
            seq=self.seq,
            clock=self.clock,
            prev=self.prev,
            time=f"2026-12-02T10:{self.clock // 60:02d}:{self.clock % 60:02d}.000Z",
            event=event_from_fields(kind, fields),
        )
        self.prev = rec.digest
        return rec


def journal_bytes(records: Sequence[Record]) -> bytes:
    return b"".join(r.line + b"\n" for r in records)


def merged(*sides: Sequence[Record]) -> list[Record]:
    """The union of several journals, deduplicated, in journal order."""
    seen = {}
    for side in sides:
        for r in side:
            seen[r.id] = r
    return sorted(seen.values(), key=lambda r: r.order)


def load_corpus() -> dict[str, Any]:
    return json.loads(CORPUS.read_text())


def corpus_records(machine: str = "hostA") -> list[Record]:
    w = Writer(machine)
    out = []
    for ev in load_corpus()["events"]:
        fields = {k: v for k, v in ev.items() if k not in ("key", "kind")}
        out.append(w.write(ev["key"], ev["kind"], **fields))
    return out


class CountingEmbedder:
    """Wraps an embedder and counts the texts it was asked to embed."""

    def __init__(self, inner: Any | None = None) -> None:
        self.inner = inner or HashedEmbedder()
        self.count = 0

    @property
    def spec(self) -> EmbedderSpec:
        return self.inner.spec

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        self.count += len(texts)
        return self.inner.embed(texts)


def same_rows(a: Any, b: Any) -> bool:
    """Two indexes hold the same chunks with the same vectors and positions."""
    return a.rows() == b.rows() and a.position.heads == b.position.heads and a.memory == b.memory and a.embedder == b.embedder
