"""The write-ahead ring: a fixed-size side file that makes journal appends
durable by overwriting in place, so that an fdatasync writes no metadata.

Rules:
  * The host keeps one ring per journal, outside the capsule (the store puts
    it at ``<state>/journal-wal/<agent_id>``, see
    :func:`capsulefs.core.journal.recovery.journal_ring_path`). A capsule
    never holds one, and nothing in a capsule names one.
  * The file is created once at its final size by writing zeros, fsynced,
    and linked into place (never over an existing ring); its directory is
    fsynced. From then on it only changes by overwrites in place, so making
    a record durable writes data blocks only (no size, no allocation).
  * A record is made durable before the append is acknowledged: by one
    O_DIRECT|O_DSYNC write of the whole pages it covers where the file
    system allows (see :class:`_Direct`), else by pwrite + fdatasync. Both
    rewrite the bytes before the record in its first page with the bytes
    they hold (page write-back does the same), so a torn write can only
    damage the new record, never the chain before it. Reads (``scan``, the
    header check) go through the page cache, which Linux keeps coherent
    with direct writes (it writes back and drops the pages they cover).
  * A ring holds one *chain*: records packed back to back from offset 0, each
    covering the journal bytes right after the previous one's, all of one
    journal inode. The first record starts where the journal file was last
    made durable by itself (a *checkpoint*: fdatasync of the journal).
  * Reading stops at the first record that is torn or stale: bad magic, bad
    checksum, a length past the end, another inode, or journal bytes not
    contiguous with the previous record. What follows it is ignored.

Record layout (little-endian), ``HEADER`` then the data::

    magic    4 bytes   b"\\xffJR1": 0xFF never occurs in UTF-8 text; "1" is
                       the version of this layout
    length   u32       bytes of journal data in the record (> 0)
    offset   u64       journal byte offset where the data starts
    ino      u64       st_ino of the journal file the data belongs to
    digest   16 bytes  blake2b-128 of the 24 bytes above + the data

A header with length 0 (and a valid digest) at ring offset 0 is the marker
a reset leaves: no chain, and the journal was synced by itself up to
``offset`` (see :meth:`Ring.synced_to`). Readers of the chain stop at it
(length 0 ends a chain), so a ring holding one reads as empty everywhere.

Theory of operation: :class:`Ring` remembers where its own chain ends
(position in the ring, next journal offset, inode), the header of the
chain's first record and, for direct writes, the chain's tail page. A process may continue its chain only if the journal
offset it is about to write at is where its chain ends and the ring still
starts with that first header (one 40-byte pread): otherwise another process
appended, restarted the ring, recovered or replaced the journal since, and
the caller must checkpoint and restart at offset 0. The journal-level policy
(when to checkpoint, how to replay a ring after a crash, what to refuse)
lives in :mod:`capsulefs.core.journal.append`; the caller holds the journal's locks.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..frozen import Frozen
from ..fsutil import TMP_PREFIX, fdatasync, fsync_dir, makedirs_durable
from ..linuxfs import dio_alignment, links_probe, path_identity

if TYPE_CHECKING:
    from hashlib import blake2b

log = logging.getLogger(__name__)

MAGIC = b"\xffJR1"
HEADER = struct.Struct("<4sIQQ16s")  # magic, length, offset, ino, digest: 40 bytes
_FIELDS = struct.Struct("<4sIQQ")  # what the digest covers, before the data
#: Default ring size. A chain restarts (one extra fdatasync of the journal)
#: each time it fills the ring, so about once per ``RING_SIZE`` of events.
RING_SIZE = 1 << 20
_ZERO_CHUNK = 1 << 16


def _first_blake2b(data: bytes, *, digest_size: int) -> "blake2b":
    """``hashlib.blake2b``, imported at the first digest (hashlib loads
    OpenSSL, which a reader that finds no ring need not wait for)."""
    global _blake2b
    from hashlib import blake2b

    _blake2b = blake2b
    return blake2b(data, digest_size=digest_size)


_blake2b: Callable[..., "blake2b"] = _first_blake2b  # hashlib.blake2b from the first call on


def _digest(fields: bytes, data: bytes | memoryview) -> bytes:
    h = _blake2b(fields, digest_size=16)
    h.update(data)
    return h.digest()


class Entry(Frozen):
    """One valid record of a ring's chain (a frozen value: core/frozen.py)."""

    __slots__ = ("pos", "offset", "ino", "data")
    pos: int  # where the record starts in the ring
    offset: int  # journal byte offset of its data
    ino: int  # journal inode
    data: bytes  # the journal bytes it vouches for

    def __init__(self, *, pos: int, offset: int, ino: int, data: bytes) -> None:
        for field, value in (("pos", pos), ("offset", offset), ("ino", ino), ("data", data)):
            object.__setattr__(self, field, value)


