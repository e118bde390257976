"""Fuzz target: ``memory/vector_index/index.json`` replaced through the mount.

A write that replaces index.json is checked as its readers check it
(``LiveAgent.check_edit`` calls :func:`capsulefs.core.semantic.vectors.parse_index`;
``capsulefs search`` and the index update read it with ``load_index_bytes``,
which rebuild an index they do not trust). So ``run`` parses the bytes as the
mount does: ``IndexCorrupt`` (a CapsuleError) is a refusal. A writer can
compute the digest as well as capsulefs can, so each input is parsed as
given and, when it is a JSON object without a digest, with a digest made
for it (the mutations then reach every field). What is accepted
must then be an index its readers can use: written back by ``dump_index`` it
parses to the same rows, embedder, journal position and memory, those are of
their documented types (digests are sha256 hex, the memory's event and
machine strings), and a search over it returns rows of its own.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from capsulefs.core.capsule import format as fmt
from capsulefs.core.semantic.embedders import EmbedderSpec
from capsulefs.core.semantic.vectors import (
    Entry,
    IndexCorrupt,
    JournalPosition,
    VectorIndex,
    dump_index,
    parse_index,
)

from . import Target

SHA = "ab" * 32


def _seeds() -> list[bytes]:
    spec = EmbedderSpec(name="hashed-ngrams", dims=4, version="1")
    rows = VectorIndex(spec, position=JournalPosition(events=2, last=SHA, bytes=300, prefix=SHA,
                                                      heads={"m": (2, SHA)}),
                       memory=("e0", (1, "m", 1)))
    rows.add([Entry(event="e1", kind="note", time="2026-01-01T00:00:00Z", start=0, end=5),
              Entry(event="e0", kind="memory_edit", time="2026-01-01T00:00:01Z", start=0, end=9)],
             np.array([[0.5, -0.5, 0.5, -0.5], [1.0, 0.0, 0.0, 0.0]], np.float32))
    digested = [dump_index(VectorIndex(spec)), dump_index(rows)]
    bodies = [b"{" + d[d.index(b'",') + 2:] for d in digested]  # (the digest is made for each input)
    return [fmt.empty_vector_index(), *digested, *bodies]


def _digested(body: bytes) -> bytes:
    """``body`` (a JSON object) as index.json with its digest, as dump_index writes one."""
    rest = body.rstrip(b"\n")[1:]
    return b'{"digest":"' + hashlib.sha256(b"{" + rest).hexdigest().encode() + b'",' + rest + b"\n"


def _run(data: bytes, scratch: Path) -> None:
    if data.startswith(b"{") and not data.startswith(b'{"digest"'):
        try:
            parse_index(data)  # (only the empty index parses without a digest)
        except IndexCorrupt:
            pass
        data = _digested(data)
    _check(data)


def _check(data: bytes) -> None:
    index = parse_index(data)  # the mount's check (IndexCorrupt: refused, EINVAL)
    again = parse_index(dump_index(index))
    assert again.rows() == index.rows(), "the rows do not read back"
    assert again.embedder == index.embedder and again.memory == index.memory, (again.embedder, again.memory)
    assert again.position == index.position, (again.position, index.position)
    pos = index.position  # what the index update compares with the journal: of the documented types
    assert all(v is None or fmt.is_sha256(v) for v in (pos.last, pos.prefix)), (pos.last, pos.prefix)
    assert all(type(s) is int and fmt.is_sha256(h) for s, h in pos.heads.values()), pos.heads
    if index.memory is not None:
        event, (clock, machine, seq) = index.memory
        assert type(event) is str and type(machine) is str and type(clock) is int and type(seq) is int, index.memory
    if index.embedder is not None:
        query = np.ones(index.embedder.dims, np.float32)
        for kinds in (None, ["note"]):
            for score, row in index.search_vector(query, 3, kinds=kinds):
                assert 0 <= row < len(index), row
                assert isinstance(score, float)


TARGETS = [Target("index_json", _seeds, _run)]
