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
  * The sandbox is hostile: the agent process made it, and a child of it
    that left the process group may still change it during the scan. So
    the scan walks directories by file descriptor without recursion
    (``walk.walk_tree``: each directory opened relative to its parent,
    ``O_NOFOLLOW | O_DIRECTORY``), opens each file with
    ``O_NOFOLLOW | O_NONBLOCK`` and hashes it only if the open file is
    regular; :func:`open_regular` opens it the same way again for the
    commit, one directory at a time from the sandbox, and the commit
    stores only bytes that hash as the scan found. A file or directory
    swapped for a symlink (to a host file), a FIFO or a device between two
    steps is skipped or refused, never read, and never blocks.
  * The agent may make its tree as deep as it likes; a capsule names a
    file by a path of at most ``fmt.MAX_PATH_BYTES``. A directory in which
    no such path fits is not entered: it is skipped and reported, like a
    symlink, and stays in this host's sandbox only. Every path that fits
    is synced and materialised, though with the sandbox's own path before
    it is longer than PATH_MAX (both work relative to directory fds).
  * A directory the scan cannot list (a daemon not run as root, a directory
    the agent made unreadable) keeps its files' snapshot entries: what it
    holds is unknown, not gone.
  * A workspace may hold gigabytes: the daemon runs :func:`scan`, the
    commit's reads and :func:`materialize` in a worker thread, never on its
    event loop (which serves the whole mount). Each takes a ``check``
    callable, called before every file and every chunk read, that may raise
    to stop the work within a chunk (the daemon passes trio's
    ``from_thread.check_cancelled``); only :func:`materialize` then leaves
    something half-done: the sandbox it was writing, for its caller to remove.

Rules: paths are checked with the capsule path rules both ways, so a
snapshot cannot write outside the sandbox and a sandbox cannot smuggle an
unsafe name into a capsule.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import BinaryIO

from . import format as fmt
from ..errors import UnsafePathError
from ..fsutil import atomic_write_at, makedirs_durable, remove_tree
from ..walk import makedirs_beneath, open_beneath, walk_tree
from ..hashing import hash_stream

log = logging.getLogger(__name__)


def _no_check() -> None:
    pass


def _checked(chunks: Iterator[bytes], check: Callable[[], None]) -> Iterator[bytes]:
    for chunk in chunks:
        check()
        yield chunk


def materialize(snapshot: Mapping[str, str], read_blob: Callable[[str], Iterator[bytes]], dest: str, *,
                check: Callable[[], None] = _no_check) -> None:
    """Make ``dest`` hold exactly the snapshot's files (removing anything
    else). ``check`` is called before each file and chunk (it may raise:
    ``dest`` is then left half-written, for the caller to remove). Every
    path is checked before anything is written, and written relative to
    its directory's fd: a workspace path may be up to 4096 bytes, which
    with ``dest`` before it is longer than any path a system call takes."""
    by_dir: dict[str, list[tuple[str, str]]] = {}
    for path, sha in snapshot.items():
        fmt.check_relpath(path, "workspace path")
        parent, _, name = path.rpartition("/")
        by_dir.setdefault(parent, []).append((name, sha))
    if os.path.isdir(dest):
        remove_tree(dest)
    makedirs_durable(dest, 0o755)
    top = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for parent in sorted(by_dir):
            fd = makedirs_beneath(top, parent)
            try:
                for name, sha in sorted(by_dir[parent]):
                    check()
                    atomic_write_at(fd, name, _checked(read_blob(sha), check))
            finally:
                os.close(fd)
    finally:
        os.close(top)


@dataclass(frozen=True, slots=True)
class ScanResult:
    changes: dict[str, str | None]  # path -> new sha256, or None if deleted
    new_files: dict[str, str]  # sha256 -> the workspace path of a file holding those bytes
    skipped: list[str]  # entries that are not regular files, or that a capsule cannot name
    root: str = ""  # the sandbox scanned (what new_files' paths are relative to)


#: Opening a sandbox file: never through a symlink, never waiting on a FIFO.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: What such an open meets when the entry is not (or no longer) a regular file.
_NOT_A_FILE = (errno.ENOENT, errno.ELOOP, errno.ENXIO, errno.ENOTDIR, errno.ENODEV)


def _open_fd(name: str, dir_fd: int | None = None) -> int | None:
    """A blocking read fd on ``name`` if it is a regular file (the last
    component not followed), else None."""
    try:
        fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in _NOT_A_FILE:
            return None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    os.set_blocking(fd, True)
    return fd