def encode(offset: int, ino: int, data: bytes) -> bytes:
    """One record (header + data)."""
    fields = _FIELDS.pack(MAGIC, len(data), offset, ino)
    return fields + _digest(fields, data) + data


class Ring:
    """An open ring file. Make one with :meth:`Ring.open`. Not thread-safe:
    the journal's locks serialize its users."""

    def __init__(self, path: str, fd: int) -> None:
        held = os.fstat(fd)  # once: a stat per write would cost an inode write per fdatasync (linuxfs.path_identity)
        self.path = path
        self.size = held.st_size
        self._id = (held.st_ino, held.st_dev)
        self._fd = fd
        self._links = links_probe(fd)  # 0 once the file was removed or replaced (no timestamps asked)
        self._pos = 0  # where the next record of our chain goes
        self._next = -1  # journal offset our chain ends at
        self._ino = -1  # journal inode of our chain
        self._first: bytes | None = None  # header of our chain's first record; None: must restart
        self._direct: _Direct | None = None  # the O_DIRECT|O_DSYNC writer, if this file system allows one
        self._direct_tried = False  # opened lazily, at the first append: readers never need it

    # -- lifecycle ---------------------------------------------------------
    @classmethod
    def open(cls, path: str, *, create: bool, size: int = RING_SIZE) -> "Ring | None":
        """Open the ring at ``path``; with ``create``, make it if it is
        missing (zeros, fsynced, linked into place). None if it is missing
        and ``create`` is false. An existing ring keeps its own size."""
        while True:
            try:
                fd = _open_rw(path)
            except FileNotFoundError:
                if not create:
                    return None
                _create(path, size)
                continue
            return cls(path, fd)

    def close(self) -> None:
        if self._direct is not None:
            self._direct.close()
            self._direct = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def is_current(self) -> bool:
        """Whether ``path`` still names the file this Ring has open."""
        try:
            return path_identity(self.path) == self._id
        except FileNotFoundError:
            return False

    @property
    def direct(self) -> bool:
        """Whether records are written with O_DIRECT|O_DSYNC (else pwrite +
        fdatasync). Known after the first append."""
        return self._direct is not None

    # -- writing -------------------------------------------------------------
    def continues(self, offset: int, ino: int, *, unchanged: bool = False) -> bool:
        """Whether a record for journal ``offset`` may follow our chain (else:
        checkpoint the journal and restart). ``unchanged``: the caller held
        the journal's flock since our last record (a lease), so no other
        process can have restarted the ring: its first header is not read.
        A ring file removed or replaced under us (no name left) never
        continues: records written there are durable where no replay looks."""
        return (
            self._first is not None
            and offset == self._next
            and ino == self._ino
            and (unchanged or os.pread(self._fd, HEADER.size, 0) == self._first)
            and self._links() > 0
        )

    def fits(self, length: int) -> bool:
        """Whether a record of ``length`` data bytes fits after our chain."""
        return self._pos + HEADER.size + length <= self.size

    def holds(self, length: int) -> bool:
        """Whether a record of ``length`` data bytes fits in the ring at all."""
        return HEADER.size + length <= self.size

    def append(self, offset: int, ino: int, data: bytes, *, restart: bool) -> None:
        """Write one record (at 0 if ``restart``, else after our chain) and
        make it durable: one O_DIRECT|O_DSYNC write where the file system
        allows, else pwrite + fdatasync. On an error the chain is forgotten
        (the caller restarts next time) and the record is made invalid if
        possible."""
        pos = 0 if restart else self._pos
        end = pos + HEADER.size + len(data)
        if end > self.size:
            raise ValueError(f"ring {self.path}: a record of {end - pos} bytes does not fit at {pos}")
        self._first = None if restart else self._first
        direct = self._direct if self._direct_tried else self._open_direct()
        try:
            if direct is not None:
                try:
                    first = direct.write(pos, offset, ino, data, self._fd)
                except OSError as exc:
                    if exc.errno != errno.EINVAL or direct.used:
                        raise
                    # Refused before any I/O (alignment the kernel did not
                    # report): nothing was written. Fall back for good.
                    _note_fallback(self.path, f"the first O_DIRECT write was refused ({exc})")
                    direct.close()
                    self._direct = direct = None
            if direct is None:
                rec = encode(offset, ino, data)
                n = os.pwrite(self._fd, rec, pos)
                if n != len(rec):  # pragma: no cover - a regular file overwritten in place never does this
                    raise OSError(errno.EIO, f"short write to ring {self.path}")
                fdatasync(self._fd)
                first = rec[: HEADER.size]
        except BaseException:
            self.forget()
            try:
                os.pwrite(self._fd, bytes(HEADER.size), pos)  # best effort: the caller acknowledges nothing
            except OSError:
                pass
            raise
        if restart:
            self._first = first
        self._pos = end
        self._next = offset + len(data)
        self._ino = ino

    def _open_direct(self) -> "_Direct | None":
        """The O_DIRECT|O_DSYNC writer of this ring, or None (logged once
        per process) where the file system refuses one."""
        self._direct_tried = True
        page = mmap.PAGESIZE
        align = dio_alignment(self._fd)
        if align == (0, 0):
            _note_fallback(self.path, "the file system does no direct I/O on it")
            return None
        # Whole pages (or the file system's unit, if larger): a write then
        # covers exactly the blocks page write-back would, so rewriting the
        # chain's tail block makes no assumption the buffered ring did not.
        unit = max(page, align[1]) if align else page
        if align is not None and align[0] > page:  # pragma: no cover - an anonymous mmap is page-aligned
            _note_fallback(self.path, f"it needs memory aligned to {align[0]} bytes")
            return None
        if self.size % unit:
            log.debug("ring %s: %d bytes is not a multiple of %d; pwrite + fdatasync", self.path, self.size, unit)
            return None
        try:
            fd = open_direct(self.path)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            _note_fallback(self.path, f"opening it with O_DIRECT failed ({exc})")
            return None
        if os.fstat(fd).st_ino != self._id[0]:  # pragma: no cover - replaced between the two opens
            os.close(fd)
            return None
        self._direct = _Direct(fd, unit)
        return self._direct

    def forget(self) -> None:
        """Drop our chain: the next record restarts the ring."""
        self._first = None

    def reset(self, synced: tuple[int, int] | None = None) -> None:
        """Invalidate the whole ring durably (fdatasync), leaving it an empty
        chain. Only once the journal itself holds and has synced what it
        vouched for. With ``synced`` (journal offset, inode): the first
        header becomes a marker saying the journal was synced by itself up
        to that offset (see :meth:`synced_to`); else it is zeroed."""
        self.forget()
        os.pwrite(self._fd, bytes(HEADER.size) if synced is None else encode(synced[0], synced[1], b""), 0)
        fdatasync(self._fd)

    def synced_to(self, ino: int) -> int | None:
        """How far the journal (inode ``ino``) is known to have been synced by
        itself, from the first header alone: a chain's first record starts
        where a checkpoint had synced the journal (its header is written
        after that fdatasync, so even a record torn past its header says
        so), and a reset leaves a marker at the offset it synced. Offsets
        of one inode only grow, so a stale first header is a lower bound
        too. None if the ring tells nothing (zeroed, another inode)."""
        fields = os.pread(self._fd, HEADER.size, 0)
        if len(fields) < HEADER.size:
            return None
        magic, length, offset, head_ino, digest = HEADER.unpack(fields)
        if magic != MAGIC or head_ino != ino:
            return None
        if length == 0 and _digest(fields[: _FIELDS.size], b"") != digest:
            return None
        return int(offset)

    # -- reading -------------------------------------------------------------
    def vouched(self) -> tuple[int, int, bytes] | None:
        """The longest chain the ring could hold, by its headers alone (no
        digest checked): (journal offset, inode, the data), or None if the
        ring was reset. :meth:`scan`'s chain is a prefix of it. Cheap: for
        the common check that the journal holds every byte already."""
        buf = os.pread(self._fd, self.size, 0)
        parts: list[bytes | memoryview] = []
        unpack, size, pos, first, nxt = HEADER.unpack_from, HEADER.size, 0, None, -1
        view = memoryview(buf)
        while pos + size <= len(buf):
            magic, length, offset, ino, _ = unpack(buf, pos)
            end = pos + size + length
            if magic != MAGIC or length == 0 or end > len(buf):
                break
            if first is None:
                first = (offset, ino)
            elif offset != nxt or ino != first[1]:
                break
            parts.append(view[pos + size : end])
            nxt = offset + length
            pos = end
        if first is None:
            return None
        return first[0], first[1], b"".join(parts)

    def scan(self) -> list[Entry]:
        """The valid chain from offset 0 (empty if the ring was reset)."""
        if os.pread(self._fd, len(MAGIC), 0) != MAGIC:
            return []
        buf = os.pread(self._fd, self.size, 0)
        view = memoryview(buf)
        out: list[Entry] = []
        pos = 0
        while pos + HEADER.size <= len(buf):
            magic, length, offset, ino, digest = HEADER.unpack_from(buf, pos)
            end = pos + HEADER.size + length
            if magic != MAGIC or length == 0 or end > len(buf):
                break
            data = view[pos + HEADER.size : end]
            if _digest(view[pos : pos + _FIELDS.size].tobytes(), data) != digest:
                break
            if out and (offset != out[-1].offset + len(out[-1].data) or ino != out[-1].ino):
                break  # a record of an earlier pass (stale)
            out.append(Entry(pos=pos, offset=offset, ino=ino, data=data.tobytes()))
            pos = end
        return out


