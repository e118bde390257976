"""Atomic, durable file writes: the one way capsulefs writes a file.

Theory of operation: a write goes to a temporary file in the destination's
directory, is fsynced, renamed over the destination, and then the directory
is fsynced. A crash at any point leaves the destination either as it was or
wholly new, never half written. Temporary files are named ``.tmp-*`` so a
reader (or ``sweep_temps``) can recognise and discard leftovers.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import Any, BinaryIO, Iterator

from .hashing import parallel_map

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


# -- walking a tree someone else shaped --------------------------------------------------
#
# os.walk, os.fwalk, Path.rglob and shutil.copytree recurse (RecursionError
# past ~1,000 levels on Python 3.11), and the path-based ones build paths
# that outgrow PATH_MAX; an agent makes its workspace as deep as it likes.
# walk_tree never recurses and never opens by a path: it enters each
# directory relative to its parent's fd, with O_NOFOLLOW | O_DIRECTORY, and
# checks that what it opened is the directory it listed (device and inode),
# so a name swapped for a symlink (or for another directory) meanwhile is
# reported, never followed. It keeps at most ``max_fds`` directories open;
# an ancestor whose fd it closed is opened again, when there is more to walk
# in it, by its names from the nearest one still open, each step checked
# the same way. Memory: one small frame per level of the current path, and
# the names of the subdirectories not yet entered.

#: Opening a directory of a walk: never through a symlink, never a non-directory.
_WALK_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

#: How many directory fds a walk keeps open at most (the soft limit on open
#: files is often 1,024, for the whole daemon).
WALK_FDS = 64

#: How deep a walk goes by default (levels below the top).
WALK_DEPTH = 4096


class TooDeep(OSError):
    """A directory deeper than the walk's ``max_depth``: not entered."""


class WalkDir:
    """One directory of :func:`walk_tree`. ``fd``, ``entries`` and ``dirs``
    hold only until the walk goes on."""

    __slots__ = ("parent", "name", "depth", "ident", "fd", "entries", "dirs", "_todo")

    def __init__(self, parent: "WalkDir | None", name: str, ident: tuple[int, int]) -> None:
        self.parent = parent
        self.name = name  # its name in its parent ("" for the top)
        self.depth: int = 0 if parent is None else parent.depth + 1
        self.ident = ident  # (st_dev, st_ino)
        self.fd = -1  # open while it is being walked (or kept for its subdirectories)
        #: Its entries in name order, each with its lstat; what vanished
        #: between the listing and the stat is left out.
        self.entries: list[tuple[str, os.stat_result]] = []
        #: The entries that are directories: the walk enters each, in order,
        #: after this one is yielded. A caller may remove names to prune them.
        self.dirs: list[str] = []
        self._todo: list[tuple[str, tuple[int, int]]] = []  # (name, ident) still to enter, last first

    @property
    def rel(self) -> str:
        """Its path from the top, '/'-separated ("" for the top)."""
        names = []
        d: WalkDir | None = self
        while d is not None and d.parent is not None:
            names.append(d.name)
            d = d.parent
        return "/".join(reversed(names))


def walk_tree(top: str | os.PathLike[str], *, max_depth: int = WALK_DEPTH, max_fds: int = WALK_FDS,
              onerror: Callable[[str, OSError], None] | None = None) -> Iterator[WalkDir]:
    """Every directory under ``top`` (itself first, then depth first, in name
    order), as :class:`WalkDir`, without recursion, without following a
    symlink, opening nothing by a path but ``top`` (whose last component is
    not followed either).

    A directory that cannot be opened or listed, one that was swapped for
    something else after it was listed, and one deeper than ``max_depth``
    levels (:class:`TooDeep`) is not yielded and is passed to ``onerror``
    with its path from the top; without ``onerror`` such an error is raised."""
    if max_fds < 2:
        raise ValueError("a walk needs at least two directory fds")

    def fail(rel: str, exc: OSError) -> None:
        if onerror is None:
            raise exc
        onerror(rel, exc)

    try:
        fd = os.open(top, _WALK_FLAGS)
    except OSError as exc:
        fail("", exc)
        return
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    root = WalkDir(None, "", (st.st_dev, st.st_ino))
    root.fd = fd
    kept: deque[WalkDir] = deque()  # directories besides the top with an open fd, shallowest first
    stack = [root]
    try:
        if _list(root, fail):
            yield root
            _queue(root, max_depth, fail)
        while stack:
            frame = stack[-1]
            if not frame._todo:
                stack.pop()
                if frame is not root and frame.fd >= 0:
                    os.close(frame.fd)
                    frame.fd = -1
                    kept.remove(frame)
                continue
            if frame.fd < 0:
                lost = _reopen(stack, kept, max_fds)
                if lost is not None:  # (moved or swapped since the walk passed it)
                    for gone in stack[lost:]:
                        fail(gone.rel, OSError(errno.ESTALE, "changed during the walk"))
                    del stack[lost:]
                    continue
            name, ident = frame._todo.pop()
            child = WalkDir(frame, name, ident)
            try:
                child.fd = _enter(frame.fd, name, ident)
            except OSError as exc:
                fail(child.rel, exc)
                continue
            _keep(kept, child, max_fds)
            stack.append(child)
            if _list(child, fail):
                yield child
                _queue(child, max_depth, fail)
    finally:
        for d in kept:
            os.close(d.fd)
            d.fd = -1
        os.close(root.fd)
        root.fd = -1


