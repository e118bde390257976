"""The agent's workspace: materialised from the snapshot, synced back as events.

Theory of operation:
  * ``artifacts/snapshot.json`` maps workspace paths to blob digests. To run
    an agent, :func:`materialize` writes those blobs into a host-local
    sandbox directory (never into the capsule).
  * When the agent stops (freeze before a move, or shutdown), :func:`scan`
    compares the sandbox with the snapshot and returns the changes: a path
    with new content maps to the sha256 of its bytes, a deleted one to None.
    The caller stores the new blobs and journals one ``workspace_update``.
  * Only regular files are part of a workspace: links, fifos and sockets in
    the sandbox are skipped (and reported), never followed; so are names
    that are not UTF-8 (a capsule's JSON cannot hold them).

Rules: paths are checked with the capsule path rules both ways, so a
snapshot cannot write outside the sandbox and a sandbox cannot smuggle an
unsafe name into a capsule.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from . import format as fmt
from .errors import UnsafePathError
from .fsutil import atomic_write, makedirs_durable
from .hashing import hash_file

log = logging.getLogger(__name__)


def materialize(snapshot: Mapping[str, str], read_blob: Callable[[str], Iterator[bytes]], dest: str) -> None:
    """Make ``dest`` hold exactly the snapshot's files (removing anything else)."""
    if os.path.isdir(dest):
        shutil.rmtree(dest)
    makedirs_durable(dest, 0o755)
    for path, sha in sorted(snapshot.items()):
        fmt.check_relpath(path, "workspace path")
        target = os.path.join(dest, path)
        makedirs_durable(os.path.dirname(target))
        atomic_write(target, read_blob(sha))


@dataclass(frozen=True, slots=True)
class ScanResult:
    changes: dict[str, str | None]  # path -> new sha256, or None if deleted
    new_files: dict[str, str]  # sha256 -> a sandbox file holding those bytes
    skipped: list[str]  # entries that are not regular files


def scan(dest: str, snapshot: Mapping[str, str]) -> ScanResult:
    """Changes of the sandbox ``dest`` relative to ``snapshot``."""
    seen: dict[str, tuple[str, str]] = {}
    skipped: list[str] = []
    unreadable: list[str] = []  # directories the walk could not list (EACCES for a daemon not run as root)

    def cannot_list(exc: OSError) -> None:
        rel = os.path.relpath(exc.filename or dest, dest).replace(os.sep, "/")
        unreadable.append("" if rel == "." else rel)

    for root, dirs, files in os.walk(dest, onerror=cannot_list):
        for name in sorted(dirs + files):
            full = os.path.join(root, name)
            rel = os.path.relpath(full, dest).replace(os.sep, "/")
            st = os.lstat(full)
            if stat.S_ISDIR(st.st_mode):
                continue
            if not stat.S_ISREG(st.st_mode):
                skipped.append(rel)
                continue
            try:
                fmt.check_relpath(rel, "workspace path")
                rel.encode()  # a name in another encoding than UTF-8 has no place in JSON
            except (UnsafePathError, UnicodeEncodeError):
                skipped.append(rel)
                continue
            sha, _size = hash_file(full)
            seen[rel] = (sha, full)
    if skipped:
        log.warning("workspace %s: skipped %d entries that are not regular files or whose names a capsule cannot hold: %s",
                    dest, len(skipped), ", ".join(map(ascii, skipped[:5])))
    changes: dict[str, str | None] = {}
    new_files: dict[str, str] = {}
    for rel, (sha, full) in seen.items():
        if snapshot.get(rel) != sha:
            changes[rel] = sha
            new_files.setdefault(sha, full)
    if unreadable:
        # What it holds is unknown, not gone: its files keep their snapshot entries.
        log.warning("workspace %s: could not list %d directories (their files are kept as they were): %s",
                    dest, len(unreadable), ", ".join(map(ascii, unreadable[:5])))
        skipped += unreadable
    for rel in snapshot:
        if rel not in seen and not any(not u or rel.startswith(u + "/") for u in unreadable):
            changes[rel] = None
    return ScanResult(changes=changes, new_files=new_files, skipped=skipped)