_fallback_noted = False


def _note_fallback(path: str, why: str) -> None:
    """Say once per process that rings are written with pwrite + fdatasync."""
    global _fallback_noted
    if not _fallback_noted:
        _fallback_noted = True
        log.info("write-ahead ring %s: %s; rings are written with pwrite + fdatasync instead "
                 "(as durable, one system call more per append)", path, why)


class _Direct:
    """A ring's O_DIRECT|O_DSYNC descriptor and the page-aligned buffer
    (an anonymous mmap) each record is assembled in.

    A direct write covers whole units (pages), from the unit holding the
    record's start to the one holding its end. Its first bytes, up to the
    record, are the end of our chain's previous record(s): the buffer keeps
    them from the previous write (``image_end`` is the ring position they
    end at), so they are rewritten with the bytes they already hold. Past
    the record, the last unit is filled with zeros: only records of earlier
    passes, stale, lay there. The write returns once the units are on
    stable storage (O_DSYNC: the data, plus a cache flush), with nothing
    else to sync, since the ring never changes size or allocation.
    """

    __slots__ = ("fd", "unit", "buf", "view", "zeros", "image_end", "used")

    def __init__(self, fd: int, unit: int) -> None:
        self.fd = fd
        self.unit = unit
        self.buf = mmap.mmap(-1, 4 * unit)
        self.view = memoryview(self.buf)
        self.zeros = memoryview(bytes(unit))
        self.image_end = -1  # ring position the kept tail ends at; -1: none kept
        self.used = False  # a direct write has succeeded (EINVAL is then a real error)

    def close(self) -> None:
        os.close(self.fd)
        self.view.release()
        self.buf.close()

    def write(self, pos: int, offset: int, ino: int, data: bytes, buffered_fd: int) -> bytes:
        """Write the record for ``data`` at ring position ``pos``, durably;
        return its header. ``buffered_fd`` reads back the bytes before
        ``pos`` in their unit if the buffer does not hold them."""
        unit = self.unit
        base = pos & -unit
        lead = pos - base
        stop = lead + HEADER.size + len(data)  # the record's end, in the buffer
        span = (stop + unit - 1) & -unit
        buf = self.buf
        if span > len(buf):
            bigger = mmap.mmap(-1, span)
            bigger[:lead] = buf[:lead]
            self.view.release()
            buf.close()
            self.buf = buf = bigger
            self.view = memoryview(bigger)
        if lead and self.image_end != pos:  # not ours to know: read it (coherent with direct writes)
            buf[:lead] = os.pread(buffered_fd, lead, base)
        self.image_end = -1  # until the write succeeds
        fields = _FIELDS.pack(MAGIC, len(data), offset, ino)
        digest = _digest(fields, data)
        at = lead + _FIELDS.size
        buf[lead:at] = fields
        buf[at : at + len(digest)] = digest
        buf[lead + HEADER.size : stop] = data
        if span > stop:
            buf[stop:span] = self.zeros[: span - stop]
        chunk = self.view[:span]
        try:
            n = os.pwrite(self.fd, chunk, base)
        finally:
            chunk.release()  # the mmap cannot close while a view of it lives
        if n != span:  # pragma: no cover - an overwrite in place of allocated blocks never does this
            raise OSError(errno.EIO, f"short direct write to a ring ({n} of {span} bytes)")
        self.used = True
        keep = (pos + stop - lead) & (unit - 1)  # the new chain end's offset in its unit
        if keep:
            buf.move(0, stop - keep, keep)
        self.image_end = pos + stop - lead
        return fields + digest


