"""Atomic, durable file writes: the one way capsulefs writes a file.

Theory of operation: a write goes to a temporary file in the destination's
directory, is fsynced, renamed over the destination, and then the directory
is fsynced. A crash at any point leaves the destination either as it was or
wholly new, never half written. Temporary files are named ``.tmp-*`` so a
reader (or ``sweep_temps``) can recognise and discard leftovers.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import BinaryIO, Iterator

from .walk import walk_tree

TMP_PREFIX = ".tmp-"


def fdatasync(fd: int) -> None:
    """fdatasync where the platform has it, else fsync."""
    (getattr(os, "fdatasync", None) or os.fsync)(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that renames and creations inside it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_name(directory: str) -> str:
    return os.path.join(directory, TMP_PREFIX + os.urandom(8).hex())


@contextmanager
def atomic_writer(path: str | os.PathLike[str], mode: int = 0o644) -> Iterator[BinaryIO]:
    """Yield a binary file; on normal exit it atomically replaces ``path``.

    On an exception the temporary file is removed and ``path`` is untouched.
    """
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    tmp = _tmp_name(directory)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    except OSError as exc:  # named by the path asked for: the temp name means nothing to the caller
        raise OSError(exc.errno, exc.strerror, path) from None
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        try:
            os.replace(tmp, path)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, path) from None
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(directory)


def atomic_write(path: str | os.PathLike[str], data: bytes | Iterable[bytes], mode: int = 0o644) -> None:
    """Atomically replace ``path`` with ``data`` (bytes or an iterable of chunks)."""
    with atomic_writer(path, mode) as f:
        if isinstance(data, (bytes, bytearray, memoryview)):
            f.write(data)
        else:
            for chunk in data:
                f.write(chunk)


def makedirs_durable(path: str | os.PathLike[str], mode: int = 0o755) -> None:
    """Create ``path`` and missing parents, fsyncing each parent that changed."""
    path = os.path.abspath(os.fspath(path))
    missing = []
    p = path
    while not os.path.isdir(p):
        missing.append(p)
        p = os.path.dirname(p)
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            continue
        fsync_dir(os.path.dirname(d))


def thread_start(tid: int) -> int | None:
    """When thread (or process) ``tid`` started, in clock ticks since boot
    (``/proc/<tid>/stat`` field 22), or None if it is gone: with its id,
    it names one thread for good (ids are reused, start times are not)."""
    try:
        with open(f"/proc/{tid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The name (field 2) is in parentheses and may hold anything: split after its last ')'.
    return int(data[data.rindex(b")") + 2 :].split()[19])


def subdirs(directory: str | os.PathLike[str], keep: Callable[[str], bool]) -> list[str]:
    """Sorted names of the directories (not symlinks) in ``directory`` that
    ``keep`` accepts; none if ``directory`` does not exist."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    return sorted(e.name for e in entries if keep(e.name) and e.is_dir(follow_symlinks=False))


def remove_tree(path: str | os.PathLike[str], *, ignore_errors: bool = False) -> None:
    """Remove ``path`` and everything under it, however deep.

    ``shutil.rmtree`` and ``os.walk`` recurse (RecursionError past ~1,000
    levels on Python 3.11) and build paths that outgrow PATH_MAX; what they
    remove here (staging areas, sandboxes, scratch) may have been shaped by a
    hostile tar or an agent. This never recurses and never opens more than
    two directories: it empties the top directory level by level, unlinking
    files and moving each grandchild directory up beside its parent
    (renameat, relative to directory fds) so that no path ever grows.
    Symbolic links are removed, never followed. With ``ignore_errors``, what
    cannot be removed is left and nothing is raised."""
    try:
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        if ignore_errors:
            return
        raise
    try:
        while True:
            names = os.listdir(top)
            if not names:
                break
            progress = False
            for name in names:
                try:
                    progress |= _remove_entry(top, name)
                except OSError:
                    if not ignore_errors:
                        raise
            if not progress:  # (only with ignore_errors: every entry left failed)
                return
    except OSError:
        if not ignore_errors:
            raise
        return
    finally:
        os.close(top)
    try:
        os.rmdir(path)
    except OSError:
        if not ignore_errors:
            raise


def _remove_entry(top: int, name: str) -> bool:
    """Remove a file of directory ``top``, or empty one of its directories by
    one level (its subdirectories move into ``top``) and remove it."""
    try:
        st = os.stat(name, dir_fd=top, follow_symlinks=False)
    except FileNotFoundError:
        return True
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=top)
        return True
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=top)
    try:
        for child in os.listdir(fd):
            cst = os.stat(child, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(cst.st_mode):
                os.rename(child, f".rm-{os.urandom(8).hex()}", src_dir_fd=fd, dst_dir_fd=top)
            else:
                os.unlink(child, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=top)
    return True


def sweep_temps(directory: str | os.PathLike[str]) -> int:
    """Remove leftover temporary files (from a crash) under ``directory``."""
    removed = 0
    for d in walk_tree(directory, onerror=_ignore):
        for name, st in d.entries:
            if name.startswith(TMP_PREFIX) and not stat.S_ISDIR(st.st_mode):
                try:
                    os.unlink(name, dir_fd=d.fd)
                except FileNotFoundError:
                    continue
                removed += 1
    return removed


def _ignore(_rel: str, _exc: OSError) -> None:
    pass


def atomic_write_at(dir_fd: int, name: str, data: Iterable[bytes], mode: int = 0o644) -> None:
    """:func:`atomic_write` of ``name`` in the directory open on ``dir_fd``
    (a temporary file beside it, fsync, rename, fsync of the directory)."""
    tmp = TMP_PREFIX + os.urandom(8).hex()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in data:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise
    os.fsync(dir_fd)
