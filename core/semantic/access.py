"""Reading one agent's capsule files for the semantic index, and replacing its index.json.

Theory of operation:
  * Access. :class:`CapsuleFiles` reads a capsule directory, a capsule tar
    (read-only) or a store agent (whose index is written through the store,
    so its manifest stays in step). All reads go through one function
    (capsule-relative path -> bytes or None); a blob is checked against its
    name when read.
  * A tar is scanned once: its small structured files and its small blobs
    (up to ``TAR_BLOB_LIMIT``: memory edits are small) are kept in memory.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import FormatError, IntegrityError, NotFoundError
from ..capsule.format import BLOBS_DIR, JOURNAL, VECTOR_INDEX, check_sha256
from ..fsutil import atomic_write, makedirs_durable

__all__ = ["TAR_BLOB_LIMIT", "CapsuleFiles"]


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
                return str(os.fspath(capsule.path(rel)))

        else:
            raise TypeError(f"not a capsule directory, tar or agent handle: {capsule!r}")
        index_path = at(VECTOR_INDEX)
        write_files = getattr(capsule, "write_files", None)
        if callable(write_files):

            def write(data: bytes) -> None:
                write_files({VECTOR_INDEX: data})

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
        from ..capsule.tarball import scan_tar

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
