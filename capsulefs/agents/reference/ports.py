"""Where the reference agent's events go: the journal port.

Rules:
  * Every event goes through the journal port: appended as draft lines to
    ``$CAPSULE_DIR/memory/timeline_events.jsonl`` (the mount stamps them),
    or, outside a mount, through the journal API with ``$CAPSULE_MACHINE``.
"""

from __future__ import annotations


import hashlib
import logging
import os
import time
from collections.abc import Sequence
from typing import Protocol

from capsulefs.core.journal import events as ev
from capsulefs.core.journal.record import Record
from capsulefs.core.capsule import format as fmt
from capsulefs.core.fsutil import atomic_write

log = logging.getLogger(__name__)

log = logging.getLogger(__name__)



class JournalPort(Protocol):
    def records(self) -> list[Record]: ...

    def append(self, events: Sequence[ev.Event]) -> None: ...

    def working_memory(self) -> str: ...

    def size(self) -> int: ...

    def read_blob(self, sha256: str) -> bytes: ...

    def put_blob(self, data: bytes) -> str: ...


class CapsuleDirPort:
    """The agent's capsule directory in a capsulefs mount: appends are draft lines."""

    def __init__(self, capsule_dir: str) -> None:
        self.dir = capsule_dir
        self.journal = os.path.join(capsule_dir, fmt.JOURNAL)

    def records(self) -> list[Record]:
        with open(self.journal, "rb") as f:
            data = f.read()
        return [Record.from_line(line) for line in data.split(b"\n") if line]

    def append(self, events: Sequence[ev.Event]) -> None:
        lines = b"".join(ev.canonical_json({"kind": e.kind, **e.payload()}) + b"\n" for e in events)
        fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND)
        try:
            view = memoryview(lines)
            while view:
                n = os.write(fd, view)
                view = view[n:]
        finally:
            os.close(fd)

    def working_memory(self) -> str:
        with open(os.path.join(self.dir, fmt.WORKING_MEMORY), encoding="utf-8", errors="replace") as f:
            return f.read()

    def size(self) -> int:
        return os.stat(self.journal).st_size

    def read_blob(self, sha256: str) -> bytes:
        """An attachment's bytes, as the capsule serves them."""
        with open(os.path.join(self.dir, fmt.blob_path(sha256)), "rb") as f:
            return f.read()

    def put_blob(self, data: bytes) -> str:
        """Store ``data`` as a blob of the capsule; its sha256. Through the
        mount: written to ``artifacts/blobs/<sha256>``, which the close
        checks and stores (OSError if refused, e.g. EFBIG past the limit)."""
        sha = hashlib.sha256(data).hexdigest()
        try:
            fd = os.open(os.path.join(self.dir, fmt.blob_path(sha)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
        except FileExistsError:
            return sha  # the capsule has it already
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # (the mount checks and stores the blob here)
        return sha


class DirectPort(CapsuleDirPort):
    """A capsule directory outside any mount: stamps events itself as ``machine``."""

    def __init__(self, capsule_dir: str, machine: str) -> None:
        super().__init__(capsule_dir)
        import secrets

        from capsulefs.core.journal.file import open_journal

        self._j = open_journal(
            self.journal, machine=machine, now=time.time, new_id=lambda: secrets.token_hex(12),
            recovery_dir=os.path.join(os.path.dirname(capsule_dir), ".recovery"),
        )

    def append(self, events: Sequence[ev.Event]) -> None:
        self._j.append_many(events)

    def put_blob(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        path = os.path.join(self.dir, fmt.blob_path(sha))
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            atomic_write(path, data, mode=0o444)
        return sha
