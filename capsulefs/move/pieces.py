"""Writing the pieces of a ``blobs`` call into a move's staging area.

Rules:
  * A ``blobs`` payload is its pieces back to back. :class:`PieceWriter`
    hashes each piece and writes each piece it was given a path for; a
    piece without a path is read and dropped (no open move for it, or it
    is already here).
  * The payload is laid out in *slabs* (:func:`layout`): each slab is one
    buffer's worth of segments, a segment being where the next bytes of a
    piece go in the buffer. A kept piece starts on a block boundary and
    every segment of it but the last is whole blocks, so its file is
    written with ``O_DIRECT`` straight from the buffer, with no copy: the
    receiver decrypts the payload into the buffer at those offsets
    (``Payload.readinto``) and hands it to :meth:`PieceWriter.write_slab`.
    :meth:`PieceWriter.feed` copies a stream of chunks into a buffer of the
    writer's own, for callers that have chunks.
  * ``O_DIRECT`` where the file system takes it, so a piece's bytes go to
    the device as they arrive instead of piling up in the page cache for
    verify's fsync; only the last part of a piece that is not a whole
    number of blocks goes through the page cache. Measured on the 2-core
    VM of docs/move.md: 1 GiB in 1,000 files took 2.7 s to write plus
    1.5 s to fsync buffered, 1.3 s plus 0.15 s this way.
  * It decides nothing about the move: it reports, per piece, whether it
    was written and whether its bytes hash to its name; the caller feeds the
    move's machine. A file whose bytes do not hash to its name is removed.
  * Not thread-safe, with one exception: :meth:`PieceWriter.precreate` may
    run in another thread. Made to be called from a worker thread, a slab
    at a time, while the event loop receives the next slab: hashing and
    ``write`` release the GIL, and nothing else here holds it for long.
  * ``write_slab`` hashes the slab in its own thread while a disk thread
    writes it, and returns once both are done: the buffer is then free,
    and a write error is raised by the slab that met it. A piece counts as
    written only once all its writes succeeded, and abandon removes every
    file whose writes did not all succeed.
  * Creating a file can cost far more than writing a piece into it: on the
    ext4 of docs/move.md, 0.1-1.3 ms of CPU per file, depending on the
    block group the directory is in. ``precreate`` creates the files of the
    pieces not yet reached, ahead of the writer, so that the writer only
    opens them; it never creates a file the writer has already reached (a
    piece whose file the writer removed for a bad hash stays removed), and
    files it created for pieces never reached are removed on abandon.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ALIGN", "BUFFER", "Outcome", "Piece", "PieceWriter", "Segment", "layout", "remove_files"]

ALIGN = 4096  # O_DIRECT offsets, lengths and buffers: a multiple of every device's logical block size
BUFFER = 4 << 20  # bytes of one slab: what the writer hashes and writes in one go


@dataclass(frozen=True, slots=True)
class Piece:
    sha: str  # the sha256 the piece must hash to
    size: int
    path: str | None  # where to write it; None: read and drop


@dataclass(frozen=True, slots=True)
class Outcome:
    sha: str
    written: bool  # it had a path and all its bytes were written there
    intact: bool  # written, and its bytes hash to ``sha`` (else the file was removed)


@dataclass(frozen=True, slots=True)
class Segment:
    """Bytes of one piece in a slab: the payload's next ``size`` bytes go
    at ``offset`` in the slab's buffer."""

    piece: int  # index in the writer's pieces
    offset: int
    size: int
    first: bool  # the piece's first bytes
    last: bool  # the piece's last bytes


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layout(pieces: Sequence[Piece], buffer: int | None = None) -> list[list[Segment]]:
    """Where the payload's bytes go: slabs of segments, in payload order,
    each slab one buffer's worth. A piece that is written starts at an
    ALIGN boundary of its buffer and every segment of it but the last is a
    whole number of blocks, so its file is written with O_DIRECT straight
    from the buffer; a piece that fits in one buffer is never split. A
    dropped piece's bytes are packed anywhere (they are read, not kept)."""
    buffer = BUFFER if buffer is None else buffer
    if buffer <= 0 or buffer % ALIGN:
        raise ValueError(f"a slab's buffer must be a positive multiple of {ALIGN} bytes")
    slabs: list[list[Segment]] = []
    slab: list[Segment] = []
    fill = 0
    for index, piece in enumerate(pieces):
        left, first = piece.size, True
        while True:
            start = fill if piece.path is None else min(_align(fill), buffer)
            take = min(left, buffer - start)
            split = take < left and (take == 0 or (piece.path is not None and left <= buffer))
            if slab and split:
                slabs.append(slab)
                slab, fill = [], 0
                continue
            last = take == left
            slab.append(Segment(index, start, take, first, last))
            fill, left, first = start + take, left - take, False
            if last:
                break
    if slab:
        slabs.append(slab)
    return slabs