def _parts(rel: str) -> list[str]:
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise OSError(errno.EINVAL, f"not a plain relative path: {rel[:60]!r}")
    return parts


def open_beneath(top: str | os.PathLike[str], rel: str, flags: int, mode: int = 0o777) -> int:
    """Open ``rel`` ('/'-separated, no '.' or '..') under the directory
    ``top`` one name at a time, each relative to the directory before and
    none through a symlink (O_NOFOLLOW | O_DIRECTORY on each directory,
    O_NOFOLLOW added to ``flags`` for the last name): a path an agent
    shaped, however long (PATH_MAX bounds only ``top``)."""
    parts = _parts(rel)
    fd = os.open(top, _WALK_FLAGS)
    try:
        for name in parts[:-1]:
            sub = os.open(name, _WALK_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = sub
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
    finally:
        os.close(fd)


def makedirs_beneath(top_fd: int, rel: str, mode: int = 0o755) -> int:
    """An fd on directory ``rel`` under the directory open on ``top_fd``
    ("" for itself), made where missing (each made one fsynced in its
    parent), opened as :func:`open_beneath` opens: no symlink followed."""
    fd = os.dup(top_fd)
    try:
        for name in _parts(rel) if rel else ():
            try:
                os.mkdir(name, mode, dir_fd=fd)
                os.fsync(fd)
            except FileExistsError:
                pass
            sub = os.open(name, _WALK_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


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


def _enter(parent_fd: int, name: str, ident: tuple[int, int]) -> int:
    """Open directory ``name`` of ``parent_fd`` if it is still the one with
    ``ident``; OSError (ELOOP, ENOTDIR, ENOENT, ESTALE...) if not."""
    fd = os.open(name, _WALK_FLAGS, dir_fd=parent_fd)
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if (st.st_dev, st.st_ino) != ident:
        os.close(fd)
        raise OSError(errno.ESTALE, "replaced during the walk")
    return fd


def _keep(kept: deque[WalkDir], d: WalkDir, max_fds: int) -> None:
    """Count ``d``'s fd as open, closing the shallowest kept beyond ``max_fds``
    (with the top's, which stays open)."""
    kept.append(d)
    while len(kept) >= max_fds:
        old = kept.popleft()
        os.close(old.fd)
        old.fd = -1


def _list(d: WalkDir, fail: Callable[[str, OSError], None]) -> bool:
    """Fill ``d.entries`` and ``d.dirs``; False (and ``fail`` told) if it
    cannot be listed, or listed but not searched (no x bit: its entries
    cannot be stat'ed)."""
    try:
        names = sorted(os.listdir(d.fd))
    except OSError as exc:
        fail(d.rel, exc)
        return False
    entries = []
    for name in names:
        try:
            st = os.stat(name, dir_fd=d.fd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # gone since the listing
        except OSError as exc:
            fail(d.rel, exc)
            return False
        entries.append((name, st))
    d.entries = entries
    d.dirs = [name for name, st in entries if stat.S_ISDIR(st.st_mode)]
    return True


def _queue(d: WalkDir, max_depth: int, fail: Callable[[str, OSError], None]) -> None:
    """After ``d`` was yielded: what of it is still to enter."""
    idents = {name: (st.st_dev, st.st_ino) for name, st in d.entries if stat.S_ISDIR(st.st_mode)}
    todo = [(name, idents[name]) for name in d.dirs if name in idents]
    d.entries, d.dirs = [], []
    if todo and d.depth >= max_depth:
        rel = d.rel
        for name, _ident in todo:
            fail(f"{rel}/{name}" if rel else name, TooDeep(errno.ENAMETOOLONG, f"deeper than {max_depth} levels"))
        return
    todo.reverse()
    d._todo = todo


def _reopen(stack: list[WalkDir], kept: deque[WalkDir], max_fds: int) -> int | None:
    """Open again, by their names from the deepest directory of the stack
    still open, the directories after it (the last one is to be walked on);
    the index in ``stack`` of the first that is no longer where the walk
    found it, or None."""
    base = max(i for i, d in enumerate(stack) if d.fd >= 0)  # (the top's is always open)
    for i in range(base + 1, len(stack)):
        d = stack[i]
        try:
            d.fd = _enter(stack[i - 1].fd, d.name, d.ident)
        except OSError:
            return i
        _keep(kept, d, max_fds)
    return None


# -- a file's identity without asking for its timestamps ------------------------------
#
# Since Linux 6.13 (multigrain timestamps), a stat() that returns a file's
# ctime/mtime flags it, and the file's next change takes a fine-grained
# timestamp, which also moves the clock every other file's next change reads.
# A file overwritten in place (the journal's write-ahead ring) then gets a new
# mtime on every write, and its fdatasync has to write the inode too: exactly
# the cost the ring exists to avoid. statx() asked for the inode alone flags
# nothing, so hot paths that only need "is this still the same file?" use it.

_STATX_INO = 0x100
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_STATX_SIZE = 256  # sizeof(struct statx)
_STX_INO = 32  # offsetof(struct statx, stx_ino)
_STX_DEV = 136  # offsetof(struct statx, stx_dev_major); stx_dev_minor follows


def _libc(name: str, argtypes: Callable[[Any], list[Any]]):  # pragma: no cover - depends on the C library
    """(ctypes, the C library's function ``name`` returning int, with the
    argument types ``argtypes(ctypes)``), or None where it has none."""
    try:
        import ctypes

        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes(ctypes)
    fn.restype = ctypes.c_int
    return ctypes, fn


_statx = _libc("statx", lambda c: [c.c_int, c.c_char_p, c.c_int, c.c_uint, c.c_void_p])


_statx_buffers = threading.local()  # one struct statx per thread, reused
_STATX_IDS = struct.Struct("=Q")  # stx_ino
_STATX_DEVS = struct.Struct("=II")  # stx_dev_major, stx_dev_minor
_STATX_INO_DEV = struct.Struct(f"=Q{_STX_DEV - _STX_INO - 8}xII")  # stx_ino ... stx_dev_major, stx_dev_minor


def identity_probe(path: str) -> Callable[[], tuple[int, int]]:
    """A function returning :func:`path_identity` of ``path`` each time it
    is called, with its buffer and the encoded path made once: for a hot
    path that asks again and again (a journal's appends). Not thread-safe:
    one caller at a time (the journal holds its lock)."""
    if _statx is None:  # pragma: no cover
        return lambda: path_identity(path)
    ctypes, fn = _statx
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    encoded = os.fsencode(path)
    ids = _STATX_INO_DEV.unpack_from
    makedev = os.makedev

    def probe() -> tuple[int, int]:
        if fn(_AT_FDCWD, encoded, 0, _STATX_INO, buf) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path) if err != 2 else FileNotFoundError(err, os.strerror(err), path)
        ino, major, minor = ids(buf, _STX_INO)
        return ino, makedev(major, minor)

    return probe


def path_identity(path: str) -> tuple[int, int]:
    """(st_ino, st_dev) of the file at ``path`` (FileNotFoundError if none),
    without querying its timestamps where the platform allows (see above)."""
    if _statx is None:  # pragma: no cover
        st = os.stat(path)
        return st.st_ino, st.st_dev
    ctypes, fn = _statx
    buf = getattr(_statx_buffers, "buf", None)
    if buf is None:
        buf = _statx_buffers.buf = ctypes.create_string_buffer(_STATX_SIZE)
    if fn(_AT_FDCWD, os.fsencode(path), 0, _STATX_INO, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path) if err != 2 else FileNotFoundError(err, os.strerror(err), path)
    (ino,) = _STATX_IDS.unpack_from(buf, _STX_INO)
    major, minor = _STATX_DEVS.unpack_from(buf, _STX_DEV)
    return ino, os.makedev(major, minor)


_STATX_NLINK = 0x4
_STX_NLINK = 16  # offsetof(struct statx, stx_nlink)


def links_probe(fd: int) -> Callable[[], int]:
    """A function returning the link count of the file open on ``fd`` (0
    once it was removed or replaced by a rename) each time it is called,
    without querying its timestamps (see above: an fstat between a ring's
    O_DSYNC writes made each of them about 60 us slower here). Not
    thread-safe: one caller at a time."""
    if _statx is None:  # pragma: no cover
        return lambda: os.fstat(fd).st_nlink
    ctypes, fn = _statx
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    nlink = struct.Struct("=I").unpack_from

    def probe() -> int:
        if fn(fd, b"", _AT_EMPTY_PATH, _STATX_NLINK, buf) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return nlink(buf, _STX_NLINK)[0]

    return probe


# -- direct I/O alignment ---------------------------------------------------------------

_STATX_DIOALIGN = 0x2000
_STX_MASK = 0  # offsetof(struct statx, stx_mask)
_STX_DIO_ALIGN = 152  # offsetof(struct statx, stx_dio_mem_align); stx_dio_offset_align follows


def dio_alignment(fd: int) -> tuple[int, int] | None:
    """(memory, file offset) alignment that O_DIRECT needs on the file open
    on ``fd``, as the kernel reports it (statx STATX_DIOALIGN, Linux 6.1+),
    (0, 0) if it says the file cannot do direct I/O, or None when it does
    not say (older kernels, file systems that do not report it). Asks for
    no timestamps (see ``path_identity``)."""
    if _statx is None:  # pragma: no cover
        return None
    ctypes, fn = _statx
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if fn(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, buf) != 0:
        return None
    (mask,) = struct.unpack_from("=I", buf, _STX_MASK)
    if not mask & _STATX_DIOALIGN:
        return None
    mem, offset = struct.unpack_from("=II", buf, _STX_DIO_ALIGN)
    return (mem, offset) if mem and offset else (0, 0)


# -- syncfs ------------------------------------------------------------------
# syncfs(2) makes everything written to one file system durable with one call:
# dirty data and inodes of every file on it, then one flush of the device's
# cache. Making many new files durable (the pieces of a move) that way costs
# one cache flush instead of one per fsync. Since Linux 5.8 it also reports a
# write-back error that happened anywhere on the file system after its
# descriptor was opened, so a caller opens the descriptor before it writes.


_syncfs = _libc("syncfs", lambda c: [c.c_int])


def syncfs(fd: int) -> None:
    """Make the whole file system that holds ``fd`` durable (syncfs(2)).
    Raises OSError: ENOSYS where the C library has no syncfs, else the
    kernel's error (EIO for a write-back error on that file system)."""
    if _syncfs is None:
        raise OSError(errno.ENOSYS, "syncfs is not available here")
    ctypes, fn = _syncfs
    if fn(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"syncfs: {os.strerror(err)}")


def fsync_file(path: str) -> None:
    """fsync a file by its path."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_each(paths: Iterable[str], each: Callable[[str], None] = fsync_file, *, workers: int = 8) -> None:
    """fsync every path (``fsync_file``, or ``fsync_dir`` for directories),
    several at a time so that the file system can commit them together."""
    list(parallel_map(each, sorted(paths), workers=workers))


_statfs = _libc("statfs", lambda c: [c.c_char_p, c.c_void_p])
_STATFS_SIZE = 256  # more than sizeof(struct statfs); f_type is its first field, a C long


def fs_magic(path: str) -> int | None:
    """The type of the file system holding ``path`` (statfs(2) f_type,
    e.g. 0xEF53 for ext4), or None if it cannot be read."""
    if _statfs is None:  # pragma: no cover
        return None
    ctypes, fn = _statfs
    buf = ctypes.create_string_buffer(_STATFS_SIZE)
    if fn(os.fsencode(path), buf) != 0:
        return None
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF


#: File systems whose syncfs, followed by an fsync of a directory on them,
#: makes durable what an fsync of each file and directory would. syncfs
#: writes back every dirty page and inode, commits (ext4 with a journal,
#: XFS: a log force; btrfs: a transaction) and flushes the device; but
#: sync_filesystem writes the block device's dirty buffers once more
#: *after* that flush, which on ext4 without a journal (and ext2) holds the
#: inode tables, bitmaps and directory blocks, so the closing fsync's flush
#: is what makes those durable. Not trusted: F2FS (its sync_fs returns 0
#: without writing after a checkpoint error or with checkpoint=disable),
#: FUSE (syncfs asks the server for nothing unless it is virtiofs),
#: network file systems, anything unknown: there FileSystemSync fsyncs
#: each path.
SYNCFS_FILE_SYSTEMS = frozenset({
    0xEF53,  # ext2/3/4
    0x58465342,  # XFS
    0x9123683E,  # btrfs
    0x01021994,  # tmpfs (nothing to make durable either way)
})


def dirty_bytes() -> int | None:
    """Bytes this machine's page cache holds dirty or being written back
    (``Dirty`` + ``Writeback`` in /proc/meminfo), or None if unknown."""
    try:
        with open("/proc/meminfo", "rb") as f:
            text = f.read()
    except OSError:
        return None
    total = 0
    found = 0
    for line in text.splitlines():
        if line.startswith((b"Dirty:", b"Writeback:")):
            parts = line.split()
            try:
                total += int(parts[1]) * 1024  # kB
            except (IndexError, ValueError):
                return None
            found += 1
    return total if found == 2 else None


#: syncfs writes everything dirty on the file system, not only the caller's
#: files: it is used only while the machine has at most this much dirty.
MAX_DIRTY = 64 << 20


class FileSystemSync:
    """Makes many files or directories of one file system durable at once:
    one syncfs(2) where that is cheap, else an fsync of each, several at a
    time.

    syncfs is used only on file systems known to make it (with a closing
    fsync) as durable as an fsync of each path (``SYNCFS_FILE_SYSTEMS``),
    and a file system gone read-only fails it. It also writes whatever
    else is dirty on the file system, so it is used for two paths or
    more, and only while the machine's page cache
    holds at most ``max_dirty`` bytes dirty (``dirty`` reads that;
    :func:`dirty_bytes` by default): a call then costs two device cache
    flushes plus a bounded amount of other write-back, instead of a flush
    per path. The descriptor syncfs needs is opened by the constructor, so
    make one before writing what it will sync: a write-back error anywhere
    on the file system after that (anyone's) fails the next syncfs. One
    caller at a time, and :meth:`close` only once no call is running (a
    descriptor number closed under a syncfs could name another file system
    by the time it is used).
    """

    def __init__(self, path: str, *, workers: int = 8, max_dirty: int = MAX_DIRTY,
                 dirty: Callable[[], int | None] = dirty_bytes,
                 magic: Callable[[str], int | None] = fs_magic) -> None:
        self.path = path
        self._workers = workers
        self._max_dirty = max_dirty
        self._dirty = dirty
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # also: the directory must exist
        try:
            trusted = _syncfs is not None and magic(path) in SYNCFS_FILE_SYSTEMS
        except BaseException:
            os.close(fd)
            raise
        if not trusted:
            os.close(fd)
            fd = -1
        self._fd = fd

    @property
    def whole(self) -> bool:
        """Whether syncfs may be used (else: an fsync of each path, always)."""
        return self._fd >= 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "FileSystemSync":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def files(self, paths: Iterable[str]) -> None:
        """Make these files (their data and size) durable."""
        self._sync(sorted(paths), fsync_file)

    def dirs(self, paths: Iterable[str]) -> None:
        """Make these directories (the names created or renamed in them) durable."""
        self._sync(sorted(paths), fsync_dir)

    def _sync(self, paths: list[str], each: Callable[[str], None]) -> None:
        if not paths:
            return
        if self._fd >= 0 and len(paths) > 1:
            dirty = self._dirty()
            if dirty is not None and dirty <= self._max_dirty:
                try:
                    self._whole()
                    return
                except OSError as exc:
                    if exc.errno != errno.ENOSYS:  # the kernel's syncfs failed: nothing here is known durable
                        raise OSError(exc.errno, f"making the file system of {self.path} durable failed: "
                                                 f"{exc.strerror or exc}") from exc
                    self.close()  # refused here (a seccomp filter, say): an fsync each from now on
        fsync_each(paths, each, workers=self._workers)

    def _whole(self) -> None:
        """syncfs, then a flush after its last write-back (see
        ``SYNCFS_FILE_SYSTEMS``), then refuse a file system that has gone
        read-only: Linux's syncfs returns 0 at once on one (after ext4's
        errors=remount-ro or a btrfs transaction abort) without writing
        anything, where an fsync of each file would fail."""
        syncfs(self._fd)
        os.fsync(self._fd)
        if os.fstatvfs(self._fd).f_flag & os.ST_RDONLY:
            raise OSError(errno.EROFS, "the file system is read-only (remounted after an error?)")
