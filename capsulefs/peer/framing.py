"""Frames of the peer link over a byte stream: a prefix, a JSON header, a raw payload.

Rules:
  * A frame is ``!IQ`` (header length, payload length), the header (a JSON
    object with a ``type``), then the payload; docs/wire.md has the calls.
  * A header over ``MAX_HEADER`` bytes is refused; before the peer is known
    (``anonymous``), so is a header or payload over ``MAX_ANONYMOUS_HEADER``.
  * A frame's :class:`Payload` is read as it arrives and must be read (or
    drained) before the next frame. Over a :class:`~capsulefs.peer.tls.TLSStream`,
    :meth:`Payload.readinto` decrypts straight into the caller's buffer.
  * Every stream error comes out as a :class:`~capsulefs.peer.errors.PeerError`.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

import trio

from capsulefs.core.capsule.format import load_json
from capsulefs.peer.errors import PeerBroken, PeerProtocolError, map_errors

__all__ = ["MAX_ANONYMOUS_HEADER", "MAX_HEADER", "PROTOCOL", "RECEIVE_CHUNK", "Framer", "Payload"]

PROTOCOL = "capsulefs-peer/1"
PREFIX = struct.Struct("!IQ")  # header length (u32), payload length (u64), big-endian
MAX_HEADER = 1 << 20
MAX_ANONYMOUS_HEADER = 64 << 10  # header and payload of a frame before the peer is known (hello, introduce)
RECEIVE_CHUNK = 1 << 20


class Framer:
    """Frames over a byte stream: prefix, JSON header, raw payload."""

    def __init__(self, stream: trio.abc.Stream, what: str) -> None:
        self.stream = stream
        self.what = what
        self._buf = bytearray()
        self.sent_bytes = 0
        self.received_bytes = 0

    async def _fill(self, n: int) -> None:
        while len(self._buf) < n:
            with map_errors(self.what):
                data = await self.stream.receive_some(RECEIVE_CHUNK)
            if not data:
                raise PeerBroken(f"{self.what}: the peer closed the link")
            self.received_bytes += len(data)
            self._buf += data

    async def send(self, header: dict[str, Any], payload: bytes | AsyncIterable[bytes | bytearray | memoryview] = b"", size: int | None = None) -> None:
        head = json.dumps(header, separators=(",", ":")).encode()
        if isinstance(payload, (bytes, bytearray, memoryview)):
            size = len(payload)
        elif size is None:
            raise ValueError("a streamed payload needs its size")
        prefix = PREFIX.pack(len(head), size)
        with map_errors(self.what):
            if isinstance(payload, (bytes, bytearray, memoryview)):
                await self.stream.send_all(prefix + head + bytes(payload))
                self.sent_bytes += len(prefix) + len(head) + size
                return
            await self.stream.send_all(prefix + head)
            self.sent_bytes += len(prefix) + len(head)
            sent = 0
            async with _closing(payload) as chunks:
                async for chunk in chunks:
                    sent += len(chunk)
                    if sent > size:
                        raise PeerProtocolError(f"{self.what}: payload longer than its declared {size} bytes")
                    await self.stream.send_all(chunk)
                    self.sent_bytes += len(chunk)
        if sent != size:
            # The frame cannot be completed: the link is now unusable.
            raise PeerBroken(f"{self.what}: payload ended at {sent} of {size} bytes")

    async def receive(self, *, anonymous: bool = False) -> tuple[dict[str, Any], "Payload"]:
        """The next frame. ``anonymous``: from a link not authenticated yet,
        whose header and payload may not exceed ``MAX_ANONYMOUS_HEADER``."""
        await self._fill(PREFIX.size)
        head_len, size = PREFIX.unpack(self._buf[: PREFIX.size])
        limit = MAX_ANONYMOUS_HEADER if anonymous else MAX_HEADER
        if head_len > limit or (anonymous and size > limit):
            raise PeerProtocolError(f"{self.what}: frame of {head_len} + {size} bytes is over {limit}")
        await self._fill(PREFIX.size + head_len)
        raw = bytes(self._buf[PREFIX.size: PREFIX.size + head_len])
        del self._buf[: PREFIX.size + head_len]
        header = load_json(raw, f"{self.what}: header", error=PeerProtocolError)
        if not isinstance(header, dict) or not isinstance(header.get("type"), str):
            raise PeerProtocolError(f"{self.what}: header must be an object with a 'type'")
        return header, Payload(self, size)


@asynccontextmanager
async def _closing(it: AsyncIterable[bytes | bytearray | memoryview]) -> AsyncIterator[AsyncIterable[bytes | bytearray | memoryview]]:
    """Close an async generator payload even when sending it fails midway."""
    try:
        yield it
    finally:
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()


class Payload:
    """A frame's payload, read as it arrives. Must be read (or drained) before the next frame."""

    def __init__(self, framer: Framer, size: int) -> None:
        self._framer = framer
        self.size = size
        self.remaining = size

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The rest of the payload, a chunk (about one TLS record) at a time."""
        async with aclosing(self.batches(1)) as batches:
            async for batch in batches:
                for chunk in batch:
                    yield chunk

    async def batches(self, size: int) -> AsyncGenerator[list[bytes], None]:
        """The rest of the payload as lists of chunks that add up to at least
        ``size`` bytes (the last list may hold less): a bulk reader steps
        once per list rather than once per TLS record."""
        f = self._framer
        while self.remaining:
            batch: list[bytes] = []
            have = 0
            with map_errors(f.what):
                while have < size and self.remaining:
                    if f._buf:
                        n = min(len(f._buf), self.remaining)
                        chunk = bytes(f._buf[:n])
                        del f._buf[:n]
                    else:  # straight from the stream, without a copy through the buffer
                        received = await f.stream.receive_some(RECEIVE_CHUNK)
                        if not received:
                            raise PeerBroken(f"{f.what}: the peer closed the link")
                        f.received_bytes += len(received)
                        chunk = received if type(received) is bytes else bytes(received)
                        if len(chunk) > self.remaining:
                            f._buf += chunk[self.remaining:]
                            chunk = chunk[: self.remaining]
                    self.remaining -= len(chunk)
                    have += len(chunk)
                    batch.append(chunk)
            yield batch

    async def readinto(self, buffer: bytearray | memoryview | mmap.mmap) -> None:
        """Fill ``buffer`` with the payload's next ``len(buffer)`` bytes (at
        most what remains). Over a :class:`TLSStream` the records are
        decrypted straight into it: the bulk reader's path, without a copy."""
        f = self._framer
        with memoryview(buffer) as whole, whole.cast("B") as view:
            if len(view) > self.remaining:
                raise ValueError(f"{len(view)} bytes asked for, {self.remaining} left in the payload")
            got = 0
            if f._buf:
                got = min(len(f._buf), len(view))
                view[:got] = f._buf[:got]
                del f._buf[:got]
                self.remaining -= got
            receive_into = getattr(f.stream, "receive_into", None)
            with map_errors(f.what):
                while got < len(view):
                    if receive_into is not None:
                        n = await receive_into(view[got:])
                    else:
                        chunk = await f.stream.receive_some(RECEIVE_CHUNK)
                        n = min(len(chunk), len(view) - got)
                        view[got : got + n] = chunk[:n]
                        f._buf += chunk[n:]
                        f.received_bytes += len(chunk) - n
                    if not n:
                        raise PeerBroken(f"{f.what}: the peer closed the link")
                    f.received_bytes += n
                    self.remaining -= n  # as it goes: a cancelled read leaves the frame's count true
                    got += n

    async def read(self, limit: int = 64 << 20) -> bytes:
        if self.remaining > limit:
            raise PeerProtocolError(f"payload of {self.remaining} bytes is over the {limit} byte limit")
        async with aclosing(self.batches(self.remaining)) as batches:
            return b"".join([c async for batch in batches for c in batch])

    async def drain(self) -> None:
        async with aclosing(self.batches(RECEIVE_CHUNK)) as batches:
            async for _ in batches:
                pass
