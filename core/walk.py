"""Walking a tree someone else shaped (an agent's workspace), and opening
beneath a directory without following a symlink.

os.walk, os.fwalk, Path.rglob and shutil.copytree recurse (RecursionError
past ~1,000 levels on Python 3.11), and the path-based ones build paths
that outgrow PATH_MAX; an agent makes its workspace as deep as it likes.
walk_tree never recurses and never opens by a path: it enters each
directory relative to its parent's fd, with O_NOFOLLOW | O_DIRECTORY, and
checks that what it opened is the directory it listed (device and inode),
so a name swapped for a symlink (or for another directory) meanwhile is
reported, never followed. It keeps at most ``max_fds`` directories open;
an ancestor whose fd it closed is opened again, when there is more to walk
in it, by its names from the nearest one still open, each step checked
the same way. Memory: one small frame per level of the current path, and
the names of the subdirectories not yet entered.
"""

from __future__ import annotations

import errno
import os
import stat
from collections import deque
from collections.abc import Callable, Iterator


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