class CheckedReader:
    """An unbuffered file whose every read first calls ``check`` (which may
    raise: a long hash or copy stops within one chunk)."""

    def __init__(self, f: BinaryIO, check: Callable[[], None]) -> None:
        self._f, self._check = f, check

    def read(self, n: int = -1) -> bytes:
        self._check()
        return self._f.read(n)

    def readinto(self, buf: bytearray | memoryview) -> int:
        self._check()
        got: int = self._f.readinto(buf)  # type: ignore[attr-defined]
        return got

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "CheckedReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_regular(root: str, path: str, *, check: Callable[[], None] = _no_check) -> CheckedReader:
    """Open the file the scan found at workspace ``path`` under the sandbox
    ``root``, for reading: refuses (UnsafePathError) anything that is not,
    or is no longer, a regular file, without following a symlink (on the
    way there either: each directory is opened relative to the one before)
    or blocking on a FIFO. Each read first calls ``check``."""
    try:
        fd = open_beneath(root, path, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno not in _NOT_A_FILE:
            raise
        fd = None
    if fd is not None and not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        fd = None
    if fd is None:
        raise UnsafePathError(f"workspace file {_shown(path)} is no longer a regular file")
    os.set_blocking(fd, True)
    return CheckedReader(os.fdopen(fd, "rb", buffering=0), check)


def _shown(path: str) -> str:
    """``path`` for a log line: a deep one shortened (its ends and its length)."""
    if len(path) <= 120:
        return ascii(path)
    return f"{ascii(path[:60])}...{ascii(path[-40:])} ({len(path.encode('utf-8', 'surrogateescape'))} bytes)"


#: How deep the scan goes: a directory there can hold no file a capsule can
#: name (a name and a '/' per level: its path would be over fmt.MAX_PATH_BYTES).
MAX_DEPTH = fmt.MAX_PATH_BYTES // 2


def scan(dest: str, snapshot: Mapping[str, str], *, check: Callable[[], None] = _no_check) -> ScanResult:
    """Changes of the sandbox ``dest`` relative to ``snapshot``. ``check`` is
    called before each entry and each chunk hashed (it may raise to stop)."""
    seen: dict[str, str] = {}  # workspace path -> sha256 of its bytes
    skipped: list[str] = []
    too_long: list[str] = []  # directories in which no path a capsule can hold fits
    found: set[str] = {""}  # directories met (as directories, not links to them), "" the sandbox itself
    listed: set[str] = set()  # directories the walk listed
    # (A directory it cannot list or enter is told to onerror; it is then
    # found but not listed, which is all the scan needs to know.)
    for d in walk_tree(dest, max_depth=MAX_DEPTH, onerror=lambda _rel, _exc: None):
        top = d.rel
        listed.add(top)
        prefix = f"{top}/" if top else ""
        room = fmt.MAX_PATH_BYTES - len(prefix.encode("utf-8", "surrogateescape"))
        for name, st in d.entries:
            check()
            rel = prefix + name
            if stat.S_ISDIR(st.st_mode):
                if len(name.encode("utf-8", "surrogateescape")) + 2 > room:  # (its files' paths: name/x at least)
                    too_long.append(rel)
                    d.dirs.remove(name)
                else:
                    found.add(rel)
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
            fd = _open_fd(name, d.fd)
            if fd is None:  # swapped for something else since the stat
                skipped.append(rel)
                continue
            with CheckedReader(os.fdopen(fd, "rb", buffering=0), check) as f:
                sha, _size = hash_stream(f)  # type: ignore[arg-type]
            seen[rel] = sha
    # A directory met but never listed could not be opened or read (EACCES
    # for a daemon not run as root): what it holds is unknown, not gone.
    unreadable = sorted(found - listed) if os.path.isdir(dest) else []
    if skipped:
        log.warning("workspace %s: skipped %d entries that are not regular files or whose names a capsule cannot hold: %s",
                    dest, len(skipped), ", ".join(map(_shown, skipped[:5])))
    if too_long:
        log.warning("workspace %s: skipped %d directories too deep for a capsule (every file in them would have a path "
                    "over %d bytes): %s", dest, len(too_long), fmt.MAX_PATH_BYTES, ", ".join(map(_shown, too_long[:5])))
        skipped += too_long
    if unreadable:
        log.warning("workspace %s: could not list %d directories (their files are kept as they were): %s",
                    dest, len(unreadable), ", ".join(map(_shown, unreadable[:5])))
        skipped += unreadable
    changes: dict[str, str | None] = {}
    new_files: dict[str, str] = {}
    for rel, sha in seen.items():
        if snapshot.get(rel) != sha:
            changes[rel] = sha
            new_files.setdefault(sha, rel)
    for rel in snapshot:
        if rel not in seen and not any(not u or rel.startswith(u + "/") for u in unreadable):
            changes[rel] = None
    return ScanResult(changes=changes, new_files=new_files, skipped=skipped, root=dest)