def open_direct(path: str) -> int:
    """A second descriptor of a ring for its writes: O_DIRECT (no page
    cache) and O_DSYNC (each write returns once it is on stable storage).
    Raises EINVAL (or EOPNOTSUPP) where the file system has no direct I/O."""
    return os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT | os.O_DSYNC)


def _open_rw(path: str) -> int:
    """Open read-write without atime updates where allowed: the header read
    before each record would otherwise dirty the inode once per tick."""
    flags = os.O_RDWR | os.O_CLOEXEC
    try:
        return os.open(path, flags | getattr(os, "O_NOATIME", 0))
    except PermissionError:  # O_NOATIME needs the file's owner (or CAP_FOWNER)
        return os.open(path, flags)


def _create(path: str, size: int) -> None:
    """Make a ring of ``size`` zeros at ``path``, unless one appears meanwhile."""
    directory = os.path.dirname(path) or "."
    makedirs_durable(directory)
    tmp = os.path.join(directory, TMP_PREFIX + os.urandom(8).hex())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        try:
            zeros = bytes(min(size, _ZERO_CHUNK))
            left = size
            while left > 0:  # real zeros, not fallocate: unwritten extents would make overwrites change metadata
                left -= os.write(fd, zeros[: min(left, len(zeros))])
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:  # e.g. ENOSPC: a half-made ring must not keep the space it took
        os.unlink(tmp)
        raise
    try:
        os.link(tmp, path)  # never over an existing ring: another creator may already use it
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    fsync_dir(directory)
    log.debug("created write-ahead ring %s (%d bytes)", path, size)


def remove(path: str) -> bool:
    """Remove a ring file (durably); False if there was none."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    fsync_dir(os.path.dirname(path) or ".")
    return True
