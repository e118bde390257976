"""Projections: the capsule files that are pure functions of the journal.

Rules:
  * ``memory/working_memory.md`` is the content of the last ``memory_edit``
    in journal order: its inline ``text``, or the bytes of its ``blob``.
  * ``artifacts/snapshot.json`` is the fold of the ``workspace_update``
    events in journal order: each change sets path -> sha256, or deletes
    the path when the sha256 is null.
  * Every blob a journal names (memory, workspace versions, attachments)
    travels with the capsule: the manifest lists it, so export, move, merge
    and gc carry it like any other blob, and verify checks attachments'.
  * Because the journal is sorted by (clock, machine, seq), merging two
    capsules never conflicts: the later edit by that order wins, and the
    other stays in the journal for a person to read.

Theory of operation: a cheap byte test picks the candidate lines
(``"kind":"memory_edit"`` can only be a JSON key and value, never the inside
of a string); each candidate is then parsed fully, so a nested object that
happens to hold the same key and value is not mistaken for an event.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from .events import Attachment, MemoryEdit, WorkspaceUpdate
from .record import Record
from ..errors import CapsuleError
from ..capsule.format import snapshot_bytes

log = logging.getLogger(__name__)

_MEMORY = b'"kind":"memory_edit"'
_WORKSPACE = b'"kind":"workspace_update"'
_ATTACHMENT = b'"kind":"attachment"'


def _records_of(lines: Iterable[bytes], needle: bytes, cls: type) -> Iterable[Record]:
    for line in lines:
        if needle in line:
            rec = Record.from_line(line)
            if isinstance(rec.event, cls):
                yield rec


def last_memory_edit(lines: Sequence[bytes]) -> MemoryEdit | None:
    """The last memory_edit event in journal order, or None."""
    for line in reversed(lines):
        if _MEMORY in line:
            rec = Record.from_line(line)
            if isinstance(rec.event, MemoryEdit):
                return rec.event
    return None


def working_memory(lines: Sequence[bytes], read_blob: Callable[[str], bytes]) -> bytes | None:
    """Bytes of working_memory.md, or None if the journal never edited it."""
    edit = last_memory_edit(lines)
    if edit is None:
        return None
    if edit.text is not None:
        return edit.text.encode()
    assert edit.blob is not None
    return read_blob(edit.blob)


def apply_workspace_changes(files: dict[str, str], changes: Mapping[str, str | None]) -> None:
    """Fold one workspace_update's changes into ``files`` (None deletes a path)."""
    for path, sha in changes.items():
        if sha is None:
            files.pop(path, None)
        else:
            files[path] = sha


def snapshot(lines: Iterable[bytes]) -> dict[str, str]:
    """The workspace (path -> sha256) after every workspace_update."""
    files: dict[str, str] = {}
    for rec in _records_of(lines, _WORKSPACE, WorkspaceUpdate):
        apply_workspace_changes(files, rec.event.changes)  # type: ignore[attr-defined]
    return files


def has_workspace_updates(lines: Iterable[bytes]) -> bool:
    return any(True for _ in _records_of(lines, _WORKSPACE, WorkspaceUpdate))


def referenced_blobs(lines: Iterable[bytes]) -> set[str]:
    """Every blob sha256 the journal names: memory_edit blobs, every
    version of every workspace file (past versions included), attachments."""
    shas: set[str] = set()
    for line in lines:
        if _MEMORY in line or _WORKSPACE in line or _ATTACHMENT in line:
            event = Record.from_line(line).event
            if isinstance(event, MemoryEdit) and event.blob is not None:
                shas.add(event.blob)
            elif isinstance(event, WorkspaceUpdate):
                shas.update(sha for sha in event.changes.values() if sha is not None)
            elif isinstance(event, Attachment):
                shas.add(event.blob)
    return shas


def attachment_blobs(lines: Iterable[bytes]) -> dict[str, int]:
    """sha256 -> line number (1-based) of each blob an attachment names:
    a capsule must hold every one of them (``capsule.check``)."""
    out: dict[str, int] = {}
    for no, line in enumerate(lines, 1):
        if _ATTACHMENT in line:
            try:
                event = Record.from_line(line).event
            except CapsuleError:
                continue  # the journal's own check reports the line
            if isinstance(event, Attachment):
                out.setdefault(event.blob, no)
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Projection:
    working_memory: bytes | None  # None: no memory_edit in the journal
    snapshot: dict[str, str]  # workspace path -> sha256
    snapshot_json: bytes  # artifacts/snapshot.json bytes
    blobs: frozenset[str]  # every blob the journal references


def project(lines: Sequence[bytes], read_blob: Callable[[str], bytes]) -> Projection:
    """All projections of a journal at once."""
    snap = snapshot(lines)
    return Projection(
        working_memory=working_memory(lines, read_blob),
        snapshot=snap,
        snapshot_json=snapshot_bytes(snap),
        blobs=frozenset(referenced_blobs(lines)),
    )
