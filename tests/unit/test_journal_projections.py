"""Projections: working memory and the workspace snapshot as functions of the journal."""

from __future__ import annotations

import hashlib

import pytest
from journal_helpers import note, replicas

from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import NotFoundError
from capsulefs.core.journal.events import MemoryEdit, ToolCall, WorkspaceUpdate
from capsulefs.core.journal.lines import merge
from capsulefs.core.journal.projections import (
    has_workspace_updates,
    last_memory_edit,
    project,
    referenced_blobs,
    snapshot,
    working_memory,
)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def no_blobs(h: str) -> bytes:
    raise NotFoundError(f"blob {h}")


def test_working_memory_is_the_last_edit() -> None:
    (a,) = replicas(1)
    assert working_memory(a.lines, no_blobs) is None and last_memory_edit(a.lines) is None
    a.append(MemoryEdit(text="first"))
    a.append(note("in between"))
    a.append(MemoryEdit(text="second ✓"))
    a.append(ToolCall(call_id="c", name="t", arguments={"kind": "memory_edit", "text": "a trap"}))
    assert working_memory(a.lines, no_blobs) == "second ✓".encode()


def test_working_memory_from_a_blob() -> None:
    (a,) = replicas(1)
    body = b"# notes\nlong memory\n"
    a.append(MemoryEdit(blob=sha(body)))
    blobs = {sha(body): body}
    assert working_memory(a.lines, blobs.__getitem__) == body
    assert referenced_blobs(a.lines) == {sha(body)}
    with pytest.raises(NotFoundError):
        working_memory(a.lines, no_blobs)


def test_after_a_merge_the_later_edit_by_clock_then_machine_wins() -> None:
    a, b = replicas(2)
    a.append(note("shared"))
    b.pull(a)
    a.append(MemoryEdit(text="alpha's edit"))  # clock 2, host-a
    b.append(MemoryEdit(text="bravo's edit"))  # clock 2, host-b: same clock, machine decides
    merged = merge(a.lines, b.lines)
    assert working_memory(merged, no_blobs) == b"bravo's edit"
    a.append(MemoryEdit(text="alpha again"))  # clock 3
    merged = merge(a.lines, b.lines)
    assert working_memory(merged, no_blobs) == b"alpha again"
    # Both edits stay in the journal for a person to read.
    assert sum(b'"kind":"memory_edit"' in line for line in merged) == 3


def test_snapshot_is_the_fold_of_workspace_updates() -> None:
    (a,) = replicas(1)
    x, y, z = (sha(bytes([i])) for i in range(3))
    assert snapshot(a.lines) == {} and not has_workspace_updates(a.lines)
    a.append(WorkspaceUpdate(changes={"src/a.py": x, "README": y}))
    a.append(WorkspaceUpdate(changes={"src/a.py": z}))
    a.append(WorkspaceUpdate(changes={"README": None}))
    assert snapshot(a.lines) == {"src/a.py": z}
    assert has_workspace_updates(a.lines)
    assert referenced_blobs(a.lines) == {x, y, z}  # past versions too
    p = project(a.lines, no_blobs)
    assert p.snapshot == {"src/a.py": z} and p.snapshot_json == fmt.snapshot_bytes({"src/a.py": z})
    assert p.working_memory is None and p.blobs == frozenset({x, y, z})


def test_merged_workspace_has_no_conflicts() -> None:
    a, b = replicas(2)
    x, y = sha(b"x"), sha(b"y")
    a.append(WorkspaceUpdate(changes={"f": x}))
    b.pull(a)
    a.append(WorkspaceUpdate(changes={"g": x}))
    b.append(WorkspaceUpdate(changes={"f": y, "h": y}))
    assert snapshot(merge(a.lines, b.lines)) == {"f": y, "g": x, "h": y}