class _File:
    """A piece's open file, written in the order of its segments."""

    __slots__ = ("fd", "direct", "path", "writer", "whole")

    def __init__(self, fd: int, direct: bool, path: str, writer: "PieceWriter") -> None:
        self.fd = fd
        self.direct = direct
        self.path = path
        self.writer = writer
        self.whole = False  # every byte of the piece was written and the file closed

    def write(self, data: memoryview, last: bool) -> None:
        """Write a segment: its whole blocks directly, then the rest (only a
        piece's last segment has a part block), closing after the last."""
        blocks = len(data) - len(data) % ALIGN
        with data[:blocks] as head, data[blocks:] as tail:
            self._write(head)
            self._write(tail)
        if last:
            self.close()
            self.whole = True

    def _write(self, data: memoryview) -> None:
        while len(data):
            if self.direct and len(data) % ALIGN:
                self._buffered()  # a direct write must be whole blocks
            try:
                n = os.write(self.fd, data)
            except OSError as exc:
                if not self.direct or exc.errno != errno.EINVAL:
                    raise
                self.writer.direct_refused = True  # open took O_DIRECT, write does not
                self._buffered()
                continue
            data = data[n:]
            if n % ALIGN:
                self._buffered()  # a short direct write leaves the offset unaligned

    def _buffered(self) -> None:
        if self.direct:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.direct = False

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def remove_files(paths: Iterable[str]) -> None:
    """Remove each file; one that is already gone is no error."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _write_all(writes: list[tuple[_File, memoryview, bool]]) -> None:
    for file, data, last in writes:
        file.write(data, last)


class PieceWriter:
    """Hashes and writes the :class:`Piece` s of one payload, slab by slab
    (:attr:`slabs`, from :func:`layout`). The receiver puts each slab's
    bytes into a buffer at the segments' offsets and hands it to
    :meth:`write_slab`; or :meth:`feed` copies a stream of chunks into the
    writer's own buffer. End with :meth:`close` (the outcomes, in order) or
    :meth:`abandon` (removes what is not whole)."""

    def __init__(self, pieces: Iterable[Piece], *, buffer: int | None = None) -> None:
        self._plan = list(pieces)
        self._buffer = BUFFER if buffer is None else buffer
        self.slabs = layout(self._plan, self._buffer)
        self._written = 0  # slabs written so far
        self._reached = 0  # pieces the writer has started: precreate leaves these alone
        self._stopped = False  # closed or abandoned: precreate stops
        self._precreated: list[str] = []
        self._creating = -1  # the piece precreate is creating the file of, if any
        self._ahead = threading.Condition()  # between the writer and precreate
        self.outcomes: list[Outcome] = []
        self._file: _File | None = None  # the file of the piece begun and not finished, if any
        self._hash = hashlib.sha256()  # and its hash so far
        self._files: list[_File] = []  # opened and not known whole
        self._disk: ThreadPoolExecutor | None = None  # writes one slab while this thread hashes it
        self.direct_refused = False  # the file system refused O_DIRECT once: write the rest buffered
        # feed()'s own buffer and where the next byte goes in it
        self._own: mmap.mmap | None = None
        self._seg = 0  # segment of slab ``_written`` being filled
        self._got = 0  # bytes of that segment filled

    # -- writing -------------------------------------------------------------------
    def write_slab(self, buffer: mmap.mmap | bytearray | memoryview) -> None:
        """Write the next slab, whose bytes the caller has put into
        ``buffer`` at its segments' offsets: hash its pieces here while a
        disk thread writes them. Returns once both are done (``buffer`` is
        free again); a write error is raised here, and abandon then removes
        every file that is not whole."""
        if self._written >= len(self.slabs):
            raise ValueError("every slab of this payload is written already")
        slab = self.slabs[self._written]
        self._written += 1
        with memoryview(buffer) as whole, whole.cast("B") as view:
            writes: list[tuple[_File, memoryview, bool]] = []
            hashes: list[tuple[Any, memoryview]] = []
            ends: list[tuple[int, Any, _File | None]] = []  # pieces that end in this slab
            try:
                for seg in slab:
                    if seg.first:
                        self._begin(seg.piece)
                    file = self._file
                    if file is not None:
                        data = view[seg.offset : seg.offset + seg.size]
                        writes.append((file, data, seg.last))
                        hashes.append((self._hash, data))
                    if seg.last:
                        ends.append((seg.piece, self._hash, file))
                        self._file = None
                pending = None
                if writes:
                    if self._disk is None:
                        self._disk = ThreadPoolExecutor(max_workers=1, thread_name_prefix="piece-disk")
                    pending = self._disk.submit(_write_all, writes)
                try:
                    for h, data in hashes:
                        h.update(data)
                finally:
                    if pending is not None:
                        pending.result()  # waited for even if hashing failed: the buffer is the caller's again
            finally:
                for _, data in hashes:
                    data.release()
        for index, digest, file in ends:
            self._end(index, digest, file)

    def _begin(self, index: int) -> None:
        with self._ahead:  # from here on precreate leaves this piece's file alone
            while self._creating == index:
                self._ahead.wait()
            self._reached = index + 1
        piece = self._plan[index]
        self._file, self._hash = None, hashlib.sha256()
        if piece.path is not None:
            fd, direct = self._open(piece.path)
            self._file = _File(fd, direct, piece.path, self)
            self._files.append(self._file)

    def _end(self, index: int, digest: Any, file: _File | None) -> None:
        piece = self._plan[index]
        if file is None:
            self.outcomes.append(Outcome(piece.sha, written=False, intact=False))
            return
        intact = digest.hexdigest() == piece.sha
        self._files.remove(file)
        if not intact:
            os.unlink(file.path)
        self.outcomes.append(Outcome(piece.sha, written=True, intact=intact))

    def _open(self, path: str) -> tuple[int, bool]:
        """The piece's file, and whether it is open with O_DIRECT."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        if not self.direct_refused:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o644), True
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                self.direct_refused = True  # e.g. tmpfs before Linux 6.6
        return os.open(path, flags, 0o644), False

    # -- feeding a stream ---------------------------------------------------------------
    def feed(self, chunks: Iterable[bytes | bytearray | memoryview]) -> None:
        """Take the next bytes of the payload (in order), copied into the
        writer's own buffer; each slab is written once it is full."""
        for chunk in chunks:
            with memoryview(chunk) as whole, whole.cast("B") as view:
                at = 0
                while at < len(view):
                    self._skip_empty()
                    if self._written >= len(self.slabs):
                        raise ValueError("the payload is longer than its pieces")
                    seg = self.slabs[self._written][self._seg]
                    n = min(seg.size - self._got, len(view) - at)
                    start = seg.offset + self._got
                    self._own_buffer()[start : start + n] = view[at : at + n]
                    self._got += n
                    at += n
                    self._skip_empty()

    def _own_buffer(self) -> mmap.mmap:
        if self._own is None:
            self._own = mmap.mmap(-1, self._buffer)
        return self._own

    def _skip_empty(self) -> None:
        """Step past filled (and empty) segments; write a slab once every
        segment of it is filled."""
        while self._written < len(self.slabs):
            slab = self.slabs[self._written]
            if self._seg < len(slab) and self._got < slab[self._seg].size:
                return
            if self._seg < len(slab):
                self._seg, self._got = self._seg + 1, 0
                continue
            self._seg = 0
            try:
                self.write_slab(self._own_buffer())
            except BaseException:
                self.abandon()
                raise

    # -- ending --------------------------------------------------------------------
    def close(self) -> list[Outcome]:
        """The payload ended: every slab must have been written (a slab of
        empty pieces only is written here); return every outcome, in the
        order of the pieces."""
        if self._own is not None or self._written < len(self.slabs):
            self._skip_empty()  # feed's last slab, or one of empty pieces only
        if self._written < len(self.slabs):
            left = sum(seg.size for slab in self.slabs[self._written :] for seg in slab) - self._got
            self.abandon()
            raise ValueError(f"the payload ended {left} bytes before its pieces did")
        with self._ahead:
            self._stopped = True
        self._release()
        return self.outcomes

    def abandon(self) -> None:
        """Stop: close and remove the piece being written (a partial file is
        never left under a piece's name), and the files made ahead for pieces
        not reached. Idempotent."""
        with self._ahead:
            self._stopped = True
            while self._creating >= 0:
                self._ahead.wait()
            reached = self._reached
        unreached = {p.path for p in self._plan[reached:] if p.path is not None}
        doomed = [path for path in self._precreated if path in unreached]
        for file in self._files:
            file.close()
            if not file.whole:  # a piece begun, or finished but whose writes failed or never ran
                doomed.append(file.path)
        self._files.clear()
        self._file = None
        remove_files(doomed)
        self._written = len(self.slabs)  # nothing more is written
        self._release()

    def stop_precreate(self) -> None:
        """Make :meth:`precreate` stop at its next file (from any thread)."""
        with self._ahead:
            self._stopped = True

    def precreate(self) -> None:
        """Create the files of the pieces the writer has not reached yet, in
        order (for another thread, while the writer works). Stops once the
        writer is closed or abandoned; a file that cannot be created is
        left for the writer, which then meets the error itself."""
        for index, piece in enumerate(self._plan):
            if piece.path is None:
                continue
            with self._ahead:
                if self._stopped:
                    return
                if index < self._reached:
                    continue
                self._creating = index  # the writer waits for this one if it gets here first
            created = False
            try:
                os.close(os.open(piece.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
                created = True
            except OSError:
                pass
            finally:
                with self._ahead:
                    self._creating = -1
                    if created:
                        self._precreated.append(piece.path)
                    self._ahead.notify_all()
            if not created:
                return

    def _release(self) -> None:
        if self._disk is not None:
            self._disk.shutdown(wait=True)
            self._disk = None
        if self._own is not None:
            try:
                self._own.close()
            except BufferError:
                pass  # a view of it outlives a failed write (its traceback holds it): unmapped when that goes
            self._own = None
