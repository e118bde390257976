"""What Linux tells and does beyond :mod:`os`, through the C library:
a file's identity without its timestamps (statx), direct I/O alignment,
syncfs, the file system's magic, and making many files durable at once.

Since Linux 6.13 (multigrain timestamps), a stat() that returns a file's
ctime/mtime flags it, and the file's next change takes a fine-grained
timestamp, which also moves the clock every other file's next change reads.
A file overwritten in place (the journal's write-ahead ring) then gets a new
mtime on every write, and its fdatasync has to write the inode too: exactly
the cost the ring exists to avoid. statx() asked for the inode alone flags
nothing, so hot paths that only need "is this still the same file?" use it.
"""

from __future__ import annotations

import errno
import os
import struct
import threading
from collections.abc import Callable, Iterable
from typing import Any

from .fsutil import fsync_dir
from .hashing import parallel_map



_STATX_INO = 0x100
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_STATX_SIZE = 256  # sizeof(struct statx)
_STX_INO = 32  # offsetof(struct statx, stx_ino)
_STX_DEV = 136  # offsetof(struct statx, stx_dev_major); stx_dev_minor follows


def _libc(name: str, argtypes: Callable[[Any], list[Any]]) -> tuple[Any, Any] | None:  # pragma: no cover - depends on the C library
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
        return int(nlink(buf, _STX_NLINK)[0])

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
    return int(ctypes.c_ulong.from_buffer(buf).value) & 0xFFFFFFFF


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
