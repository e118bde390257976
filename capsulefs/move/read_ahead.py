"""The source's read-ahead of a ``blobs`` call: the pieces' bytes, read from
the store while the link encrypts and sends the chunks before them.

Rules:
  * Pieces come out in the order asked, each exactly its manifest size: a
    blob whose file grew or shrank would break the call's framing, so it
    fails as a :class:`~capsulefs.core.errors.CorruptBlobError` naming its
    path before its first byte goes out, or as soon as it is read.
  * Nothing is hashed here: the target hashes every piece as it arrives
    (docs/move.md, "One hash per byte").
  * Reading never waits for the disk on the event loop: a chunk the page
    cache holds is read there (``preadv`` with ``RWF_NOWAIT``: no thread
    hand-off, and the bytes are still in this core's cache when TLS
    encrypts them), any other in a worker thread.
  * Blobs are read into a pool of ``READ_AHEAD + 2`` buffers of
    ``READ_CHUNK`` bytes; a buffer goes back to the pool only once the
    consumer has taken the next chunk, i.e. once the link has sent (and
    encrypted) the chunk read into it. So at most ``READ_AHEAD`` chunks
    wait, and no buffer is read into while its bytes are still wanted.

Theory of operation: :func:`read_ahead` runs a reader task beside its body;
the body iterates over the chunks (``bytes`` for capsule files held in
memory, ``memoryview`` into a pool buffer for blobs). The first failure of
either the reader or the body is raised, not an ExceptionGroup.
"""

from __future__ import annotations

import errno
import math
import os
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import cast

import trio

from capsulefs.core.errors import CorruptBlobError
from capsulefs.nursery import first_failure

__all__ = ["READ_AHEAD", "READ_CHUNK", "BlobReader", "read_ahead"]

READ_CHUNK = 1 << 20
READ_AHEAD = 4  # chunks read ahead of the one being sent


class BlobReader:
    """A stored blob's bytes in chunks of up to ``READ_CHUNK``, its size
    checked against the manifest's before the first byte goes out and as it
    is read. :meth:`cached` reads on the event loop, and only what the page
    cache holds; :meth:`next` may wait for the disk (a worker thread's)."""

    nowait = hasattr(os, "RWF_NOWAIT")  # cleared for the process if the file system refuses it

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.size = size
        self.offset = 0
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise CorruptBlobError(path, why=f"unreadable ({exc.strerror or exc})") from exc
        try:
            actual = os.fstat(self.fd).st_size
            if actual != size:
                raise CorruptBlobError(path, why=f"{actual} bytes, the manifest says {size}")
        except BaseException:
            os.close(self.fd)
            raise

    def _take(self, buf: memoryview, n: int) -> memoryview:
        if n == 0:
            raise CorruptBlobError(self.path, why=f"it ended {self.size - self.offset} bytes early")
        self.offset += n
        return buf[:n]

    def cached(self, buf: memoryview) -> memoryview | None:
        """The next chunk, read into ``buf``, if the page cache holds (some
        of) it; empty at the end, None if reading it would wait for the disk."""
        if self.offset == self.size:
            return buf[:0]
        if not BlobReader.nowait:
            return None
        buf = buf[: min(len(buf), self.size - self.offset)]
        try:
            n = os.preadv(self.fd, [buf], self.offset, os.RWF_NOWAIT)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                BlobReader.nowait = False
            return None  # EAGAIN, or an error that next() meets again and reports
        return None if n == 0 else self._take(buf, n)  # 0: let next() tell the end of the file from a miss

    def next(self, buf: memoryview) -> memoryview:
        """The next chunk, read into ``buf``, empty at the end (may wait for the disk)."""
        if self.offset == self.size:
            return buf[:0]
        buf = buf[: min(len(buf), self.size - self.offset)]
        try:
            n = os.preadv(self.fd, [buf], self.offset)
        except OSError as exc:
            raise CorruptBlobError(self.path, why=f"unreadable ({exc.strerror or exc})") from exc
        return self._take(buf, n)

    def close(self) -> None:
        os.close(self.fd)


async def _read(shas: list[str], files: Mapping[str, bytes], blob: Callable[[str], tuple[str, int]],
                out: trio.MemorySendChannel[bytes | memoryview], free: trio.MemoryReceiveChannel[bytearray],
                free_in: trio.MemorySendChannel[bytearray]) -> None:
    """Send the pieces' bytes into ``out``: from the page cache on the event
    loop, from the disk in a worker thread."""
    with out:  # closed without a checkpoint once the last chunk is in
        try:
            for sha in shas:
                if sha in files:
                    await out.send(files[sha])
                    continue
                reader = BlobReader(*blob(sha))
                try:
                    while True:
                        buf = memoryview(await free.receive())
                        chunk = reader.cached(buf)
                        if chunk is None:
                            chunk = await trio.to_thread.run_sync(reader.next, buf)
                        if not chunk:
                            free_in.send_nowait(cast(bytearray, buf.obj))  # a buffer of the pool
                            break
                        await out.send(chunk)
                finally:
                    reader.close()
        except trio.BrokenResourceError:
            return  # the consumer stopped; its own error says why


@asynccontextmanager
async def read_ahead(shas: list[str], *, files: Mapping[str, bytes],
                     blob: Callable[[str], tuple[str, int]]) -> AsyncIterator[AsyncIterator[bytes | memoryview]]:
    """The bytes of the pieces ``shas``, back to back, as an async iterator
    of chunks: a piece in ``files`` (a capsule file of the snapshot) is its
    bytes, any other a stored blob at ``blob(sha)`` = (path, manifest size)."""
    send, receive = trio.open_memory_channel[bytes | memoryview](READ_AHEAD)
    # Fresh 1 MiB buffers would cost the event loop their zeroing and page
    # faults: about a tenth of its time in a move.
    free_in, free = trio.open_memory_channel[bytearray](math.inf)
    for _ in range(READ_AHEAD + 2):
        free_in.send_nowait(bytearray(READ_CHUNK))

    async def chunks() -> AsyncGenerator[bytes | memoryview, None]:
        with receive:
            async for chunk in receive:
                yield chunk
                if isinstance(chunk, memoryview):  # sent (encrypted): its buffer may be read into again
                    free_in.send_nowait(cast(bytearray, chunk.obj))

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_read, shas, files, blob, send, free, free_in)
            yield chunks()
    except BaseExceptionGroup as group:
        raise first_failure(group) from None
